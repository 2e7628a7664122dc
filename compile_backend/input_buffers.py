"""Persistent input buffers: allocated once at the largest size, written in
place every step, so captured graphs always read the same addresses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host_staging import HostStaging, host_array
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
    staging: HostStaging = field(default=None, repr=False)  # host twins (set by allocate)

    @classmethod
    def allocate(cls, cfg: KVCacheConfig, device: torch.device | str) -> "InputBuffers":
        t, r = cfg.max_num_tokens, cfg.max_num_reqs
        staging = HostStaging(device)
        return cls(
            input_ids=staging.register(torch.zeros(t, dtype=torch.int64, device=device)),
            positions=staging.register(torch.zeros(t, dtype=torch.int64, device=device)),
            query_start_loc=staging.register(torch.zeros(r + 1, dtype=torch.int32, device=device)),
            seq_lens=staging.register(torch.zeros(r, dtype=torch.int32, device=device)),
            state_indices=staging.register(torch.full((r,), -1, dtype=torch.int32, device=device)),
            has_initial_state=staging.register(torch.zeros(r, dtype=torch.bool, device=device)),
            staging=staging,
        )

    def write(self, batch: InputBatch) -> None:
        """Copy one batch in (one queued host->device copy per field, see
        host_staging.py). Padding tokens: id 0, position 0; padding requests:
        no tokens, seq_len 0, slot -1."""
        T, B = batch.num_tokens_padded, batch.num_reqs_padded
        pad_t, pad_b = T - batch.num_tokens, B - batch.num_reqs
        ids, pos = host_array(torch.int64), host_array(torch.int64)
        qsl, lens = host_array(torch.int32), host_array(torch.int32)
        slots, has_state = host_array(torch.int32), host_array(torch.bool)
        ids.extend(batch.token_ids)
        ids.extend([0] * pad_t)
        start = 0
        qsl.append(0)
        for q, s in zip(batch.query_lens, batch.seq_lens):
            pos.extend(range(s - q, s))
            start += q
            qsl.append(start)
            has_state.append(q < s)
        pos.extend([0] * pad_t)
        qsl.extend([start] * pad_b)
        lens.extend(batch.seq_lens)
        lens.extend([0] * pad_b)
        slots.extend(batch.req_slots)
        slots.extend([-1] * pad_b)
        has_state.extend([False] * pad_b)
        with self.staging.write() as st:
            st.put(self.input_ids, ids)
            st.put(self.positions, pos)
            st.put(self.query_start_loc, qsl)
            st.put(self.seq_lens, lens)
            st.put(self.state_indices, slots)
            st.put(self.has_initial_state, has_state)
