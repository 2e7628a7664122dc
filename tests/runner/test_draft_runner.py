"""The speculative-decoding draft path (CPU, graphs are the stand-in)."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.draft_runner import DraftRunner
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import make_engine, random_prompts


@pytest.fixture(autouse=True)
def _torch_reference_kernels(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


K = 3


def _propose(mode):
    """Prefill three requests, then draft K tokens for each."""
    torch._dynamo.reset()
    prompts = random_prompts([5, 9, 3], seed=3)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine(mode)
        engine.runner.capture()
        draft = DraftRunner(engine.runner, K)
        builds_before = len(engine.runner.model_state.build_log)
        captured = draft.capture()
        engine.draft_builds = engine.runner.model_state.build_log[builds_before:]
        block = engine.blocks.allocate(3 * 2)
        blocks = [block[2 * i: 2 * i + 2] for i in range(3)]
        cblocks = [engine.compressed_blocks.allocate(1) for _ in range(3)]
        prefill = InputBatch([t for p in prompts for t in p], [len(p) for p in prompts],
                             [len(p) for p in prompts], [0, 1, 2], block_ids=blocks,
                             compressed_block_ids=cblocks)
        logits = engine.runner.execute(prefill)
        last = torch.tensor([4, 13, 16])
        first = logits[last].argmax(-1).tolist()
        decode = InputBatch(first, [1, 1, 1], [len(p) + 1 for p in prompts], [0, 1, 2],
                            block_ids=blocks, compressed_block_ids=cblocks)
        return draft.propose(decode), captured, engine


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise", "piecewise"])
def test_draft_tokens_equal_an_eager_autoregressive_loop(mode):
    ref, _, _ = _propose("none")
    out, captured, engine = _propose(mode)
    assert out.shape == (3, K)
    assert torch.equal(out, ref)
    if mode == "piecewise":
        assert captured == []  # the main runner's piecewise graphs serve the loop
    else:
        sizes = [s for s in engine.runner.decode_sizes]
        assert captured == [StepGraph.full_decode(n) for n in sorted(sizes, reverse=True)]
        # captured through prepare_inputs_to_capture with a FULL step (for_capture):
        # every build the draft's capture made (warm-up and capture alike)
        assert engine.draft_builds and all(b["dummy"] for b in engine.draft_builds)
        assert all(b["for_capture"] and b["mode"] == "full" for b in engine.draft_builds)
        assert cb.counters["cudagraph_replays"] >= 1


def test_draft_path_rejects_a_batch_that_is_not_decode():
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()):
        engine = make_engine("full")
        draft = DraftRunner(engine.runner, 2)
        with pytest.raises(ValueError, match="uniform decode"):
            draft.propose(InputBatch([1, 2], [2], [2], [0], block_ids=[[1]], compressed_block_ids=[[1]]))
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        DraftRunner(engine.runner, 0)
