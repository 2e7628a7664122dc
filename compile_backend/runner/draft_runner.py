"""The speculative-decoding draft path: an autoregressive draft model proposes
`num_draft_tokens` tokens for every request, one uniform decode step at a time.

Graphs are keyed by their StepGraph (a FULL uniform-decode graph of n
requests); a DraftRunner drafts a fixed k, so the loop graphs it holds are
all k-step loops. In FULL mode the whole k-step
loop is one graph: each step's argmax becomes the next step's input, and
positions, seq_lens and slot mappings advance on the device, in the
persistent buffers the metadata views read, so nothing leaves the graph. In
PIECEWISE mode the loop runs in Python over the model's piecewise graphs, and
metadata is rebuilt each step (the attention breakpoint runs eagerly with
exact bounds). Capture goes through the same `prepare_inputs_to_capture(graph, ...)`
as the main model.
"""

from __future__ import annotations

import torch

from compile_backend.runner.capture import prepare_inputs_to_capture
from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import current_graph_backend
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner


class DraftRunner:
    def __init__(self, runner: ModelRunner, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.runner = runner
        self.k = num_draft_tokens
        self.mode = CUDAGraphMode.FULL if runner.mode.has_full else (
            CUDAGraphMode.PIECEWISE if runner.mode.has_piecewise else CUDAGraphMode.NONE)
        self.loop_graph = CUDAGraphWrapper(
            self._loop, CUDAGraphMode.FULL, name="draft_loop",
            debug_checks=runner.config.debug_checks, graphs=current_graph_backend())
        self.captured: list[StepGraph] = []  # the loop graphs captured, largest first

    # ---- the k-step loop (device only) ----------------------------------------

    def _advance(self, num_tokens: int, num_reqs: int, tokens: torch.Tensor) -> None:
        """Feed `tokens` [T'] back as the next step's inputs, one position on."""
        buf, tables = self.runner.input_buffers, self.runner.block_tables
        bs = self.runner.kv_cache_config.block_size
        real = buf.seq_lens[:num_reqs] > 0  # padding requests have seq_len 0
        # A row that wrote no KV this step writes none in the next: padding
        # rows, and every row of a capture's dummy batch (which must leave the
        # cache, null block included, as it was).
        writes = tables.slot_mapping[:num_reqs] >= 0
        buf.input_ids[:num_tokens].copy_(tokens)
        pos = buf.positions[:num_reqs]
        pos.add_(real.to(pos.dtype))
        buf.seq_lens[:num_reqs].add_(real.to(torch.int32))
        blk = tables.block_table[:num_reqs].gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
        slots = torch.where(writes, blk.to(torch.int64) * bs + pos % bs, -1)
        tables.slot_mapping[:num_reqs].copy_(slots)
        buf.has_initial_state[:num_reqs].copy_(real)

    def _loop(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[0]
        out = []
        for i in range(self.k):
            tokens = self.runner._run_compiled(input_ids, positions).argmax(-1)  # [T']
            out.append(tokens)
            if i + 1 < self.k:
                self._advance(T, T, tokens)
        return torch.stack(out, dim=1)  # [T', k]

    # ---- capture and propose --------------------------------------------------

    def capture(self, sizes: list[int] | None = None) -> list[StepGraph]:
        """One graph per (requests, k), largest first, for `sizes` (default:
        every decode size of the runner). PIECEWISE needs nothing beyond the
        main runner's piecewise graphs."""
        if self.mode is not CUDAGraphMode.FULL:
            return []
        r = self.runner
        sizes = r.decode_sizes if sizes is None else sizes
        unknown = sorted(set(sizes) - set(r.decode_sizes))
        if unknown:
            raise ValueError(f"draft sizes {unknown} are not decode sizes of the runner "
                             f"({r.decode_sizes}); a batch is padded to one of those")
        for n in sorted(sizes, reverse=True):
            graph = StepGraph.full_decode(n)
            ids, pos = r.input_buffers.input_ids[:n], r.input_buffers.positions[:n]
            meta = prepare_inputs_to_capture(graph, r.model_state)
            with set_forward_context(ForwardContext(meta, StepGraph.eager(n, n))):
                self._loop(ids, pos)  # warm-up
            # Re-prepare: the warm-up advanced the (dummy) buffers.
            meta = prepare_inputs_to_capture(graph, r.model_state)
            self._run_loop(graph, meta, ids, pos)
            self.captured.append(graph)
        return self.captured

    def _run_loop(self, graph: StepGraph, meta: dict, ids: torch.Tensor,
                  pos: torch.Tensor) -> torch.Tensor:
        """The k-step loop in `graph` (captured on its first call)."""
        with set_forward_context(ForwardContext(meta, graph)):
            return self.loop_graph(ids, pos)

    def propose(self, batch: InputBatch) -> torch.Tensor:
        """Draft tokens [B, k] (int64, on the runner's device, whichever path
        ran) for a uniform decode batch (each request's last token). Every
        request's seq_len grows to seq_len + k - 1 in the loop: that must fit
        max_model_len and its block_ids (ValueError, naming the request,
        before anything is written)."""
        if not batch.uniform_decode:
            raise ValueError("the draft path takes uniform decode batches (one token per request)")
        r = self.runner
        r.model_state.check(batch)
        self._check_room(batch)
        sizes = [s for s in r.decode_sizes if s >= batch.num_reqs]
        if self.mode is CUDAGraphMode.FULL and sizes:
            n = sizes[0]
            graph = StepGraph.full_decode(n)
            if not self.loop_graph.is_captured(graph):  # checked before anything is written
                raise RuntimeError(
                    f"no draft graph for {n} requests x {self.k} draft tokens (the padded size "
                    f"of this {batch.num_reqs}-request batch); captured: "
                    f"{[s.num_reqs for s in self.captured] or 'none'} requests. Call "
                    "DraftRunner.capture() before propose(): the draft loop is not captured "
                    "on demand")
            meta = r._write_step(batch, graph)  # checked above
            ids, pos = r.input_buffers.input_ids[:n], r.input_buffers.positions[:n]
            return self._run_loop(graph, meta, ids, pos)[: batch.num_reqs].clone()
        # PIECEWISE / NONE / too large: step by step through the main runner.
        out = []
        for i in range(self.k):
            logits = r.execute(batch)  # [tokens, vocab]: one token per request
            tokens = logits.argmax(-1).tolist()
            out.append(tokens)
            # The next step's batch: the same requests, one token each.
            batch = InputBatch(tokens, [1] * batch.num_reqs, [s + 1 for s in batch.seq_lens],
                               batch.req_slots, block_ids=batch.block_ids,
                               compressed_block_ids=batch.compressed_block_ids)
        return torch.tensor(out, dtype=torch.int64, device=logits.device).T.contiguous()

    def _check_room(self, batch: InputBatch) -> None:
        """Refuse a batch whose draft tokens outgrow max_model_len or the
        request's blocks. In FULL mode the loop's later steps advance on the
        device (a position past the block table fails in its gather; one past
        the request's blocks writes its KV into the null block); stepping
        through execute would refuse only the step that outgrows them, after
        the earlier ones wrote KV. Checked for all k steps now."""
        cfg, grow = self.runner.kv_cache_config, self.k - 1
        if max(batch.seq_lens) + grow > cfg.max_model_len:
            i, s = next((i, s) for i, s in enumerate(batch.seq_lens)
                        if s + grow > cfg.max_model_len)
            raise ValueError(
                f"request {i}: seq_len {s} with num_draft_tokens={self.k} reaches seq_len "
                f"{s + grow}, more than max_model_len={cfg.max_model_len}; draft fewer tokens "
                "or finish the request")
        bs = cfg.block_size
        for i, (ids, s) in enumerate(zip(batch.block_ids, batch.seq_lens)):  # rows: checked
            if len(ids) * bs < s + grow:
                raise ValueError(
                    f"request {i}: block_ids has {len(ids)} blocks, too few for num_draft_tokens="
                    f"{self.k} after seq_len {s}: the draft loop reaches seq_len {s + grow}, "
                    f"which needs ceil({s + grow} / block_size={bs}) = {-(-(s + grow) // bs)}; "
                    "give the request blocks for its draft tokens before propose")
