"""Persistent input buffers: allocated once at the largest size, written in
place every step, so captured graphs always read the same addresses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compile_backend.runner.host_staging import Field, HostStaging, host_array
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig


@dataclass
class InputBuffers:
    input_ids: torch.Tensor  # [max_num_tokens] int64
    positions: torch.Tensor  # [max_num_tokens] int64
    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    state_indices: torch.Tensor  # [max_num_reqs] int32 (-1: padding row)
    has_initial_state: torch.Tensor  # [max_num_reqs] bool
    staging: HostStaging = field(default=None, repr=False)  # the arena the fields view

    @classmethod
    def allocate(cls, cfg: KVCacheConfig, device: torch.device | str) -> "InputBuffers":
        t, r = cfg.max_num_tokens, cfg.max_num_reqs
        staging = HostStaging(device, [
            Field("input_ids", (t,), torch.int64, 0),
            Field("positions", (t,), torch.int64, 0),
            Field("query_start_loc", (r + 1,), torch.int32, 0),
            Field("seq_lens", (r,), torch.int32, 0),
            Field("state_indices", (r,), torch.int32, -1),
            Field("has_initial_state", (r,), torch.bool, 0),
        ])
        return cls(**staging.views, staging=staging)

    def write(self, batch: InputBatch) -> None:
        """Copy one batch in (one queued host->device copy, see host_staging.py).
        Padding tokens: id 0, position 0; padding requests: no tokens,
        seq_len 0, slot -1."""
        T, B = batch.num_tokens_padded, batch.num_reqs_padded
        pad_t, pad_b = T - batch.num_tokens, B - batch.num_reqs
        ids = host_array(torch.int64, batch.token_ids)
        ids.extend([0] * pad_t)
        pos = host_array(torch.int64, batch.positions())
        pos.extend([0] * pad_t)
        qsl, has_state = host_array(torch.int32, [0]), host_array(torch.bool)
        start = 0
        for q, s in zip(batch.query_lens, batch.seq_lens):
            start += q
            qsl.append(start)
            has_state.append(q < s)
        qsl.extend([start] * pad_b)
        lens = host_array(torch.int32, batch.seq_lens)
        lens.extend([0] * pad_b)
        slots = host_array(torch.int32, batch.req_slots)
        slots.extend([-1] * pad_b)
        has_state.extend([False] * pad_b)
        with self.staging.write() as st:  # the whole arena: a few bytes per token
            st.put("input_ids", ids)
            st.put("positions", pos)
            st.put("query_start_loc", qsl)
            st.put("seq_lens", lens)
            st.put("state_indices", slots)
            st.put("has_initial_state", has_state)
