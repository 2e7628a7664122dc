"""Persistent block tables and slot mappings, one pair per KV-cache group."""

from __future__ import annotations

import torch

from .input_batch import InputBatch
from .kv_cache_config import KVCacheConfig


class BlockTables:
    def __init__(self, cfg: KVCacheConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        r, t = cfg.max_num_reqs, cfg.max_num_tokens
        # [max_num_reqs, max_blocks_per_req] int32; 0 = the null block
        self.block_table = torch.zeros(r, cfg.max_blocks_per_req, dtype=torch.int32, device=device)
        self.compressed_block_table = torch.zeros(
            r, cfg.max_compressed_blocks_per_req, dtype=torch.int32, device=device)
        # [max_num_tokens] int64; -1 = write nothing
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)

    def write(self, batch: InputBatch) -> torch.Tensor:
        """Write the batch's block rows (padding rows: all null block) and its
        slot mapping; returns the slot-mapping view [T'] for this step."""
        B, T = batch.num_reqs_padded, batch.num_tokens_padded
        table = _rows(batch.block_ids, B, self.block_table.shape[1])
        ctable = _rows(batch.compressed_block_ids, B, self.compressed_block_table.shape[1])
        slots: list[int] = []
        bs = self.cfg.block_size
        for i, (q, s) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            if batch.is_dummy:  # capture writes no KV
                slots.extend([-1] * q)
                continue
            for pos in range(s - q, s):
                slots.append(batch.block_ids[i][pos // bs] * bs + pos % bs)
        slots += [-1] * (T - len(slots))
        self.block_table[:B].copy_(table)
        self.compressed_block_table[:B].copy_(ctable)
        self.slot_mapping[:T].copy_(torch.tensor(slots, dtype=torch.int64))
        return self.slot_mapping[:T]

    def get_dummy_block_tables(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, max_blocks_per_req] of null blocks, in the persistent buffer."""
        self.block_table[:num_reqs].zero_()
        return self.block_table[:num_reqs]


def _rows(rows: list[list[int]], num_rows: int, width: int) -> torch.Tensor:
    """[num_rows, width] int32, each row zero-padded (0 = the null block)."""
    padded = [r + [0] * (width - len(r)) for r in rows]
    padded += [[0] * width] * (num_rows - len(rows))
    return torch.tensor(padded, dtype=torch.int32).reshape(num_rows, width)
