"""One step's batch: requests, their new tokens and their context lengths.

Host-side lists describe the real requests; `pad_to(graph)` records the
graph the batch runs in and its padded sizes. Padding requests own zero
tokens; padding tokens belong to no request (slot -1, position 0, token 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.kv_cache_config import KVCacheConfig


@dataclass
class InputBatch:
    token_ids: list[int]  # [T] real tokens, request by request
    query_lens: list[int]  # [B] new tokens per request
    seq_lens: list[int]  # [B] context length after this step (incl. new tokens)
    req_slots: list[int]  # [B] the request's state slot (sconv/compressor state, block-table row)
    is_dummy: bool = False
    # The graph this batch runs in (or is captured for), with its padded
    # sizes: set once, by pad_to, from the runner's dispatch or capture plan.
    graph: StepGraph | None = None
    block_ids: list[list[int]] = field(default_factory=list)  # [B][blocks] KV blocks
    compressed_block_ids: list[list[int]] = field(default_factory=list)  # compressor cache

    def __post_init__(self) -> None:
        if not len(self.query_lens) == len(self.seq_lens) == len(self.req_slots):
            raise ValueError(
                f"query_lens, seq_lens and req_slots need one entry per request, got "
                f"{len(self.query_lens)}, {len(self.seq_lens)} and {len(self.req_slots)}")
        if sum(self.query_lens) != len(self.token_ids):
            raise ValueError(
                f"token_ids has {len(self.token_ids)} tokens but query_lens adds up to "
                f"{sum(self.query_lens)}; give every request's new tokens, request by request")
        if self.query_lens and (min(self.query_lens) < 0 or not all(
                q <= s for q, s in zip(self.query_lens, self.seq_lens))):
            i, q, s = next((i, q, s) for i, (q, s) in enumerate(zip(self.query_lens, self.seq_lens))
                           if not 0 <= q <= s)
            raise ValueError(
                f"request {i}: query_len {q} with seq_len {s}; valid: 0 <= query_len <= seq_len "
                "(seq_len counts the cached tokens and this step's)")

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_padded(self) -> int:
        """T' >= T: the padded token count (T before pad_to)."""
        return self.graph.num_tokens if self.graph is not None else self.num_tokens

    @property
    def num_reqs_padded(self) -> int:
        """B' >= B: the padded request count (B before pad_to)."""
        return self.graph.num_reqs if self.graph is not None else self.num_reqs

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def uniform_decode(self) -> bool:
        return self.num_reqs > 0 and all(q == 1 for q in self.query_lens)

    def check_against(self, cfg: KVCacheConfig, *, vocab_size: int | None = None,
                      vocab_source: str = "vocab_size") -> None:
        """Raise ValueError, naming the request, the field, the value and the
        valid range, for sizes and ids the cache layout or the model cannot
        take: a bad req_slot would fail deep inside an op (or, negative, be
        taken for a padding row and skip its state), a seq_len past
        max_model_len would outgrow the block table, a token id outside
        [0, vocab_size) indexes outside the embedding (Inductor's kernel aborts
        the process), and a request without a block row on a model whose
        layers read that table (cfg.groups_reading) would run on the null
        block, silently (its KV not written, block 0 read as its context).
        vocab_size None: token ids are not checked. Block ids are checked
        where they are written (BlockTables.write), row by row as rows change.

        On the per-step host path: the good path is a few min/max over the
        lists; only a failure scans request by request to name the culprit.
        Dummy batches (capture, engines' padding steps) use slot -1.
        """
        B = self.num_reqs
        if self.num_tokens > cfg.max_num_tokens:
            raise ValueError(
                f"batch has {self.num_tokens} tokens, more than max_num_tokens="
                f"{cfg.max_num_tokens}; split it or raise max_num_tokens")
        if B > cfg.max_num_reqs:
            raise ValueError(
                f"batch has {B} requests, more than max_num_reqs={cfg.max_num_reqs}; "
                "split it or raise max_num_reqs")
        if B == 0:
            return
        low = -1 if self.is_dummy else 0
        slots = self.req_slots
        if (min(slots) < low or max(slots) >= cfg.max_num_reqs
                or max(self.seq_lens) > cfg.max_model_len):
            raise ValueError(self._first_out_of_range(cfg, low))
        if not self.is_dummy and len(set(slots)) != B:
            i = next(i for i, s in enumerate(slots) if s in slots[:i])
            raise ValueError(
                f"request {i}: req_slot {slots[i]} is also request {slots.index(slots[i])}'s; "
                "each request needs its own slot (two on one slot would share one state)")
        ids = self.token_ids
        if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(self._first_bad_token(vocab_size, vocab_source))
        for name in ("block_ids", "compressed_block_ids"):
            rows = len(getattr(self, name))
            if rows != B:
                readers = cfg.groups_reading(name)
                if rows or readers:
                    raise ValueError(self._missing_rows(cfg, name, rows, readers))

    def _first_bad_token(self, vocab_size: int, source: str) -> str:
        """The error for the first token id outside [0, vocab_size)."""
        start = 0
        for i, q in enumerate(self.query_lens):
            for j, t in enumerate(self.token_ids[start: start + q]):
                if not 0 <= t < vocab_size:
                    return (f"request {i}: token_ids[{start + j}] = {t} (its new token {j}) is "
                            f"not in the model's vocabulary; valid: 0 <= token id < vocab_size="
                            f"{vocab_size} ({source}). Give ids of the model's own tokenizer "
                            "(the runner pads batches itself)")
            start += q
        raise AssertionError(self.token_ids)

    def _missing_rows(self, cfg: KVCacheConfig, name: str, rows: int, readers: list) -> str:
        """The error for `name` (block_ids, compressed_block_ids) with `rows`
        rows for a batch of another request count; `readers`: the
        KVCacheGroups whose layers read that table."""
        B = self.num_reqs
        counts = f"{name} has {rows} rows for {B} requests"
        if rows > B:
            return (f"{counts}; give one row per request"
                    + ("" if readers else " (or none: no layer of this model reads them)"))
        head = f"request {rows}: no {name} row ({counts})"
        if not readers:
            return f"{head}; give one row per request, or none (no layer of this model reads them)"
        bs = cfg.block_size
        cache, blocks = (("the KV cache", f"ceil(seq_len / block_size={bs})")
                         if name == "block_ids" else
                         ("the compressed cache", f"ceil(ceil(seq_len / compress_ratio="
                                                  f"{cfg.compress_ratio}) / block_size={bs})"))
        kinds = ", ".join(repr(g.kind) for g in readers)
        layers = [n for g in readers for n in g.layer_names]
        shown = ", ".join(layers[:2]) + (f", ... ({len(layers)} layers)" if len(layers) > 2 else "")
        return (f"{head}; the model's {kinds} layers ({shown}) read {cache} through it. Give one "
                f"row per request: its blocks, {blocks} of them")

    def _first_out_of_range(self, cfg: KVCacheConfig, low: int) -> str:
        """The error for the first request whose slot or seq_len is out of range."""
        for i, (slot, s) in enumerate(zip(self.req_slots, self.seq_lens)):
            if not low <= slot < cfg.max_num_reqs:
                return (f"request {i}: req_slot {slot} is out of range; valid: {low} <= req_slot "
                        f"< max_num_reqs={cfg.max_num_reqs}"
                        + ("" if low else " (-1 marks padding rows, which the runner adds itself)"))
            if s > cfg.max_model_len:
                return (f"request {i}: seq_len {s} is more than max_model_len={cfg.max_model_len}; "
                        "valid: query_len <= seq_len <= max_model_len (raise max_model_len or "
                        "finish the request)")
        raise AssertionError((self.req_slots, self.seq_lens))

    def positions(self) -> list[int]:
        """[T] absolute position of every real token."""
        out: list[int] = []
        for q, s in zip(self.query_lens, self.seq_lens):
            if q == 1:  # decode, the common case: no range object
                out.append(s - 1)
            else:
                out.extend(range(s - q, s))
        return out

    def pad_to(self, graph: StepGraph) -> "InputBatch":
        """Run this batch in `graph`, padded to its sizes."""
        assert graph.num_tokens >= self.num_tokens and graph.num_reqs >= self.num_reqs, (
            graph, self.num_tokens, self.num_reqs)
        assert not graph.uniform_decode or self.uniform_decode or self.num_reqs == 0, (
            graph, self.query_lens)
        self.graph = graph
        return self

    @classmethod
    def make_dummy(
        cls, num_reqs: int, num_tokens: int, max_model_len: int, block_size: int = 16
    ) -> "InputBatch":
        """The batch a graph is captured with (docs/design.md, "Metadata builders").

        Tokens are spread evenly: no request gets more than
        ceil(num_tokens / num_reqs) tokens, nor more than max_model_len (the
        upstream bug: the last request took all the remainder, e.g. 241 of
        496 tokens for 256 requests, past a max_model_len of 128). Every
        request uses the null block 0 and state slot -1, so capture reads and
        writes no real request's cache or state.
        """
        if num_reqs <= 0 or num_tokens < num_reqs:
            raise ValueError(
                f"a dummy batch needs 1 <= num_reqs <= num_tokens, got "
                f"num_reqs={num_reqs}, num_tokens={num_tokens}"
            )
        per_req = math.ceil(num_tokens / num_reqs)
        if per_req > max_model_len:
            raise ValueError(
                f"{num_tokens} tokens over {num_reqs} requests need {per_req} tokens per "
                f"request, more than max_model_len={max_model_len}; capture fewer tokens "
                "or allow more requests (max_num_reqs)"
            )
        base, extra = divmod(num_tokens, num_reqs)
        query_lens = [base + (1 if i < extra else 0) for i in range(num_reqs)]
        blocks = math.ceil(max(query_lens) / block_size)
        return cls(
            token_ids=[0] * num_tokens,
            query_lens=query_lens,
            seq_lens=list(query_lens),
            req_slots=[-1] * num_reqs,
            is_dummy=True,
            block_ids=[[0] * blocks for _ in range(num_reqs)],
            compressed_block_ids=[[0] for _ in range(num_reqs)],
        )
