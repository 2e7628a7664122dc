"""The debug switch of the kernels: index checks on CUDA tensors too
(Note [index checks] in compile_backend/kernels/_checks.py). Off by default: on CUDA each
check costs a device->host sync per launch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_debug_checks = False  # set_debug_checks; read through debug_checks_on()


def set_debug_checks(on: bool) -> bool:
    """Check index values on CUDA tensors too (Note [index checks]); returns
    the previous setting. Off by default: each check syncs with the device."""
    global _debug_checks
    if not isinstance(on, bool):
        raise ValueError(f"set_debug_checks: expected True or False, got {on!r}")
    previous, _debug_checks = _debug_checks, on
    return previous


@contextlib.contextmanager
def debug_checks(on: bool = True) -> Iterator[None]:
    """`with debug_checks():` index checks on CUDA too, restored on exit."""
    previous = set_debug_checks(on)
    try:
        yield
    finally:
        set_debug_checks(previous)


def debug_checks_on() -> bool:
    """Is the switch on? (Attention plans stand aside while it is: Note
    [attention plans] in compile_backend/kernels/attention_plan.py.)"""
    return _debug_checks


def index_checks_on(device: torch.device) -> bool:
    """Does `check_ids` run for index tensors on `device`? (Note [index checks])"""
    if device.type == "cpu":
        return True
    if not _debug_checks:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
