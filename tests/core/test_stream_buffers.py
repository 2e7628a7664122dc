"""compile_backend/core/stream_buffers.py: per-(device, stream) buffers made
zeroed on first use, the same tensor afterwards, never made inside a capture."""

import torch

from compile_backend.core import stream_buffers


def test_a_declared_buffer_is_made_zeroed_once_and_kept(monkeypatch):
    monkeypatch.setattr(stream_buffers, "_buffers", {})
    stream_buffers.declare("test.counters", 5, torch.int32)
    buf = stream_buffers.buffer("test.counters", torch.device("cpu"))
    assert buf.shape == (5,) and buf.dtype == torch.int32 and int(buf.abs().sum()) == 0
    buf[2] = 7  # a kernel's state between launches: the same tensor comes back
    assert stream_buffers.buffer("test.counters", torch.device("cpu")) is buf


def test_warming_makes_every_declared_buffer_and_a_capture_makes_none(monkeypatch):
    monkeypatch.setattr(stream_buffers, "_buffers", {})
    monkeypatch.setattr(stream_buffers, "_declared", {})
    stream_buffers.declare("test.a", 3, torch.int32)
    stream_buffers.declare("test.b", 4, torch.float32)
    stream_buffers.warm_stream_buffers(torch.device("cpu"))
    assert sorted(name for name, _, _ in stream_buffers._buffers) == ["test.a", "test.b"]
    # inside a capture on a CUDA stream without the buffer: None, nothing recorded
    monkeypatch.setattr(stream_buffers, "_stream_key", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert stream_buffers.buffer("test.a", torch.device("cuda", 0)) is None
    assert len(stream_buffers._buffers) == 2
