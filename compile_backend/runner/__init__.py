"""The capture runner: persistent step inputs, metadata builders, capture
plans and dispatch, and the speculative-decoding draft loop."""
