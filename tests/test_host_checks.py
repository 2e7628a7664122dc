"""Ids and lengths checked on the host when the runner writes a batch:
a bad one raises ValueError naming the request, the field, the value and the
valid range, before anything reaches the persistent buffers (so never a
kernel). Regressions: block id 999 failed deep inside an op with an
IndexError; block id -2 wrapped to another request's block silently; req_slot
7 of 4 failed with an IndexError about "dimension 0 with size 4"."""

import copy

import pytest
import torch

from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.input_batch import InputBatch
from runtime_helpers import make_engine
from test_runtime import _torch_reference_kernels  # noqa: F401 (autouse fixture)

# runtime_helpers.kv_config: num_blocks=64, block_size=16, max_model_len=64
# (4 blocks per row), max_num_reqs=4, max_num_tokens=64


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
    (lambda b: b.block_ids.pop(), r"block_ids has 2 rows for 3 requests"),
    (lambda b: (b.token_ids.extend([1] * 60), b.query_lens.__setitem__(2, 61),
                b.seq_lens.__setitem__(2, 61), b.block_ids[2].append(7)),
     r"batch has 67 tokens, more than max_num_tokens=64"),
]


def _buffers(runner):
    """Everything a step writes: both arenas and their host twins, and the
    block tables' record of what each row holds."""
    tensors = [runner.input_buffers.staging.host, runner.input_buffers.staging.arena,
               runner.block_tables.staging.host, runner.block_tables.staging.arena]
    return [t.clone() for t in tensors], copy.deepcopy(runner.block_tables._rows)


@pytest.fixture(scope="module")
def runner():
    return make_engine("none").runner  # nothing compiles until a forward runs


@pytest.mark.parametrize("change, message", BAD)
def test_bad_batch_raises_naming_request_field_value_and_range_and_writes_nothing(
        runner, change, message):
    runner.prepare_step(_good(), StepGraph.eager(8, 4))  # buffers hold a real step
    before, rows = _buffers(runner)
    batch = _good()
    change(batch)
    with pytest.raises(ValueError, match=message):
        runner.execute(batch)
    after, rows_after = _buffers(runner)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and rows == rows_after


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


def test_after_a_refused_batch_steps_equal_a_runner_that_never_saw_it():
    """Dummy batches (slot -1, null block) keep working through execute."""
    with torch.no_grad():
        runners = [make_engine("none").runner for _ in range(2)]
        outs = []
        for i, r in enumerate(runners):
            dummy = InputBatch.make_dummy(4, 8, r.kv_cache_config.max_model_len)
            r.execute(dummy)
            steps = [r.execute(_good()).clone()]
            if i == 1:
                bad = _good()
                bad.block_ids[2][1] = 999
                with pytest.raises(ValueError, match="999"):
                    r.execute(bad)
            decode = InputBatch([3, 4, 5], [1, 1, 1], [16, 21, 34], [0, 1, 2],
                                block_ids=[[1, 8], [2, 3], [4, 5, 6]],
                                compressed_block_ids=[[1], [2], [3]])
            steps.append(r.execute(decode).clone())
            outs.append(steps)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
