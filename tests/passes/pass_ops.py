"""Test-only ops for the pass tests (namespace `passtest`), each with a fake impl.

passtest::host_read     x -> x * tanh(x.sum().item()): a custom op the passes cannot
                        look into (hides a host sync); not trusted
passtest::graph_unsafe  x -> x + 1, tagged torch.Tag.cudagraph_unsafe
passtest::bump          x (mutated: x += 1) -> None; a schema-declared mutation
passtest::compress      attention-like in the tests: x [T, D], cache [D]
                        (mutated: cache = 0.5 * cache + mean(x)) -> cache * x
passtest::cache_write   breakpoint in the tests: k, v [T, D], cache [2, D]
                        (mutated: cache = [k.sum(0), v.sum(0)])
opaque_shift            a plain python function kept whole in Dynamo graphs
                        (allow_in_graph): effects unknown to the passes
"""

import math

import torch
import torch._dynamo

_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("passtest::host_read", mutates_args=())
def host_read(x: torch.Tensor) -> torch.Tensor:
    return x * math.tanh(x.sum().item())


@host_read.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("passtest::graph_unsafe", mutates_args=(), tags=_TAGS)
def graph_unsafe(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@graph_unsafe.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("passtest::bump", mutates_args=("x",))
def bump(x: torch.Tensor) -> None:
    x.add_(1)


@bump.register_fake
def _(x):
    return None


@torch.library.custom_op("passtest::compress", mutates_args=("cache",))
def compress(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.mul_(0.5).add_(x.mean(0))
    return x * cache


@compress.register_fake
def _(x, cache):
    return torch.empty_like(x)


@torch.library.custom_op("passtest::cache_write", mutates_args=("cache",))
def cache_write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> None:
    cache[0].copy_(k.sum(0))
    cache[1].copy_(v.sum(0))


@cache_write.register_fake
def _(k, v, cache):
    return None


def opaque_shift(x: torch.Tensor) -> torch.Tensor:
    return x - 0.25


opaque_shift = torch._dynamo.allow_in_graph(opaque_shift)
