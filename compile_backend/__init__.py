"""mrv2: a torch.compile backend that captures LLM inference steps as
piecewise and full CUDA graphs.

    torch.compile(model, backend="mrv2", options={"cudagraph_mode": "piecewise"})

Without CUDA, graph modes run as `none`; `with compile_backend.standin_graphs():`
captures and replays with a CPU stand-in instead (`mrv2 demo --standin`).

The backend is found by name through the `torch_dynamo_backends` entry point;
importing this package is not needed and registers nothing. Names load on
first use (PEP 562): importing the package, a kernel or the pytest plugin does
not load Dynamo (or Triton, whose interpreter switch must be read first).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule that defines it
_EXPORTS = {
    "AttentionMetadata": "runner.attention_metadata",
    "CompressorMetadata": "runner.attention_metadata",
    "Metadata": "runner.attention_metadata",
    "SConvMetadata": "runner.attention_metadata",
    "backend": "compile.backend",
    "CompiledStep": "compile.compiled_step",
    "clear_compiled_steps": "compile.compiled_step",
    "compiled_steps": "compile.compiled_step",
    "release_graphs": "runtime.graph_pool",
    "mrv2_backend": "compile.backend",
    "Mrv2Backend": "compile.backend",
    "CompilationConfig": "core.config",
    "CUDAGraphMode": "core.graph_mode",
    "StepGraph": "core.graph_mode",
    "GraphPlan": "core.graph_plan",
    "ForwardContext": "core.forward_context",
    "get_forward_context": "core.forward_context",
    "has_forward_context": "core.forward_context",
    "resolve_layer": "core.forward_context",
    "set_forward_context": "core.forward_context",
    "ModelRunner": "runner.model_runner",
    "KVCacheConfig": "runner.kv_cache_config",
    "InputBatch": "runner.input_batch",
    "prepare_inputs_to_capture": "runner.capture",
    "DraftRunner": "runner.draft_runner",
    "write_compile_dump": "debug.dump",
    "update_manifest_runtime": "debug.dump",
    "read_manifest": "debug.dump",
    "reset_dump": "debug.dump",
    "depyf_dump": "debug.dump",
    "BaseMetadataBuilder": "runner.metadata_builders",
    "CaptureSupport": "core.graph_mode",
    "MetadataBuilder": "runner.metadata_builders",
    "register_metadata_builder": "runner.metadata_builders",
    "OpRegistry": "core.op_registry",
    "OpRole": "core.op_registry",
    "qualified_name": "core.op_registry",
    "register_op": "core.op_registry",
    "unregister_op": "core.op_registry",
    "register_op_role": "core.op_registry",
    "register_layer_keyed_op": "core.op_registry",
    "register_capture_safe": "core.op_registry",
    "Piece": "compile.split",
    "split_graph": "compile.split",
    "mark_token_dim": "core.symbolic",
    "symbolic_tokens": "core.symbolic",
    "standin_graphs": "runtime.graph_standin",
}

# Loaded now: light (no torch), and read on every step.
from .core.counters import counters, reset_counters  # noqa: E402

__all__ = sorted([*_EXPORTS, "counters", "reset_counters"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
