"""Persistent block tables and slot mappings, one pair per KV-cache group."""

from __future__ import annotations

import torch

from .host_staging import Field, HostStaging, host_array
from .input_batch import InputBatch
from .kv_cache_config import KVCacheConfig


class BlockTables:
    def __init__(self, cfg: KVCacheConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        r, t = cfg.max_num_reqs, cfg.max_num_tokens
        # Arena order: a write copies [0, end of the block table's first B rows).
        self.staging = HostStaging(device, [
            # [max_num_tokens] int64; -1 = write nothing
            Field("slot_mapping", (t,), torch.int64, -1),
            # [max_num_reqs, max_compressed_blocks_per_req] int32; 0 = the null block
            Field("compressed_block_table", (r, cfg.max_compressed_blocks_per_req), torch.int32, 0),
            # [max_num_reqs, max_blocks_per_req] int32; 0 = the null block
            Field("block_table", (r, cfg.max_blocks_per_req), torch.int32, 0),
        ])
        self.slot_mapping = self.staging.views["slot_mapping"]
        self.compressed_block_table = self.staging.views["compressed_block_table"]
        self.block_table = self.staging.views["block_table"]
        # What each host row holds now (a decode step changes few rows: a
        # request gains a block every block_size tokens), per table.
        self._rows = {"block_table": [[] for _ in range(r)],
                      "compressed_block_table": [[] for _ in range(r)]}

    def write(self, batch: InputBatch) -> torch.Tensor:
        """Write the batch's block rows (padding rows: all null block) and its
        slot mapping; returns the slot-mapping view [T'] for this step."""
        B, T = batch.num_reqs_padded, batch.num_tokens_padded
        for name, rows in (("block_table", batch.block_ids),
                           ("compressed_block_table", batch.compressed_block_ids)):
            width = self.staging.views[name].shape[1]
            longest = max(map(len, rows), default=0)
            if longest > width:
                raise ValueError(
                    f"a request has {longest} blocks, more than the block table's {width} "
                    "(max_model_len / block_size); raise max_model_len")
        slots = host_array(torch.int64)
        bs = self.cfg.block_size
        if batch.is_dummy:  # capture writes no KV
            slots.extend([-1] * T)
        else:
            for ids, q, s in zip(batch.block_ids, batch.query_lens, batch.seq_lens):
                if q == 1:  # decode: the common case, without a generator
                    slots.append(ids[(s - 1) // bs] * bs + (s - 1) % bs)
                else:
                    slots.extend(ids[p // bs] * bs + p % bs for p in range(s - q, s))
            slots.extend([-1] * (T - len(slots)))
        with self.staging.write(upto=self.staging.end("block_table", B * self.block_table.shape[1])) as st:
            self._put_rows(st, "block_table", batch.block_ids, B)
            self._put_rows(st, "compressed_block_table", batch.compressed_block_ids, B)
            st.put("slot_mapping", slots)
        return self.slot_mapping[:T]

    def _put_rows(self, st: HostStaging, name: str, rows: list[list[int]], num_rows: int) -> None:
        """Rows [0, num_rows) of table `name`: `rows`, then null rows; only rows
        that differ from what the host twin holds are rewritten."""
        held, width = self._rows[name], self.staging.views[name].shape[1]
        for i in range(num_rows):
            row = rows[i] if i < len(rows) else []
            if row == held[i]:
                continue
            values = host_array(torch.int32, row)
            values.extend([0] * (len(held[i]) - len(row)))  # clear what the old row had past it
            st.put(name, values, start=i * width)
            held[i] = list(row)  # a copy: callers may extend their lists in place
