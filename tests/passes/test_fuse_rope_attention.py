"""`rope_and_cache` + `unified_attention` of one layer become one
`mrv2::rope_attention` (compile_backend/passes/fuse_rope_attention.py), in
graphs compiled for FULL only: where the pass fires (a Dynamo graph, the
backend, the runner), where it must not (the option off, PIECEWISE and
FULL_AND_PIECEWISE, another user of the rotated q, a node between that
touches the caches, writes or runs eagerly), and a runner's FULL replays
against an eager runner after every step, outputs and every KV cache.
fp32 on the CPU, compared with eager at atol=rtol=1e-5: the torch
references (the same ops as eager), and in the slow tier the Triton kernels
through the interpreter (the fused decode kernel against the pair's)."""

import copy
import importlib
import logging
import random

import pytest
import torch
from torch import nn

import compile_backend as cb
import compile_backend.kernels  # noqa: F401  (registers mrv2::rope_attention)
import pass_ops  # noqa: F401  (registers passtest::host_read)
from fx_helpers import calls, dynamo_graph
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.core.op_registry import EAGER_REASON
from compile_backend.demo.models import build_model, preset
from compile_backend.demo.models.blocks import Rotary
from compile_backend.kernels import PagedAttention
from compile_backend.passes import FuseRopeAttentionPass, PassManager
from compile_backend.passes import fuse_rope_attention
from compile_backend.passes.fuse_rope_attention import fused_rope_attentions
from compile_backend.runner.attention_metadata import AttentionMetadata
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.testing import check_against_eager
from runtime_helpers import _torch_reference_kernels, kv_config  # noqa: F401  (autouse fixture)

H, KVH, D, C, BS, NUM_BLOCKS = 4, 2, 16, 32, 4, 24
BLOCK = 16  # kv_config's block size (the runner tests)
ROPE = torch.ops.mrv2.rope_and_cache
ATTENTION = torch.ops.mrv2.unified_attention
FUSED = torch.ops.mrv2.rope_attention.default


# ---- models -------------------------------------------------------------------------------


class RopeLayers(nn.Module):
    """Two attention layers as the reference models call them: projections,
    then PagedAttention with positions and a Rotary's inv_freq."""

    def __init__(self, layers=2):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(C, (H + 2 * KVH) * D, bias=False) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(H * D, C, bias=False) for _ in range(layers))
        self.rotary = Rotary(D, 10000.0)
        self.attn = nn.ModuleList(PagedAttention(H, KVH, D, f"layers.{i}.attn")
                                  for i in range(layers))

    def forward(self, x, positions):
        T = x.shape[0]
        for qkv, o, attn in zip(self.qkv, self.o, self.attn):
            q, k, v = qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
            x = x + o(attn(q, k.reshape(T, KVH, D), v, positions, self.rotary.inv_freq))
        return x


class _Ops(nn.Module):
    """One layer written with the ops themselves, for the patterns a model
    layer does not make. `pair(x, positions)`: q, k, v and the rope."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, (H + 2 * KVH) * D, bias=False)
        self.rotary = Rotary(D, 10000.0)
        self.attn = PagedAttention(H, KVH, D, "layers.0.attn")
        self.other = PagedAttention(H, KVH, D, "layers.1.attn")

    def rope(self, x, positions):
        T = x.shape[0]
        q, k, v = self.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
        a = self.attn
        return ROPE(q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D), positions,
                    self.rotary.inv_freq, a.k_cache, a.v_cache, "layers.0.attn")

    def attend(self, q_rot, attn=None, layer="layers.0.attn"):
        attn = attn or self.attn
        out = torch.empty(q_rot.shape[0], H, D, dtype=q_rot.dtype)
        ATTENTION(q_rot, attn.k_cache, attn.v_cache, out, layer, D ** -0.5)
        return out


class QUsedTwice(_Ops):
    def forward(self, x, positions):
        q_rot = self.rope(x, positions)
        return self.attend(q_rot) + q_rot


class CacheReadBetween(_Ops):
    def forward(self, x, positions):
        q_rot = self.rope(x, positions)
        s = self.attn.v_cache.mean()
        return self.attend(q_rot) * s


class WriteBetween(_Ops):
    def forward(self, x, positions):
        q_rot = self.rope(x, positions)
        y = x * 2
        y.add_(1)
        return self.attend(q_rot).sum() + y


class EagerBetween(_Ops):
    def forward(self, x, positions):
        q_rot = self.rope(x, positions)
        s = torch.ops.passtest.host_read(x)
        return self.attend(q_rot).sum() + s


class OtherCaches(_Ops):
    def forward(self, x, positions):
        return self.attend(self.rope(x, positions), attn=self.other)


class OtherLayer(_Ops):
    def forward(self, x, positions):
        return self.attend(self.rope(x, positions), layer="layers.1.attn")


class NoAttention(_Ops):
    """The rotated q reaches the attention through a view."""

    def forward(self, x, positions):
        q_rot = self.rope(x, positions)
        return self.attend(q_rot.view(-1, H, D)[:, :, :])


NOT_FIRING = [
    (QUsedTwice, "the rotated q has 2 users"),
    (CacheReadBetween, "`Tensor.mean` (s) between the rope_and_cache and the attention"),
    (WriteBetween, "`Tensor.add_` (add_) between the rope_and_cache and the attention"),
    (EagerBetween, "`passtest::host_read` (s) between the rope_and_cache and the attention"),
    (OtherCaches, "the key_caches differ"),
    (OtherLayer, "layer names differ: 'layers.0.attn', attention 'layers.1.attn'"),
    (NoAttention, "its rotated q feeds no mrv2::unified_attention directly (users: `Tensor.view`"),
]


# ---- helpers ------------------------------------------------------------------------------


def _bind(model, seed):
    """Random caches (earlier tokens' keys and values) in every PagedAttention."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, PagedAttention):
            m.bind_kv_cache(NUM_BLOCKS, BS, torch.float32, "cpu")
            m.k_cache.copy_(torch.randn(m.k_cache.shape, generator=g))
            m.v_cache.copy_(torch.randn(m.v_cache.shape, generator=g))
    return model


def _metadata(q_lens, seq_lens, layers=("layers.0.attn", "layers.1.attn")):
    """A batch of len(q_lens) requests, request b in blocks 1 + 5b .. 5 + 5b,
    and its positions: every layer's AttentionMetadata."""
    table = torch.tensor([[1 + 5 * b + i for i in range(5)] for b in range(len(q_lens))],
                         dtype=torch.int32)
    slots, positions = [], []
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            slots.append(int(table[b, p // BS]) * BS + p % BS)
            positions.append(p)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table, slot_mapping=torch.tensor(slots), num_reqs=len(q_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return {name: meta for name in layers}, torch.tensor(positions)


DECODE = ([1, 1, 1], [7, 13, 2])
MIXED = ([3, 1, 2], [3, 16, 9])


def _passes(gm, **options):
    """Every pass, as the backend runs them; this pass's log entry."""
    config = cb.CompilationConfig(**{"cudagraph_mode": "full", "fuse_rope_attention": True,
                                     **options})
    manager = PassManager.from_config(config, cb.OpRegistry.from_config(config))
    manager(gm.graph)
    gm.graph.lint()
    gm.recompile()
    (entry,) = [e for e in manager.log if e["pass"] == "FuseRopeAttentionPass"]
    return entry


def _caches(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("_cache")}


# ---- where it fires -----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [DECODE, MIXED], ids=["decode", "mixed"])
def test_fires_on_a_dynamo_graph_and_computes_the_same(batch, caplog):
    """Each layer's pair becomes one rope_attention with the pair's arguments;
    the graph then computes what eager does, outputs and caches."""
    torch.manual_seed(0)
    model = _bind(RopeLayers().eval(), seed=1)
    reference = copy.deepcopy(model)
    before = _caches(model)
    metas, positions = _metadata(*batch)
    x = torch.randn(positions.shape[0], C)
    with set_forward_context(ForwardContext(metas)):
        gm, inputs = dynamo_graph(model, x, positions)  # ran once: the caches are written
    for name, cache in model.named_buffers():
        if name in before:
            cache.copy_(before[name])
    with caplog.at_level(logging.INFO, logger=fuse_rope_attention.__name__):
        entry = _passes(gm)
    details = entry["details"]
    assert entry["changed"] and details["enabled"] and details["not_fused"] == []
    assert details["num_fused"] == 2 and "disabled" not in details
    assert [f["layer"] for f in details["fused"]] == ["layers.0.attn", "layers.1.attn"]
    assert all(f["source"].startswith("layers.py:") for f in details["fused"])
    assert not calls(gm, ROPE) and not calls(gm, ATTENTION)
    nodes = calls(gm, FUSED)
    assert [n.args[8] for n in nodes] == ["layers.0.attn", "layers.1.attn"]
    assert all(n.args[9] == D ** -0.5 for n in nodes)
    # the caches and inv_freq are the graph's inputs, out the empty before it
    assert all(n.args[i].op == "placeholder" for n in nodes for i in (3, 4, 5, 6))
    assert all(n.args[7].target is torch.empty for n in nodes)
    assert all("example_value" not in n.meta and "val" not in n.meta for n in nodes)
    assert "fused 2 rope_and_cache + unified_attention pair(s)" in caplog.text
    assert cb.counters["pass_rope_attention_fused"] == 2
    with torch.no_grad(), set_forward_context(ForwardContext(metas)):
        got = gm(*inputs)[0]
        want = reference(x, positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, cache in _caches(model).items():
        torch.testing.assert_close(cache, dict(reference.named_buffers())[name], atol=1e-5,
                                   rtol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise", "none"])
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_only_full_graphs_with_the_option_on(mode, on):
    """The option off, or any mode but FULL: the graph as it was, the report
    says why, and the pass's uuid is the one of a pass that does nothing."""
    model = _bind(RopeLayers().eval(), seed=2)
    metas, positions = _metadata(*DECODE)
    with set_forward_context(ForwardContext(metas)):
        gm, _ = dynamo_graph(model, torch.randn(3, C), positions)
    entry = _passes(gm, cudagraph_mode=mode, fuse_rope_attention=on)
    details = entry["details"]
    fires = on and mode == "full"
    assert details["enabled"] is fires and entry["changed"] is fires
    assert len(calls(gm, FUSED)) == (2 if fires else 0)
    assert len(calls(gm, ROPE)) == len(calls(gm, ATTENTION)) == (0 if fires else 2)
    if not on:
        assert details["disabled"] == "fuse_rope_attention is off"
    elif mode != "full":
        assert details["disabled"].startswith(f"cudagraph_mode is {mode}, not full")
    roles = cb.OpRegistry()
    off = FuseRopeAttentionPass(roles, enabled=False).uuid()
    this = FuseRopeAttentionPass(roles, enabled=on, mode=mode).uuid()
    assert (this != off) is fires


def test_the_option_validates_and_is_off_by_default():
    assert cb.CompilationConfig().fuse_rope_attention is False
    with pytest.raises(ValueError, match="fuse_rope_attention must be True or False"):
        cb.CompilationConfig(fuse_rope_attention="yes")
    config = cb.CompilationConfig.from_options({"fuse_rope_attention": True})
    assert config.summary()["fuse_rope_attention"] is True  # in the compile cache's key


def test_without_the_op_the_graph_is_unchanged_and_the_report_says_why(monkeypatch):
    model = _bind(RopeLayers(layers=1).eval(), seed=3)
    metas, positions = _metadata(*DECODE)
    with set_forward_context(ForwardContext(metas)):
        gm, _ = dynamo_graph(model, torch.randn(3, C), positions)
    monkeypatch.setattr(FuseRopeAttentionPass, "fused_op", lambda self: None)
    before = str(gm.graph)
    report = FuseRopeAttentionPass(cb.OpRegistry())(gm.graph)
    assert not report.changed and str(gm.graph) == before
    (why,) = report.details["not_fused"]
    assert "mrv2::rope_attention is not registered" in why["reason"]
    assert why["layer"] == "layers.0.attn"


# ---- where it must not fire ---------------------------------------------------------------


@pytest.mark.parametrize("cls, reason", NOT_FIRING, ids=[c.__name__ for c, _ in NOT_FIRING])
def test_does_not_fire(cls, reason):
    model = _bind(cls().eval(), seed=4)
    metas, positions = _metadata(*DECODE)
    with set_forward_context(ForwardContext(metas)):
        gm, _ = dynamo_graph(model, torch.randn(3, C), positions)
    entry = _passes(gm)
    assert not entry["changed"] and entry["details"]["fused"] == []
    assert not calls(gm, FUSED) and len(calls(gm, ROPE)) == 1
    (why,) = entry["details"]["not_fused"]
    assert reason in why["reason"], why
    assert cb.counters["pass_rope_attention_fused"] == 0


@pytest.mark.parametrize("marked", ["rope", "attention"])
def test_nodes_marked_eager_are_not_fused(marked):
    model = _bind(RopeLayers(layers=1).eval(), seed=5)
    metas, positions = _metadata(*DECODE)
    with set_forward_context(ForwardContext(metas)):
        gm, _ = dynamo_graph(model, torch.randn(3, C), positions)
    node = (calls(gm, ROPE) if marked == "rope" else calls(gm, ATTENTION))[0]
    node.meta[EAGER_REASON] = "marked by the test"
    report = FuseRopeAttentionPass(cb.OpRegistry())(gm.graph)
    assert not report.changed and not calls(gm, FUSED)
    (why,) = report.details["not_fused"]
    what = "rope_and_cache" if marked == "rope" else "attention"
    assert why["reason"] == f"the {what} runs eagerly (marked by the test)"


def test_an_attention_that_is_no_breakpoint_keeps_its_rope():
    """non_splitting_ops takes the attention out of the breakpoints: the fused
    op, a breakpoint, would change the split."""
    model = _bind(RopeLayers(layers=1).eval(), seed=6)
    metas, positions = _metadata(*DECODE)
    with set_forward_context(ForwardContext(metas)):
        gm, _ = dynamo_graph(model, torch.randn(3, C), positions)
    entry = _passes(gm, non_splitting_ops=["mrv2::unified_attention"])
    (why,) = entry["details"]["not_fused"]
    assert why["reason"].startswith("the attention's role is ordinary, the fused op's breakpoint")


# ---- against eager after every step: the runner --------------------------------------------


def decode_schedule(seed, sizes=(4, 1, 2, "mixed", 3, 4, 2, 1, 3, 4), slots=4, prompt=(2, 7),
                    chunk=None, first_block=1):
    """One session: a prefill of every request (prompts of `prompt` lengths, in
    steps of at most `chunk` tokens a request), then decode steps of `sizes`
    requests (chosen at random; "mixed": one request takes 3 tokens beside the
    others' one), fresh random tokens each step. Slot s owns its own run of
    blocks from `first_block` (a later session passes blocks past the
    earlier's: new cache rows, new block-table entries)."""
    rng = random.Random(seed)
    lens = [rng.randint(*prompt) for _ in range(slots)]
    per_slot = -(-(max(lens) + 3 * len(sizes)) // BLOCK)

    def batch(chosen, qlens, seq):
        return InputBatch([rng.randrange(256) for _ in range(sum(qlens))], qlens,
                          [seq[s] for s in chosen], chosen,
                          block_ids=[[first_block + per_slot * s + i for i in range(per_slot)]
                                     for s in chosen])

    done = [0] * slots
    while min(d - n for d, n in zip(done, lens)) < 0:  # the prompts, chunk by chunk
        step = [min(n - d, chunk or n) for d, n in zip(done, lens)]
        done = [d + q for d, q in zip(done, step)]
        chosen = [s for s in range(slots) if step[s]]
        yield batch(chosen, [step[s] for s in chosen], done)
    for n in sizes:
        chosen = sorted(rng.sample(range(slots), slots if n == "mixed" else n))
        qlens = [1] * len(chosen)
        if n == "mixed":
            qlens[rng.randrange(len(chosen))] = 3
        for s, q in zip(chosen, qlens):
            lens[s] += q
        yield batch(chosen, qlens, lens)


def two_sessions(seed, long_prompt, chunk):
    """What a serving loop sees: a session of short prompts, then new requests
    in the same slots with `long_prompt`-long prompts (so decode runs several
    splits), prefilled in chunks, on the blocks after the first session's."""
    first = list(decode_schedule(seed))
    last_block = max(b for batch in first for ids in batch.block_ids for b in ids)
    return [*first, *decode_schedule(seed + 1, prompt=long_prompt, chunk=chunk,
                                     first_block=last_block + 1)]


def _llama_runner(device="cpu", dtype=torch.float32, **options):
    with torch.device(device):
        model = build_model("llama", preset("tiny", num_layers=2, dtype=dtype))
    # two_sessions' blocks: the short session's, then 4 slots of up to 24 (384 tokens)
    kv = kv_config(num_blocks=112, max_num_tokens=128, max_model_len=BLOCK * 24)
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, device)
    cfg = cb.CompilationConfig(**{"cudagraph_mode": "full", "capture_sizes": [1, 2, 4, 8],
                                  "piece_compiler": "eager", "fuse_rope_attention": True,
                                  "cache_dir": None, **options})
    return ModelRunner(model, kv, cfg, device, progress=False)


def _check_runner(schedule, device="cpu", dtype=torch.float32, tol=1e-5):
    runner = _llama_runner(device, dtype)
    # every step's logits and every parameter and buffer (both layers' KV
    # caches) against an eager runner without passes, after each step
    report = check_against_eager(runner, schedule, modes=["full"], standin=device == "cpu",
                                 atol=tol, rtol=tol)
    assert report["full"].replays > 0 and report["full"].calls == len(schedule)
    step = cb.compiled_steps()[-1]
    assert [f["layer"] for f in fused_rope_attentions(step.pass_log)] == \
        ["layers.0.attn", "layers.1.attn"]
    assert "mrv2.rope_attention" in step.passed_code
    assert "mrv2.rope_and_cache" not in step.passed_code
    return report


@pytest.mark.filterwarnings("error::compile_backend.testing.NothingCapturedWarning")
@pytest.mark.parametrize("seed", [11, 12])
def test_reference_llama_runner_full_equals_eager_after_every_step(seed):
    """FULL replays (the CPU stand-in) of decode steps of 1-4 requests and a
    mixed step over two sessions (short prompts, then new requests with
    prompts of 40-70 tokens on other blocks), each step compared with an
    eager runner: logits and both layers' KV caches. On the CPU the op runs
    the torch references."""
    _check_runner(two_sessions(seed, (40, 70), chunk=16))


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_reference_llama_runner_keeps_the_pair_outside_full(mode):
    runner = _llama_runner(cudagraph_mode=mode)
    report = check_against_eager(runner, list(decode_schedule(13, sizes=(2, 2, 2))), modes=[mode],
                                 standin=True)
    assert report[mode].replays > 0
    step = cb.compiled_steps()[-1]
    assert fused_rope_attentions(step.pass_log) == []
    (entry,) = [e for e in step.pass_log if e["pass"] == "FuseRopeAttentionPass"]
    assert entry["details"]["disabled"].startswith(f"cudagraph_mode is {mode}, not full")
    assert "mrv2.rope_attention" not in step.passed_code


@pytest.mark.slow
@pytest.mark.interpreted_kernels
def test_reference_llama_runner_full_equals_eager_through_the_interpreter(monkeypatch):
    """The same through Triton's interpreter: the subject's decode steps run
    the fused decode kernel (rotary and the KV write inside the attention
    launch), the eager runner rope_and_cache then unified_attention."""
    module = importlib.import_module("compile_backend.kernels.rope_attention")
    took = []

    def fused(*args):
        took.append(module_fused(*args))
        return took[-1]

    module_fused = module.fused
    monkeypatch.setattr(module, "fused", fused)
    _check_runner(list(decode_schedule(14, sizes=(2, 1, "mixed", 2))))
    assert True in took and False in took  # decode: the fused launch; prefill, mixed: the pair


# ---- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["one_launch", "two_launch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_llama_runner_full_equals_eager_on_the_gpu(dtype, form, monkeypatch):
    """FULL CUDA graphs over two sessions: decode steps of 1-4 requests (the
    fused launch) and mixed steps (the two ops inside the graph), the second
    session's new requests with 150-300-token prompts on other blocks, so
    the replays run several splits and the last one writes the new key;
    each decode form forced (the tiny model's few programs would pick two
    launches). Against an eager runner after every step: logits and both
    layers' KV caches."""
    monkeypatch.setenv("MRV2_DECODE_TWO_LAUNCH", "1" if form == "two_launch" else "0")
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    _check_runner(two_sessions(15, (150, 300), chunk=32), "cuda", dtype, tol)
