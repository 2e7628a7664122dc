"""Worked examples of the extension points (each module is imported and run
by the tests)."""
