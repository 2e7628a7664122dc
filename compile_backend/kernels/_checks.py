"""Argument checks of the kernel launchers: each raises `ValueError` naming
the argument, what was expected and what came (`check_tensor`, `check_int`,
...), and the index checks that read the values of metadata tensors before a
launch (`check_ids`, Note [index checks]).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch

from ._debug import index_checks_on
from ._device import interpreting

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
    dtype_of: str | None = None,
) -> torch.Tensor:
    """Raise ValueError (naming `name` and what was expected) unless `t` fits."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            why = f" (the dtype of {dtype_of})" if dtype_of else ""
            raise ValueError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}{why}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(
            f"{name}: expected a tensor on {device} (the device of the other inputs), "
            f"got one on {t.device}"
        )
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape "
            f"{tuple(t.shape)} (call .contiguous() first)"
        )
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected the last dimension to be contiguous (stride 1), got strides "
            f"{t.stride()}"
        )
    return t


def check_device(name: str, t: torch.Tensor) -> torch.device:
    """The device of the first tensor: CUDA, or CPU while interpreting."""
    if t.is_cuda or (t.device.type == "cpu" and interpreting()):
        return t.device
    if t.device.type == "cpu":
        raise ValueError(
            f"{name}: CPU tensors need Triton's interpreter (set TRITON_INTERPRET=1 before "
            "importing triton), or call the op (torch.ops.mrv2.*), which falls back to the "
            "torch reference on CPU"
        )
    raise ValueError(f"{name}: expected a CUDA tensor (or CPU with TRITON_INTERPRET=1), got device {t.device}")


def check_int(name: str, value: object, minimum: int) -> int:
    """A Python int >= minimum (grid-shaping arguments), else ValueError."""
    if not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name}: expected a {kind} int, got {value!r}")
    return value


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, *, dtype: torch.dtype,
                    dtype_of: str, device: torch.device,
                    shape: tuple[int | None, ...]) -> None:
    """The paged K and V caches [num_blocks, block_size, KVH, D]: contiguous,
    of `dtype` and `device`, matching `shape` (None: any) and each other."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, cache, ndim=4, dtypes=(dtype,), dtype_of=dtype_of, device=device,
                     contiguous=True)
        check_tensor(name, cache, shape=shape)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache: expected the shape of key_cache {tuple(key_cache.shape)}, "
            f"got {tuple(value_cache.shape)}"
        )


def check_paged_metadata(device: torch.device, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor) -> int:
    """query_start_loc [B+1], seq_lens [B] and block_table [B, *] (last dim
    contiguous), int32 on `device`, else ValueError; returns B."""
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    B = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device,
                 last_dim_contiguous=True)
    check_tensor("block_table", block_table, shape=(B, None))
    return B


# Note [index checks]: the kernels index caches and states with values read
# from metadata tensors (block ids, slots, state indices, query offsets). An
# index out of range reads or writes another tensor's memory: a crash in
# Triton's interpreter, silent corruption on a GPU. `check_ids` checks them
# before any launch, always for CPU tensors (cheap, no sync) and for CUDA
# tensors only under `set_debug_checks(True)`: there it costs one
# device->host sync per launch, and it is skipped while a CUDA graph is being
# captured (a sync is illegal then, and capture-time values are dummies).


class _Range(NamedTuple):
    """values[i] must lie in [lo, hi) (lo, hi: ints or tensors shaped like
    values) wherever `used` (None: everywhere)."""
    name: str
    values: torch.Tensor
    lo: int | torch.Tensor
    hi: int | torch.Tensor
    used: torch.Tensor | None
    where: Callable[[int], str]  # first index -> whose entry it is: "request 3"
    what: str  # "a block id", ...
    why: str  # where the range comes from and what to do


def _request(i: int) -> str:
    return f"request {i}"


def _pick(bound: int | torch.Tensor, idx: tuple[int, ...]) -> int:
    return int(bound[idx]) if isinstance(bound, torch.Tensor) else bound


def check_ids(
    op: str,
    *,
    num_tokens: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    cache: tuple[str, torch.Tensor] | None = None,
    positions_per_entry: int = 1,
    state_indices: torch.Tensor | None = None,
    states: tuple[str, int] | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Raise ValueError (naming `op`, the argument, the request or token, the
    value and the valid range) unless every index a launch would use is in
    range (Note [index checks]). Only what the kernels read is checked:
      * query_start_loc [B+1]: non-decreasing offsets in [0, num_tokens];
        request b is real when it has tokens (and, with state_indices, a state);
      * state_indices [B] (every row): in [-1, num_states), -1 = padding row;
      * seq_lens [B] (real rows): at least the request's new tokens, at most
        what block_table's row covers;
      * block_table [B, W] (real rows, entries in use): in [0, num_blocks).
        Entry j is in use when j < ceil((seq_len // positions_per_entry) /
        block_size), with cache = (name, [num_blocks, block_size, ...]);
        positions_per_entry is 1 for attention, the group size for the
        compressor (one cache entry per complete group);
      * slot_mapping [T]: in [-1, num_blocks * block_size), -1 = write nothing.
    Callers pass the metadata their kernels read; shapes are checked already."""
    first = query_start_loc if query_start_loc is not None else slot_mapping
    if not index_checks_on(first.device):
        return
    checks: list[_Range] = []
    real = q_len = None
    if query_start_loc is not None:
        qsl = query_start_loc.long()
        prev = torch.cat([qsl.new_zeros(1), qsl[:-1]])
        checks.append(_Range(
            "query_start_loc", qsl, prev, num_tokens + 1, None,
            lambda i: f"start of request {i}" if i < len(qsl) - 1 else "end of the last request",
            "an offset", f"Offsets never decrease and stay within the {num_tokens} tokens of "
            "the input. Fix query_start_loc"))
        q_len = qsl[1:] - qsl[:-1]
        real = q_len > 0
    if state_indices is not None:
        name, num_states = states
        idx = state_indices.long()
        checks.append(_Range(
            "state_indices", idx, -1, num_states, None, _request, "a state index",
            f"{name} has {num_states} slots; -1 marks a padding row. Fix the state indices "
            "or bind more state slots"))
        real = idx >= 0 if real is None else real & (idx >= 0)
    if block_table is not None:
        cache_name, cache_t = cache
        num_blocks, block_size = cache_t.shape[0], cache_t.shape[1]
        width, per = block_table.shape[1], positions_per_entry
        entries = "seq_len" if per == 1 else f"(seq_len // {per})"
        lens = seq_lens.long()
        checks.append(_Range(
            "seq_lens", lens, q_len, (width * block_size + 1) * per, real, _request, "a length",
            f"A seq_len counts at least the request's new tokens and at most what a block_table "
            f"row covers ({width} entries x {block_size} cache entries"
            + ("" if per == 1 else f" x {per} positions")
            + "). Fix seq_lens or widen block_table"))
        needed = (lens.clamp_min(0) // per + block_size - 1) // block_size
        in_use = torch.arange(width, device=lens.device)[None, :] < needed[:, None]
        checks.append(_Range(
            "block_table", block_table.long(), 0, num_blocks, in_use & real[:, None],
            _request, "a block id",
            f"{cache_name} has {num_blocks} blocks; a request with new tokens uses its first "
            f"ceil({entries} / {block_size}) entries. Fix the block table or bind more cache "
            "blocks"))
    if slot_mapping is not None:
        cache_name, cache_t = cache
        num_blocks, block_size = cache_t.shape[0], cache_t.shape[1]
        checks.append(_Range(
            "slot_mapping", slot_mapping.long(), -1, num_blocks * block_size, None,
            lambda i: f"token {i}",
            "a slot", f"{cache_name} has {num_blocks} blocks x {block_size} slots; -1 writes "
            "nothing. Fix the slot mapping or bind more cache blocks"))

    bad = []
    for c in checks:
        out = (c.values < c.lo) | (c.values >= c.hi)
        bad.append(out if c.used is None else out & c.used)
    flags = torch.stack([b.any() for b in bad]).tolist()  # the one device->host sync
    for c, b, flag in zip(checks, bad, flags):
        if flag:
            idx = tuple(int(i) for i in b.nonzero()[0])
            at = ", ".join(map(str, idx))
            raise ValueError(
                f"{op}: {c.name}[{at}] = {int(c.values[idx])} ({c.where(idx[0])}) is out "
                f"of range: expected {c.what} in [{_pick(c.lo, idx)}, {_pick(c.hi, idx)}). "
                f"{c.why}.")
