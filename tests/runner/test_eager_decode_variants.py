"""An eager decode step (PIECEWISE's attention between graphs) launches a
decode kernel variant that its plan's capture already launched: the split
count (a constexpr of the kernel, and the grid) follows the padded request
count alone, never a context's length. Regression: the exact max_seq_len
gave a new variant whenever a context crossed a split boundary, each one a
Triton compile in the middle of serving (and in a cold start's first step).
The variants are computed as the launcher computes them, for an H100's 132
SMs; the tokens are checked against eager over several sessions."""

import importlib

import pytest
import torch

from compile_backend.demo.models import preset
from compile_backend.runner.attention_metadata import AttentionMetadata
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import _torch_reference_kernels, make_engine, random_prompts  # noqa: F401 (fixture)

ua = importlib.import_module("compile_backend.kernels.unified_attention")  # the package's name is the op
GPU = torch.device("cuda")  # only named: the split rules read the device's kind and SM count
KV = dict(num_blocks=160, max_model_len=512, max_num_reqs=4, max_num_tokens=64)


def _variant(meta: AttentionMetadata, kv_heads: int) -> tuple[int, bool, int]:
    """(requests, two launches?, splits) of a decode launch for this metadata."""
    two, min_split = ua.decode_form(meta.num_reqs, kv_heads, GPU)
    return meta.num_reqs, two, ua.num_kv_splits(meta.num_reqs, kv_heads, meta.max_seq_len, GPU,
                                                min_split)


@pytest.mark.parametrize("mode", ["piecewise", "none"])
def test_eager_decode_steps_launch_only_the_plans_variants(mode, monkeypatch):
    monkeypatch.setattr(ua, "_sm_count", lambda device: 132)
    seen: dict[str, set] = {"plan": set(), "serving": set()}
    longest = [0]
    phase = ["plan"]
    forward = ModelRunner._forward

    def spy(self, graph, metadata, trace=None):
        for meta in metadata.values():
            if isinstance(meta, AttentionMetadata) and meta.max_query_len == 1:
                seen[phase[0]].add(_variant(meta, preset("tiny").num_kv_heads))
                if phase[0] == "serving":
                    longest[0] = max(longest[0], int(meta.seq_lens.max()))
        return forward(self, graph, metadata, trace)

    monkeypatch.setattr(ModelRunner, "_forward", spy)
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine(mode, **KV)
        engine.runner.capture()
        ref = make_engine("none", **KV)
        phase[0] = "serving"
        for session in range(3):  # new requests each time, contexts from 20 to ~330 tokens
            prompts = random_prompts([20 + 100 * session + 7 * i for i in range(1 + session)],
                                     seed=session)
            got = engine.generate(prompts, max_new_tokens=24)
            phase[0] = "reference"
            seen.setdefault("reference", set())
            assert got == ref.generate(prompts, max_new_tokens=24), session
            phase[0] = "serving"
    # Contexts crossed several of the two-launch form's 64-key split boundaries.
    assert longest[0] > 4 * ua.TWO_LAUNCH_MIN_SPLIT_LEN, longest[0]
    assert seen["serving"], "no eager decode step ran"
    if mode == "piecewise":
        assert seen["serving"] <= seen["plan"], (seen["serving"] - seen["plan"], seen["plan"])
    else:  # no plan: every step of a request count launches one variant
        assert len({v[0] for v in seen["serving"]}) == len(seen["serving"]), seen["serving"]
