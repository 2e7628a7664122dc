"""Sizing the KV cache from a memory budget: what everything else takes is
measured, and the KV cache gets the rest of the budget, in whole blocks.

    budget = size_kv_cache(model, CompilationConfig(cudagraph_mode="piecewise"),
                           gpu_memory_utilization=0.9, max_model_len=8192,
                           max_num_reqs=256, max_num_tokens=8192)
    print(budget.report())                # every term, the formula, the headroom
    kv = budget.kv_cache_config           # num_blocks set
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cuda")
    runner = ModelRunner(model, kv, config, "cuda")

Three layers, each testable alone: `cache_layout` (bytes per block and per
request slot), `measure_memory` (the measured terms) and `plan_memory` (pure
arithmetic to num_blocks). docs/design.md, section "Memory budget".
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from compile_backend.core.config import CompilationConfig
from compile_backend.runner.kv_cache_config import KVCacheConfig

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
# The CUDA caching allocator rounds an allocation of 10 MiB or more up to a
# multiple of 2 MiB (smaller ones share 2 MiB / 20 MiB segments): at most
# this much per cache tensor is reserved beyond its bytes.
ROUNDING_PER_TENSOR = 2 * MiB


# ---- bytes per block and per request, from the layers --------------------------


@dataclass(frozen=True)
class CacheLayout:
    """What a model's caches cost, by buffer (the leaf name: k_cache, v_cache,
    compressed_cache, conv_state, state_max, ...), summed over its layers.
    Bytes of a binding = fixed + num_blocks * per_block + num_slots * per_request."""

    block_size: int
    per_block: dict[str, int]  # buffer -> bytes one KV block adds (every layer)
    per_request: dict[str, int]  # buffer -> bytes one request slot adds (every layer)
    fixed: int = 0  # bytes that depend on neither (0 for the reference models)
    num_tensors: int = 0  # tensors a binding allocates (the allocator rounds each)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.per_block.values())

    @property
    def bytes_per_request(self) -> int:
        return sum(self.per_request.values())

    def nbytes(self, num_blocks: int, num_slots: int) -> int:
        """Bytes `bind_caches(num_blocks, block_size, num_slots, ...)` allocates."""
        return self.fixed + num_blocks * self.bytes_per_block + num_slots * self.bytes_per_request


def bound_cache_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors a `bind_caches` replaces (qualified name -> tensor),
    found by a dry bind on the meta device: for counting what a real bind
    allocated (tests, benchmarks)."""
    names = set(_dry_bind(model, 1, 16, 1))
    return {name: t for name, t in _named_tensors(model).items() if name in names}


def cache_layout(model: torch.nn.Module, block_size: int) -> CacheLayout:
    """Bytes per block and per request slot of `model`'s caches, from dry
    `bind_caches` calls on the meta device (nothing is allocated; the model's
    buffers are put back). Raises ValueError for a model without bind_caches,
    or whose caches do not grow linearly in blocks and slots."""
    points = {(b, s): _dry_bind(model, b, block_size, s) for b, s in ((1, 1), (2, 1), (1, 2), (3, 5))}
    leaves: dict[str, list[str]] = {}
    for name in points[(1, 1)]:
        leaves.setdefault(name.rsplit(".", 1)[-1], []).append(name)

    def leaf_bytes(point: tuple[int, int], leaf: str) -> int:
        return sum(points[point].get(n, 0) for n in leaves[leaf])

    per_block, per_request, fixed = {}, {}, 0
    for leaf in leaves:
        base = leaf_bytes((1, 1), leaf)
        pb = leaf_bytes((2, 1), leaf) - base
        ps = leaf_bytes((1, 2), leaf) - base
        f = base - pb - ps
        if leaf_bytes((3, 5), leaf) != f + 3 * pb + 5 * ps or min(pb, ps, f) < 0:
            raise ValueError(
                f"the model's {leaf!r} caches do not grow linearly in num_blocks and num_slots "
                "(bytes at (blocks, slots) = (1, 1), (2, 1), (1, 2), (3, 5): "
                f"{[leaf_bytes(p, leaf) for p in points]}), so num_blocks cannot be solved for. "
                "Size KVCacheConfig(num_blocks=...) by hand for this model")
        if pb:
            per_block[leaf] = pb
        if ps:
            per_request[leaf] = ps
        fixed += f
    return CacheLayout(block_size, per_block, per_request, fixed, len(points[(1, 1)]))


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and plain tensor attributes of every module, by qualified name."""
    out = {}
    for prefix, m in model.named_modules():
        for name, t in list(m._buffers.items()) + [
                (k, v) for k, v in vars(m).items() if isinstance(v, torch.Tensor)]:
            if t is not None:
                out[f"{prefix}.{name}" if prefix else name] = t
    return out


def _dry_bind(model: torch.nn.Module, num_blocks: int, block_size: int,
              num_slots: int) -> dict[str, int]:
    """Qualified name -> bytes of every tensor `bind_caches` creates on the
    meta device; the model's buffers and tensor attributes are restored."""
    bind = getattr(model, "bind_caches", None)
    if not callable(bind):
        raise ValueError(
            f"{type(model).__name__} has no bind_caches(num_blocks, block_size, num_slots, "
            "device): the memory budget reads its caches' sizes from a dry call on the meta "
            "device. Add one that binds each layer's cache and state (as "
            "compile_backend/demo/models/blocks.py: Decoder.bind_caches does), or size "
            "KVCacheConfig(num_blocks=...) by hand")
    saved = _snapshot(model)
    try:
        bind(num_blocks, block_size, num_slots, torch.device("meta"))
        return {name: t.numel() * t.element_size()
                for name, t in _named_tensors(model).items() if t.is_meta}
    finally:
        _restore(saved)


def _snapshot(model: torch.nn.Module) -> list:
    """Every module's buffers and tensor attributes, for `_restore`."""
    return [(m, dict(m._buffers), {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)})
            for m in model.modules()]


def _restore(saved: list) -> None:
    """Put back what `_snapshot` saw: a bind's new tensors are dropped (freed
    when nothing else holds them)."""
    for m, buffers, attrs in saved:
        m._buffers.clear()
        m._buffers.update(buffers)
        for k in [k for k, v in vars(m).items() if isinstance(v, torch.Tensor) and k not in attrs]:
            del m.__dict__[k]
        m.__dict__.update(attrs)


# ---- the measured terms and the arithmetic ---------------------------------------


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes measured before the KV cache is sized (all reserved memory: what
    the process takes from the device, the allocator's cached blocks included).

    The process's peak, once serving, is predicted as the sum of these, the
    per-request state, the cache rounding and the KV cache; `plan_memory`
    solves that for num_blocks."""

    total: int  # device memory (mem_get_info), or the total_bytes given
    weights: int  # the model's parameters and buffers (bytes of their storages)
    held: int = 0  # reserved at the start beyond the weights (their rounding, other tensors)
    non_torch: int = 0  # outside torch's allocator at the start: CUDA context, libraries, other processes
    non_torch_growth: int = 0  # outside the allocator, added by compile and capture: kernel code, graphs
    runner_buffers: int = 0  # the runner's persistent step inputs, block tables, metadata buffers
    workspaces: int = 0  # what the first steps leave allocated (cuBLAS workspaces, ...)
    activations: int = 0  # the largest step's reserved growth (max_batch_tokens, no graphs)
    graph_pool: int = 0  # the capture plan's reserved growth (one shared pool)
    graph_pool_by_mode: dict[str, int] = field(default_factory=dict)  # mode -> bytes the graphs kept allocated
    graphs_by_mode: dict[str, int] = field(default_factory=dict)  # mode -> sizes captured (runner captures)
    startup_excess: int = 0  # the compile's or capture's peak above workspaces + pool + activations
    cache: CacheLayout = field(default_factory=lambda: CacheLayout(16, {}, {}))
    device: str = ""  # what measured them ("cuda:0 (NVIDIA H200)", "cpu: ...")
    measured: bool = True  # False: allocator terms are 0 (no CUDA allocator to read)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryTerms":
        d = dict(d)
        d["cache"] = CacheLayout(**d["cache"])
        return cls(**d)


@dataclass(frozen=True)
class MemoryBudget:
    """The KV cache the budget allows, with every term that decided it."""

    terms: MemoryTerms
    gpu_memory_utilization: float
    block_size: int
    max_model_len: int
    max_num_reqs: int
    max_num_tokens: int
    compress_ratio: int
    num_blocks: int  # block 0 included (the null block, never a request's)

    @property
    def limit(self) -> int:
        """gpu_memory_utilization x total: the process's peak stays within it."""
        return int(self.gpu_memory_utilization * self.terms.total)

    @property
    def per_request_state(self) -> int:
        return self.max_num_reqs * self.terms.cache.bytes_per_request

    @property
    def cache_rounding(self) -> int:
        return self.terms.cache.num_tensors * ROUNDING_PER_TENSOR

    @property
    def bytes_per_block(self) -> int:
        return self.terms.cache.bytes_per_block

    @property
    def kv_cache_bytes(self) -> int:
        """The paged caches (KV and compressed: both bound with num_blocks)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def fixed_bytes(self) -> int:
        """Every term but the KV cache (what num_blocks does not change)."""
        return sum(b for _, b, _ in self._fixed_rows())

    @property
    def predicted_peak(self) -> int:
        return self.fixed_bytes + self.kv_cache_bytes

    @property
    def headroom(self) -> int:
        """Within the budget and unused: less than one block's bytes unless
        num_blocks was capped."""
        return self.limit - self.predicted_peak

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache holds (block 0 is the null block)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The config to bind the caches with and build the runner from."""
        return KVCacheConfig(num_blocks=self.num_blocks, block_size=self.block_size,
                             max_model_len=self.max_model_len, max_num_reqs=self.max_num_reqs,
                             max_num_tokens=self.max_num_tokens, compress_ratio=self.compress_ratio)

    def _fixed_rows(self) -> list[tuple[str, int, str]]:
        t = self.terms
        how = "measured" if t.measured else "not measured here (0)"
        pool_parts = ", ".join(
            f"{m}: {t.graphs_by_mode.get(m, 0)} sizes, {_mib(b)} MiB allocated"
            for m, b in t.graph_pool_by_mode.items())
        state = ", ".join(f"{k} {v} B" for k, v in t.cache.per_request.items()) or "none"
        tokens = min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)
        return [
            ("weights", t.weights, "measured (parameters and buffers)"),
            ("held at start", t.held, f"{how} (reserved beyond the weights: rounding, other tensors)"),
            ("outside torch at start", t.non_torch, f"{how} (CUDA context, libraries, other processes)"),
            ("outside torch, compile+capture", t.non_torch_growth, f"{how} (kernel code, CUDA graphs)"),
            ("runner buffers", t.runner_buffers, f"{how} (step inputs, block tables, metadata)"),
            ("workspaces", t.workspaces, f"{how} (left by the first steps: cuBLAS and the like)"),
            ("per-request state", self.per_request_state,
             f"layers: max_num_reqs {self.max_num_reqs} x {t.cache.bytes_per_request} B ({state})"),
            ("activations", t.activations, f"{how} (largest step: {tokens} tokens, no graphs)"),
            ("graph pool", t.graph_pool, f"{how} (one pool; {pool_parts or 'no graphs'})"),
            ("startup above serving", t.startup_excess, f"{how} (compile or capture peak beyond the rest)"),
            ("cache rounding", self.cache_rounding,
             f"at most {ROUNDING_PER_TENSOR // MiB} MiB x {t.cache.num_tensors} cache tensors"),
        ]

    def rows(self) -> list[tuple[str, int, str]]:
        """(term, bytes, how) for every term of the predicted peak, KV cache
        last; they add up to `predicted_peak`."""
        parts = ", ".join(f"{k} {v} B" for k, v in self.terms.cache.per_block.items()) or "no paged cache"
        return self._fixed_rows() + [
            ("KV cache", self.kv_cache_bytes,
             f"{self.num_blocks} blocks x {self.bytes_per_block} B ({parts})")]

    def report(self) -> str:
        """The budget as a person reads it: every term, their sum, the headroom,
        the formula for num_blocks and what the KV cache holds."""
        t = self.terms
        u = self.gpu_memory_utilization
        width = max(len(name) for name, _, _ in self.rows())
        lines = [f"Memory budget on {t.device or 'this device'}: gpu_memory_utilization {u:g} x "
                 f"{_gib(t.total)} GiB = {_gib(self.limit)} GiB ({_mib(self.limit)} MiB)",
                 f"  {'term':<{width}}  {'MiB':>11}  how"]
        for name, nbytes, how in self.rows():
            lines.append(f"  {name:<{width}}  {_mib(nbytes):>11}  {how}")
        lines += [
            f"  {'= predicted peak':<{width}}  {_mib(self.predicted_peak):>11}",
            f"  {'headroom':<{width}}  {_mib(self.headroom):>11}  within the budget, unused",
            f"  {'= budget':<{width}}  {_mib(self.limit):>11}",
            f"  {'outside the budget':<{width}}  {_mib(t.total - self.limit):>11}  "
            f"(1 - {u:g}) x total",
            f"num_blocks = floor((gpu_memory_utilization x total - sum of the terms above the KV "
            f"cache) / bytes_per_block) = floor(({_mib(self.limit)} - {_mib(self.fixed_bytes)}) MiB "
            f"/ {self.bytes_per_block} B) = {self.num_blocks}",
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens (block 0 is the null "
            f"block) = {self.num_tokens} tokens, {_gib(self.kv_cache_bytes)} GiB; "
            f"{self.num_tokens // self.max_model_len} requests of max_model_len={self.max_model_len} "
            f"at once (max_num_reqs={self.max_num_reqs})",
        ]
        if not t.measured:
            lines.append("Allocator terms were not measured (no CUDA allocator on this device): "
                         "they count as 0")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: the inputs, the terms, the result and each row."""
        return {"terms": self.terms.to_dict(), "gpu_memory_utilization": self.gpu_memory_utilization,
                "block_size": self.block_size, "max_model_len": self.max_model_len,
                "max_num_reqs": self.max_num_reqs, "max_num_tokens": self.max_num_tokens,
                "compress_ratio": self.compress_ratio, "num_blocks": self.num_blocks,
                "limit": self.limit, "predicted_peak": self.predicted_peak,
                "headroom": self.headroom, "num_tokens": self.num_tokens,
                "rows": [{"term": n, "bytes": b, "how": h} for n, b, h in self.rows()]}


def _check_utilization(gpu_memory_utilization: Any) -> None:
    if isinstance(gpu_memory_utilization, bool) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r} "
                         "(the fraction of the device's memory this process may take, e.g. 0.9)")


def plan_memory(terms: MemoryTerms, *, gpu_memory_utilization: float = 0.9, block_size: int = 16,
                max_model_len: int = 2048, max_num_reqs: int = 256, max_num_tokens: int = 8192,
                compress_ratio: int = 4) -> MemoryBudget:
    """num_blocks from measured terms: pure arithmetic.

        num_blocks = floor((gpu_memory_utilization x total - fixed) / bytes_per_block)

    where `fixed` is every term but the KV cache (MemoryBudget.rows). Raises
    ValueError, naming each term and what to change, when the KV cache would
    not hold one request of max_model_len (its blocks plus the null block)."""
    _check_utilization(gpu_memory_utilization)
    if terms.cache.block_size != block_size:
        raise ValueError(f"the terms were measured with block_size {terms.cache.block_size}, "
                         f"not {block_size}: measure again with this block size")
    # Limits checked, and the blocks one request needs, by KVCacheConfig itself.
    limits = KVCacheConfig(num_blocks=2, block_size=block_size, max_model_len=max_model_len,
                           max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                           compress_ratio=compress_ratio)
    need = 1 + max(limits.max_blocks_per_req, limits.max_compressed_blocks_per_req)
    budget = MemoryBudget(terms, gpu_memory_utilization, block_size, max_model_len, max_num_reqs,
                          max_num_tokens, compress_ratio, num_blocks=need)
    left = budget.limit - budget.fixed_bytes
    per_block = budget.bytes_per_block
    if per_block == 0:  # no paged cache: the blocks cost nothing; one request's worth
        num_blocks = need if left >= 0 else 0
    else:
        num_blocks = max(left, 0) // per_block
    if num_blocks < need:
        raise ValueError(_refusal(budget, left, need))
    return dataclasses.replace(budget, num_blocks=num_blocks)


def _refusal(budget: MemoryBudget, left: int, need: int) -> str:
    t = budget.terms
    terms = "; ".join(f"{name} {_mib(b)} MiB" for name, b, _ in budget._fixed_rows())
    one = need * budget.bytes_per_block
    return (
        f"no room for the KV cache: gpu_memory_utilization {budget.gpu_memory_utilization:g} x "
        f"{_mib(t.total)} MiB = {_mib(budget.limit)} MiB, and everything else takes "
        f"{_mib(budget.fixed_bytes)} MiB ({terms}), "
        f"{f'leaving {_mib(left)} MiB' if left >= 0 else f'{_mib(-left)} MiB over'}; one request of "
        f"max_model_len={budget.max_model_len} needs {need} blocks (with the null block) x "
        f"{budget.bytes_per_block} B = {_mib(one)} MiB. Change one of: gpu_memory_utilization "
        f"(raise it), max_model_len={budget.max_model_len} (the blocks of one request), "
        f"max_num_tokens={budget.max_num_tokens} (activations), max_num_reqs="
        f"{budget.max_num_reqs} (per-request state, runner buffers), capture_sizes or "
        "cudagraph_mode (graph pool), or the model (weights: a smaller one, or tensor parallel)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"


# ---- measuring ----------------------------------------------------------------


class _Allocator:
    """Reads of torch's CUDA allocator on one device; zeros on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def settle(self) -> None:
        """Collect garbage and return cached free blocks: what is left
        reserved is what something holds."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def used(self) -> int:
        """Device memory in use by anyone (mem_get_info's total - free)."""
        if not self.cuda:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1] if self.cuda else 0

    def name(self) -> str:
        if not self.cuda:
            return f"{self.device} (allocator terms not measured)"
        return f"{self.device} ({torch.cuda.get_device_name(self.device)})"


def _tensor_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the storages of the model's parameters and buffers on `device`."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == device.type and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_memory(model: torch.nn.Module, config: CompilationConfig | None = None, *,
                   block_size: int = 16, max_model_len: int = 2048, max_num_reqs: int = 256,
                   max_num_tokens: int = 8192, compress_ratio: int = 4,
                   device: torch.device | str = "cuda", total_bytes: int | None = None,
                   progress: bool = True) -> MemoryTerms:
    """Measure every term but the KV cache on `device`, where `model`'s weights
    already are and its caches are not yet bound.

    Binds 2-block caches (with max_num_reqs slots of state), builds a
    ModelRunner from `config`, runs one step of max_batch_tokens tokens twice
    (the first compiles), captures the whole plan, reading the allocator
    around each phase; then frees the runner's graphs (`release_graphs`) and
    puts the model's empty caches back. Resets the device's peak memory
    statistics. Graphs captured before (another runner's) are refused: they
    would share the pool being measured, and are freed at the end."""
    # Here, not at the top: the runner loads Dynamo, which the arithmetic does not need.
    from compile_backend.runner.model_runner import ModelRunner
    from compile_backend.runtime import graph_pool
    from compile_backend.runtime.machine import check_device

    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    alloc = _Allocator(dev)
    if not alloc.cuda and total_bytes is None:
        raise ValueError(f"device {str(dev)!r} has no device memory to read: pass total_bytes=N "
                         "(the memory to budget, in bytes), or measure on a CUDA device")
    if total_bytes is not None and (isinstance(total_bytes, bool) or total_bytes <= 0):
        raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
    layout = cache_layout(model, block_size)
    bound = {n: t for n, t in bound_cache_tensors(model).items() if t.numel()}
    if bound:
        raise ValueError(
            f"the model's caches are already bound ({_mib(sum(t.numel() * t.element_size() for t in bound.values()))}"
            f" MiB: {sorted(bound)[:3]}...): they would be counted as held memory and then again as "
            "the KV cache. Size the KV cache before bind_caches (with a fresh model), then bind")
    gc.collect()  # graphs only garbage holds are not alive
    if graph_pool._pool_graphs:  # the registry's live graphs (no public count)
        raise ValueError(
            f"{len(graph_pool._pool_graphs)} CUDA graphs are alive in this process: measure the "
            "memory budget before capturing anything (their pool would be shared and they are "
            "freed at the end), or call compile_backend.release_graphs() first")
    probe = KVCacheConfig(num_blocks=2, block_size=block_size, max_model_len=max_model_len,
                          max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                          compress_ratio=compress_ratio)
    config = config or CompilationConfig()
    device_scope = torch.cuda.device(dev) if alloc.cuda else contextlib.nullcontext()
    saved = _snapshot(model)
    runner = None
    with device_scope:
        alloc.settle()
        start = alloc.reserved()
        non_torch = alloc.used() - start if alloc.cuda else 0
        weights = _tensor_bytes(model, dev)
        try:
            model.bind_caches(probe.num_blocks, block_size, max_num_reqs, dev)
            alloc.settle()
            bound_at = alloc.reserved()
            runner = ModelRunner(model, probe, config, dev, progress=progress)
            alloc.settle()
            r0 = alloc.reserved()
            # The first step compiles (its peak may exceed a step's); what it
            # leaves allocated (workspaces) stays for the process.
            if alloc.cuda and runner.plan.captures():
                # The capture stream's cuBLAS workspaces, which the first
                # capture would otherwise put in the pool: a workspace term.
                graph_pool.warm_capture_stream(dev)
            alloc.reset_peak()
            runner.warmup(probe.max_batch_tokens)
            alloc.settle()
            compile_peak = alloc.peak() - r0
            r1 = alloc.reserved()
            alloc.reset_peak()
            runner.warmup(probe.max_batch_tokens)
            alloc.settle()
            activations = alloc.peak() - r1
            r2 = alloc.reserved()
            alloc.reset_peak()
            runner.capture()
            alloc.settle()
            capture_peak = alloc.peak() - r2
            r3 = alloc.reserved()
            non_torch_end = alloc.used() - r3 if alloc.cuda else 0
            by_mode: dict[str, int] = {}
            graphs: dict[str, int] = {}
            for rec in runner.captures:
                m = rec.graph.mode.value
                by_mode[m] = by_mode.get(m, 0) + rec.pool_bytes
                graphs[m] = graphs.get(m, 0) + 1
        finally:
            del runner
            graph_pool.release_graphs()
            _restore(saved)  # the empty caches back: the probe's are freed
            alloc.settle()
    workspaces = max(r2 - r0, 0)
    pool = max(r3 - r2, 0)
    excess = max(0, compile_peak - workspaces - pool - activations, capture_peak - pool - activations)
    return MemoryTerms(
        total=total_bytes if total_bytes is not None else alloc.total(), weights=weights,
        held=max(start - weights, 0), non_torch=max(non_torch, 0),
        non_torch_growth=max(non_torch_end - non_torch, 0), runner_buffers=max(r0 - bound_at, 0),
        workspaces=workspaces, activations=max(activations, 0), graph_pool=pool,
        graph_pool_by_mode=by_mode, graphs_by_mode=graphs, startup_excess=excess, cache=layout,
        device=alloc.name(), measured=alloc.cuda)


def size_kv_cache(model: torch.nn.Module, config: CompilationConfig | None = None, *,
                  gpu_memory_utilization: float = 0.9, block_size: int = 16,
                  max_model_len: int = 2048, max_num_reqs: int = 256, max_num_tokens: int = 8192,
                  compress_ratio: int = 4, device: torch.device | str = "cuda",
                  total_bytes: int | None = None, progress: bool = True) -> MemoryBudget:
    """The KV cache that keeps this process's peak within
    gpu_memory_utilization x the device's memory: `measure_memory`, then
    `plan_memory`; the report is logged. `budget.kv_cache_config` has
    num_blocks set (the compressed cache, bound with as many blocks, is in
    bytes_per_block). Call it with the weights on the device and the caches
    unbound, before any capture; then bind and build the runner with the same
    `config`. Raises ValueError, naming each term, when one request of
    max_model_len does not fit."""
    _check_utilization(gpu_memory_utilization)
    limits = dict(block_size=block_size, max_model_len=max_model_len, max_num_reqs=max_num_reqs,
                  max_num_tokens=max_num_tokens, compress_ratio=compress_ratio)
    terms = measure_memory(model, config, device=device, total_bytes=total_bytes,
                           progress=progress, **limits)
    budget = plan_memory(terms, gpu_memory_utilization=gpu_memory_utilization, **limits)
    logger.info("%s", budget.report())
    return budget
