"""Progress on waits a person would notice: compiling, capturing, a first
`generate`. Nothing is printed for work that ends within `delay` seconds
(default 3), so quick runs and tests stay quiet.

    with progress("capturing CUDA graphs", total=len(plan)) as bar:
        for graph in plan:
            ...
            bar.update(note=f"{graph.num_tokens} tokens")

A wait without steps (Dynamo tracing a model) shows its line too: once `delay`
has passed a timer draws it, every half second on a terminal (so the elapsed
time moves) and once more at the end in a log. On a terminal this is a tqdm
bar on stderr; elsewhere (logs, CI) tqdm writes plain lines. `MRV2_PROGRESS=0`
turns it off; `MRV2_PROGRESS=1` shows it even for short waits. Torch-free.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any


class Progress:
    """A tqdm bar that appears only after `delay` seconds."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "step",
                 delay: float = 3.0, enabled: bool | None = None) -> None:
        env = os.environ.get("MRV2_PROGRESS", "").strip()
        if enabled is None:
            enabled = env != "0"
        if env == "1":
            delay = 0.0
        self._bar: Any = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._timer: threading.Timer | None = None
        if not enabled:
            return
        from tqdm import tqdm

        tty = getattr(sys.stderr, "isatty", lambda: False)()
        # A wait without steps shows its elapsed time; a log keeps the last line.
        fmt = "{desc}: {elapsed}" if total is None else None
        self._bar = tqdm(total=total, desc=f"mrv2: {desc}", unit=unit, delay=delay,
                         file=sys.stderr, leave=not tty, dynamic_ncols=True, mininterval=0.5,
                         bar_format=fmt)
        if delay > 0:  # a wait that never calls update still shows once delay passed
            self._timer = threading.Timer(delay, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        while True:
            with self._lock:
                if self._closed.is_set() or self._bar is None:
                    return
                self._bar.refresh()
            if not tty or self._closed.wait(0.5):
                return

    def update(self, n: int = 1, note: str | None = None) -> None:
        if self._bar is None:
            return
        with self._lock:
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
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
