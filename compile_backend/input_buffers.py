"""Persistent input buffers: allocated once at the largest size, written in
place every step, so captured graphs always read the same addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .input_batch import InputBatch
from .kv_cache_config import KVCacheConfig


@dataclass
class InputBuffers:
    input_ids: torch.Tensor  # [max_num_tokens] int64
    positions: torch.Tensor  # [max_num_tokens] int64
    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    state_indices: torch.Tensor  # [max_num_reqs] int32 (-1: padding row)
    has_initial_state: torch.Tensor  # [max_num_reqs] bool

    @classmethod
    def allocate(cls, cfg: KVCacheConfig, device: torch.device | str) -> "InputBuffers":
        t, r = cfg.max_num_tokens, cfg.max_num_reqs
        return cls(
            input_ids=torch.zeros(t, dtype=torch.int64, device=device),
            positions=torch.zeros(t, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(r + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(r, dtype=torch.int32, device=device),
            state_indices=torch.full((r,), -1, dtype=torch.int32, device=device),
            has_initial_state=torch.zeros(r, dtype=torch.bool, device=device),
        )

    def write(self, batch: InputBatch) -> None:
        """Copy one batch in (one host->device copy per field). Padding tokens:
        id 0, position 0; padding requests: no tokens, seq_len 0, slot -1."""
        T, B = batch.num_tokens_padded, batch.num_reqs_padded
        pad_t, pad_b = T - batch.num_tokens, B - batch.num_reqs
        qsl = [0]
        for q in batch.query_lens:
            qsl.append(qsl[-1] + q)
        qsl += [qsl[-1]] * pad_b
        _put(self.input_ids, batch.token_ids + [0] * pad_t)
        _put(self.positions, batch.positions() + [0] * pad_t)
        _put(self.query_start_loc, qsl)
        _put(self.seq_lens, batch.seq_lens + [0] * pad_b)
        _put(self.state_indices, batch.req_slots + [-1] * pad_b)
        has_state = [q < s for q, s in zip(batch.query_lens, batch.seq_lens)]
        _put(self.has_initial_state, has_state + [False] * pad_b)


def _put(buf: torch.Tensor, values: list) -> None:
    # A small pageable host->device copy: allocating pinned memory per step
    # costs more than the copy itself.
    assert len(values) <= buf.numel(), (len(values), buf.numel())
    buf[: len(values)].copy_(torch.tensor(values, dtype=buf.dtype))
