"""Persistent block tables and slot mappings, one pair per KV-cache group."""

from __future__ import annotations

import torch

from .host_staging import HostStaging, host_array
from .input_batch import InputBatch
from .kv_cache_config import KVCacheConfig


class BlockTables:
    def __init__(self, cfg: KVCacheConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        r, t = cfg.max_num_reqs, cfg.max_num_tokens
        self.staging = HostStaging(device)  # host twins: see host_staging.py
        # [max_num_reqs, max_blocks_per_req] int32; 0 = the null block
        self.block_table = self.staging.register(
            torch.zeros(r, cfg.max_blocks_per_req, dtype=torch.int32, device=device))
        self.compressed_block_table = self.staging.register(torch.zeros(
            r, cfg.max_compressed_blocks_per_req, dtype=torch.int32, device=device))
        # [max_num_tokens] int64; -1 = write nothing
        self.slot_mapping = self.staging.register(
            torch.full((t,), -1, dtype=torch.int64, device=device))

    def write(self, batch: InputBatch) -> torch.Tensor:
        """Write the batch's block rows (padding rows: all null block) and its
        slot mapping; returns the slot-mapping view [T'] for this step."""
        B, T = batch.num_reqs_padded, batch.num_tokens_padded
        table = _rows(batch.block_ids, B, self.block_table.shape[1])
        ctable = _rows(batch.compressed_block_ids, B, self.compressed_block_table.shape[1])
        slots = host_array(torch.int64)
        bs = self.cfg.block_size
        for i, (q, s) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            if batch.is_dummy:  # capture writes no KV
                slots.extend([-1] * q)
                continue
            ids = batch.block_ids[i]
            slots.extend(ids[pos // bs] * bs + pos % bs for pos in range(s - q, s))
        slots.extend([-1] * (T - len(slots)))
        with self.staging.write() as st:
            st.put(self.block_table, table)
            st.put(self.compressed_block_table, ctable)
            st.put(self.slot_mapping, slots)
        return self.slot_mapping[:T]

    def get_dummy_block_tables(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, max_blocks_per_req] of null blocks, in the persistent buffer."""
        self.block_table[:num_reqs].zero_()
        return self.block_table[:num_reqs]


def _rows(rows: list[list[int]], num_rows: int, width: int):
    """[num_rows * width] int32 row-major, each row zero-padded (0 = the null block)."""
    out = host_array(torch.int32)
    for r in rows:
        if len(r) > width:
            raise ValueError(f"a request has {len(r)} blocks, more than the block table's "
                             f"{width} (max_model_len / block_size); raise max_model_len")
        out.extend(r)
        out.extend([0] * (width - len(r)))
    out.extend([0] * (width * (num_rows - len(rows))))
    return out
