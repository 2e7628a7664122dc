"""`CompilationConfig`: everything the backend needs, filled from
`torch.compile(model, backend="mrv2", options={...})` or `mode="..."`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from compile_backend.core.dump_path import check_dump_path
from compile_backend.core.graph_mode import CUDAGraphMode


PIECE_COMPILERS = ("inductor", "eager")
# How a tensor-parallel all-reduce runs (compile_backend/core/all_reduce.py).
TP_ALL_REDUCE_MODES = ("nccl", "auto", "one_shot")
CAPTURE_WARMUPS = ("every_size", "on_demand")  # CompilationConfig.capture_warmup


def default_cache_dir() -> str | None:
    """$MRV2_CACHE_DIR ("off" or empty: None), else the user's cache folder."""
    env = os.environ.get("MRV2_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "none", "0") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mrv2")


def default_capture_sizes() -> list[int]:
    return [1, 2, 4] + list(range(8, 257, 8))


def _is_count(value: object) -> bool:
    """An int >= 0 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class CompilationConfig:
    """Options of the `mrv2` backend. Every field is an option name.

    cudagraph_mode: graph mode (string, case-insensitive, or CUDAGraphMode).
    capture_sizes: token counts to capture; sorted and deduplicated.
    splitting_ops: extra breakpoint ops, `namespace::name` (or `namespace::*`).
    attention_like_ops: extra attention-like ops, `namespace::name`.
    non_splitting_ops: ops to remove from the breakpoint defaults.
    piece_compiler: "inductor" (default) or "eager".
    inductor_min_fusible_ops: with Inductor, a captured piece holding fewer
        ops it could fuse (aten compute; not views, allocations or custom ops
        it leaves as they are) runs as traced, without Inductor: the same
        launches, no compile and no load of Inductor at a warm start
        (compile/fusible.py). 0 compiles every piece with Inductor.
    debug_dump_path: folder for the debug dump, or None; a path that cannot hold
        one (an existing file, a read-only place) raises when the config is built.
    debug_checks: check tensor addresses at every replay (slow; for debugging).
    strict_capture: a piece that must fall back to eager raises instead.
    enable_passes: run the FX passes (compile_backend/passes/) before splitting.
    reorder_for_fewer_pieces: let the segment pass move independent nodes
        across breakpoints so that fewer pieces result.
    growing_caches_eager: what reads a cache that the graph grows by
        concatenation at every call (transformers' DynamicCache) runs eagerly
        with the attention, so the pieces between keep fixed shapes and their
        graphs (compile_backend/passes/growing_caches.py).
    fuse_sibling_linears: linears that read the same input (q/k/v, gate/up)
        become one matmul over their weights, packed once in place
        (compile_backend/passes/fuse_sibling_linears.py).
    fuse_linear_residual: `residual + linear(x, w, b)` (o_proj, down_proj)
        becomes one `mrv2::linear_add`: at decode on a GPU one kernel with
        the residual added in its epilogue, else torch's GEMM and add (as eager)
        (compile_backend/passes/fuse_linear_residual.py).
    fuse_norm_linear: an RMSNorm and the linear(s) that read it, and a
        SwiGLU gate `silu(g) * u` over a linear's two halves, become one
        `mrv2::norm_linear`: at decode on a GPU (up to 16 rows) one kernel
        that normalizes and gates inside the GEMM, with more rows the norm,
        the linear and the gate as three launches, on the CPU the same ops
        in torch (compile_backend/passes/fuse_norm_linear.py). On by
        default: llama8b decode 1.4-2.1% faster at 1-16 requests, within
        1.2% at 32-64 (docs/design.md, "RMSNorm, projection and gate").
    fuse_residual_norm: a `mrv2::linear_add` whose sum the next
        `mrv2::norm_linear` normalizes becomes one
        `mrv2::residual_norm_linear`: above 64 rows on a GPU the residual's
        add runs inside the norm's launch (one launch a pair fewer, the same
        bits); elsewhere the two ops as before
        (compile_backend/passes/fuse_residual_norm.py). On by default:
        llama8b decode 0.6% faster at 256 requests on an H100, the same at
        64 (docs/design.md, "Residual, norm and projection").
    fuse_rope_attention: a `mrv2::rope_and_cache` whose rotated q feeds only
        the `mrv2::unified_attention` of the same layer and caches becomes
        one `mrv2::rope_attention`: rotary and the KV write inside the
        decode attention's launch (compile_backend/passes/fuse_rope_attention.py).
        Only in graphs compiled for cudagraph_mode="full": in PIECEWISE the
        rope kernel is inside a captured piece already, while the fused op
        would run at the eager breakpoint with its plan built per call. Off
        until measured on the H200.
    direct_op_calls: eager pieces call registered ops' implementations without
        the dispatcher while grad is off (compile_backend/core/direct_calls.py).
    capture_warmup: when a runner's plan runs the eager step before a capture:
        "on_demand" (default) only where the capture would compile a Triton
        kernel or tune an Inductor one (once per kernel configuration: the
        capture is dropped, the warm-up runs and it captures again;
        runtime/jit_guard.py), or "every_size" before every capture
        (docs/design.md, "Capture warms up per kernel configuration").
        With "on_demand" such a graph's kernels compile ahead on worker
        threads while the plan captures its other graphs, and their list is
        saved beside the warm-start entry, which a later start loads before
        its first capture (runtime/kernel_precompile.py).
    derive_mixed_graphs: a FULL plan records each size's decode graph once
        and makes the mixed graph of that size from it, the launches of its
        metadata-reading ops (attention, the KV write, short convolutions)
        replaced by the mixed step's, captured alone (runtime/graph_surgery.py,
        docs/design.md, "A mixed graph derived from the decode graph"); where
        it cannot (an op not defined through mrv2's op definitions, a driver
        without the graph API) the mixed graph is recorded as before, the
        reason logged and counted. Only cudagraph_mode="full" has FULL mixed
        graphs; other modes ignore it. Off until the startup bench has
        measured it (its replays equal eager on an H100).
    scout_sizes_first: where a plan's kernels compile ahead, it captures
        the largest size, then every power-of-two size and the smallest,
        then the rest (core/graph_plan.py, scouts_first): the kernels that
        only smaller batches use are asked for early and compile while the
        larger sizes capture. False: largest first throughout.
    early_scouts: a cold start whose kernels compile ahead runs the plan's
        scout graphs (and the first prefills) dry right after its first
        step's dry run: their kernels are asked for then and compile on
        past the first step (which waits for its own only), not at each
        scout's refused capture (docs/design.md, "Scouts asked for in the
        first step's wait"). Not under tensor parallelism.
    precompile_threads: worker threads that compile a plan's Triton kernels
        ahead (0: one per CPU core, at most 16).
    precompile_workers: worker processes that compile a cold plan's Triton
        kernels into Triton's disk cache, holding no GPU, so that the
        capture keeps Python's lock (runtime/kernel_workers.py); the threads
        above then only load them. Started with the first step of a start
        without a saved kernel list. None: one per two cores beside this
        process's, at most 3 (none on 4 cores or fewer); 0: the threads
        compile.
    compile_workers: worker processes that compile distinct Inductor pieces
        in parallel with each other and with the caller, started when a
        compile begins (compile/compile_workers.py); None: one per two cores
        beside the caller's, at most 3 (none on 2 cores); 0: every piece in
        the caller's process, one after another.
    warm_gemms: a runner with a warm-start cache records the GEMMs its first
        step asks cuBLAS for, saves them beside the entry, and a later
        start makes cuBLAS's first call of each (about 2 ms of host time
        each) at every capture size on a thread while its first step loads,
        not inside the captures (runtime/gemm_warmup.py). CUDA only.
    graphs_per_shape: how many graphs one piece (or whole graph) keeps per input
        shape, one per set of addresses of the inputs it writes (a new cache
        object per `generate` call); the least recently used goes beyond it.
    cache_dir: where a ModelRunner saves its compiled step and loads it in a
        later process (warm start: no Dynamo tracing, no Inductor compile).
        Default: $MRV2_CACHE_DIR, else $XDG_CACHE_HOME/mrv2 (~/.cache/mrv2);
        None (or MRV2_CACHE_DIR=off) saves and loads nothing.
        `mrv2 cache ls|clear` shows and clears it.
    serializable: compile Inductor pieces as artifacts that can be saved (the
        runner sets it when it has a cache_dir).
    tp_all_reduce: how tensor parallelism's all-reduces run inside the pieces
        (compile_backend/core/all_reduce.py): "nccl" (default) keeps the
        functional collective; "auto" runs messages of at most
        `tp_all_reduce_threshold` bytes as a one-shot all-reduce over
        symmetric memory and larger ones on NCCL, and falls back to NCCL
        (counted, the reason logged once) where symmetric memory or peer
        access is missing; "one_shot" is "auto" that raises instead of
        falling back.
    tp_all_reduce_threshold: the largest message (bytes) the one-shot path
        takes; also the size of each rank's symmetric buffer per dtype.
    """

    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.PIECEWISE
    capture_sizes: list[int] = field(default_factory=default_capture_sizes)
    splitting_ops: list[str] = field(default_factory=list)
    attention_like_ops: list[str] = field(default_factory=list)
    non_splitting_ops: list[str] = field(default_factory=list)
    piece_compiler: str = "inductor"
    inductor_min_fusible_ops: int = 2
    debug_dump_path: str | None = None
    debug_checks: bool = False
    strict_capture: bool = False
    enable_passes: bool = True
    reorder_for_fewer_pieces: bool = True
    growing_caches_eager: bool = True
    fuse_sibling_linears: bool = True
    fuse_linear_residual: bool = True
    fuse_norm_linear: bool = True
    fuse_residual_norm: bool = True
    fuse_rope_attention: bool = False
    direct_op_calls: bool = True
    capture_warmup: str = "on_demand"
    derive_mixed_graphs: bool = False
    scout_sizes_first: bool = True
    early_scouts: bool = True
    precompile_threads: int = 0
    precompile_workers: int | None = None
    compile_workers: int | None = None
    warm_gemms: bool = True
    graphs_per_shape: int = 4
    cache_dir: str | None = field(default_factory=default_cache_dir)
    serializable: bool = False
    tp_all_reduce: str = "nccl"
    tp_all_reduce_threshold: int = 512 * 1024

    def __post_init__(self) -> None:
        self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        sizes = self.capture_sizes
        if isinstance(sizes, int) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes
        ):
            raise ValueError(
                f"capture_sizes must be a list of positive ints, got {sizes!r}; "
                "for example [1, 2, 4, 8, 16]"
            )
        self.capture_sizes = sorted(set(sizes))
        if not self.capture_sizes and self.cudagraph_mode is not CUDAGraphMode.NONE:
            raise ValueError(
                f"capture_sizes is empty: cudagraph_mode {self.cudagraph_mode.value} needs at "
                "least one token count to capture (for example [1, 2, 4, 8]); or use "
                "cudagraph_mode='none'")
        for name in ("splitting_ops", "attention_like_ops", "non_splitting_ops"):
            ops = getattr(self, name)
            if isinstance(ops, str) or not all(isinstance(o, str) for o in ops):
                raise ValueError(
                    f"{name} must be a list of op names like 'mylib::my_attention', "
                    f"got {ops!r}"
                )
            from compile_backend.core.op_registry import check_op_name  # torch: not at import

            for op in ops:  # the form only: whether it resolves is checked at compile
                check_op_name(op)
            setattr(self, name, list(ops))
        if self.piece_compiler not in PIECE_COMPILERS:
            raise ValueError(
                f"piece_compiler must be one of {PIECE_COMPILERS}, "
                f"got {self.piece_compiler!r}"
            )
        if (not isinstance(self.inductor_min_fusible_ops, int)
                or isinstance(self.inductor_min_fusible_ops, bool) or self.inductor_min_fusible_ops < 0):
            raise ValueError(
                f"inductor_min_fusible_ops must be an int >= 0, got "
                f"{self.inductor_min_fusible_ops!r}; 0 compiles every piece with Inductor")
        if self.debug_dump_path is not None:
            if not isinstance(self.debug_dump_path, (str, os.PathLike)):
                raise ValueError(
                    f"debug_dump_path must be a folder path, got {self.debug_dump_path!r}")
            self.debug_dump_path = os.fspath(self.debug_dump_path)
            check_dump_path(self.debug_dump_path)  # refused now, not after compiling
        if self.capture_warmup not in CAPTURE_WARMUPS:
            raise ValueError(
                f"capture_warmup must be one of {', '.join(map(repr, CAPTURE_WARMUPS))}, got "
                f"{self.capture_warmup!r}")
        if not _is_count(self.precompile_threads):
            raise ValueError(
                f"precompile_threads must be an int >= 0, got {self.precompile_threads!r}; "
                "0 uses one thread per CPU core (at most 16)")
        if self.precompile_workers is not None and not _is_count(self.precompile_workers):
            raise ValueError(
                f"precompile_workers must be None or an int >= 0, got {self.precompile_workers!r}; "
                "None picks one per two cores beside this process's (at most 3), 0 compiles a "
                "plan's Triton kernels on threads of this process")
        if self.compile_workers is not None and not _is_count(self.compile_workers):
            raise ValueError(
                f"compile_workers must be None or an int >= 0, got {self.compile_workers!r}; "
                "None picks one per two cores beside this process's (at most 3), 0 compiles every "
                "piece in this process")
        if not isinstance(self.warm_gemms, bool):
            raise ValueError(f"warm_gemms must be True or False, got {self.warm_gemms!r}")
        if (not isinstance(self.graphs_per_shape, int) or isinstance(self.graphs_per_shape, bool)
                or self.graphs_per_shape < 1):
            raise ValueError(
                f"graphs_per_shape must be a positive int, got {self.graphs_per_shape!r}; "
                "for example 4 (graphs kept per input shape, one per address of the "
                "tensors a graph writes)")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise ValueError(f"cache_dir must be a folder path or None, got {self.cache_dir!r}")
            self.cache_dir = os.fspath(self.cache_dir)
        if self.tp_all_reduce not in TP_ALL_REDUCE_MODES:
            raise ValueError(
                f"tp_all_reduce must be one of {', '.join(map(repr, TP_ALL_REDUCE_MODES))}, got "
                f"{self.tp_all_reduce!r}")
        threshold = self.tp_all_reduce_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 16:
            raise ValueError(
                f"tp_all_reduce_threshold must be an int of at least 16 (bytes), got "
                f"{threshold!r}; for example 524288 (512 KiB)")
        for name in ("debug_checks", "strict_capture", "enable_passes",
                     "reorder_for_fewer_pieces", "growing_caches_eager", "fuse_sibling_linears",
                     "fuse_linear_residual",
                     "fuse_norm_linear", "fuse_residual_norm", "fuse_rope_attention",
                     "direct_op_calls", "serializable"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any] | None = None, mode: str | None = None
    ) -> "CompilationConfig":
        """Build from torch.compile's `options` dict, or its `mode` string
        (a graph-mode name is a shorthand for `{"cudagraph_mode": mode}`)."""
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown mrv2 option(s) {unknown}; valid options: {', '.join(valid)}"
            )
        if mode is not None and mode != "default":
            if "cudagraph_mode" in options:
                raise ValueError(
                    "give the graph mode either as mode= or as "
                    "options={'cudagraph_mode': ...}, not both"
                )
            try:
                options["cudagraph_mode"] = CUDAGraphMode.parse(mode)
            except ValueError as e:
                raise ValueError(
                    f"torch.compile(mode={mode!r}) is not an mrv2 graph mode; {e}"
                ) from None
        return cls(**options)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly view (for logs and the debug dump)."""
        out = dataclasses.asdict(self)
        out["cudagraph_mode"] = self.cudagraph_mode.value
        return out
