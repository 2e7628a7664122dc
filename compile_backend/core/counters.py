"""Process-wide counters that tests and the debug dump read.

Keys (all ints):
  dynamo_graphs          graphs Dynamo handed to the backend
  pieces / eager_pieces  pieces made by splitting (eager_pieces: not captured)
  piece_compiles         distinct pieces compiled (identical pieces count once)
  piece_compile_reuses   pieces that reused an identical piece's artifact
  inductor_compiles      calls into Inductor's compile_fx
  capture_fallbacks      pieces kept eager because they cannot be captured
  collective_fallbacks   collective ops kept out of graphs: their process group's
                         backend (gloo) cannot be captured (compile_backend/passes/capture_safety.py)
  all_reduce_fallbacks   all-reduces left on the functional collective although
                         tp_all_reduce asked for one-shot: no symmetric memory
                         for their group (compile_backend/passes/symmetric_all_reduce.py)
  cudagraph_captures     CUDA graphs captured
  cudagraph_replays      CUDA-graph replays (each capture is followed by one)
  grad_fallbacks         graphs run uncompiled because grad was on (inference only)
  lazy_warmups           no runner: first calls of a shape, run eagerly
  lazy_captures          no runner: captures on the second call of a shape
  captures_skipped       no runner: calls of a new input shape run without a graph
                         because the wrapper's inputs grow at every call
                         (runtime/cuda_graph.py, CUDAGraphWrapper._grows)
  growing_inputs         wrappers (pieces, whole graphs) found growing that way
  full_graph_fallbacks   no runner, a FULL mode: graphs that run PIECEWISE
                         instead (something in them needs runner metadata)
  capture_warmups        eager steps a runner's plan ran before a capture: one where
                         a capture would have compiled a Triton kernel (once per
                         kernel configuration), or every capture with
                         capture_warmup="every_size" (runtime/jit_guard.py)
  capture_warmups_skipped
                         captures of a plan that needed no warm-up
  triton_compiles        Triton JIT compiles (or loads from Triton's disk cache)
                         seen during a runner's capture plan, outside captures,
                         with capture_warmup="on_demand" (the guard counts them)
  eager_no_graph         steps/pieces run eagerly because no graph fits
  metadata_builds        metadata builds (tests check `for_capture` separately)
  direct_calls           op calls in eager pieces rewritten to skip the dispatcher
  pass_linears_fused     linears fused into sibling matmuls (compile_backend/passes/fuse_sibling_linears.py)
  pass_linear_residual_fused
                         linear + residual adds fused into one mrv2::linear_add
                         (compile_backend/passes/fuse_linear_residual.py)
  skinny_split_k_fallbacks
                         skinny GEMM launches that asked for split K and took one
                         split: a capture on a stream without arrival counters,
                         or more column tiles than the counters
                         (compile_backend/kernels/skinny_linear.py, Note [split K])
  pass_norm_linear_fused RMSNorm / linear / SiLU·mul groups fused into one
                         mrv2::norm_linear (compile_backend/passes/fuse_norm_linear.py)
"""

from __future__ import annotations

import collections

counters: collections.Counter[str] = collections.Counter()


def reset_counters() -> None:
    counters.clear()
