"""Triton kernels of mrv2, each a `torch.library` custom op in namespace
`mrv2` with a fake (meta) implementation and a plain-torch reference.

Importing this package registers the ops and their facts (role, layer-keyed,
capture-safe: `register_op` beside each definition, README.md "Op roles").
Models use the layers in compile_backend/kernels/layers.py, which read
metadata from the forward context by layer name. CUDA tensors, or any
tensors with TRITON_INTERPRET=1, run the Triton kernels; plain CPU tensors
run the torch reference (compile_backend/kernels/_device.py). Index checks
run before every launch on CPU tensors, on CUDA only under
`set_debug_checks(True)` or `with debug_checks():`, never during a capture
(Note [index checks] in compile_backend/kernels/_checks.py). Each op, its
role and its file: docs/design.md, section "Kernels: one custom op each".
"""

from ._debug import debug_checks, set_debug_checks
from ._device import PDL_ENV
from .all_reduce import all_reduce
from .kv_compress import kv_compress, kv_compress_ref
from .layers import KVCompressor, PagedAttention, ShortConv
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from .norm_linear import norm_linear, norm_linear_ref
from .residual_norm_linear import residual_norm_linear, residual_norm_linear_ref
from .rms_norm import rms_norm_ref
from .rope_and_cache import rope_and_cache, rope_and_cache_ref
from .rope_attention import rope_attention, rope_attention_ref
from .sconv import sconv, sconv_ref
from .sibling_linear import pack_siblings, packed_view, sibling_linear
from .skinny_linear import SKINNY_ENV, WIDE_ENV, linear_add, skinny_linear
from .unified_attention import TWO_LAUNCH_ENV, num_kv_splits, unified_attention, unified_attention_ref

# The environment switches that change which kernels run (the debug manifest
# records their values): PDL off, the skinny GEMM's rule and its wide rows,
# the decode's form.
KERNEL_SWITCHES = (PDL_ENV, SKINNY_ENV, WIDE_ENV, TWO_LAUNCH_ENV)

__all__ = [
    "KERNEL_SWITCHES", "KVCompressor", "PagedAttention", "ShortConv", "all_reduce", "debug_checks",
    "kv_compress", "kv_compress_ref", "norm_linear", "norm_linear_ref", "num_kv_splits", "pack_siblings", "packed_view",
    "reshape_and_cache", "reshape_and_cache_ref", "residual_norm_linear",
    "residual_norm_linear_ref", "rope_and_cache", "rope_and_cache_ref",
    "rope_attention", "rope_attention_ref",
    "rms_norm_ref", "sconv", "sconv_ref", "set_debug_checks",
    "linear_add", "sibling_linear", "skinny_linear", "unified_attention", "unified_attention_ref",
]
