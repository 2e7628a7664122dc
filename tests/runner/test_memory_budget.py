"""The memory budget (compile_backend/runner/memory_budget.py): the arithmetic
from measured terms to num_blocks and its refusal, bytes per block against
what bind_caches really allocates, the report, the measurement's plumbing on
the CPU, and on a GPU a runner sized by it serving its largest batches."""

import dataclasses
import gc
import re

import pytest
import torch

import compile_backend as cb
from compile_backend.demo.models import build_model, preset
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runner.memory_budget import (
    ROUNDING_PER_TENSOR, CacheLayout, MemoryTerms, bound_cache_tensors, cache_layout,
    measure_memory, plan_memory, size_kv_cache)
from compile_backend.runner.model_runner import ModelRunner

MiB = 1 << 20
GiB = 1 << 30
# Made-up terms: 80 GiB device, a 1 MiB block (two tensors), 4 KiB of state per request.
LAYOUT = CacheLayout(16, {"k_cache": 512 * 1024, "v_cache": 512 * 1024}, {"conv_state": 4096},
                     num_tensors=3)
TERMS = MemoryTerms(total=80 * GiB, weights=16 * GiB, held=3 * MiB, non_torch=500 * MiB,
                    non_torch_growth=40 * MiB, runner_buffers=6 * MiB, workspaces=34 * MiB,
                    activations=2 * GiB, graph_pool=280 * MiB,
                    graph_pool_by_mode={"piecewise": 60 * MiB, "full": 58 * MiB},
                    graphs_by_mode={"piecewise": 35, "full": 35}, startup_excess=7 * MiB,
                    cache=LAYOUT, device="cuda:0 (made up)")
LIMITS = dict(block_size=16, max_model_len=4096, max_num_reqs=128, max_num_tokens=8192)
FIXED_TERMS = ["weights", "held", "non_torch", "non_torch_growth", "runner_buffers", "workspaces",
               "activations", "graph_pool", "startup_excess"]


def _fixed(terms: MemoryTerms, max_num_reqs: int) -> int:
    return (sum(getattr(terms, name) for name in FIXED_TERMS)
            + max_num_reqs * terms.cache.bytes_per_request
            + terms.cache.num_tensors * ROUNDING_PER_TENSOR)


# ---- the arithmetic ---------------------------------------------------------------


def test_num_blocks_is_what_the_budget_leaves_over_the_bytes_of_a_block():
    budget = plan_memory(TERMS, gpu_memory_utilization=0.9, **LIMITS)
    limit = int(0.9 * 80 * GiB)
    assert budget.limit == limit
    assert budget.fixed_bytes == _fixed(TERMS, 128)
    assert budget.num_blocks == (limit - _fixed(TERMS, 128)) // MiB
    assert budget.predicted_peak == budget.fixed_bytes + budget.num_blocks * MiB <= limit
    assert 0 <= budget.headroom < MiB  # one more block would cross the limit
    assert budget.num_tokens == (budget.num_blocks - 1) * 16
    kv = budget.kv_cache_config
    assert (kv.num_blocks, kv.num_compressed_blocks) == (budget.num_blocks, budget.num_blocks)
    assert (kv.block_size, kv.max_model_len, kv.max_num_reqs, kv.max_num_tokens) == (16, 4096, 128, 8192)


@pytest.mark.parametrize("name", FIXED_TERMS)
def test_every_term_takes_its_bytes_from_the_kv_cache(name):
    before = plan_memory(TERMS, **LIMITS).num_blocks
    more = dataclasses.replace(TERMS, **{name: getattr(TERMS, name) + 5 * MiB})
    assert plan_memory(more, **LIMITS).num_blocks == before - 5


def test_per_request_state_scales_with_max_num_reqs_not_blocks():
    few = plan_memory(TERMS, **{**LIMITS, "max_num_reqs": 128})
    many = plan_memory(TERMS, **{**LIMITS, "max_num_reqs": 128 + 256})  # 256 x 4 KiB = 1 MiB more
    assert many.per_request_state - few.per_request_state == MiB
    assert many.num_blocks == few.num_blocks - 1


def test_utilization_scales_the_limit():
    for util in (0.5, 0.75, 1.0):
        budget = plan_memory(TERMS, gpu_memory_utilization=util, **LIMITS)
        assert budget.limit == int(util * 80 * GiB)
        assert budget.num_blocks == (budget.limit - _fixed(TERMS, 128)) // MiB


def _just_enough(extra: int) -> MemoryTerms:
    """Terms that leave exactly one request of max_model_len 4096 (256 blocks
    plus the null block) plus `extra` bytes for the KV cache at utilization 1."""
    fixed_but_weights = _fixed(TERMS, 128) - TERMS.weights
    return dataclasses.replace(TERMS, weights=80 * GiB - fixed_but_weights - 257 * MiB - extra)


def test_exactly_one_request_of_max_model_len_fits():
    budget = plan_memory(_just_enough(0), gpu_memory_utilization=1.0, **LIMITS)
    assert budget.num_blocks == 257 and budget.headroom == 0


def test_refusal_names_every_term_and_what_to_change():
    with pytest.raises(ValueError) as e:
        plan_memory(_just_enough(-1), gpu_memory_utilization=1.0, **LIMITS)
    msg = str(e.value)
    budget = plan_memory(_just_enough(0), gpu_memory_utilization=1.0, **LIMITS)
    for name, nbytes, _ in budget.rows()[:-1]:  # every term but the KV cache, with its MiB
        assert f"{name} {nbytes / MiB:.1f} MiB" in msg, name
    for fix in ("gpu_memory_utilization", "max_model_len=4096", "max_num_tokens=8192",
                "max_num_reqs=128", "capture_sizes", "cudagraph_mode", "tensor parallel"):
        assert fix in msg, fix
    assert "257 blocks" in msg and "no room for the KV cache" in msg


def test_refusal_when_the_rest_is_over_the_limit():
    with pytest.raises(ValueError, match=r"MiB over; one request"):
        plan_memory(dataclasses.replace(TERMS, weights=90 * GiB), **LIMITS)


@pytest.mark.parametrize("util", [0, -0.1, 1.01, True])
def test_utilization_outside_0_1_is_refused(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_memory(TERMS, gpu_memory_utilization=util, **LIMITS)


def test_terms_of_another_block_size_are_refused():
    with pytest.raises(ValueError, match="measure again with this block size"):
        plan_memory(TERMS, **{**LIMITS, "block_size": 32})


def test_a_model_without_paged_caches_gets_one_requests_worth_of_blocks():
    terms = dataclasses.replace(TERMS, cache=CacheLayout(16, {}, {"conv_state": 4096}, num_tensors=1))
    assert plan_memory(terms, **LIMITS).num_blocks == 257


def test_terms_survive_json():
    import json

    again = MemoryTerms.from_dict(json.loads(json.dumps(TERMS.to_dict())))
    assert again == TERMS


# ---- bytes per block, from the layers --------------------------------------------


def _bound_bytes(model) -> int:
    return sum(t.untyped_storage().nbytes() for t in bound_cache_tensors(model).values())


@pytest.mark.parametrize("name", ["llama", "hybrid"])
@pytest.mark.parametrize("num_blocks,block_size,num_slots", [(2, 16, 1), (37, 16, 8), (5, 64, 3)])
def test_bytes_per_block_and_request_are_what_bind_caches_allocates(name, num_blocks, block_size,
                                                                    num_slots):
    model = build_model(name, preset("tiny"))
    layout = cache_layout(model, block_size)
    model.bind_caches(num_blocks, block_size, num_slots, "cpu")
    assert _bound_bytes(model) == layout.nbytes(num_blocks, num_slots)
    assert layout.fixed == 0


def test_the_layout_counts_each_cache_of_the_tiny_presets():
    cfg = preset("tiny")  # 2 layers, 2 KV heads of 32, fp32, conv kernel 4, 128 channels
    kv = 2 * 16 * 2 * 32 * 4  # layers x block_size x KV heads x head_dim x fp32
    llama, hybrid = (cache_layout(build_model(n, cfg), 16) for n in ("llama", "hybrid"))
    assert llama.per_block == {"k_cache": kv, "v_cache": kv} and llama.per_request == {}
    assert hybrid.per_block == {"k_cache": kv, "v_cache": kv, "compressed_cache": kv}
    assert hybrid.per_request == {"conv_state": 2 * 128 * 3 * 4, "state_max": 2 * 2 * 4,
                                  "state_sum": 2 * 2 * 4, "state_acc": 2 * 2 * 32 * 4}
    assert (llama.num_tensors, hybrid.num_tensors) == (4, 14)


def test_reading_the_layout_leaves_the_model_as_it_was():
    model = build_model("hybrid", preset("tiny"))
    model.bind_caches(3, 16, 2, "cpu")
    before = dict(model.named_buffers())
    cache_layout(model, 16)
    assert all(t is before[n] for n, t in model.named_buffers()) and len(before) == len(
        dict(model.named_buffers()))
    assert not any(t.is_meta for t in model.buffers())


def test_a_model_without_bind_caches_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="has no bind_caches.*Decoder.bind_caches"):
        cache_layout(torch.nn.Linear(2, 2), 16)


# ---- the report ---------------------------------------------------------------------


def _mib_of(text: str, label: str) -> float:
    m = re.search(rf"^  {re.escape(label)}\s+(-?[\d.]+)", text, re.M)
    assert m, label
    return float(m.group(1))


def test_the_report_shows_every_term_and_they_add_up():
    budget = plan_memory(TERMS, gpu_memory_utilization=0.9, **LIMITS)
    text = budget.report()
    rows = budget.rows()
    assert [n for n, _, _ in rows] == [
        "weights", "held at start", "outside torch at start", "outside torch, compile+capture",
        "runner buffers", "workspaces", "per-request state", "activations", "graph pool",
        "startup above serving", "cache rounding", "KV cache"]
    assert sum(b for _, b, _ in rows) == budget.predicted_peak
    shown = [_mib_of(text, name) for name, _, _ in rows]
    assert shown == [round(b / MiB, 1) for _, b, _ in rows]
    peak, headroom, limit = (_mib_of(text, s) for s in ("= predicted peak", "headroom", "= budget"))
    assert abs(sum(shown) - peak) <= 0.05 * len(rows)  # each row rounded to 0.1 MiB
    assert abs(peak + headroom - limit) <= 0.1
    assert limit == round(budget.limit / MiB, 1)
    assert f"= {budget.num_blocks}" in text and "num_blocks = floor((gpu_memory_utilization x total" in text
    assert "piecewise: 35 sizes, 60.0 MiB allocated" in text and "full: 35 sizes" in text
    assert f"{budget.num_tokens} tokens" in text and "conv_state 4096 B" in text
    assert "max_num_reqs 128 x 4096 B" in text


def test_a_report_without_allocator_readings_says_so():
    terms = dataclasses.replace(TERMS, measured=False)
    assert "not measured" in plan_memory(terms, **LIMITS).report()


# ---- measuring (CPU: the plumbing; the allocator terms are 0) ---------------------


@pytest.fixture
def torch_kernels(monkeypatch):
    """The kernels' torch references on the CPU (the interpreter is slow and
    the bytes are the same)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


CPU_LIMITS = dict(block_size=16, max_model_len=128, max_num_reqs=8, max_num_tokens=64)
CPU_CONFIG = dict(capture_sizes=[1, 2, 4, 8], piece_compiler="eager", cache_dir=None)


def test_on_the_cpu_the_budget_measures_captures_and_gives_the_model_back(torch_kernels):
    cb.release_graphs()  # earlier tests' graphs: the budget refuses to share a pool
    model = build_model("hybrid", preset("tiny"))
    config = cb.CompilationConfig(cudagraph_mode="full_and_piecewise", **CPU_CONFIG)
    with cb.standin_graphs():
        budget = size_kv_cache(model, config, gpu_memory_utilization=0.5, device="cpu",
                               total_bytes=64 * MiB, progress=False, **CPU_LIMITS)
    terms = budget.terms
    assert not terms.measured and terms.graph_pool == 0 and terms.activations == 0
    assert terms.graphs_by_mode == {"piecewise": 4, "full": 4}  # FULL: uniform decode only
    assert terms.weights == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * 4 for b in model.buffers())  # caches empty again: inv_freq only
    assert all(t.numel() == 0 for t in bound_cache_tensors(model).values())
    assert budget.num_blocks == (32 * MiB - budget.fixed_bytes) // budget.bytes_per_block
    # The caches it chose bind to exactly the bytes it counted.
    kv = budget.kv_cache_config
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
    assert _bound_bytes(model) == budget.kv_cache_bytes + budget.per_request_state


def test_measuring_refuses_live_graphs_bound_caches_and_a_cpu_without_total_bytes(torch_kernels):
    cb.release_graphs()
    with cb.standin_graphs():  # one live graph, from plain torch.compile
        toy = torch.compile(torch.nn.Linear(4, 4), backend="mrv2",
                            options={"cudagraph_mode": "piecewise", "piece_compiler": "eager"})
        with torch.no_grad():
            for _ in range(3):  # warm-up, capture, replay
                toy(torch.randn(2, 4))
        with pytest.raises(ValueError, match="CUDA graphs are alive.*release_graphs"):
            measure_memory(build_model("llama", preset("tiny")), device="cpu", total_bytes=GiB,
                           **CPU_LIMITS)
    cb.release_graphs()
    model = build_model("llama", preset("tiny"))
    with pytest.raises(ValueError, match="pass total_bytes=N"):
        measure_memory(model, device="cpu", **CPU_LIMITS)
    model.bind_caches(4, 16, 2, "cpu")
    with pytest.raises(ValueError, match="already bound.*Size the KV cache before bind_caches"):
        measure_memory(model, device="cpu", total_bytes=GiB, **CPU_LIMITS)


# ---- on a GPU: sized by the budget, the largest batches fit -------------------------


def _prefill(kv: KVCacheConfig, vocab: int) -> InputBatch:
    """max_num_tokens new tokens in requests of max_model_len, own blocks each."""
    n, reqs = kv.max_model_len, kv.max_num_tokens // kv.max_model_len
    nb, nc = kv.max_blocks_per_req, kv.max_compressed_blocks_per_req
    return InputBatch(token_ids=[7] * (n * reqs), query_lens=[n] * reqs, seq_lens=[n] * reqs,
                      req_slots=list(range(reqs)),
                      block_ids=[list(range(1 + r * nb, 1 + (r + 1) * nb)) for r in range(reqs)],
                      compressed_block_ids=[list(range(1 + r * nc, 1 + (r + 1) * nc)) for r in range(reqs)])


def _decode(kv: KVCacheConfig) -> InputBatch:
    """max_num_reqs requests, one token each after max_model_len - 1 cached."""
    B, nb, nc = kv.max_num_reqs, kv.max_blocks_per_req, kv.max_compressed_blocks_per_req
    return InputBatch(token_ids=[3] * B, query_lens=[1] * B, seq_lens=[kv.max_model_len] * B,
                      req_slots=list(range(B)),
                      block_ids=[list(range(1 + r * nb, 1 + (r + 1) * nb)) for r in range(B)],
                      compressed_block_ids=[list(range(1 + r * nc, 1 + (r + 1) * nc)) for r in range(B)])


@pytest.mark.gpu
def test_a_runner_sized_by_the_budget_serves_its_largest_batches_within_it():
    cb.release_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = build_model("hybrid", preset("small", dtype=torch.bfloat16))
    config = cb.CompilationConfig(cudagraph_mode="full_and_piecewise",
                                  capture_sizes=[1, 2, 4, 8, 16, 32, 64], cache_dir=None)
    limits = dict(block_size=16, max_model_len=1024, max_num_reqs=64, max_num_tokens=2048)
    budget = size_kv_cache(model, config, gpu_memory_utilization=0.9, device="cuda",
                           progress=False, **limits)
    print(budget.report())
    terms = budget.terms
    assert terms.measured and terms.graph_pool > 0 and terms.activations > 0
    assert terms.graphs_by_mode["piecewise"] == 7 and terms.non_torch > 0
    kv = budget.kv_cache_config
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cuda")
    runner = ModelRunner(model, kv, config, "cuda", progress=False)
    runner.capture()
    for batch in (_prefill(kv, model.cfg.vocab_size), _decode(kv)):
        out = runner.execute(batch)
        assert torch.isfinite(out).all()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_reserved() + outside
    print(f"peak {peak / MiB:.0f} MiB, predicted {budget.predicted_peak / MiB:.0f} MiB, "
          f"limit {budget.limit / MiB:.0f} MiB ({(peak - budget.predicted_peak) / budget.predicted_peak:+.3%})")
    assert peak <= budget.limit
    assert peak >= 0.97 * budget.predicted_peak  # a budget that counts too much wastes the cache
    del runner
    cb.release_graphs()
