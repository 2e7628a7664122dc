"""A small engine loop: continuous batching over paged KV blocks, chunked
prefill mixed with decode, greedy sampling, every step through ModelRunner.

Tensor parallel: one Engine per rank, each over its model shard (its KV
cache holds its KV heads; block ids are the same on every rank). Every rank
schedules the same requests from the same prompts and samples the same
tokens from the same (replicated lm_head) logits, so every rank executes the
same batch each step, which the graphs' collectives need
(compile_backend/runner/parallel.py). A `sample` function must therefore
give the same tokens on every rank (seed it the same)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from compile_backend.core.config import CompilationConfig
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime.machine import check_device


class BlockAllocator:
    """Free list of KV blocks; block 0 is the null block and never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free.extend(reversed(ids))


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    num_computed: int = 0  # tokens whose KV is cached
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    compressed_block_ids: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class StepStats:
    steps: int = 0
    tokens_generated: int = 0
    step_seconds: list[float] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, model: torch.nn.Module, kv_cache_config: KVCacheConfig,
                 config: CompilationConfig, device: torch.device | str,
                 prefill_chunk: int = 64, max_admit_per_step: int = 2,
                 progress: bool = True) -> None:
        device = check_device(device)  # before the caches are bound there
        self.cfg = kv_cache_config
        self.prefill_chunk = prefill_chunk
        self.max_admit_per_step = max_admit_per_step
        model.bind_caches(kv_cache_config.num_blocks, kv_cache_config.block_size,
                          kv_cache_config.max_num_reqs, device)
        self.runner = ModelRunner(model, kv_cache_config, config, device, progress=progress)
        self.blocks = BlockAllocator(kv_cache_config.num_blocks)
        self.compressed_blocks = BlockAllocator(kv_cache_config.num_blocks)
        self.free_slots = list(range(kv_cache_config.max_num_reqs - 1, -1, -1))
        self.stats = StepStats()
        self.device = torch.device(device)

    def _grow(self, req: Request, new_len: int) -> None:
        bs = self.cfg.block_size
        need = math.ceil(new_len / bs) - len(req.block_ids)
        if need > 0:
            req.block_ids += self.blocks.allocate(need)
        groups = math.ceil(new_len / self.cfg.compress_ratio)
        need = math.ceil(groups / bs) - len(req.compressed_block_ids)
        if need > 0:
            req.compressed_block_ids += self.compressed_blocks.allocate(need)

    def _finish(self, req: Request) -> None:
        self.blocks.release(req.block_ids)
        self.compressed_blocks.release(req.compressed_block_ids)
        self.free_slots.append(req.slot)
        req.block_ids, req.compressed_block_ids = [], []

    def step(self, running: list[Request], sample=None) -> torch.Tensor:
        """One step over `running`: each request gets its next prompt chunk or
        one decode token; requests that finished their prompt sample a token
        (greedy, or `sample(last_logits [B, V]) -> list[int]`). Returns the
        step's logits at each request's last token, [B, V]."""
        ids, qlens, slens, slots, blocks, cblocks = [], [], [], [], [], []
        budget = self.cfg.max_num_tokens
        scheduled: list[tuple[Request, int]] = []
        for req in running:
            pending = len(req.tokens) - req.num_computed
            n = min(pending, self.prefill_chunk, budget)
            if n <= 0:
                continue
            budget -= n
            self._grow(req, req.num_computed + n)
            ids += req.tokens[req.num_computed: req.num_computed + n]
            qlens.append(n)
            slens.append(req.num_computed + n)
            slots.append(req.slot)
            blocks.append(list(req.block_ids))
            cblocks.append(list(req.compressed_block_ids))
            scheduled.append((req, n))
        batch = InputBatch(ids, qlens, slens, slots, block_ids=blocks, compressed_block_ids=cblocks)
        t0 = time.perf_counter()
        logits = self.runner.execute(batch)
        last = torch.tensor([sum(qlens[: i + 1]) - 1 for i in range(len(qlens))], device=logits.device)
        last_logits = logits[last]
        next_tokens = sample(last_logits) if sample else last_logits.argmax(-1).tolist()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.step_seconds.append(time.perf_counter() - t0)
        self.stats.steps += 1
        for (req, n), tok in zip(scheduled, next_tokens):
            req.num_computed += n
            if req.num_computed == len(req.tokens):  # caught up: sample
                req.output.append(tok)
                self.stats.tokens_generated += 1
        return last_logits

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sample=None,
                 on_step=None) -> list[list[int]]:
        """Greedy generation with continuous batching. `on_step(logits)` sees
        every step's last-token logits."""
        for p in prompts:
            if len(p) + max_new_tokens > self.cfg.max_model_len:
                raise ValueError(
                    f"a prompt of {len(p)} tokens plus {max_new_tokens} new tokens exceeds "
                    f"max_model_len={self.cfg.max_model_len}; shorten it or raise max_model_len")
        waiting = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
        running: list[Request] = []
        finished: dict[int, Request] = {}
        while waiting or running:
            for _ in range(self.max_admit_per_step):
                if not waiting or not self.free_slots:
                    break
                req = waiting.pop(0)
                req.slot = self.free_slots.pop()
                running.append(req)
            logits = self.step(running, sample)
            if on_step is not None:
                on_step(logits)
            for req in [r for r in running if r.done]:
                running.remove(req)
                self._finish(req)
                finished[req.rid] = req
        return [finished[i].output for i in range(len(prompts))]
