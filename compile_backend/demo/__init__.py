"""The demo: a small continuous-batching engine, the reference models and
the `mrv2` command line."""
