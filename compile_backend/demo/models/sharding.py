"""How the reference models split their weights across tensor-parallel ranks.

A module that holds a shard of a parameter says so in `tp_shards` (parameter
name -> `Shard`). `Decoder.init_weights` draws every parameter at its full
(TP=1) shape from the one seeded generator, in module order, and keeps this
rank's part: TP=N computes the same function as TP=1 from the same seed, and
a TP=1 model (no `tp_shards`) draws exactly what it always drew.

    column-parallel  nn.Linear(in, out / N)   weight [out/N, in]: Shard(dim=0)
    row-parallel     nn.Linear(in / N, out)   weight [out, in/N]: Shard(dim=1);
                     its output is a partial sum, all-reduced by the caller
                     (the hybrid layer sums three such outputs, then reduces once)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compile_backend.core.parallel import TensorParallel


@dataclass(frozen=True)
class Shard:
    """Rank r of N keeps slice r of N along `dim`. A fused parameter of
    `chunks` equal parts along `dim` (gate | up) has each part split on its own,
    so rank r keeps [gate_r | up_r]."""

    dim: int
    chunks: int = 1

    def full_shape(self, local: torch.Size, size: int) -> list[int]:
        shape = list(local)
        shape[self.dim] *= size
        return shape

    def take(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        parts = full.chunk(self.chunks, dim=self.dim)  # [.., n/chunks, ..] each
        return torch.cat([p.chunk(size, dim=self.dim)[rank] for p in parts], dim=self.dim)


def column_linear(in_features: int, out_features: int, tp: TensorParallel,
                  chunks: int = 1) -> nn.Linear:
    """Output features split across ranks: [T, in] -> [T, out/N] (this rank's
    columns of the TP=1 output)."""
    linear = nn.Linear(in_features, tp.shard(out_features), bias=False)
    if tp.size > 1:
        linear.tp_shards = {"weight": Shard(0, chunks)}
    return linear


def row_linear(in_features: int, out_features: int, tp: TensorParallel) -> nn.Linear:
    """Input features split across ranks: [T, in/N] -> [T, out], one rank's
    term of the TP=1 output (sum over ranks: `tp.all_reduce`)."""
    linear = nn.Linear(tp.shard(in_features), out_features, bias=False)
    if tp.size > 1:
        linear.tp_shards = {"weight": Shard(1)}
    return linear


def shard_rows(module: nn.Module, tp: TensorParallel, *names: str) -> nn.Module:
    """Mark `module`'s parameters `names` as split along dim 0 (channels)."""
    if tp.size > 1:
        module.tp_shards = {name: Shard(0) for name in names}
    return module
