"""Host staging of step inputs (compile_backend/runner/host_staging.py) and what the
persistent buffers hold after a write, against a plain-list reference."""

import random

import pytest
import torch

from compile_backend.runner.block_tables import BlockTables
from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.host_staging import Field, HostStaging, host_array
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.input_buffers import InputBuffers
from compile_backend.runner.model_state import ModelState, attention_groups_for
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
        b.pad_to(StepGraph.eager(T, rng.randint(b.num_reqs, 8)))
        bufs.write(b)
        slots = tables.write(b)
        B, pad_t, pad_b = b.num_reqs_padded, T - b.num_tokens, b.num_reqs_padded - b.num_reqs
        qsl = [0]
        for q in b.query_lens:
            qsl.append(qsl[-1] + q)
        assert bufs.input_ids[:T].tolist() == b.token_ids + [0] * pad_t
        positions = [p for q, s in zip(b.query_lens, b.seq_lens) for p in range(s - q, s)]
        assert bufs.positions[:T].tolist() == positions + [0] * pad_t
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


def test_arena_fields_are_aligned_typed_views_and_a_write_copies_up_to_its_bound():
    st = HostStaging("cpu", [Field("a", (3,), torch.int64, -1), Field("b", (2, 5), torch.int32, 7),
                             Field("c", (4,), torch.bool, 0)])
    a, b, c = st.views["a"], st.views["b"], st.views["c"]
    assert a.tolist() == [-1] * 3 and b.tolist() == [[7] * 5] * 2 and c.tolist() == [False] * 4
    assert all(v.data_ptr() % 16 == 0 for v in (a, b, c))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one arena
    with st.write():
        st.put("a", host_array(torch.int64, [4, 5]))
        st.put("b", host_array(torch.int32, [1, 2, 3]), start=4)  # flat offset: row 0 col 4 on
        st.put("c", host_array(torch.bool, [True, False, True]))
    assert a.tolist() == [4, 5, -1] and b.tolist() == [[7, 7, 7, 7, 1], [2, 3, 7, 7, 7]]
    assert c.tolist() == [True, False, True, False]
    with st.write(upto=st.end("b", 5)):  # only a and b's first row reach the device
        st.put("b", host_array(torch.int32, [0] * 10))
    assert b.tolist() == [[0] * 5, [2, 3, 7, 7, 7]]
    with pytest.raises(AssertionError):
        st.put("a", host_array(torch.int32, [1]))  # wrong element type


def test_block_rows_rewritten_only_where_they_changed_still_read_right():
    """Rows that shrink, grow, vanish (padding) or are mutated in place by the
    caller between steps: the table always equals a fresh zero-padded build."""
    cfg = kv_config(max_num_reqs=4, max_model_len=64)
    tables = BlockTables(cfg, "cpu")
    rows = [[5, 6, 7], [8], [9, 10]]
    steps = [rows, [[5, 6, 7, 11], [8], [9, 10]], [[12], [8, 13]], [[12], [8, 13], [1, 2, 3, 4]]]
    for i, block_ids in enumerate(steps):
        if i == 1:
            rows[0].append(11)  # in place: the same list object as step 0's
            block_ids = rows
        b = InputBatch([1] * len(block_ids), [1] * len(block_ids), [1] * len(block_ids),
                       list(range(len(block_ids))), block_ids=block_ids,
                       compressed_block_ids=[[1]] * len(block_ids)).pad_to(StepGraph.eager(4, 4))
        tables.write(b)
        want = [r + [0] * (4 - len(r)) for r in block_ids] + [[0] * 4] * (4 - len(block_ids))
        assert tables.block_table.tolist() == want, i


def test_serving_builds_stop_being_logged_but_capture_builds_do_not():
    cfg = kv_config()
    bufs, tables = InputBuffers.allocate(cfg, "cpu"), BlockTables(cfg, "cpu")

    class Layer(torch.nn.Module):
        metadata_kind, layer_name = "attention", "layer0"

    state = ModelState(cfg, bufs, tables, attention_groups_for(Layer(), cfg, bufs, tables))
    state.MAX_LOGGED_SERVING_BUILDS = 3
    serve = InputBatch([1], [1], [5], [0], block_ids=[[1]], compressed_block_ids=[[1]])
    dummy = InputBatch.make_dummy(1, 1, cfg.max_model_len)
    for batch in [serve] * 5 + [dummy]:
        state.write(batch.pad_to(StepGraph.eager(batch.num_tokens, batch.num_reqs)))
        meta = state.prepare_attn(batch)
        assert meta["layer0"].seq_lens.tolist() == batch.seq_lens  # built whether logged or not
    assert [b["dummy"] for b in state.build_log] == [False] * 3 + [True]
