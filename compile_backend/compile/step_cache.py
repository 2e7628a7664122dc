"""The warm-start cache: saved compiled steps, one file per entry.

    <cache_dir>/steps/<key>.mrv2           pickle {"header": {...}, "aot": bytes, "direct": {...}}
    <cache_dir>/steps/<key>.kernels.json   a plan's Triton kernels (runtime/kernel_precompile.py)
    <cache_dir>/steps/<key>.gemms.json     its first step's GEMMs (runtime/gemm_warmup.py)

The key hashes everything the saved step depends on (`entry_header`): the
model's code and its parameters' names, shapes and dtypes; the inputs' dtypes
and ranks; the config (not the capture sizes: `NOT_IN_KEY`); mrv2's own source; torch, Triton, Python and CUDA
versions; the GPU. The header is stored in the entry and compared on load:
an entry that does not match is refused, never used. Writes go to a
temporary file in the same folder, then `os.replace`: a reader sees a whole
entry or none. `mrv2 cache ls|clear` (compile_backend/demo/cli.py) lists and
clears entries. docs/design.md, section "Start in seconds" (a saved step).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import pickle
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

SUFFIX = ".mrv2"
KERNELS_SUFFIX = ".kernels.json"
GEMMS_SUFFIX = ".gemms.json"


# Options a saved step does not depend on, left out of its key: where things
# go and how the compile is spread (not what runs), and the runner's plan
# (which sizes it captures, and when it warms up: the step is traced with a
# symbolic token count, so a runner of other sizes loads the same entry). A
# loaded step takes this runner's values of them (guard_free._adopt).
NOT_IN_KEY = ("cache_dir", "debug_dump_path", "precompile_threads", "precompile_workers",
              "compile_workers", "warm_gemms", "capture_sizes", "capture_warmup",
              "derive_mixed_graphs", "scout_sizes_first")


def steps_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "steps")


@functools.lru_cache(maxsize=1)
def _own_source_hash() -> str:
    """sha256 over mrv2's own Python files (the package, its kernels and
    passes included): a change to the backend's code is a change to what it
    compiles."""
    import compile_backend

    h = hashlib.sha256()
    root = os.path.dirname(compile_backend.__file__)
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:24]


def _model_code(model: torch.nn.Module) -> dict[str, str] | None:
    """Source hash per module class in `model` (None: some source is not
    available, so the code cannot be told apart: no cache)."""
    out = {}
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch.") or klass is object:
                continue  # torch's own classes: covered by torch's version
            name = f"{klass.__module__}.{klass.__qualname__}"
            if name in out:
                continue
            try:
                src = inspect.getsource(klass)
            except (OSError, TypeError):
                return None
            out[name] = hashlib.sha256(src.encode()).hexdigest()[:16]
    return out


def _device() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{p.name} sm{p.major}{p.minor}"
    return "cpu"


def inputs_key(args: Sequence[Any]) -> list:
    """What an entry depends on of the call's inputs: each tensor's dtype and
    rank (sizes are symbolic), anything else's repr."""
    return [(str(a.dtype), a.dim()) if isinstance(a, torch.Tensor) else repr(a) for a in args]


def entry_header(model: torch.nn.Module, config: Any, args: Sequence[Any]) -> tuple[dict, str | None]:
    """(what a saved step depends on, why it cannot be cached or None)."""
    code = _model_code(model)
    if code is None:
        return {}, "the model's source is not available (inspect.getsource fails)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    options = config.summary()
    for name in NOT_IN_KEY:
        options.pop(name, None)
    header = {
        "format": 1,
        "mrv2": _own_source_hash(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model": code,
        # Everything the guards on them checked (guard_free.guard_filter drops those).
        "state": [(n, list(t.shape), list(t.stride()), str(t.dtype), str(t.device),
                   t.requires_grad)
                  for n, t in [*model.named_parameters(), *model.named_buffers()]],
        "inputs": inputs_key(args),
        "config": options,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": list(sys.version_info[:2]),
        "cuda": torch.version.cuda,
        "device": _device(),
        "interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    return header, None


def entry_key(header: dict) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()[:24]


def entry_path(cache_dir: str, header: dict) -> str:
    return os.path.join(steps_dir(cache_dir), entry_key(header) + SUFFIX)


def read_entry(path: str, header: dict) -> dict[str, Any]:
    """The entry at `path` for `header`: "aot" (Dynamo's saved function
    around the step) and, where one was written, "direct" (the step's own
    bytes and how to call it without Dynamo: compile/direct_step.py). Raises
    (with the reason) when the entry is corrupt or was saved for something
    else."""
    with open(path, "rb") as f:
        try:
            entry = pickle.load(f)
        except Exception as e:
            raise RuntimeError(f"corrupt entry ({type(e).__name__}: {e})") from None
    if not isinstance(entry, dict) or "aot" not in entry or "header" not in entry:
        raise RuntimeError("corrupt entry (not an mrv2 step)")
    if entry["header"] != header:
        changed = sorted(k for k in set(entry["header"]) | set(header)
                         if entry["header"].get(k) != header.get(k))
        raise RuntimeError(f"stale entry (saved for another {', '.join(changed)})")
    direct = entry.get("direct")
    if direct is not None and not (isinstance(direct, dict) and isinstance(direct.get("step"), bytes)
                                   and isinstance(direct.get("plan"), dict)):
        raise RuntimeError("corrupt entry (its direct part is not a step and a plan)")
    return entry


def _write_atomic(path: str, suffix: str, data: bytes) -> None:
    """A temporary file in the same folder, synced, then os.replace: a
    reader sees the whole file or none."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_entry(path: str, header: dict, aot: bytes, direct: dict | None = None) -> None:
    """Atomic (_write_atomic). `direct`: {"step": the step's bytes, "plan":
    direct_step.plan_for's plan}, or None where the step needs Dynamo's code."""
    entry = {"header": header, "aot": aot, "saved": time.time()}
    if direct is not None:
        entry["direct"] = direct
    _write_atomic(path, SUFFIX, pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))


def _side_path(entry: str, suffix: str) -> str:
    """Where a list saved beside the entry at `entry` lives."""
    return entry[: -len(SUFFIX)] + suffix if entry.endswith(SUFFIX) else entry + suffix


def kernels_path(entry: str) -> str:
    """Where the kernel list of the entry at `entry` lives."""
    return _side_path(entry, KERNELS_SUFFIX)


def _read_side(entry: str, suffix: str, field: str) -> list:
    """The list `field` of a file beside an entry; [] when there is none or
    it cannot be read (what it lists is then done at launch, as before)."""
    try:
        with open(_side_path(entry, suffix)) as f:
            data = json.load(f)
        items = data[field]
        return items if isinstance(items, list) else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def read_kernels(entry: str) -> list[tuple[str, str]]:
    """The (kernel, specialization) pairs saved beside an entry."""
    try:
        return [(str(name), str(spec)) for name, spec in _read_side(entry, KERNELS_SUFFIX, "kernels")]
    except (ValueError, TypeError):
        return []


def write_kernels(entry: str, kernels: list[tuple[str, str]]) -> None:
    """Atomic, as write_entry; a list already there is merged (a runner of
    other sizes adds its kernels)."""
    merged = sorted(set(read_kernels(entry)) | set(kernels))
    _write_atomic(kernels_path(entry), KERNELS_SUFFIX,
                  json.dumps({"format": 1, "kernels": merged}).encode())


def read_gemms(entry: str) -> list[dict[str, Any]]:
    """The GEMM problems saved beside an entry, as saved (runtime/gemm_warmup.loads)."""
    return [d for d in _read_side(entry, GEMMS_SUFFIX, "gemms") if isinstance(d, dict)]


def write_gemms(entry: str, gemms: list[dict[str, Any]]) -> None:
    """Atomic, merged with a list already there, as write_kernels."""
    merged = {json.dumps(d, sort_keys=True): d for d in [*read_gemms(entry), *gemms]}
    _write_atomic(_side_path(entry, GEMMS_SUFFIX), GEMMS_SUFFIX,
                  json.dumps({"format": 1, "gemms": [merged[k] for k in sorted(merged)]}).encode())


def list_entries(cache_dir: str) -> list[dict[str, Any]]:
    """One row per entry: key, bytes, saved time, model classes, mode,
    device, torch, and whether it loads without Dynamo (`direct`)."""
    folder = steps_dir(cache_dir)
    rows = []
    if not os.path.isdir(folder):
        return rows
    for name in sorted(os.listdir(folder)):
        if not name.endswith(SUFFIX) or name.startswith(".tmp-"):
            continue
        path = os.path.join(folder, name)
        row: dict[str, Any] = {"key": name[: -len(SUFFIX)], "bytes": os.path.getsize(path)}
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            header = entry["header"]
            row.update(saved=entry.get("saved"), model=header["model_class"],
                       mode=header["config"].get("cudagraph_mode"), device=header["device"],
                       torch=header["torch"], direct=entry.get("direct") is not None)
        except Exception as e:  # listed as unreadable; `clear` removes it
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def clear_entries(cache_dir: str) -> int:
    """Remove every entry (and leftover temporary files); returns how many."""
    folder = steps_dir(cache_dir)
    if not os.path.isdir(folder):
        return 0
    n = 0
    for name in os.listdir(folder):
        if name.endswith(SUFFIX):
            os.unlink(os.path.join(folder, name))
            n += not name.startswith(".tmp-")
        elif name.endswith((KERNELS_SUFFIX, GEMMS_SUFFIX)):  # an entry's lists go with it
            os.unlink(os.path.join(folder, name))
    return n
