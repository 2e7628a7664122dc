"""mrv2: a torch.compile backend that captures LLM inference steps as
piecewise and full CUDA graphs.

    torch.compile(model, backend="mrv2", options={"cudagraph_mode": "piecewise"})

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
    "AttentionMetadata": "attention_metadata",
    "CompressorMetadata": "attention_metadata",
    "Metadata": "attention_metadata",
    "SConvMetadata": "attention_metadata",
    "CompiledStep": "backend",
    "clear_compiled_steps": "backend",
    "compiled_steps": "backend",
    "mrv2_backend": "backend",
    "BatchDescriptor": "batch_descriptor",
    "CompilationConfig": "config",
    "CUDAGraphMode": "config",
    "ForwardContext": "forward_context",
    "get_forward_context": "forward_context",
    "has_forward_context": "forward_context",
    "set_forward_context": "forward_context",
    "BaseMetadataBuilder": "metadata_builders",
    "CaptureSupport": "metadata_builders",
    "MetadataBuilder": "metadata_builders",
    "register_metadata_builder": "metadata_builders",
    "OpRegistry": "op_registry",
    "OpRole": "op_registry",
    "qualified_name": "op_registry",
    "register_op_role": "op_registry",
    "Piece": "split",
    "split_graph": "split",
    "mark_token_dim": "symbolic",
    "symbolic_tokens": "symbolic",
}

# Loaded now: the submodule shares the dict's name, and a submodule import sets
# the package attribute, which would then shadow the lazy lookup.
from .counters import counters, reset_counters  # noqa: E402  (light: no torch)

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
