"""Triton kernels compiled in worker processes, into Triton's disk cache: a
cold plan's compiles then leave this process's Python lock to the capture
(docs/design.md, "Kernels compiled ahead, in parallel"). A worker holds no
GPU: it compiles for the target this process names, and this process's
own compile of the same request becomes a cache hit (a few ms).

    job = compile_job("module:kernel", spec)        # here: the target, the cache folder
    workers.submit(REMOTE, job)                     # there: compile_in_worker(job)

A request is what Triton's jit_cache_hook hands kernel_precompile.py: a
kernel's `module:qualname` and its serialised specialisation.
"""

from __future__ import annotations

import os
import time
from typing import Any

# What a worker imports before its first job (compile/compile_workers.py), and its entry.
PRELOAD = ("compile_backend.runtime.kernel_workers", "compile_backend.kernels")
REMOTE = "compile_backend.runtime.kernel_workers:compile_in_worker"
# A worker sees no GPU: no CUDA context (and its memory) in any of them.
WORKER_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
# At most 3: a cold llama8b FULL start on a 16-core H100 host (25 kernels) gave mrv2's
# share 10.87 s with 3 workers, 11.29-11.39 with 7 (their imports slowed the
# model's compile beside them: 7.1 against 7.5 s) and 12.23-12.27 with none
# (16 threads; bench/results/startup_workers_h100.md).
MAX_WORKERS = 3


def auto_workers() -> int:
    """Workers for `precompile_workers=None`: one per two cores beside this
    process's, at most MAX_WORKERS (measured, above); none on 4 cores or
    fewer, where they would take the capture's cores (each imports torch
    before its first job)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return 0 if cores <= 4 else min(MAX_WORKERS, cores // 2 - 1)


class TargetOnlyDriver:
    """What `JITFunction.preload` and `triton.compile` ask of Triton's active
    driver, in a process that launches nothing: the device, the target to
    compile for, a stream. Loading a module or launching would fail here."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_current_stream(self, device: Any = None) -> int:
        return 0


def current_target() -> dict[str, Any]:
    """This process's Triton target (backend, arch, warp size) as a dict a worker can rebuild."""
    from triton.runtime import driver

    return dict(vars(driver.active.get_current_target()))


def compile_job(name: str, spec: str, target: dict[str, Any] | None = None) -> tuple:
    """One request as a worker takes it: (kernel, specialisation, target,
    Triton's cache folder). The folder is this process's, so the worker's
    binary is where this process's compile looks first."""
    from triton import knobs

    return name, spec, target if target is not None else current_target(), knobs.cache.dir


def compile_in_worker(job: tuple) -> float:
    """In a worker: compile one request into Triton's disk cache; its
    seconds. The module is never loaded here (no GPU)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from compile_backend.runtime.kernel_precompile import resolve

    name, spec, target, cache_dir = job
    knobs.cache.dir = cache_dir
    triton.runtime.driver.set_active(TargetOnlyDriver(GPUTarget(**target)))
    t0 = time.perf_counter()
    resolve(name).preload(spec)
    return time.perf_counter() - t0
