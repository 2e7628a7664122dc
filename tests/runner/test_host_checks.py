"""Ids and lengths checked on the host when the runner writes a batch:
a bad one raises ValueError naming the request, the field, the value and the
valid range, before anything reaches the persistent buffers or the caches (so
never a kernel). Regressions: block id 999 failed deep inside an op with an
IndexError; block id -2 wrapped to another request's block silently; req_slot
7 of 4 failed with an IndexError about "dimension 0 with size 4"; a batch
without block_ids rows ran on a model with a KV cache (no KV written, the null
block read as context: decode logits 0.41 off); token id 256 of a 256-token vocabulary killed the
process with Inductor pieces (SIGABRT) and raised IndexError with eager ones;
a draft batch without blocks for its draft tokens wrote their KV into the
null block, and one past max_model_len failed in the loop's gather."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import compile_backend as cb
from compile_backend.core.graph_mode import StepGraph
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runner.draft_runner import DraftRunner
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config, make_engine
from runtime_helpers import _torch_reference_kernels  # noqa: F401 (autouse fixture)

# runtime_helpers.kv_config: num_blocks=64, block_size=16, max_model_len=64
# (4 blocks per row), max_num_reqs=4, max_num_tokens=64; the tiny models'
# vocabulary has 256 tokens.


def _good() -> InputBatch:
    """A prefill of 5 tokens after 10 cached ones, then two decodes."""
    return InputBatch([7] * 7, [5, 1, 1], [15, 20, 33], [0, 1, 2],
                      block_ids=[[1], [2, 3], [4, 5, 6]],
                      compressed_block_ids=[[1], [2], [3]])


def _set(field, i, value, j=None):
    def change(b):
        rows = getattr(b, field)
        if j is None:
            rows[i] = value
        else:
            rows[i][j] = value
    return change


BAD = [
    (_set("block_ids", 1, 999, 1),
     r"request 1: block_ids\[1\] = 999 is not a block of the cache; "
     r"valid: 0 <= block id < num_blocks=64"),
    (_set("block_ids", 2, -2, 0), r"request 2: block_ids\[0\] = -2 is not a block"),
    (_set("compressed_block_ids", 2, 64, 0),
     r"request 2: compressed_block_ids\[0\] = 64 .* valid: 0 <= block id < "
     r"num_compressed_blocks=64"),
    (_set("req_slots", 1, 7),
     r"request 1: req_slot 7 is out of range; valid: 0 <= req_slot < max_num_reqs=4"),
    (_set("req_slots", 2, -1), r"request 2: req_slot -1 is out of range; valid: 0 <= req_slot"),
    (_set("req_slots", 2, 0), r"request 2: req_slot 0 is also request 0's"),
    (_set("seq_lens", 2, 65),
     r"request 2: seq_len 65 is more than max_model_len=64; "
     r"valid: query_len <= seq_len <= max_model_len"),
    (_set("block_ids", 2, [4, 5]),
     r"request 2: block_ids has 2 blocks, too few for seq_len 33: it needs "
     r"ceil\(seq_len / block_size=16\) = 3"),
    (_set("block_ids", 0, [1, 2, 3, 4, 5]),
     r"request 0: block_ids has 5 blocks, more than the block table's 4"),
    (lambda b: b.block_ids.pop(), r"request 2: no block_ids row \(block_ids has 2 rows for 3 "
                                  r"requests\)"),
    (lambda b: (b.token_ids.extend([1] * 60), b.query_lens.__setitem__(2, 61),
                b.seq_lens.__setitem__(2, 61), b.block_ids[2].append(7)),
     r"batch has 67 tokens, more than max_num_tokens=64"),
    # A model with a KV cache needs every request's blocks: without them its KV
    # is not written and the null block is read as its context, silently.
    (lambda b: b.block_ids.clear(),
     r"request 0: no block_ids row \(block_ids has 0 rows for 3 requests\); the model's "
     r"'attention' layers \(layers\.0\.attn, layers\.1\.attn\) read the KV cache through it\. "
     r"Give one row per request: its blocks, ceil\(seq_len / block_size=16\) of them"),
    (lambda b: b.compressed_block_ids.clear(),
     r"request 0: no compressed_block_ids row \(compressed_block_ids has 0 rows for 3 "
     r"requests\); the model's 'compressor' layers \(layers\.0\.compress, layers\.1\.compress\) "
     r"read the compressed cache through it\. Give one row per request: its blocks, "
     r"ceil\(ceil\(seq_len / compress_ratio=4\) / block_size=16\) of them"),
    # Token ids index the embedding: past it, Inductor's kernel aborts the process.
    (_set("token_ids", 5, 256),
     r"request 1: token_ids\[5\] = 256 \(its new token 0\) is not in the model's vocabulary; "
     r"valid: 0 <= token id < vocab_size=256 \(model\.get_input_embeddings\(\)\)"),
    (_set("token_ids", 3, -1), r"request 0: token_ids\[3\] = -1 \(its new token 3\) is not in "
                               r"the model's vocabulary"),
]


def _buffers(runner):
    """Everything a step writes: both arenas and their host twins, the
    block tables' record of what each row holds, and the model's caches and
    state (KV, compressed KV, conv and compressor state)."""
    tensors = [runner.input_buffers.staging.host, runner.input_buffers.staging.arena,
               runner.block_tables.staging.host, runner.block_tables.staging.arena,
               *runner.model.buffers()]
    return [t.clone() for t in tensors], copy.deepcopy(runner.block_tables._rows)


def _same(before, after):
    (a, rows_a), (b, rows_b) = before, after
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) and rows_a == rows_b


@pytest.fixture(scope="module")
def runner():
    r = make_engine("none").runner  # nothing compiles until a forward runs
    with torch.no_grad():  # caches and state hold values, so that a write shows
        for name, b in r.model.named_buffers():
            if "cache" in name or "state" in name:
                b.normal_(generator=torch.Generator().manual_seed(len(name)))
    return r


@pytest.mark.parametrize("change, message", BAD)
def test_bad_batch_raises_naming_request_field_value_and_range_and_writes_nothing(
        runner, change, message):
    runner.prepare_step(_good(), StepGraph.eager(8, 4))  # buffers hold a real step
    before = _buffers(runner)
    batch = _good()
    change(batch)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        runner.execute(batch)
    assert _same(before, _buffers(runner))


def test_a_row_changed_in_place_after_it_was_written_is_checked_again(runner):
    """Only rows that differ from the held ones are checked: one the caller
    extends in place (the same list object) differs, so it is checked."""
    batch = _good()
    runner.prepare_step(batch, StepGraph.eager(8, 4))
    batch.block_ids[1].append(999)
    with pytest.raises(ValueError, match=r"request 1: block_ids\[2\] = 999"):
        runner.prepare_step(batch, StepGraph.eager(8, 4))


def test_query_len_past_seq_len_raises_when_the_batch_is_built():
    with pytest.raises(ValueError, match=r"request 1: query_len 3 with seq_len 2; "
                                         r"valid: 0 <= query_len <= seq_len"):
        InputBatch([1] * 4, [1, 3], [4, 2], [0, 1])


def _engine(mode, model="hybrid"):
    """make_engine with two capture sizes: 8 (the prefill) and 4 (the decode)."""
    m = build_model(model, preset("tiny", num_layers=2))
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[4, 8], piece_compiler="eager")
    return Engine(m, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)


REFUSED = [
    (lambda b: b.block_ids[2].__setitem__(1, 999), "999"),
    (lambda b: b.block_ids.clear(), "no block_ids row"),
    (lambda b: b.compressed_block_ids.clear(), "no compressed_block_ids row"),
    (_set("token_ids", 5, 256), "token_ids\\[5\\] = 256"),
]


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_after_refused_batches_steps_equal_eager_that_never_saw_them(mode):
    """Dummy batches (slot -1, null block) keep working through execute;
    the runner that refused batches (captured: piecewise prefill, FULL
    decode) then computes what an eager runner computes."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        outs = []
        for r, refuse in ((_engine("none").runner, False), (_engine(mode).runner, True)):
            if refuse:
                r.capture()
            dummy = InputBatch.make_dummy(4, 8, r.kv_cache_config.max_model_len)
            r.execute(dummy)
            steps = [r.execute(_good()).clone()]
            for change, message in REFUSED if refuse else []:
                bad = _good()
                change(bad)
                with pytest.raises(ValueError, match=message):
                    r.execute(bad)
            decode = InputBatch([3, 4, 5], [1, 1, 1], [16, 21, 34], [0, 1, 2],
                                block_ids=[[1, 8], [2, 3], [4, 5, 6]],
                                compressed_block_ids=[[1], [2], [3]])
            steps.append(r.execute(decode).clone())
            outs.append(steps)
    if mode != "none":
        assert cb.counters["cudagraph_replays"] >= 2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_a_model_without_a_compressed_cache_takes_batches_without_its_rows():
    """Llama has attention only: compressed_block_ids may have no rows (the
    logits are the same as with them), block_ids may not."""
    with torch.no_grad():
        r = _engine("none", model="llama").runner
        with_rows = r.execute(_good()).clone()
        before = _buffers(r)
        no_kv = _good()
        no_kv.block_ids = []
        with pytest.raises(ValueError, match=r"request 0: no block_ids row .* the model's "
                                             r"'attention' layers"):
            r.execute(no_kv)
        assert _same(before, _buffers(r))
        without = _good()
        without.compressed_block_ids = []
        torch.testing.assert_close(r.execute(without), with_rows)  # the same step again


# ---- the vocabulary -----------------------------------------------------------


class Echo(nn.Module):
    """No cache and no layer with metadata: the output is the ids themselves."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (input_ids * 2 + positions)[:, None]


def _echo_runner(model):
    cfg = cb.CompilationConfig(cudagraph_mode="none", capture_sizes=[4], piece_compiler="eager")
    return ModelRunner(model, kv_config(), cfg, "cpu", progress=False, compile_fn=lambda m: m)


def test_the_vocabulary_size_comes_from_the_model():
    assert make_engine("none").runner.vocab_size == 256  # get_input_embeddings()
    declared = Echo()
    declared.vocab_size = 100
    assert _echo_runner(declared).vocab_size == 100
    configured = Echo()
    configured.config = SimpleNamespace(vocab_size=50)
    r = _echo_runner(configured)
    assert r.vocab_size == 50
    with pytest.raises(ValueError, match=r"request 0: token_ids\[1\] = 50 \(its new token 1\) "
                                         r"is not in the model's vocabulary; valid: 0 <= token "
                                         r"id < vocab_size=50 \(model\.config\.vocab_size\)"):
        r.execute(InputBatch([49, 50], [2], [2], [0]))


def test_a_model_without_a_vocabulary_size_is_refused_when_the_runner_is_built():
    with pytest.raises(ValueError, match=r"cannot tell the vocabulary size of Echo .*"
                                         r"model\.vocab_size = None"):
        _echo_runner(Echo())
    bad = Echo()
    bad.vocab_size = 0
    with pytest.raises(ValueError, match=r"model\.vocab_size must be a positive int or None"):
        _echo_runner(bad)


def test_a_model_that_takes_no_token_ids_declares_vocab_size_none():
    """Its input ids are not checked (nor needed: no block rows either)."""
    m = Echo()
    m.vocab_size = None
    r = _echo_runner(m)
    assert r.vocab_size is None
    out = r.execute(InputBatch([10**9, 5], [1, 1], [3, 1], [0, 1]))
    assert out[:, 0].tolist() == [2 * 10**9 + 2, 10]  # positions 2 and 0


# ---- draft batches -------------------------------------------------------------


def _draft(mode):
    """A draft runner of 3 tokens over the hybrid model; in FULL mode its
    4-request loop is captured (the stand-in graphs)."""
    engine = _engine(mode)
    draft = DraftRunner(engine.runner, 3)
    draft.capture(sizes=[4] if mode == "full" else None)
    return engine.runner, draft


DRAFT_BAD = [
    # seq_len 16 + 3 draft tokens - 1 = 18 tokens: 2 blocks, request 1 has 1.
    ([[1, 2], [3], [4, 5]], [15, 16, 20],
     r"request 1: block_ids has 1 blocks, too few for num_draft_tokens=3 after seq_len 16: the "
     r"draft loop reaches seq_len 18, which needs ceil\(18 / block_size=16\) = 2"),
    ([[1, 2], [3, 7, 8, 9], [4, 5]], [15, 63, 20],
     r"request 1: seq_len 63 with num_draft_tokens=3 reaches seq_len 65, more than "
     r"max_model_len=64"),
]


@pytest.mark.parametrize("mode", ["full", "none"])
@pytest.mark.parametrize("blocks, seq_lens, message", DRAFT_BAD)
def test_draft_batch_without_room_for_its_draft_tokens_raises_and_writes_nothing(
        mode, blocks, seq_lens, message):
    """Checked before the first draft step: in FULL mode the loop's later
    steps run on the device, and stepping through execute would have
    written the first steps' KV before the last one failed."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        r, draft = _draft(mode)
        before = _buffers(r)
        batch = InputBatch([1, 2, 3], [1, 1, 1], seq_lens, [0, 1, 2], block_ids=blocks,
                           compressed_block_ids=[[1], [2], [3]])
        with pytest.raises(ValueError, match=message):
            draft.propose(batch)
        assert _same(before, _buffers(r))
        bad_token = InputBatch([1, 256, 3], [1, 1, 1], [15, 17, 20], [0, 1, 2],
                               block_ids=[[1, 2], [3, 6], [4, 5]],
                               compressed_block_ids=[[1], [2], [3]])
        with pytest.raises(ValueError, match=r"request 1: token_ids\[1\] = 256"):
            draft.propose(bad_token)
        assert _same(before, _buffers(r))
