"""A user's own attention-like op with its own metadata: a running sum per
request (README, "Your own attention-like ops"). Importing this module
registers the op, its role and its metadata builder.

Three parts: the op `running_state::running_sum` (a custom op with a fake,
reading its metadata from the forward context by layer name; attention-like,
so it runs inside captured graphs in every mode), its metadata
`RunningSumMetadata` with the builder registered for the kind "running_sum",
and the layer `RunningSum`. For request b with tokens x[qsl[b]:qsl[b+1]] this
step, state row s = its slot:
    prev      = state[s] if the request has cached tokens else 0     [C]
    out[t]    = prev + sum of the request's tokens up to and including t
    state[s] <- prev + sum of all the request's tokens this step
Padding rows (slot -1) and padding tokens read and write nothing; output 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compile_backend import (BaseMetadataBuilder, CaptureSupport, Metadata, get_forward_context,
                             register_metadata_builder, register_op_role)
from compile_backend.runner.input_batch import InputBatch


@dataclass
class RunningSumMetadata(Metadata):  # Metadata.tensors(): debug_checks watch their addresses
    """B = padded number of requests."""

    query_start_loc: torch.Tensor  # [B+1] int32: request b owns tokens qsl[b]:qsl[b+1]
    state_indices: torch.Tensor  # [B] int32: its state row, -1 = padding row
    has_initial_state: torch.Tensor  # [B] bool: False = a new request, starts from 0


class RunningSumMetadataBuilder(BaseMetadataBuilder):  # keeps self.cfg, .buffers, .tables
    kind = "running_sum"
    attention_like = True  # inside captured graphs in every mode, so its
    capture_support = CaptureSupport.ALWAYS  # metadata must always be capturable

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        b = self.buffers
        return {"query_start_loc": b.query_start_loc, "state_indices": b.state_indices,
                "has_initial_state": b.has_initial_state}

    def build(self, batch: InputBatch, *, for_capture: bool) -> RunningSumMetadata:
        """Views of the persistent buffers at the padded size: the same tensors
        at capture and at every replay of that size. The op bakes no Python
        int into a graph, so `for_capture` changes nothing here."""
        B, b = batch.num_reqs_padded, self.buffers
        return RunningSumMetadata(b.query_start_loc[: B + 1], b.state_indices[:B],
                                  b.has_initial_state[:B])


register_metadata_builder("running_sum", RunningSumMetadataBuilder)


@torch.library.custom_op("running_state::running_sum", mutates_args=("state",))
def running_sum(x: torch.Tensor, state: torch.Tensor, layer_name: str) -> torch.Tensor:
    """x [T, C]; state [num_slots, C] (updated in place) -> [T, C].

    Tensor ops only, sized by the padded batch: no host sync and no
    data-dependent shape, so a CUDA graph can capture it. Padding rows read
    row 0 and add zeros to it; index_add_ accumulates, so those zeros never
    race a real request's write there. A new request's row is first zeroed
    (s + -s is exactly 0), then every real row adds its tokens."""
    meta = get_forward_context().metadata(layer_name)  # this layer's RunningSumMetadata
    qsl, slot = meta.query_start_loc.long(), meta.state_indices.long()  # [B+1], [B]
    B, T, C = slot.shape[0], x.shape[0], x.shape[1]
    real, row = slot >= 0, slot.clamp(min=0)  # [B]
    prev = torch.where((real & meta.has_initial_state)[:, None], state[row], 0)  # [B, C]
    # each token's request; padding tokens (past the last request) get B
    req = torch.searchsorted(qsl[1:], torch.arange(T, device=x.device), right=True)  # [T]
    req_c = req.clamp(max=B - 1)
    mine = (req < B) & real[req_c]  # [T]: a real request's token
    # sums[i]: the sum of the real tokens before token i, [T+1, C]
    sums = torch.cat([x.new_zeros(1, C), torch.where(mine[:, None], x, 0).cumsum(0)])
    out = torch.where(mine[:, None], prev[req_c] + sums[1:] - sums[qsl[req_c]], 0)
    total = sums[qsl[1:]] - sums[qsl[:-1]]  # [B, C]
    state.index_add_(0, row, torch.where((real & ~meta.has_initial_state)[:, None], -state[row], 0))
    state.index_add_(0, row, torch.where(real[:, None], total, 0))
    return out


@running_sum.register_fake
def _(x, state, layer_name):
    return torch.empty_like(x)


register_op_role("running_state::running_sum", "attention_like")  # never split there


class RunningSum(nn.Module):
    """x [T, C] -> [T, C]: each request's running sum of x over its tokens."""

    metadata_kind = "running_sum"  # -> RunningSumMetadataBuilder

    def __init__(self, channels: int, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.register_buffer("state", torch.empty(0, channels), persistent=False)

    def bind_state(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """One state row per request slot (KVCacheConfig.max_num_reqs)."""
        self.state = torch.zeros(num_slots, self.state.shape[1], dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.running_state.running_sum(x, self.state, self.layer_name)
