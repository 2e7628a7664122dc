"""Reference models: a Llama-like decoder and a hybrid decoder (attention,
short convolution, KV compressor), built from `ModelConfig` with seeded
random weights. `build_model(name, config, tp_size=None)` is the one entry
point; `preset(name, **changes)` gives a config:

    model = build_model("llama", preset("tiny", dtype=torch.bfloat16))
"""

from compile_backend.demo.names import MODEL_NAMES, PRESET_NAMES

from .config import PRESETS, ModelConfig, preset
from .hybrid import HybridDecoder
from .llama import LlamaDecoder

MODELS = {"llama": LlamaDecoder, "hybrid": HybridDecoder}
assert sorted(MODELS) == list(MODEL_NAMES) and sorted(PRESETS) == list(PRESET_NAMES)


def build_model(name: str, config: ModelConfig, tp_size: int | None = None):
    """`tp_size`: tensor-parallel ranks (None: the process group's size, 1
    without one; 1: the whole model in this process)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](config, tp_size)


__all__ = ["PRESETS", "ModelConfig", "preset", "HybridDecoder", "LlamaDecoder", "MODELS", "build_model"]
