"""Whether a path can hold a debug dump, checked before anything is written
(the config checks it when it is built, before anything compiles)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class DumpPathError(ValueError):
    """A dump path that cannot hold a dump; the message says why and what to do."""


def check_dump_path(path: str | os.PathLike) -> Path:
    """Refuse, before creating anything, a path that is a file or whose
    nearest existing ancestor is not a writable folder."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        if not p.is_dir():
            raise DumpPathError(f"dump path {str(p)!r} is an existing file; give a folder path")
        _probe(p, f"dump folder {str(p)!r} is not writable")
        return p
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DumpPathError(f"cannot create dump folder {str(p)!r}: {str(parent)!r} is a file")
    _probe(parent, f"cannot create dump folder {str(p)!r}: {str(parent)!r} is not writable")
    return p


def _probe(folder: Path, message: str) -> None:
    """Create and remove a hidden folder: os.access says yes to root even
    where the file system says no (/proc, read-only mounts)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mrv2-probe.", dir=folder))
    except OSError as e:
        raise DumpPathError(f"{message} ({e.strerror})") from None
