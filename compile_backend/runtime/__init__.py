"""The graph runtime: the CUDA-graph wrapper (capture, replay, lazy capture)
and its CPU stand-in."""
