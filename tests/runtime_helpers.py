"""Builders for runtime tests: a tiny hybrid model behind an Engine that
captures with the CPU graph stand-in."""

import torch

import compile_backend as cb
from compile_backend.runtime.cuda_graph import use_graph_backend
from compile_backend.demo.engine import Engine
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_standin import StandInGraphs

CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]


def kv_config(**changes):
    base = dict(num_blocks=64, block_size=16, max_model_len=64, max_num_reqs=4, max_num_tokens=64)
    base.update(changes)
    return KVCacheConfig(**base)


def make_engine(mode, model="hybrid", debug_checks=False, **kv):
    m = build_model(model, preset("tiny", num_layers=2))
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=CAPTURE_SIZES,
                               piece_compiler="eager", debug_checks=debug_checks)
    return Engine(m, kv_config(**kv), cfg, "cpu", prefill_chunk=8, progress=False)


def generate(mode, prompts, max_new_tokens=6, model="hybrid"):
    """Tokens from one engine run in `mode` (captured with the stand-in)."""
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine(mode, model)
        engine.runner.capture()
        return engine.generate(prompts, max_new_tokens), engine


def random_prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
