"""One step's batch: requests, their new tokens and their context lengths.

Host-side lists describe the real requests; `pad_to(num_tokens, num_reqs)`
records the padded sizes a graph was captured for. Padding requests own zero
tokens; padding tokens belong to no request (slot -1, position 0, token 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class InputBatch:
    token_ids: list[int]  # [T] real tokens, request by request
    query_lens: list[int]  # [B] new tokens per request
    seq_lens: list[int]  # [B] context length after this step (incl. new tokens)
    req_slots: list[int]  # [B] the request's state slot (sconv/compressor state, block-table row)
    num_tokens_padded: int = 0  # T' >= T (0: not padded yet)
    num_reqs_padded: int = 0  # B' >= B
    is_dummy: bool = False
    # Set by whoever picks the graph: True when it runs in (or is captured as) a
    # uniform-decode graph, False for a mixed-batch graph, None without one.
    # A dummy batch of T tokens over T requests looks like decode either way.
    uniform_decode_graph: bool | None = None
    block_ids: list[list[int]] = field(default_factory=list)  # [B][blocks] KV blocks
    compressed_block_ids: list[list[int]] = field(default_factory=list)  # compressor cache

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.seq_lens) == len(self.req_slots), (
            len(self.query_lens), len(self.seq_lens), len(self.req_slots))
        assert sum(self.query_lens) == len(self.token_ids), (sum(self.query_lens), len(self.token_ids))
        assert all(q <= s for q, s in zip(self.query_lens, self.seq_lens)), (
            self.query_lens, self.seq_lens)
        self.num_tokens_padded = max(self.num_tokens_padded, self.num_tokens)
        self.num_reqs_padded = max(self.num_reqs_padded, self.num_reqs)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def uniform_decode(self) -> bool:
        return self.num_reqs > 0 and all(q == 1 for q in self.query_lens)

    def positions(self) -> list[int]:
        """[T] absolute position of every real token."""
        out: list[int] = []
        for q, s in zip(self.query_lens, self.seq_lens):
            if q == 1:  # decode, the common case: no range object
                out.append(s - 1)
            else:
                out.extend(range(s - q, s))
        return out

    def pad_to(self, num_tokens: int, num_reqs: int,
               uniform_decode_graph: bool | None = None) -> "InputBatch":
        assert num_tokens >= self.num_tokens and num_reqs >= self.num_reqs, (
            num_tokens, self.num_tokens, num_reqs, self.num_reqs)
        self.num_tokens_padded, self.num_reqs_padded = num_tokens, num_reqs
        self.uniform_decode_graph = uniform_decode_graph
        return self

    @classmethod
    def make_dummy(
        cls, num_reqs: int, num_tokens: int, max_model_len: int, block_size: int = 16
    ) -> "InputBatch":
        """The batch a graph is captured with (DESIGN.md, "The metadata contract").

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
