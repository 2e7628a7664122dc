"""A Hugging Face Llama (small config, random weights, no download) through
`torch.compile(backend="mrv2")`: same logits as eager, and with SDPA as the
breakpoint the dump shows one eager piece per layer."""

import pytest
import torch

from compile_backend.debug.dump import read_manifest

transformers = pytest.importorskip("transformers")

SDPA = "aten::scaled_dot_product_attention"


def _tiny_llama(layers):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_hf_llama_matches_eager_with_one_eager_piece_per_layer(tmp_path):
    layers = 3
    model = _tiny_llama(layers)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    dump = tmp_path / "dump"
    compiled = torch.compile(model, backend="mrv2", options={
        "piece_compiler": "eager", "cudagraph_mode": "none", "debug_dump_path": str(dump)})
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits  # [1, 12, 128]
        got = compiled(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    pieces = [p for g in read_manifest(dump)["graphs"] for p in g["pieces"]]
    attention = [p for p in pieces if p["breakpoints"]]
    assert len(attention) == layers
    assert all(p["breakpoints"] == [SDPA] and not p["captured"] for p in attention)
    # nothing else falls back: transformers' torch._C._log_api_usage_once in
    # forward is host-only bookkeeping, which the capture-safety pass lets through
    assert [p for p in pieces if not p["captured"]] == attention
