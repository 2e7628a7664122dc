"""The shared vocabulary at the bottom: the op registry, graph modes, the
step graph (which graph a step runs in) and the rules that plan and pick
graphs, the compilation config, counters, the forward context, the
direct-call registry, symbolic token counts, progress on long waits. `compile_backend/passes/` and `compile_backend/kernels/` import
only from here; this package imports nothing above it."""
