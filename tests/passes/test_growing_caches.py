"""passes/growing_caches.py on Dynamo's graphs: a cache that the graph grows
by concatenation at every call (its length symbolic, the cat returned) runs
with the attention, with what reads its length; the pieces between read
fixed shapes only. A cache written in place, and a symbolic token count
without a growing cache (a runner's step, a plain call at new batch sizes),
leave the graph as it was."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compile_backend as cb
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs

W = 16


class Attends(nn.Module):
    """x [1, 1, W]; cache [1, L, W] grows by cat (DynamicCache) or is written
    in place at `pos` (StaticCache); SDPA over it, then an MLP; the position
    read from the cache length, as HF computes cache_position."""

    def __init__(self):
        super().__init__()
        self.k, self.q = nn.Linear(W, W), nn.Linear(W, W)
        self.up, self.down = nn.Linear(W, 2 * W), nn.Linear(2 * W, W)

    def forward(self, x, box, pos=None):
        k = self.k(x)
        if pos is None:
            where = torch.arange(box["keys"].shape[1], box["keys"].shape[1] + 1)
            box["keys"] = torch.cat([box["keys"], k], dim=1)
        else:
            where = pos
            box["keys"].index_copy_(1, pos, k)
        att = F.scaled_dot_product_attention(self.q(x)[:, None], box["keys"][:, None],
                                             box["keys"][:, None])[:, 0]
        return self.down(F.gelu(self.up(att))) + x + where.float()[:, None, None]


def _steps(model, calls):
    cb.reset_counters()
    cb.clear_compiled_steps()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="mrv2", options={"piece_compiler": "eager"})
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        for args in calls:
            want = model(*[dict(a) if isinstance(a, dict) else a for a in args])
            got = compiled(*args)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return cb.compiled_steps()


def _symbolic(piece) -> list[str]:
    """The piece's placeholders of a symbolic shape or value."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    out = []
    for n in piece.graph_module.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(v, (torch.Tensor, torch.SymInt)) and free_symbols(v):
                out.append(n.name)
    return out


def test_a_cache_grown_by_cat_runs_with_the_attention():
    torch.manual_seed(0)
    model = Attends().eval()
    g = torch.Generator().manual_seed(3)
    box = {"keys": torch.randn(1, 3, W, generator=g)}
    steps = _steps(model, [(torch.randn(1, 1, W, generator=g), box) for _ in range(5)])
    grown = steps[-1]  # the graph Dynamo made for a symbolic cache length
    entry = next(e for e in grown.pass_log if e["pass"] == "GrowingCachesPass")
    # the length + 1, the arange of it, the cat, the SDPA's two views of the cache
    assert entry["changed"] and entry["details"]["growing"] == ["l_box_keys_"]
    assert set(entry["details"]["nodes"]) >= {"where", "cat"}
    eager = [p for p in grown.pieces if not p.captured]
    captured = [p for p in grown.pieces if p.captured]
    assert [p.ops for p in eager] == [["_operator.add", "torch._VariableFunctionsClass.arange",
                                       "torch._VariableFunctionsClass.cat",
                                       "aten::scaled_dot_product_attention"]]
    assert captured and all(not _symbolic(p) for p in captured), [(p.name, _symbolic(p)) for p in captured]
    assert all(not p.eager_reasons for p in grown.pieces)  # a choice, not a capture fallback
    assert cb.counters["pass_growing_cache_nodes"] == entry["details"]["marked"] * sum(
        1 for s in steps if any(e["pass"] == "GrowingCachesPass" and e["changed"] for e in s.pass_log))


def test_a_cache_written_in_place_is_left_alone():
    torch.manual_seed(0)
    model = Attends().eval()
    g = torch.Generator().manual_seed(4)
    box = {"keys": torch.randn(1, 8, W, generator=g)}
    calls = [(torch.randn(1, 1, W, generator=g), box, torch.tensor([i])) for i in range(4)]
    for step in _steps(model, calls):
        entry = next(e for e in step.pass_log if e["pass"] == "GrowingCachesPass")
        assert not entry["changed"] and entry["details"]["marked"] == 0
    assert cb.counters["pass_growing_cache_nodes"] == 0


def test_a_symbolic_token_count_without_a_growing_cache_is_left_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W)).eval()
    g = torch.Generator().manual_seed(5)
    steps = _steps(model, [(torch.randn(t, W, generator=g),) for t in (3, 5, 7, 9)])
    assert any(_symbolic(p) for s in steps for p in s.pieces)  # the token count is symbolic
    for step in steps:
        entry = next(e for e in step.pass_log if e["pass"] == "GrowingCachesPass")
        assert not entry["changed"]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_option_switches_it(enabled):
    torch.manual_seed(0)
    model = Attends().eval()
    g = torch.Generator().manual_seed(6)
    box = {"keys": torch.randn(1, 3, W, generator=g)}
    cb.reset_counters()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="mrv2",
                             options={"piece_compiler": "eager", "growing_caches_eager": enabled})
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        for _ in range(4):
            compiled(torch.randn(1, 1, W, generator=g), box)
    assert (cb.counters["pass_growing_cache_nodes"] > 0) is enabled
