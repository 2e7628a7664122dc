"""Persistent block tables and slot mappings, one pair per KV-cache group."""

from __future__ import annotations

import array

import torch

from compile_backend.runner.host_staging import Field, HostStaging, host_array
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig


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
        slot mapping; returns the slot-mapping view [T'] for this step.

        Every block id is checked before anything is written (ValueError
        naming the request, the field, the id and the valid range): an id past
        the cache fails deep inside an op, a negative one wraps to another
        block silently. Only rows that changed since the last write are
        checked (a decode step changes few): the others were checked then.
        """
        B, T = batch.num_reqs_padded, batch.num_tokens_padded
        changed = [
            (table, self._changed_rows(table, field, getattr(batch, field), B, limit, width_why))
            for table, field, limit, width_why in (
                ("block_table", "block_ids", "num_blocks", "max_model_len / block_size"),
                ("compressed_block_table", "compressed_block_ids", "num_compressed_blocks",
                 "max_model_len / compress_ratio / block_size"))
        ]
        slots = self._slot_mapping(batch)
        with self.staging.write(upto=self.staging.end("block_table", B * self.block_table.shape[1])) as st:
            for table, rows in changed:
                self._put_rows(st, table, rows)
            st.put("slot_mapping", slots)
        return self.slot_mapping[:T]

    def _changed_rows(self, table: str, field: str, rows: list[list[int]], num_rows: int,
                      limit: str, width_why: str) -> list[tuple[int, list[int]]]:
        """(row index, ids) of rows [0, num_rows) of `table` that differ from
        what the host twin holds (rows past `rows` are padding: empty), each
        checked against the table's width and the cache's block count (the
        KVCacheConfig attribute `limit`)."""
        held, width = self._rows[table], self.staging.views[table].shape[1]
        num_blocks = getattr(self.cfg, limit)
        out = []
        for i in range(num_rows):
            row = rows[i] if i < len(rows) else []
            if row == held[i]:
                continue
            if len(row) > width:
                raise ValueError(
                    f"request {i}: {field} has {len(row)} blocks, more than the block table's "
                    f"{width} ({width_why}); raise max_model_len")
            if row and (min(row) < 0 or max(row) >= num_blocks):
                j, bad = next((j, b) for j, b in enumerate(row) if not 0 <= b < num_blocks)
                raise ValueError(
                    f"request {i}: {field}[{j}] = {bad} is not a block of the cache; valid: "
                    f"0 <= block id < {limit}={num_blocks} (KVCacheConfig)")
            out.append((i, row))
        return out

    def _slot_mapping(self, batch: InputBatch) -> array.array:
        """[T'] cache slot of every token (padding tokens and dummy batches: -1)."""
        T, bs = batch.num_tokens_padded, self.cfg.block_size
        slots = host_array(torch.int64)
        if batch.is_dummy:  # capture writes no KV
            slots.extend([-1] * T)
            return slots
        try:
            for ids, q, s in zip(batch.block_ids, batch.query_lens, batch.seq_lens):
                if q == 1:  # decode: the common case, without a generator
                    slots.append(ids[(s - 1) // bs] * bs + (s - 1) % bs)
                else:
                    slots.extend(ids[p // bs] * bs + p % bs for p in range(s - q, s))
        except IndexError:  # a row without a block for a token's position
            short = next(((i, ids, s) for i, (ids, q, s) in enumerate(
                zip(batch.block_ids, batch.query_lens, batch.seq_lens)) if q and len(ids) * bs < s),
                None)
            if short is None:
                raise
            i, ids, s = short
            raise ValueError(
                f"request {i}: block_ids has {len(ids)} blocks, too few for seq_len {s}: it "
                f"needs ceil(seq_len / block_size={bs}) = {-(-s // bs)}; give the request a "
                "block for every block_size tokens") from None
        slots.extend([-1] * (T - len(slots)))
        return slots

    def _put_rows(self, st: HostStaging, table: str, rows: list[tuple[int, list[int]]]) -> None:
        """Rewrite the twin's rows `rows` ((index, ids), from _changed_rows)."""
        held, width = self._rows[table], self.staging.views[table].shape[1]
        for i, row in rows:
            values = host_array(torch.int32, row)
            values.extend([0] * (len(held[i]) - len(row)))  # clear what the old row had past it
            st.put(table, values, start=i * width)
            held[i] = list(row)  # a copy: callers may extend their lists in place
