"""The step plan cache of unified attention's direct path: which calls may
build a plan, how plans are keyed, and where they are kept.

An eager piece calls `unified_attention_direct` once per layer. The first
call of a step runs the full checks and builds a plan (`_Plan` in
compile_backend/kernels/unified_attention.py: path, grid, KV splits, strides,
decode scratch), keyed by `plan_key` and kept on the step's metadata object
in the field it declares (`PLANS_FIELD`), or, while mrv2 captures a graph, in
that capture's own dict (`ForwardContext.capture_plans`, dropped when the
capture ends); a later call with the same key, metadata tensors and ints, on
the same device and stream, with no launch hook, launches the plan's kernels
through bound launchers. Anything else runs the checked path. Note
[attention plans]: docs/design.md, section "Attention plans and bound launches".
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


def plannable(query, key_cache, value_cache, output, ctx: Any = None) -> bool:
    """May a plan be built for this call? On CUDA: no Triton launch hook, and
    no capture but one mrv2 started (`ctx.capture_plans` set)."""
    if debug_checks_on():
        return False
    if not all(isinstance(t, torch.Tensor) for t in (query, key_cache, value_cache, output)):
        return False  # the checks name the argument
    if not aligned(query, key_cache, value_cache, output):
        return False
    if not query.is_cuda:
        return True
    if not hooks_unset():
        return False
    return not stream_capturing() or getattr(ctx, "capture_plans", None) is not None


def _store(meta: Any, ctx: Any, create: bool) -> tuple[dict | None, Any]:
    """(where this call's plans are kept, the key prefix): the capture's own
    dict while mrv2 captures, else the metadata's field (None if it has none,
    or, unless `create`, no plan yet)."""
    capture = getattr(ctx, "capture_plans", None)
    if capture is not None:
        return capture, id(meta)
    plans = getattr(meta, PLANS_FIELD, None)
    if plans is None and create and hasattr(meta, PLANS_FIELD):
        plans = {}
        setattr(meta, PLANS_FIELD, plans)
    return plans, None


def find_plan(meta: Any, query, key_cache, value_cache, output, ctx: Any = None) -> Any | None:
    """The plan kept for these arguments' key, or None (it may still not
    serve the call: `_Plan.ready` decides)."""
    plans, prefix = _store(meta, ctx, create=False)
    if plans is None:
        return None
    return plans.get((prefix, plan_key(query, key_cache, value_cache, output)))


def keep_plan(meta: Any, plan: Any, query, key_cache, value_cache, output, ctx: Any = None) -> None:
    """Keep `plan`: for the rest of the capture while mrv2 captures (`ctx`),
    else for the rest of this step in `meta`'s declared field (a metadata
    object without the field keeps none)."""
    plans, prefix = _store(meta, ctx, create=True)
    if plans is not None:
        plans[(prefix, plan_key(query, key_cache, value_cache, output))] = plan
