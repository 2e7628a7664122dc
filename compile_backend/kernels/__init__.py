"""Triton kernels of mrv2, each a `torch.library` custom op in namespace
`mrv2` with a fake (meta) implementation and a plain-torch reference.

Importing this package registers the ops and their facts (role, layer-keyed,
capture-safe: `register_op` beside each definition, README.md "Op roles"):
    mrv2::reshape_and_cache  (attention-like) compile_backend/kernels/reshape_and_cache.py
    mrv2::rope_and_cache     (attention-like) compile_backend/kernels/rope_and_cache.py (rotary on
                             q and k, and the KV cache write, in one kernel)
    mrv2::unified_attention  (breakpoint)     compile_backend/kernels/unified_attention.py
    mrv2::sconv              (attention-like) compile_backend/kernels/sconv.py
    mrv2::kv_compress        (attention-like) compile_backend/kernels/kv_compress.py
    mrv2::sibling_linear     (ordinary)       compile_backend/kernels/sibling_linear.py (one matmul
                             for sibling linears: compile_backend/passes/fuse_sibling_linears.py)
    mrv2::linear_add         (ordinary)       compile_backend/kernels/skinny_linear.py (residual +
                             linear, one kernel at decode: compile_backend/passes/fuse_linear_residual.py)
    mrv2::norm_linear        (ordinary)       compile_backend/kernels/norm_linear.py (RMSNorm, linear(s)
                             and SiLU·mul, one kernel at decode: compile_backend/passes/fuse_norm_linear.py)
    mrv2::all_reduce         (collective)     compile_backend/kernels/all_reduce.py (tensor
                             parallelism's sum: one-shot or NCCL per message,
                             compile_backend/passes/symmetric_all_reduce.py)
Models use the layers in compile_backend/kernels/layers.py, which read metadata from the
forward context by layer name (compile_backend/kernels/_metadata.py).
unified_attention writes an out-parameter; eager pieces call it through
`unified_attention_direct` (one checked call and one plan per step, then
bound Triton launches: Note [attention plans] in compile_backend/kernels/attention_plan.py,
compile_backend/kernels/_launch.py).

Dispatch (compile_backend/kernels/_device.py): CUDA tensors, or any tensors with
TRITON_INTERPRET=1, run the Triton kernels; plain CPU tensors run the torch
reference, so models built on these ops run on any CPU machine. Argument
checks: compile_backend/kernels/_checks.py.

Index checks (block ids, slots, state indices; Note [index checks] in
compile_backend/kernels/_checks.py) run before every launch on CPU tensors; on CUDA they cost
a device sync and run only under `set_debug_checks(True)` or
`with debug_checks():` (compile_backend/kernels/_debug.py), never while a CUDA graph is being
captured.
"""

from ._debug import debug_checks, set_debug_checks
from ._device import PDL_ENV
from .all_reduce import all_reduce
from .kv_compress import kv_compress, kv_compress_ref
from .layers import KVCompressor, PagedAttention, ShortConv
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from .norm_linear import norm_linear, norm_linear_ref, rms_norm_ref
from .rope_and_cache import rope_and_cache, rope_and_cache_ref
from .sconv import sconv, sconv_ref
from .sibling_linear import pack_siblings, packed_view, sibling_linear
from .skinny_linear import SKINNY_ENV, linear_add, skinny_linear
from .unified_attention import TWO_LAUNCH_ENV, num_kv_splits, unified_attention, unified_attention_ref

# The environment switches that change which kernels run (the debug manifest
# records their values): PDL off, the skinny GEMM's rule, the decode's form.
KERNEL_SWITCHES = (PDL_ENV, SKINNY_ENV, TWO_LAUNCH_ENV)

__all__ = [
    "KERNEL_SWITCHES", "KVCompressor", "PagedAttention", "ShortConv", "all_reduce", "debug_checks",
    "kv_compress", "kv_compress_ref", "norm_linear", "norm_linear_ref", "num_kv_splits", "pack_siblings", "packed_view",
    "reshape_and_cache", "reshape_and_cache_ref", "rope_and_cache", "rope_and_cache_ref",
    "rms_norm_ref", "sconv", "sconv_ref", "set_debug_checks",
    "linear_add", "sibling_linear", "skinny_linear", "unified_attention", "unified_attention_ref",
]
