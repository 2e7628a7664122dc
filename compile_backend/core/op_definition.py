"""Defining a kernel's op so a call costs one C++ dispatch to its Python body.

`torch.library.custom_op` puts Python layers in front of the body (an autograd
kernel, an ADInplaceOrView kernel for mutating ops, an output alias check),
about 4x the dispatch of an op defined with `torch.library.Library` and one
CompositeExplicitAutograd kernel (bench/host_overhead.py --dispatch). Inductor
pieces, FULL graphs given up and capture warm-ups call our ops that way once
per layer, so the layers cost host time the device waits for. `define_op`
defines with `Library`; the fake goes through `torch.library.register_fake`
as usual. Autograd is not supported (inference kernels): with grad on, a call
works and a backward through it warns or fails as for any op without a formula.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from compile_backend.core.op_recording import recordable

# One fragment per namespace, alive for the process (ops die with their Library).
_LIBRARIES: dict[str, torch.library.Library] = {}


def define_op(qualname: str, *, mutates_args: Iterable[str] = (), schema: str | None = None,
              same_launches: bool = False, into: Callable[..., Any] | None = None):
    """Decorator: define `qualname` ("ns::name") with the decorated function as
    its body (CPU and CUDA) and return the op (`torch.ops.ns.name`). `schema`
    ("(Tensor x, ...) -> Tensor") defaults to the one inferred from the
    function's annotations, with `mutates_args` marked written.
    `same_launches`, `into`: for a layer-keyed op, what a FULL plan's derived
    mixed graphs need (core/op_recording.py: `recordable`)."""
    ns, name = qualname.split("::")

    def wrap(impl: Callable[..., Any]):
        text = schema if schema is not None else torch.library.infer_schema(
            impl, mutates_args=tuple(mutates_args))
        lib = _LIBRARIES.get(ns)
        if lib is None:
            lib = _LIBRARIES[ns] = torch.library.Library(ns, "FRAGMENT")
        lib.define(name + text)
        # Through `recordable`: a FULL plan notes where its metadata-reading
        # ops' launches sit in a decode graph (core/op_recording.py).
        lib.impl(name, recordable(qualname, impl, same_launches=same_launches, into=into),
                 "CompositeExplicitAutograd")
        return getattr(getattr(torch.ops, ns), name)

    return wrap
