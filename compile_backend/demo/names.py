"""The demo's choices by name, without torch: the command line lists them in
`mrv2 --help` without importing torch (under a second). The modules that
build from them (models/, run.py) check that they hold the same names."""

MODEL_NAMES = ("hybrid", "llama")
PRESET_NAMES = ("bench", "deep", "llama8b", "small", "tiny")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
