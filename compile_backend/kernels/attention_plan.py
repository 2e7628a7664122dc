"""The step plan cache of unified attention's direct path (Note [attention
plans]): which calls may build a plan, how plans are keyed, and where a
step's plans are kept.

Where the plans live. A plan is valid for one step's metadata only (its
tensors, by identity, and its Python ints), so it is kept on the step's
metadata object, in a field the metadata class declares:
`AttentionMetadata.attention_plans` (compile_backend/runner/attention_metadata.py),
`field(default=None, init=False, repr=False, compare=False)`: no constructor
argument, not in repr or equality, not a tensor (so not in `tensors()`), and
`dataclasses.replace` gives the copy an empty cache. A new step builds new
metadata, so plans never outlive their step and need no invalidation. The
kernels sit below the runner (core < runtime < kernels < ... < runner) and
never import its classes: they reach the field by its name, `PLANS_FIELD`
(tests/kernels check that AttentionMetadata declares it). A metadata class
without the field (a user's own) gets no plans: every call of a step then
runs the checked path (correct, slower).

Note [attention plans]: an eager piece calls `unified_attention_direct` once
per layer. All but the tensors' contents is the same for every layer of a
step with the same shapes: the checks, the path, the grid, the number of KV
splits, the strides, the decode scratch. The first such call of a step runs
the launcher's full checks and builds a plan (`_Plan` in
compile_backend/kernels/unified_attention.py), kept in the step metadata's `attention_plans`
(a dict keyed by `plan_key`: shapes, strides, dtypes and devices of query,
caches and output); later calls find it and launch its kernels through bound
launchers (compile_backend/kernels/_launch.py). A plan is used only where it does what the
checked call would: the same key, the same metadata tensors (identity) and
Python ints, 16-byte aligned tensors (what the bound kernels were specialised
for), debug_checks off, and on CUDA no graph capture, no Triton launch hooks,
and the device and stream the plan was built on (`_Plan.ready`). Anything
else runs the checked path. Layers share the plan's scratch and the device's
decode ticket counters (Note [decode tickets] in compile_backend/kernels/unified_attention.py):
a later layer's decode launch writes them only after the earlier layer's has
finished (one stream, launch order). On CPU (the interpreter) a plan launches normally and still
checks the index values every call (Note [index checks] in compile_backend/kernels/_checks.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ._debug import debug_checks_on
from ._launch import hooks_unset, stream_capturing

# The metadata field that holds a step's plans: None (no plan yet) or
# {plan_key: plan}. Declared by AttentionMetadata (see the module docstring).
PLANS_FIELD = "attention_plans"


def plan_key(query, key_cache, value_cache, output) -> tuple:
    """What a plan is specialised for besides the metadata: shapes, strides,
    dtypes and devices of query [T, H, D], the caches and output [T, H, D]."""
    return (query.shape, query.stride(), key_cache.shape, key_cache.stride(), value_cache.shape,
            value_cache.stride(), output.shape, output.stride(), query.dtype, key_cache.dtype,
            value_cache.dtype, output.dtype, query.device, key_cache.device, value_cache.device,
            output.device)


def aligned(query, key_cache, value_cache, output) -> bool:
    """Every tensor 16-byte aligned (what the bound kernels were specialised for)."""
    return not (query.data_ptr() | key_cache.data_ptr() | value_cache.data_ptr()
                | output.data_ptr()) & 15


def plannable(query, key_cache, value_cache, output) -> bool:
    """May a plan be built for this call?"""
    if debug_checks_on():
        return False
    if not all(isinstance(t, torch.Tensor) for t in (query, key_cache, value_cache, output)):
        return False  # the checks name the argument
    if not aligned(query, key_cache, value_cache, output):
        return False
    return not query.is_cuda or (not stream_capturing() and hooks_unset())


def find_plan(meta: Any, query, key_cache, value_cache, output) -> Any | None:
    """The plan this step's metadata keeps for these arguments' key, or None
    (it may still not serve the call: `_Plan.ready` decides)."""
    plans = getattr(meta, PLANS_FIELD, None)
    if plans is None:
        return None
    return plans.get(plan_key(query, key_cache, value_cache, output))


def keep_plan(meta: Any, plan: Any, query, key_cache, value_cache, output) -> None:
    """Keep `plan` for the rest of this step, in `meta`'s declared field; a
    metadata object without the field keeps none."""
    if not hasattr(meta, PLANS_FIELD):
        return
    plans = getattr(meta, PLANS_FIELD)
    if plans is None:
        plans = {}
        setattr(meta, PLANS_FIELD, plans)
    plans[plan_key(query, key_cache, value_cache, output)] = plan
