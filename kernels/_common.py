"""What every kernel launcher shares: argument checks that raise `ValueError`
naming the argument, and the switch between Triton and plain torch.

Dispatch rule (used by every `mrv2::` op): CUDA tensors, or any tensors while
Triton's interpreter is on (`TRITON_INTERPRET=1`), go to the Triton launcher;
plain CPU tensors without the interpreter go to the op's pure-torch reference,
so that a model built on these ops runs on any CPU machine.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import triton.language as tl

from compile_backend.forward_context import get_forward_context

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Should an op on `t` run the Triton launcher (else: the torch reference)?"""
    return t.is_cuda or interpreting()


def upcast_dots(dtype: torch.dtype) -> bool:
    """Note [interpreter bf16 dots]: Triton's interpreter computes `tl.dot` on
    bf16 operands wrongly, so when interpreting, bf16 dot operands are upcast
    to fp32 (a constexpr switch); on the GPU they stay bf16 (tensor cores)."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots rather than tf32 (what the caller asked for)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Note [scalar masks]: Triton 3.9's interpreter turns `bool_tensor & bool_scalar`
# into an int32 tensor, which loads and stores then reject as a mask. Kernels
# therefore fold a scalar condition into a bound instead:
#     mask = offs < tl.where(cond, N, 0)      # not: (offs < N) & cond


def tl_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


def layer_metadata(layer_name: str, event: str):
    """What every layer-name op does first: record the call in the forward
    context's trace and return that layer's metadata."""
    ctx = get_forward_context()
    ctx.record(layer_name, event)
    return ctx.metadata(layer_name)
