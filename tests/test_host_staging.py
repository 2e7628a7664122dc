"""Host staging of step inputs (compile_backend/host_staging.py) and what the
persistent buffers hold after a write, against a plain-list reference."""

import random

import pytest
import torch

from compile_backend.block_tables import BlockTables
from compile_backend.config import CUDAGraphMode
from compile_backend.host_staging import HostStaging, host_array
from compile_backend.input_batch import InputBatch
from compile_backend.input_buffers import InputBuffers
from compile_backend.model_state import ModelState, attention_groups_for
from runtime_helpers import kv_config

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_batch(rng: random.Random, cfg, num_reqs: int) -> InputBatch:
    qlens = [rng.choice([1, 1, rng.randint(1, 9)]) for _ in range(num_reqs)]
    seqs = [q + rng.randint(0, cfg.max_model_len - q) for q in qlens]
    blocks = [[rng.randint(1, cfg.num_blocks - 1) for _ in range(-(-s // cfg.block_size))]
              for s in seqs]
    cblocks = [[rng.randint(1, cfg.num_blocks - 1)] for _ in seqs]
    return InputBatch(token_ids=[rng.randint(0, 255) for _ in range(sum(qlens))],
                      query_lens=qlens, seq_lens=seqs, req_slots=rng.sample(range(8), num_reqs),
                      block_ids=blocks, compressed_block_ids=cblocks)


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_hold_random_batches_written_back_to_back(device):
    """Several steps written without a synchronize in between: each read sees
    its own step (the staging event keeps a twin from being overwritten while
    its copy is queued)."""
    cfg = kv_config(max_num_reqs=8, max_num_tokens=64, max_model_len=64)
    bufs, tables = InputBuffers.allocate(cfg, device), BlockTables(cfg, device)
    rng = random.Random(0)
    for _ in range(20):
        b = random_batch(rng, cfg, rng.randint(1, 6))
        T = b.num_tokens + rng.randint(0, 64 - b.num_tokens)
        b.pad_to(T, rng.randint(b.num_reqs, 8))
        bufs.write(b)
        slots = tables.write(b)
        B, pad_t, pad_b = b.num_reqs_padded, T - b.num_tokens, b.num_reqs_padded - b.num_reqs
        qsl = [0]
        for q in b.query_lens:
            qsl.append(qsl[-1] + q)
        assert bufs.input_ids[:T].tolist() == b.token_ids + [0] * pad_t
        assert bufs.positions[:T].tolist() == b.positions() + [0] * pad_t
        assert bufs.query_start_loc[: B + 1].tolist() == qsl + [qsl[-1]] * pad_b
        assert bufs.seq_lens[:B].tolist() == b.seq_lens + [0] * pad_b
        assert bufs.state_indices[:B].tolist() == b.req_slots + [-1] * pad_b
        assert bufs.has_initial_state[:B].tolist() == (
            [q < s for q, s in zip(b.query_lens, b.seq_lens)] + [False] * pad_b)
        width = tables.block_table.shape[1]
        want = [r + [0] * (width - len(r)) for r in b.block_ids] + [[0] * width] * pad_b
        assert tables.block_table[:B].tolist() == want
        want_slots = [ids[p // cfg.block_size] * cfg.block_size + p % cfg.block_size
                      for ids, q, s in zip(b.block_ids, b.query_lens, b.seq_lens)
                      for p in range(s - q, s)]
        assert slots.tolist() == want_slots + [-1] * pad_t


def test_too_many_blocks_for_the_table_raise_and_write_nothing():
    cfg = kv_config(max_model_len=32)  # 2 blocks of 16 per request
    tables = BlockTables(cfg, "cpu")
    before = tables.block_table.clone()
    b = InputBatch([1], [1], [48], [0], block_ids=[[1, 2, 3]], compressed_block_ids=[[1]])
    with pytest.raises(ValueError, match="more than the block table's 2.*raise max_model_len"):
        tables.write(b)
    assert torch.equal(tables.block_table, before)


def test_staging_gives_a_replaced_buffer_its_own_twin():
    st = HostStaging("cpu")
    a = st.register(torch.zeros(4, dtype=torch.int32))
    b = torch.full((6,), 7, dtype=torch.int32)  # never registered
    with st.write():
        st.put(a, [1, 2, 3])
        st.put(b, host_array(torch.int32) + host_array(torch.int32))  # empty: no-op
        st.put(b, [5, 6])
    assert a.tolist() == [1, 2, 3, 0] and b.tolist() == [5, 6, 7, 7, 7, 7]


def test_serving_builds_stop_being_logged_but_capture_builds_do_not():
    cfg = kv_config()
    bufs, tables = InputBuffers.allocate(cfg, "cpu"), BlockTables(cfg, "cpu")

    class Layer(torch.nn.Module):
        metadata_kind, layer_name = "attention", "layer0"

    state = ModelState(attention_groups_for(Layer(), cfg, bufs, tables))
    state.MAX_LOGGED_SERVING_BUILDS = 3
    serve = InputBatch([1], [1], [5], [0], block_ids=[[1]], compressed_block_ids=[[1]])
    dummy = InputBatch.make_dummy(1, 1, cfg.max_model_len)
    for batch in [serve] * 5 + [dummy]:
        bufs.write(batch)
        slots = tables.write(batch)
        meta = state.prepare_attn(batch, CUDAGraphMode.NONE, tables, slots, state.attn_groups,
                                  cfg, for_capture=False)
        assert meta["layer0"].seq_lens.tolist() == batch.seq_lens  # built whether logged or not
    assert [b["dummy"] for b in state.build_log] == [False] * 3 + [True]
