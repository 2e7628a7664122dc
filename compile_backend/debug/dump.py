"""The debug dump: what the backend did, as files a person can read.

    DIR/
      manifest.json              every field documented in docs/manifest.md
      graph_<k>/                 one folder per Dynamo graph (graph breaks give several)
        graph_before_passes.py, graph_after_passes.py, split_graph.py
        pieces/piece_<i>.py
      depyf/                     depyf's output, only inside `depyf_dump(DIR)`

The backend calls `write_compile_dump` once per Dynamo graph; the runtime
section comes from `update_manifest_runtime(DIR, runner)` (a runner's owner,
after capture and after serving) or, without a runner, at process exit.
Nothing is half-written, and a path that cannot hold a dump is refused before
anything is created (`check_dump_path`). Layout and fields: docs/manifest.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch

from compile_backend.core.counters import counters
from compile_backend.core.direct_calls import public_code
from compile_backend.core.dump_path import DumpPathError, check_dump_path  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DEFAULT_SVG = "step.svg"  # where `mrv2 inspect` draws the step unless told otherwise
SCHEMA_VERSION = 1
DEPYF_NOTE = (
    "depyf output needs `mrv2 demo --dump DIR` or a "
    "`with compile_backend.debug.dump.depyf_dump(DIR):` block around the compiled run"
)

# Paths this process has started a dump in (a path's first graph starts a new manifest).
_started: set[str] = set()
# Paths currently inside depyf_dump().
_depyf_active: set[str] = set()
# Plain use: per path, the `created` stamp of the manifest this process
# started there, and its compiled steps (weakly), for the runtime section
# written at exit (or by update_manifest_runtime without a runner).
_plain_runs: dict[str, tuple[str, list[Any]]] = {}
_exit_hook_registered = False


def reset_dump(path: str | os.PathLike) -> None:
    """Make the next write to `path` start a new manifest (a new run)."""
    _started.discard(str(Path(path).expanduser().absolute()))


def versions() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = "not installed"
    return {"torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def kernel_switches() -> dict[str, str | None]:
    """The kernels' environment switches (MRV2_PDL, ...) as this process sees
    them; None: unset."""
    from compile_backend.kernels import KERNEL_SWITCHES

    return {name: os.environ.get(name) for name in KERNEL_SWITCHES}


# ---- manifest file ---------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    with open(Path(path) / MANIFEST) as f:
        return json.load(f)


def _write_json_atomic(target: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _empty_manifest() -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(),
        "kernel_switches": kernel_switches(),
        "config": None,
        "op_roles": None,
        "graphs": [],
        "runtime": None,
        "captures": [],
        "metadata_builds": [],
        "fallbacks": [],
        "counters": {},
        "depyf": {"dir": None, "written": False, "note": DEPYF_NOTE},
    }


def _clear_previous_run(root: Path, keep_depyf: bool) -> None:
    """A new run starts over: remove what an earlier run wrote here (its
    graphs, depyf output, inspect's picture, manifest), and nothing else."""
    owned = [*root.glob("graph_*"), root / DEFAULT_SVG, root / MANIFEST]
    if not keep_depyf:
        owned.append(root / "depyf")
    for old in owned:
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()


def _load_or_start(root: Path) -> dict[str, Any]:
    key = str(root)
    if key in _started and (root / MANIFEST).exists():
        return read_manifest(root)
    _started.add(key)
    _plain_runs.pop(key, None)
    _clear_previous_run(root, keep_depyf=key in _depyf_active)
    manifest = _empty_manifest()
    if key in _depyf_active:
        manifest["depyf"] = {"dir": "depyf", "written": True, "note": None}
    return manifest


# ---- one Dynamo graph ---------------------------------------------------------------


def _describe_value(v: Any) -> Any:
    """A placeholder's example value as JSON: a tensor's symbolic shape and
    dtype, a SymInt's expression, else its type."""
    if isinstance(v, torch.Tensor):
        return {"shape": [str(d) for d in v.shape], "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, torch.SymInt):
        return {"symint": str(v)}
    if isinstance(v, (int, float, bool)):
        return {"value": v}
    return {"type": type(v).__name__}


def piece_inputs(piece: Any) -> list[dict[str, Any]]:
    gm = piece.graph_module
    if gm is None:
        return []
    return [{"name": n.name, **_describe_value(n.meta.get("example_value"))}
            for n in gm.graph.nodes if n.op == "placeholder"]


def _graph_record(k: int, step: Any) -> dict[str, Any]:
    pieces = []
    for p in step.pieces:
        rec = p.summary()
        rec["inputs"] = piece_inputs(p)
        rec["file"] = f"graph_{k}/pieces/piece_{p.index}.py"
        pieces.append(rec)
    has_full = step.graph_mode.has_full
    return {
        "index": k,
        "dir": f"graph_{k}",
        "graph_mode": step.graph_mode.value,
        "mode_reason": step.mode_reason,
        # Without a runner, in a mode with FULL graphs: the whole graph is one
        # lazily captured FULL graph, or `full_blocker` says why not.
        "full_graph_without_runner": (getattr(step, "full_graph", None) is not None
                                      if has_full else None),
        "full_blocker": getattr(step, "full_blocker", None) if has_full else None,
        "compile_seconds": round(step.compile_seconds, 6),
        "passes_uuid": step.passes_uuid,
        "passes": [{"name": e.get("pass"), "uuid": e.get("uuid"), "changed": e.get("changed"),
                    "details": e.get("details", {})} for e in step.pass_log],
        "pieces": pieces,
    }


def _write_graph_files(folder: Path, step: Any) -> None:
    (folder / "pieces").mkdir(parents=True)
    (folder / "graph_before_passes.py").write_text(step.original_code)
    (folder / "graph_after_passes.py").write_text(step.passed_code)
    (folder / "split_graph.py").write_text(step.split_gm.code)
    for p in step.pieces:
        code = public_code(p.graph_module.code) if p.graph_module is not None else "# no graph module\n"
        (folder / "pieces" / f"piece_{p.index}.py").write_text(code)


def _piece_fallbacks(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"kind": "piece_eager", "graph": g["index"], "piece": p["index"], "reason": r}
            for g in graphs for p in g["pieces"] for r in p["eager_reasons"]]


def write_compile_dump(path: str | os.PathLike, step: Any) -> Path:
    """Add one compiled Dynamo graph to the dump at `path`; returns the folder."""
    root = check_dump_path(path)
    root.mkdir(parents=True, exist_ok=True)
    manifest = _load_or_start(root)
    k = len(manifest["graphs"])
    tmp = Path(tempfile.mkdtemp(prefix=f".graph_{k}.", dir=root))
    try:
        _write_graph_files(tmp, step)
        final = root / f"graph_{k}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest["config"] = manifest["config"] or step.config.summary()
    manifest["op_roles"] = manifest["op_roles"] or step.roles.summary()
    manifest["graphs"].append(_graph_record(k, step))
    runtime_fallbacks = [f for f in manifest["fallbacks"] if f["kind"] != "piece_eager"]
    manifest["fallbacks"] = _piece_fallbacks(manifest["graphs"]) + runtime_fallbacks
    manifest["counters"] = dict(counters)
    _write_json_atomic(root / MANIFEST, manifest)
    _remember_plain_run(root, manifest, step)
    logger.info("mrv2: dumped graph %d (%d pieces) to %s", k, len(step.pieces), root)
    return root


def _remember_plain_run(root: Path, manifest: dict[str, Any], step: Any) -> None:
    """Keep `step` (weakly) so that the runtime section of a plain run can
    be written after its calls: at exit, unless a runner reports first."""
    global _exit_hook_registered
    key = str(root)
    created, steps = _plain_runs.get(key, (manifest["created"], []))
    try:
        steps.append(weakref.ref(step))
    except TypeError:  # not weakly referable: counters only
        steps.append(lambda: None)
    _plain_runs[key] = (created, steps)
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_record_plain_runs_at_exit, os.getpid())


def _graphs_held(step: Any) -> dict[str, int]:
    """Graphs a plain run's step holds now: its whole-graph FULL graphs and
    its pieces' graphs (captured lazily, one per input shape and address)."""
    def held(wrapper: Any) -> int:
        return sum(len(v) for v in getattr(wrapper, "variants", {}).values())

    full = getattr(step, "full_graph", None)
    return {"full": held(full) if full is not None else 0,
            "pieces": sum(held(w) for w in getattr(step, "wrappers", []))}


def _plain_runtime(manifest: dict[str, Any], steps: list[Any], when: str) -> dict[str, Any]:
    graphs = manifest["graphs"]
    first = graphs[0] if graphs else {}
    held = []
    for k, ref in enumerate(steps):
        step = ref()
        if step is not None:  # the FULL graph may be given up at a call (then the blocker says why)
            held.append({"graph": k, **_graphs_held(step),
                         "full_blocker": getattr(step, "full_blocker", None)})
    return {
        "runner": False,
        "mode": first.get("graph_mode"),
        "requested_mode": (manifest.get("config") or {}).get("cudagraph_mode"),
        "mode_reason": first.get("mode_reason"),
        "recorded": when,
        "graphs_held": held,
    }


def _record_plain_run(root: Path, when: str) -> dict[str, Any] | None:
    """Write the runtime section of this process's plain run at `root`
    (None: the manifest there is another run's, or a runner's)."""
    created, steps = _plain_runs.get(str(root), (None, []))
    if created is None or not (root / MANIFEST).is_file():
        return None
    manifest = read_manifest(root)
    rt = manifest.get("runtime")
    if manifest.get("created") != created or (rt is not None and rt.get("runner", True)):
        return None
    manifest["runtime"] = _plain_runtime(manifest, steps, when)
    manifest["counters"] = dict(counters)
    _write_json_atomic(root / MANIFEST, manifest)
    return manifest


def _record_plain_runs_at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child that exits normally
        return
    for key in list(_plain_runs):
        try:
            _record_plain_run(Path(key), "at process exit")
        except Exception as e:  # never fail the exit of the run that was watched
            logger.debug("mrv2: no runtime section written to %s: %s", key, e)


# ---- what the runner did ---------------------------------------------------------------


def update_manifest_runtime(path: str | os.PathLike, runner: Any = None) -> dict[str, Any]:
    """Merge a ModelRunner's captures, metadata builds, fallbacks and the
    current counters into `path`'s manifest; returns the new manifest.

    Without a runner (plain `torch.compile` use, graphs captured lazily):
    record now what the process's compiled steps for `path` captured and
    hold, and the counters (else that is written when the process exits)."""
    root = check_dump_path(path)
    if runner is None:
        manifest = _record_plain_run(root, "by update_manifest_runtime")
        if manifest is None:
            raise ValueError(
                f"{str(path)!r}: no plain run of this process dumped there (or a runner "
                "reported to it): pass the runner, update_manifest_runtime(path, runner)")
        return manifest
    root.mkdir(parents=True, exist_ok=True)
    manifest = _load_or_start(root)
    _plain_runs.pop(str(root), None)  # a runner's run: nothing to write at exit
    manifest["runtime"] = {
        "runner": True,
        "mode": runner.mode.value,
        "mode_reason": runner.mode_reason,
        "requested_mode": runner.config.cudagraph_mode.value,
        "capture_sizes": list(runner.capture_sizes),
        "decode_sizes": list(runner.decode_sizes),
    }
    if hasattr(runner.compiled, "summary"):  # how the first step got its compiled step
        manifest["runtime"]["step"] = runner.compiled.summary()
    manifest["captures"] = [c.summary() for c in runner.captures]
    manifest["metadata_builds"] = list(runner.model_state.build_log)
    fallbacks = _piece_fallbacks(manifest["graphs"])
    if runner.mode_reason:
        fallbacks.append({"kind": "mode_lowered", "reason": runner.mode_reason})
    reasons = {
        "eager_no_graph": "batches larger than every capture size ran without a graph",
        "eager_mixed_batch": "batches that are not uniform decode ran without a graph "
                             "(mode full_decode_only)",
    }
    for key, reason in reasons.items():
        if counters[key]:
            fallbacks.append({"kind": key, "count": counters[key], "reason": reason})
    mixed = getattr(runner.full_graph, "mixed", None)  # runtime/mixed_graphs.py
    for reason, count in (mixed.refusals.items() if mixed is not None else ()):
        fallbacks.append({"kind": "mixed_graph_recorded", "count": count,
                          "reason": f"a mixed FULL graph was recorded, not derived: {reason}"})
    manifest["fallbacks"] = fallbacks
    manifest["counters"] = dict(counters)
    _write_json_atomic(root / MANIFEST, manifest)
    return manifest


@contextlib.contextmanager
def depyf_dump(path: str | os.PathLike) -> Iterator[Path]:
    """Wrap the *execution* of a torch.compile'd model: depyf writes its
    decompiled bytecode and graphs to `path/depyf`, and the manifest says so."""
    import depyf

    root = check_dump_path(path)
    root.mkdir(parents=True, exist_ok=True)
    key = str(root)
    if key not in _started:  # a new run: depyf must not add to an earlier run's files
        shutil.rmtree(root / "depyf", ignore_errors=True)
    _depyf_active.add(key)
    note = None
    try:
        with depyf.prepare_debug(str(root / "depyf")):
            yield root
    except Exception as e:  # depyf failing must not fail the run it watched
        if not isinstance(e, _DEPYF_ERRORS):
            raise
        note = f"depyf stopped early: {type(e).__name__}: {e}"
        logger.warning("mrv2: %s", note)
    finally:
        _depyf_active.discard(key)
    if (root / MANIFEST).exists():
        manifest = read_manifest(root)
        manifest["depyf"] = {"dir": "depyf", "written": (root / "depyf").is_dir(), "note": note}
        _write_json_atomic(root / MANIFEST, manifest)


_DEPYF_ERRORS = (AttributeError, AssertionError, OSError, TypeError)


def write_aot_code(path: str | os.PathLike, fn: Any, step: Any = None) -> Path | None:
    """A runner's step is AOT-compiled (compile/guard_free.py), which depyf's
    hook does not see: write what it would, `depyf/full_code_for_<name>.py`,
    from Dynamo's transformed code (decompiled by depyf) and the backend's
    split graph, and say so in the manifest. Returns the file (None when
    depyf is missing or cannot decompile: the manifest then says why)."""
    root = check_dump_path(path)
    root.mkdir(parents=True, exist_ok=True)
    code = getattr(fn, "__code__", None)
    name = code.co_name if code is not None else "step"
    target = root / "depyf" / f"full_code_for_{name}_0.py"
    note = ("written by mrv2 from the AOT-compiled step (depyf.decompile of Dynamo's code): "
            "depyf's own hook does not see AOT compiles")
    try:
        import depyf

        source = depyf.decompile(fn)
    except Exception as e:  # noqa: BLE001 - the dump says why; the run goes on
        source, note = None, f"depyf could not decompile the AOT-compiled step: {type(e).__name__}: {e}"
        logger.warning("mrv2: %s", note)
    if source is not None:
        parts = [f"# Dynamo's transformed code for {name}, decompiled by depyf {depyf.__version__}",
                 source]
        split_gm = getattr(step, "split_gm", None)
        if split_gm is not None:
            parts += ["", "# The backend's split graph: the compiled function the code above calls",
                      "# (its pieces' code: graph_*/ beside this folder)",
                      public_code(split_gm.code)]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(parts) + "\n")
    manifest = _load_or_start(root)
    manifest["depyf"] = {"dir": "depyf", "written": source is not None, "note": note,
                         "files": sorted(p.name for p in (root / "depyf").glob("full_code_for_*"))
                         if (root / "depyf").is_dir() else []}
    _write_json_atomic(root / MANIFEST, manifest)
    return target if source is not None else None
