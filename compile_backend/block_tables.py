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
        table = torch.zeros(B, self.block_table.shape[1], dtype=torch.int32)
        ctable = torch.zeros(B, self.compressed_block_table.shape[1], dtype=torch.int32)
        for i, ids in enumerate(batch.block_ids):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for i, ids in enumerate(batch.compressed_block_ids):
            ctable[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots: list[int] = []
        bs = self.cfg.block_size
        for i, (q, s) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            if batch.is_dummy:  # capture writes no KV
                slots.extend([-1] * q)
                continue
            for pos in range(s - q, s):
                slots.append(batch.block_ids[i][pos // bs] * bs + pos % bs)
        slots += [-1] * (T - len(slots))
        nb = self.block_table.is_cuda
        self.block_table[:B].copy_(table, non_blocking=nb)
        self.compressed_block_table[:B].copy_(ctable, non_blocking=nb)
        self.slot_mapping[:T].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=nb)
        return self.slot_mapping[:T]

    def get_dummy_block_tables(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, max_blocks_per_req] of null blocks, in the persistent buffer."""
        self.block_table[:num_reqs].zero_()
        return self.block_table[:num_reqs]
