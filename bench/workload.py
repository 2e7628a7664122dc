"""What the decode benchmarks run on: the input batches and the caches' contents.

Shared by bench/decode.py, bench/tp.py and the scripts that reuse their
batches (startup.py, profile_step.py, host_overhead.py), so that no bench
script imports another for them.
  decode_batch   `batch` requests each decoding one token after `context` cached tokens
  mixed_batch    decode requests plus one prefill (a mixed step)
  fill_caches    random KV caches and state (never time zeros), the same values
                 at every tensor-parallel size
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compile_backend.runner.input_batch import InputBatch  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402

# Cache and state buffers: the dimension split across ranks (KV heads, channels).
SHARDED_DIM = {"k_cache": 2, "v_cache": 2, "compressed_cache": 2, "state_max": 1,
               "state_sum": 1, "state_acc": 1, "conv_state": 1}


def decode_batch(batch: int, context: int, kv: KVCacheConfig, vocab: int, seed: int = 0) -> InputBatch:
    """`batch` requests each decoding one token after `context` cached tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil((context + 1) / kv.block_size)
    cblocks = math.ceil(math.ceil((context + 1) / kv.compress_ratio) / kv.block_size)
    return InputBatch(
        token_ids=torch.randint(0, vocab, (batch,), generator=g).tolist(),
        query_lens=[1] * batch, seq_lens=[context + 1] * batch, req_slots=list(range(batch)),
        block_ids=[[1 + r * blocks + i for i in range(blocks)] for r in range(batch)],
        compressed_block_ids=[[1 + r * cblocks + i for i in range(cblocks)] for r in range(batch)],
    )


def mixed_batch(num_tokens: int, num_decodes: int, context: int, kv: KVCacheConfig,
                vocab: int) -> InputBatch:
    """`num_decodes` decode requests (0: none) plus one prefill of the remaining tokens."""
    d = decode_batch(num_decodes, context, kv, vocab)
    n = num_tokens - num_decodes
    first = 1 + sum(map(len, d.block_ids))  # the prefill's blocks after the decodes'
    cfirst = 1 + sum(map(len, d.compressed_block_ids))
    g = torch.Generator().manual_seed(1)
    return InputBatch(
        token_ids=d.token_ids + torch.randint(0, vocab, (n,), generator=g).tolist(),
        query_lens=d.query_lens + [n], seq_lens=d.seq_lens + [n],
        req_slots=d.req_slots + [num_decodes],
        block_ids=d.block_ids + [list(range(first, first + math.ceil(n / kv.block_size)))],
        compressed_block_ids=d.compressed_block_ids + [list(range(
            cfirst, cfirst + math.ceil(math.ceil(n / kv.compress_ratio) / kv.block_size)))],
    )


@torch.no_grad()
def fill_caches(model: torch.nn.Module, device: str | torch.device, seed: int = 1) -> None:
    """Random caches and state (never time zeros) for a model whose caches are
    bound, the same values at every TP size: each sharded buffer is drawn at
    its TP=1 shape and this rank (model.tp) keeps its slice."""
    tp = model.tp
    g = torch.Generator(device=device).manual_seed(seed)
    for name, buf in model.named_buffers():
        if not buf.dtype.is_floating_point or buf.dim() < 2:
            continue
        dim = SHARDED_DIM.get(name.rsplit(".", 1)[-1])
        if dim is None or tp.size == 1:
            buf.normal_(generator=g)
            continue
        shape = list(buf.shape)
        shape[dim] *= tp.size
        full = torch.empty(shape, dtype=buf.dtype, device=buf.device).normal_(generator=g)
        buf.copy_(full.chunk(tp.size, dim=dim)[tp.rank])


def config_options(ap: argparse.ArgumentParser, pairs: list[str]) -> dict[str, Any]:
    """--config FIELD=VALUE pairs -> CompilationConfig keyword arguments
    (true/false, ints and floats parsed; the config checks names and values)."""
    from compile_backend.core.config import CompilationConfig

    fields = {f.name for f in dataclasses.fields(CompilationConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in fields:
            ap.error(f"--config {pair!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        low = text.lower()
        if low in ("true", "false"):
            out[name] = low == "true"
        else:
            try:
                out[name] = int(text)
            except ValueError:
                try:
                    out[name] = float(text)
                except ValueError:
                    out[name] = text
    return out
