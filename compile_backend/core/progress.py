"""Progress on waits a person would notice: compiling, capturing, a first
`generate`. Nothing is printed for work that ends within `delay` seconds
(default 3), so quick runs and tests stay quiet.

    with progress("capturing CUDA graphs", total=len(plan)) as bar:
        for step in plan:
            ...
            bar.update(note=f"{step.num_tokens} tokens")

On a terminal this is a tqdm bar on stderr; elsewhere (logs, CI) tqdm writes
plain lines. `MRV2_PROGRESS=0` turns it off; `MRV2_PROGRESS=1` shows it even
for short waits. Torch-free.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class Progress:
    """A tqdm bar that appears only after `delay` seconds (tqdm's own delay)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "step",
                 delay: float = 3.0, enabled: bool | None = None) -> None:
        env = os.environ.get("MRV2_PROGRESS", "").strip()
        if enabled is None:
            enabled = env != "0"
        if env == "1":
            delay = 0.0
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"mrv2: {desc}", unit=unit, delay=delay,
                             file=sys.stderr, leave=False, dynamic_ncols=True,
                             mininterval=0.5)

    def update(self, n: int = 1, note: str | None = None) -> None:
        if self._bar is None:
            return
        if note is not None:
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(desc: str, total: int | None = None, unit: str = "step", delay: float = 3.0,
             enabled: bool | None = None) -> Progress:
    """A progress bar for one wait (see the module docstring)."""
    return Progress(desc, total=total, unit=unit, delay=delay, enabled=enabled)
