"""Where and how a kernel runs: the switch between Triton and plain torch,
and the Triton pieces that several kernels share (request tiles, dot
settings, sizes).

Dispatch rule (used by every `mrv2::` op): CUDA tensors, or any tensors while
Triton's interpreter is on (`TRITON_INTERPRET=1`), go to the Triton launcher;
plain CPU tensors without the interpreter go to the op's pure-torch reference,
so that a model built on these ops runs on any CPU machine.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


# CPython keeps os.environ's values in a dict of bytes on POSIX (`_data`,
# which every os.environ write updates); launch paths read their switches
# there at every call, in about a tenth of os.environ.get's time (a launch
# reads two to five of them). Elsewhere, os.environ.get.
_ENV_BY_BYTES = os.name == "posix"


def env(name: str, default: str = "") -> str:
    """os.environ.get(name, default) for an ASCII name, cheaper (above)."""
    data = getattr(os.environ, "_data", None) if _ENV_BY_BYTES else None
    if type(data) is not dict:
        return os.environ.get(name, default)
    value = data.get(name.encode())
    return default if value is None else os.fsdecode(value)  # as os.environ decodes


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return env("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Should an op on `t` run the Triton launcher (else: the torch reference)?"""
    return t.is_cuda or interpreting()


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (grids are sized by
    them); 4 elsewhere (the interpreter: any small number)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def upcast_dots(dtype: torch.dtype) -> bool:
    """Note [interpreter bf16 dots]: Triton's interpreter computes `tl.dot` on
    bf16 operands wrongly, so when interpreting, bf16 dot operands are upcast
    to fp32 (a constexpr switch); on the GPU they stay bf16 (tensor cores)."""
    return interpreting() and dtype == torch.bfloat16


# Note [programmatic dependent launch]: on Hopper and later a kernel launched
# with the PDL attribute (`launch_pdl=True`) may start while the kernel before
# it on the stream is still finishing: its programs get resident, run what
# does not read earlier kernels' results, and block in `griddepcontrol.wait`
# until that kernel has completed and its writes are visible. Inside a CUDA
# graph the edge stays programmatic, so each such boundary saves part of a
# launch's latency and the previous kernel's tail (on the H200 these are a
# large share of a decode step's small kernels: bench/results/pdl.md).
# The rules every kernel here follows:
#   * `pdl_wait` comes before any load of an argument (the kernel just before
#     may have computed it: q, the caches, a residual, even a weight, which a
#     dequant kernel may write) and before any store (the kernel just before
#     may still read that buffer). Before it: index math, and the attention
#     metadata of the forward context (query_start_loc, seq_lens, slots),
#     which the step's inputs carry and no kernel right before attention
#     writes (at least the q projection lies between).
#   * `pdl_release` (griddepcontrol.launch_dependents) comes only after the
#     wait, so that when a kernel's programs start, every kernel before the
#     one just before has completed; it is issued after the main loop, so
#     waiting dependents do not hold SMs that a long kernel's programs need
#     (right after the wait in kernels without one).
# Where PDL is off (the interpreter, CPUs, GPUs before sm_90, ROCm, a Triton
# without `gdc_wait`, or MRV2_PDL=0) both are compiled out (PDL constexpr
# False) and the launch carries no attribute.


PDL_ENV = "MRV2_PDL"  # "0": PDL off


def pdl_meta(device: torch.device) -> dict:
    """The launch keywords that turn PDL on or off for a kernel on `device`:
    {"PDL": True, "launch_pdl": True} where it is on (Note [programmatic
    dependent launch]), else {"PDL": False}. MRV2_PDL=0 turns it off."""
    if (env(PDL_ENV) == "0" or device.type != "cuda" or interpreting()
            or not _HAS_GDC or torch.version.hip):  # ROCm: no griddepcontrol
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _cuda_major(index) >= 9 else {"PDL": False}


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


try:  # grid dependency control (Triton 3.3+); without it PDL stays off
    from triton.language.extra import cuda as _tl_cuda
    _HAS_GDC = hasattr(_tl_cuda, "gdc_wait") and hasattr(_tl_cuda, "gdc_launch_dependents")
except ImportError:
    _HAS_GDC = False


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible (a no-op
    compiled out unless PDL; Note [programmatic dependent launch])."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel's programs launch (after `pdl_wait` only)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


# Note [interpreter bf16 rounding]: Triton 3.9's interpreter converts fp32 to
# bf16 by truncation; the GPU (and torch) round to nearest even. When
# interpreting a bf16 kernel, `round_to` rounds the fp32 value to nearest
# even in its bits first (a constexpr switch), so the truncation is exact and
# the interpreter computes what the GPU does.


@triton.jit
def round_to(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 x -> dtype, rounded to nearest even (Note [interpreter bf16 rounding])."""
    if RNE_BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots rather than tf32 (what the caller asked for)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Note [scalar masks]: Triton 3.9's interpreter turns `bool_tensor & bool_scalar`
# into an int32 tensor, which loads and stores then reject as a mask. Kernels
# therefore fold a scalar condition into a bound instead:
#     mask = offs < tl.where(cond, N, 0)      # not: (offs < N) & cond


# Note [request tiles]: kernels over a batch's tokens launch a grid sized by
# the tokens present, never by requests x a padded max_query_len (in PIECEWISE
# that bound is the padded token count T, and most such programs would find
# nothing to do). Axis 0 has cdiv(T, TILE) + B programs; request b owns the
# programs from first(b) = qsl[b] // TILE + b to first(b + 1) - 1, at least
# cdiv(q_len_b, TILE) of them, and its local tile j holds its tokens
# [j * TILE, (j + 1) * TILE). The programs from first(B) on make a padding
# pseudo-request b = B over the tokens [qsl[B], T): no keys, no state, output
# 0. A program finds its request by counting the requests that start at or
# before it (one vector load of query_start_loc per SEARCH requests).
# With ONE_TOKEN (max_query_len == 1: every request has at most one token) the
# grid is max(B, T): program p is request p (when p < B) and also writes the
# zero row p when p lies in [qsl[B], T) (`pad_row`, -1 otherwise). The grid
# depends only on shapes and Python ints, so the kernels stay capturable.
SEARCH = 256
# Note [batch ints unspecialised]: the request and token counts a request-tile
# kernel takes (num_reqs, num_tokens) feed only its prologue's index math, so
# Triton's specialisation of an int (equal to 1, a multiple of 16, neither)
# buys nothing there and made a variant, compiled and loaded, of each kernel
# per class of each: up to 3 of a decode kernel per split count, 4 of the
# prefill kernel. `@triton.jit(do_not_specialize=BATCH_INTS)` compiles one.
BATCH_INTS = ("num_reqs", "num_tokens")


def request_grid(num_tokens: int, num_reqs: int, tile: int, one_token: bool) -> int:
    """Programs on axis 0 for Note [request tiles]."""
    return max(num_reqs, num_tokens) if one_token else cdiv(num_tokens, tile) + num_reqs


@triton.jit
def request_tile(qsl_ptr, num_reqs, num_tokens, TILE: tl.constexpr, SEARCH: tl.constexpr,
                 ONE_TOKEN: tl.constexpr):
    """Note [request tiles]: this program's (b, q_start, q_len, tile, pad_row);
    b == num_reqs is the padding pseudo-request."""
    pid = tl.program_id(0)
    if ONE_TOKEN:
        b = tl.minimum(pid, num_reqs)
        end = tl.load(qsl_ptr + num_reqs)
        pad_row = tl.where((pid >= end) & (pid < num_tokens), pid, -1)
    else:
        b = pid * 0
        for i in range(0, num_reqs, SEARCH):
            r = i + 1 + tl.arange(0, SEARCH)  # requests 1..B
            ok = r <= num_reqs
            first = tl.load(qsl_ptr + r, mask=ok, other=0) // TILE + r
            b += tl.sum(((first <= pid) & ok).to(tl.int32), 0)
        pad_row = pid * 0 - 1
    q_start = tl.load(qsl_ptr + b)
    q_end = tl.load(qsl_ptr + b + 1, mask=b < num_reqs, other=num_tokens)  # pseudo-request: to T
    tile = pid - (q_start // TILE + b)
    if ONE_TOKEN:  # the pseudo-request is empty; its rows go through pad_row
        q_end = tl.where(b < num_reqs, q_end, q_start)
        tile = pid * 0
    return b, q_start, q_end - q_start, tile, pad_row


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
