"""The one-launch decode of mrv2::unified_attention (Note [one-launch decode]
and Note [decode tickets] in compile_backend/kernels/unified_attention.py): against the torch
reference (rel. error per dtype: kernel_cases.REL_TOL) on fresh random inputs,
replayed like a captured graph (one launch plan, new seq_lens, block tables,
queries and caches in place every time), in any program order, with the
ticket counters back at 0 after every launch; the split policy decided in
the kernel; the two-launch path kept for comparison and for captures without
a ticket buffer."""

import importlib
import logging
import math
import os

import pytest
import torch

from compile_backend.core import stream_buffers
from compile_backend.core.counters import counters
from kernel_cases import (DTYPE_IDS, DTYPES, GPU_HEAD_DIMS, SMALL_HEAD_DIMS, assert_close_rel, gen,
                          randn, stable_seed)
from kernel_cases import gpu_dot_limits  # noqa: F401  (autouse: tl.dot's GPU minimum)
from compile_backend.kernels.unified_attention import (LOG2E, _Plan, unified_attention,
                                                       unified_attention_ref)

ua = importlib.import_module("compile_backend.kernels.unified_attention")

needs_interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="CPU kernels need TRITON_INTERPRET=1")


def _tickets_zero() -> bool:
    made = [t for (name, *_), t in stream_buffers._buffers.items() if name == ua.TICKETS]
    return all(int(t.count_nonzero()) == 0 for t in made)


class Replays:
    """A decode batch laid out once, like a captured graph: B requests (the
    last `pad_reqs` of them padding: no query), `pad_tokens` rows past
    qsl[B], caches of enough blocks for every request at `bound` tokens, and
    one launch plan built for max_seq_len = `bound`. `step(seq_lens)` writes
    new seq_lens, a new random block table, queries and cache values in place
    (never zeros), runs the plan and compares with the reference."""

    def __init__(self, B, H, KVH, D, dtype, device, bound, seed, block_size=16, pad_reqs=0,
                 pad_tokens=0, num_splits=None, config=None, two_launch=False):
        # two_launch: config["TWO_LAUNCH"] (these tests exercise the one-launch
        # kernel, which a GPU's plan picks only for large grids); None: unset.
        config = dict(config or {})
        if two_launch is not None:
            config.setdefault("TWO_LAUNCH", two_launch)
        self.g = gen(seed)
        if device != "cpu":
            self.device_g = torch.Generator(device=device).manual_seed(seed)
        self.B, self.H, self.KVH, self.D, self.dtype, self.device = B, H, KVH, D, dtype, device
        self.bs, self.pad_reqs = block_size, pad_reqs
        self.width = math.ceil(bound / block_size)
        self.num_blocks = 1 + B * self.width + 3
        real = B - pad_reqs
        self.qsl = torch.tensor([min(i, real) for i in range(B + 1)], dtype=torch.int32, device=device)
        self.T = real + pad_tokens
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(B, self.width, dtype=torch.int32, device=device)
        shape = (self.num_blocks, block_size, KVH, D)
        self.kc = torch.empty(shape, dtype=dtype, device=device)
        self.vc = torch.empty(shape, dtype=dtype, device=device)
        self.q = torch.empty(self.T, H, D, dtype=dtype, device=device)
        self.out = torch.empty_like(self.q)
        self.scale = D ** -0.5
        self.plan = _Plan(self.q, self.kc, self.out, self.qsl, self.seq_lens, self.block_table, 1,
                          bound, num_splits, config)

    def fill(self, seq_lens):
        g, B = self.g, self.B
        assert len(seq_lens) == B - self.pad_reqs
        lens = list(seq_lens) + [0] * self.pad_reqs
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        perm = (torch.randperm(self.num_blocks - 1, generator=g) + 1)[: B * self.width]
        self.block_table.copy_(perm.view(B, self.width).to(torch.int32))
        for t in (self.kc, self.vc, self.q):
            if self.device == "cpu":
                t.copy_(randn(t.shape, self.dtype, "cpu", g))
            else:  # large caches: drawn on the device
                t.normal_(generator=self.device_g)
        self.out.fill_(float("nan"))  # every row must be written

    def run(self):
        self.plan.run(self.q, self.kc, self.vc, self.out, self.scale * LOG2E, self.plan.stream)
        return self.out

    def ref(self):
        return unified_attention_ref(self.q.cpu().float(), self.kc.cpu().float(), self.vc.cpu().float(),
                                     self.qsl.cpu(), self.seq_lens.cpu(), self.block_table.cpu(),
                                     self.scale)

    def step(self, seq_lens, what=""):
        self.fill(seq_lens)
        out = self.run()
        if self.device == "cuda":
            torch.cuda.synchronize()
        n = self.B - self.pad_reqs
        assert torch.isfinite(out).all(), f"{what}: every row is written"
        assert (out[n:] == 0).all(), f"{what}: rows of no request are 0"
        assert_close_rel(out, self.ref(), self.dtype, f"{what} seq_lens={list(seq_lens)}")
        assert _tickets_zero(), f"{what}: every ticket counter is back at 0"
        return out


# Lengths around the interpreter's key tile (32), the block size (16) and the
# split sizes below; several splits where MIN_SPLIT_LEN = 64.
LENS = [[1, 31, 33, 200, 517], [517, 64, 2, 129, 16], [300, 1, 65, 511, 48]]


@needs_interp
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_replays_match_reference(dtype, num_heads, num_kv_heads, head_dim):
    """One plan (4 splits, at least 64 keys each), three launches on new
    lengths, block tables, queries and caches, with a padding request and two
    padding rows: each within REL_TOL of the reference, tickets back at 0."""
    r = Replays(len(LENS[0]) + 1, num_heads, num_kv_heads, head_dim, dtype, "cpu", bound=520,
                seed=stable_seed(str(dtype), num_heads, num_kv_heads, head_dim), pad_reqs=1,
                pad_tokens=2, num_splits=4, config=dict(MIN_SPLIT_LEN=64))
    for i, lens in enumerate(LENS):
        r.step(lens, f"launch {i}")


@needs_interp
@pytest.mark.parametrize("batch", [1, pytest.param(64, marks=pytest.mark.slow)])
def test_long_contexts(batch):
    """Contexts of thousands of keys (not multiples of the tile or block),
    the default MIN_SPLIT_LEN, 8 splits; then short ones on the same plan."""
    g = gen(batch)
    long = [int(x) for x in torch.randint(1, 1200, (batch,), generator=g)]  # interpreter time
    long[0] = 3499
    r = Replays(batch, 8, 2, 64, torch.bfloat16, "cpu", bound=3500, seed=batch, num_splits=8)
    r.step(long, "long")
    r.step([1 + i % 7 for i in range(batch)], "short")


@needs_interp
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_program_order(seed, monkeypatch):
    """The interpreter runs programs one after another in grid order, so the
    last split of a request to arrive is its highest; here the programs run
    in a random order (a random bijection of the grid), so that any split
    may merge and the padding rows' program may come anywhere."""
    from triton.runtime.interpreter import interpreter_builder

    rng = gen(100 + seed)
    perm = {}
    real_dim, real_idx = interpreter_builder.set_grid_dim, interpreter_builder.set_grid_idx

    def set_grid_dim(x, y, z):
        order = torch.randperm(x * y * z, generator=rng).tolist()
        perm.clear()
        perm.update(dims=(x, y, z), order=order)
        return real_dim(x, y, z)

    def set_grid_idx(x, y, z):
        X, Y, Z = perm["dims"]
        k = perm["order"][(x * Y + y) * Z + z]
        return real_idx(k // (Y * Z), k // Z % Y, k % Z)

    monkeypatch.setattr(interpreter_builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(interpreter_builder, "set_grid_idx", set_grid_idx)
    r = Replays(4, 8, 2, 64, torch.float32, "cpu", bound=600, seed=seed, pad_reqs=1, pad_tokens=1,
                num_splits=5, config=dict(MIN_SPLIT_LEN=32))
    r.step([600, 97, 161], "shuffled")
    r.step([33, 599, 5], "shuffled again")


@needs_interp
def test_short_context_is_one_split():
    """A request shorter than 2 x MIN_SPLIT_LEN keys is one split in the
    kernel, whatever the captured split count: its program writes the output
    itself, bit for bit what a one-split plan writes; a longer request in the
    same batch uses several splits (not bit-identical, within REL_TOL)."""
    lens = [5, 100, 2 * 64 - 1]
    outs = {}
    for S in (1, 6):
        r = Replays(3, 8, 2, 64, torch.float32, "cpu", bound=400, seed=9, num_splits=S,
                    config=dict(MIN_SPLIT_LEN=64))
        outs[S] = r.step(lens, f"S={S}").clone()
        outs[S, "long"] = r.step([400, 3, 250], f"S={S} long").clone()
    assert torch.equal(outs[1], outs[6])
    assert not torch.equal(outs[1, "long"][0], outs[6, "long"][0])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interp),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_at_small_and_odd_head_sizes(dtype, device):
    """Head sizes below tl.dot's 16 and not powers of two (Note [dot tiles]),
    merged over several splits: on CPU the small ones, on the GPU every size
    from 1 to MAX_HEAD_DIM."""
    for D in (SMALL_HEAD_DIMS[::3] if device == "cpu" else GPU_HEAD_DIMS):
        r = Replays(3, 6, 2, D, dtype, device, bound=300, seed=stable_seed(D, str(dtype)),
                    num_splits=5, config=dict(MIN_SPLIT_LEN=32))
        r.step([300, 129, 7], f"D={D}")


def _launched_kernels(monkeypatch) -> list:
    launched = []
    real = ua.Launch.launch
    monkeypatch.setattr(ua.Launch, "launch",
                        lambda self, s, a: (launched.append(self.kernel), real(self, s, a)))
    return launched


def _capture_semantics(monkeypatch, warmed: bool) -> None:
    """stream_buffers.buffer as inside a CUDA capture on a new stream: only a
    buffer made before it (a capture cannot make one: its torch.zeros would
    be recorded, not run). `warmed`: the stream's buffers made first, as
    graph_pool.warm_capture_stream does before every capture."""
    monkeypatch.setattr(stream_buffers, "_buffers", {})
    if warmed:
        stream_buffers.warm_stream_buffers(torch.device("cpu"))
    made = dict(stream_buffers._buffers)
    monkeypatch.setattr(stream_buffers, "buffer",
                        lambda name, device: made.get((name, str(device),
                                                       stream_buffers._stream_key(device))))
    monkeypatch.setattr(ua, "_logged_fallback", set())


@needs_interp
def test_tickets_are_the_streams_buffer_and_stay_zero(monkeypatch):
    """The one-launch decode's counters are the stream's buffer (made once,
    zeroed), left at 0 by every launch, the same tensor for every batch."""
    monkeypatch.setattr(stream_buffers, "_buffers", {})
    cpu = torch.device("cpu")
    small = ua.decode_tickets(cpu, 10)
    assert small.numel() == ua.TICKET_SLOTS and small.dtype == torch.int32
    assert ua.decode_tickets(cpu, ua.TICKET_SLOTS) is small
    assert ua.decode_tickets(cpu, ua.TICKET_SLOTS + 1) is None
    launched = _launched_kernels(monkeypatch)
    r = Replays(3, 4, 2, 16, torch.float32, "cpu", bound=300, seed=4, num_splits=3,
                config=dict(MIN_SPLIT_LEN=32))
    r.step([300, 150, 1])
    r.step([7, 299, 64])
    assert launched == [ua._decode_kernel] * 2
    assert _tickets_zero() and stream_buffers.buffer(ua.TICKETS, cpu) is small


@needs_interp
def test_a_warmed_capture_stream_has_tickets(monkeypatch):
    """A capture finds the counters on a stream warmed before it (what
    graph_pool.warm_capture_stream does before every capture), with no eager
    decode call before: the one launch, as an eager call takes. A warm start
    captures so, and used to fall back to two launches there."""
    _capture_semantics(monkeypatch, warmed=True)
    launched = _launched_kernels(monkeypatch)
    before = counters["decode_two_launch_fallbacks"]
    r = Replays(2, 4, 2, 16, torch.float16, "cpu", bound=300, seed=5, num_splits=3,
                config=dict(MIN_SPLIT_LEN=32))
    r.step([300, 77])
    assert launched == [ua._decode_kernel]
    assert counters["decode_two_launch_fallbacks"] == before and _tickets_zero()


@needs_interp
@pytest.mark.parametrize("cause", ["capture_stream_without_them", "more_pairs_than_tickets"])
def test_no_tickets_takes_two_launches(cause, monkeypatch, caplog):
    """Without counters the one launch cannot run: a capture on a stream
    without them cannot make them (a zeroing inside the graph would run at
    every replay), and more (request, kv head) pairs than counters (only with
    an explicit num_splits) do not fit. Either takes the split + reduce
    launches, counted and logged, and stays exact."""
    if cause == "more_pairs_than_tickets":
        monkeypatch.setattr(ua, "TICKET_SLOTS", 3)
        monkeypatch.setattr(ua, "_logged_fallback", set())
        said = "need more than the 3 ticket counters"
    else:
        _capture_semantics(monkeypatch, warmed=False)
        said = "stream without ticket counters"
    launched = _launched_kernels(monkeypatch)
    before = counters["decode_two_launch_fallbacks"]
    with caplog.at_level(logging.WARNING, logger=ua.__name__):
        r = Replays(2, 4, 2, 16, torch.float16, "cpu", bound=300, seed=5, num_splits=3,
                    config=dict(MIN_SPLIT_LEN=32))
        r.step([300, 77])
    assert launched == [ua._decode_split_kernel, ua._decode_reduce_kernel]
    assert said in caplog.text
    assert counters["decode_two_launch_fallbacks"] == before + 1


@needs_interp
@pytest.mark.parametrize("how", ["config", "env", "default", "one_split"])
def test_path_selection(how, monkeypatch):
    """config["TWO_LAUNCH"] or MRV2_DECODE_TWO_LAUNCH=1 select the split +
    reduce launches (for comparisons); otherwise one launch."""
    launched = []
    real = ua.Launch.launch
    monkeypatch.setattr(ua.Launch, "launch",
                        lambda self, s, a: (launched.append(self.kernel), real(self, s, a)))
    config = dict(MIN_SPLIT_LEN=32)
    if how == "config":
        config["TWO_LAUNCH"] = True
    if how == "env":
        monkeypatch.setenv(ua.TWO_LAUNCH_ENV, "1")
    r = Replays(2, 4, 2, 16, torch.bfloat16, "cpu", bound=300, seed=6,
                num_splits=1 if how == "one_split" else 3, config=config, two_launch=None)
    r.step([300, 41])
    two = [ua._decode_split_kernel, ua._decode_reduce_kernel]
    assert launched == (two if how in ("config", "env") else [ua._decode_kernel])


def test_one_launch_only_where_it_pays(monkeypatch):
    """Unasked, a GPU plan takes one launch once num_reqs x KVH programs fill
    the SMs ONE_LAUNCH_PROGRAMS_PER_SM times (measured on the H200: below
    that the two-launch form is faster); off a GPU always one launch; the
    environment variable (1 or 0) overrides the rule."""
    monkeypatch.setattr(ua, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    need = ua.ONE_LAUNCH_PROGRAMS_PER_SM * 132
    assert not ua.one_launch_pays(1, 8, cuda) and not ua.one_launch_pays(8, 8, cuda)
    assert not ua.one_launch_pays(need // 8 - 1, 8, cuda)
    assert ua.one_launch_pays(need // 8, 8, cuda) and ua.one_launch_pays(256, 8, cuda)
    assert ua.one_launch_pays(1, 1, torch.device("cpu"))


@needs_interp
def test_checked_call_matches_reference():
    """Through the launcher: a decode batch with a padding request and rows."""
    g = gen(21)
    lens = [700, 1, 45, 0]
    qsl = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    width = math.ceil(700 / 16)
    nb = 1 + 4 * width
    table = (torch.randperm(nb - 1, generator=g) + 1)[: 4 * width].view(4, width).to(torch.int32)
    kc, vc = randn((nb, 16, 4, 32), torch.float16, "cpu", g), randn((nb, 16, 4, 32), torch.float16, "cpu", g)
    q = randn((5, 16, 32), torch.float16, "cpu", g)
    args = (q, kc, vc, qsl, torch.tensor(lens, dtype=torch.int32), table, 0.2)
    out = unified_attention(*args, 1, 700, num_splits=4, config=dict(MIN_SPLIT_LEN=100),
                            out=torch.full_like(q, float("nan")))
    assert (out[3:] == 0).all()
    assert_close_rel(out, unified_attention_ref(*args), torch.float16)
    assert _tickets_zero()


# ---- on the GPU: llama-8B shapes (32 q heads, 8 kv heads, head dim 128, bf16) ----

def _graph(fn):
    """Warm up on a side stream (eager: compiles, allocates the tickets),
    then capture `fn` in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_graph_replays_gpu(batch):
    """Captured once for max_seq_len 4096 (1024 at B=256; FULL graphs
    capture with a bound), replayed 6 times on new seq_lens (1 .. the bound,
    not multiples of the tile or block), block tables, queries and caches;
    every replay within REL_TOL and the tickets back at 0."""
    bound = 4096 if batch <= 64 else 1024  # B=256: 2 x 2 GiB of cache at 4096
    r = Replays(batch, 32, 8, 128, torch.bfloat16, "cuda", bound=bound, seed=batch)
    r.fill([bound] * batch)
    graph = _graph(r.run)
    g = gen(1000 + batch)
    fixed = [[1] * batch, [bound] * batch, [500] * batch, [bound - 3 - 3 * i for i in range(batch)]]
    rand = [[int(x) for x in torch.randint(1, bound + 1, (batch,), generator=g)] for _ in range(2)]
    for i, lens in enumerate(fixed + rand):
        r.fill(lens)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(r.out).all()
        assert_close_rel(r.out, r.ref(), torch.bfloat16, f"B={batch} replay {i}")
        assert _tickets_zero(), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("num_splits,min_split", [(128, 64), (16, 256)])
def test_merge_is_deterministic_gpu(num_splits, min_split):
    """Many splits racing to the ticket: the merge reads every partial in
    split order, so 30 replays of the same inputs are bit-identical (a stale
    or missing partial would show as a difference) and match the reference."""
    r = Replays(2, 32, 8, 128, torch.bfloat16, "cuda", bound=32768, seed=num_splits,
                num_splits=num_splits, config=dict(MIN_SPLIT_LEN=min_split))
    r.fill([32768, 20001])
    graph = _graph(r.run)
    graph.replay()
    torch.cuda.synchronize()
    first = r.out.clone()
    assert_close_rel(first, r.ref(), torch.bfloat16)
    for i in range(30):
        r.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(r.out, first), f"replay {i} differs"
    assert _tickets_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_one_and_two_launches_agree_gpu():
    """The one-launch kernel and the two-launch path (kept for comparison)
    on the same inputs, eager and several layers in one graph (the tickets
    shared by the layers): both within REL_TOL."""
    r1 = Replays(8, 32, 8, 128, torch.bfloat16, "cuda", bound=4000, seed=31)
    r2 = Replays(8, 32, 8, 128, torch.bfloat16, "cuda", bound=4000, seed=31,
                 config=dict(TWO_LAUNCH=True))
    lens = [4000, 1, 17, 255, 256, 257, 3001, 999]
    for r in (r1, r2):
        r.fill(lens)
    graph = _graph(lambda: [r.run() for r in (r1, r2, r1, r2)])
    for i in range(3):
        lens = [max(1, x - 123 * i) for x in lens]
        for r in (r1, r2):
            r.fill(lens)
        r2.q.copy_(r1.q), r2.kc.copy_(r1.kc), r2.vc.copy_(r1.vc), r2.block_table.copy_(r1.block_table)
        graph.replay()
        torch.cuda.synchronize()
        ref = r1.ref()
        assert_close_rel(r1.out, ref, torch.bfloat16, f"one launch, replay {i}")
        assert_close_rel(r2.out, ref, torch.bfloat16, f"two launches, replay {i}")
        assert _tickets_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("stream", ["torch_default", "warmed_capture_stream"])
def test_capture_tickets_gpu(stream, monkeypatch):
    """A capture before any eager decode (a warm start's): on mrv2's capture
    stream, warmed before it as every capture of its graph pool is, the one
    launch; on a stream without the counters (torch.cuda.graph's own), the
    two-launch path, counted. Both replay exactly with new lengths."""
    from compile_backend.runtime import graph_pool

    r = Replays(4, 32, 8, 128, torch.bfloat16, "cuda", bound=2048, seed=41)
    r2 = Replays(4, 32, 8, 128, torch.bfloat16, "cuda", bound=2048, seed=41,
                 config=dict(TWO_LAUNCH=True))
    r2.fill([2048] * 4)
    r2.run()  # compiles the two-launch kernels outside the capture
    r.fill([2048] * 4)
    plan = _Plan(r.q, r.kc, r.out, r.qsl, r.seq_lens, r.block_table, 1, 2048,
                 config=dict(TWO_LAUNCH=False))
    plan.run(r.q, r.kc, r.vc, r.out, r.scale * LOG2E, plan.stream)  # and the one-launch kernel
    torch.cuda.synchronize()
    monkeypatch.setattr(stream_buffers, "_buffers", {})
    monkeypatch.setattr(graph_pool, "_warmed_streams", {})
    monkeypatch.setattr(ua, "_logged_fallback", set())
    side = None
    if stream == "warmed_capture_stream":
        graph_pool.warm_capture_stream()
        side = graph_pool.capture_stream()
    launched = _launched_kernels(monkeypatch)
    before = counters["decode_two_launch_fallbacks"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        plan = _Plan(r.q, r.kc, r.out, r.qsl, r.seq_lens, r.block_table, 1, 2048,
                     config=dict(TWO_LAUNCH=False))
        plan.run(r.q, r.kc, r.vc, r.out, r.scale * LOG2E, plan.stream)
    if side is None:
        assert launched == [ua._decode_split_kernel, ua._decode_reduce_kernel]
        assert counters["decode_two_launch_fallbacks"] == before + 1
    else:
        assert launched == [ua._decode_kernel]
        assert counters["decode_two_launch_fallbacks"] == before
    for lens in ([2048, 1, 1000, 77], [5, 2047, 300, 1024]):
        r.fill(lens)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rel(r.out, r.ref(), torch.bfloat16)
        assert _tickets_zero()
