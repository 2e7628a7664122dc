"""Builders for runtime tests: a tiny hybrid model behind an Engine that
captures with the CPU graph stand-in."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.demo.engine import Engine
from compile_backend.runner.input_batch import InputBatch
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


@pytest.fixture(autouse=True)
def _torch_reference_kernels(request, monkeypatch):
    """On the CPU, ops run their plain-torch references here (the interpreter
    is slow); tests marked `interpreted_kernels` keep Triton's interpreter."""
    if not torch.cuda.is_available() and "interpreted_kernels" not in request.keywords:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def random_schedule(seed, steps=10, slots=4, max_len=60):
    """Random mixed prefill/decode batches over `slots` requests, state carried;
    a request that would pass max_len starts over as a new request."""
    import random

    rng = random.Random(seed)
    lens = [0] * slots
    for _ in range(steps):
        chosen = sorted(rng.sample(range(slots), rng.randint(1, slots)))
        qlens, slens = [], []
        for s in chosen:
            q = 1 if lens[s] and rng.random() < 0.6 else rng.randint(1, 8)
            if lens[s] + q > max_len:
                lens[s] = 0
            lens[s] += q
            qlens.append(q)
            slens.append(lens[s])
        yield InputBatch(
            [rng.randrange(256) for _ in range(sum(qlens))], qlens, slens, chosen,
            block_ids=[[1 + 4 * s + i for i in range(4)] for s in chosen],
            compressed_block_ids=[[1 + s] for s in chosen])


def copy_batch(batch):
    """A new InputBatch with the same fields (a runner may pad the one it is given)."""
    return InputBatch(list(batch.token_ids), list(batch.query_lens), list(batch.seq_lens),
                      list(batch.req_slots), block_ids=batch.block_ids,
                      compressed_block_ids=batch.compressed_block_ids)
