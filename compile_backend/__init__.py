"""mrv2: a torch.compile backend that captures LLM inference steps as
piecewise and full CUDA graphs.

    torch.compile(model, backend="mrv2", options={"cudagraph_mode": "piecewise"})

The backend is found by name through the `torch_dynamo_backends` entry point;
importing this package is not needed and registers nothing.
"""

from .attention_metadata import AttentionMetadata, CompressorMetadata, SConvMetadata
from .backend import CompiledStep, clear_compiled_steps, compiled_steps, mrv2_backend
from .batch_descriptor import BatchDescriptor
from .config import CompilationConfig, CUDAGraphMode
from .counters import counters, reset_counters
from .forward_context import (
    ForwardContext,
    get_forward_context,
    has_forward_context,
    set_forward_context,
)
from .op_registry import OpRegistry, OpRole, qualified_name, register_op_role
from .split import Piece, split_graph
from .symbolic import mark_token_dim, symbolic_tokens

__all__ = [
    "AttentionMetadata",
    "BatchDescriptor",
    "CompilationConfig",
    "CompiledStep",
    "CompressorMetadata",
    "CUDAGraphMode",
    "ForwardContext",
    "OpRegistry",
    "OpRole",
    "Piece",
    "SConvMetadata",
    "clear_compiled_steps",
    "compiled_steps",
    "counters",
    "get_forward_context",
    "has_forward_context",
    "mark_token_dim",
    "mrv2_backend",
    "qualified_name",
    "register_op_role",
    "reset_counters",
    "set_forward_context",
    "split_graph",
    "symbolic_tokens",
]
