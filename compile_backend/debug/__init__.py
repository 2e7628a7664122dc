"""Debugging: the debug dump (manifest, graphs, depyf) and `mrv2 inspect`."""
