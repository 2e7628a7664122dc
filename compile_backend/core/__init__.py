"""The shared vocabulary at the bottom: op roles, graph modes and the
compilation config, counters, the forward context, batch descriptors, the
direct-call registry, symbolic token counts. `passes/` and `kernels/` import
only from here; this package imports nothing above it."""
