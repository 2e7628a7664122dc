"""Small custom ops for backend tests (namespace `toy`), each with a fake impl.

toy::attn        breakpoint-like: q, k, v [T, D] -> [T, D] (softmax attention)
toy::attn_pair   breakpoint returning a tuple: x -> (2x, x + 1)
toy::state_mix   attention-like: x [T, D], state [D] (mutated: state += sum(x));
                 returns x + state (after the update)
"""

import torch


@torch.library.custom_op("toy::attn", mutates_args=())
def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, dim=-1)
    return w @ v


@attn.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op("toy::attn_pair", mutates_args=())
def attn_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@attn_pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("toy::state_mix", mutates_args=("state",))
def state_mix(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    state.add_(x.sum(0))
    return x + state


@state_mix.register_fake
def _(x, state):
    return torch.empty_like(x)
