"""A runner's saved step, called without Dynamo: each graph input found
where Dynamo took it from, the step called, its output returned.

    plan, why_not = plan_for(aot, step, model, args, first)   # cold: after the first call
    call = bind(step, resolve(plan, model), model)            # warm: no Dynamo imported
    out = call(input_ids, positions)

A plan holds each graph input's source (`L['input_ids'].size()[0]`, a
parameter by attribute) and which output the forward returns. It is written
only where the compile's first call showed it exact: Dynamo's code loads
nothing else and writes nothing (its bytecode), and the plan finds the very
objects Dynamo passed and returns what it returned. docs/design.md, "A warm
start without Dynamo".
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import re
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

# What Dynamo's code may load besides its compiled function and the sources'
# attributes: the utilities it calls around the graph (profiling marks, sizes
# and offsets of inputs).
_DYNAMO_UTILS = "__import_torch_dot__dynamo_dot_utils"
_UTIL_NAMES = {_DYNAMO_UTILS, "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit",
               "call_size", "call_stride", "call_storage_offset"}
# Instructions that change state or reach beyond the frame: none may appear.
_WRITES = {"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "STORE_DEREF", "STORE_NAME",
           "STORE_SLICE", "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL", "DELETE_DEREF",
           "DELETE_NAME", "IMPORT_NAME", "IMPORT_FROM", "IMPORT_STAR", "YIELD_VALUE",
           "SETUP_WITH", "BEFORE_WITH", "RAISE_VARARGS", "LOAD_DEREF", "LOAD_CLOSURE",
           "MAKE_FUNCTION"}

_ROOT = re.compile(r"L\['([A-Za-z_][A-Za-z0-9_]*)'\]")
_STEP = re.compile(r"\.size\(\)\[(\d+)\]|\.stride\(\)\[(\d+)\]|(\.storage_offset\(\))"
                   r"|\.([A-Za-z_][A-Za-z0-9_]*)|\['([^'\\]*)'\]|\[(\d+)\]")


def parse_source(name: str | None) -> tuple[str, tuple] | None:
    """(the local it starts from, its steps) for a source name of the forms
    Dynamo gives a runner's graph inputs; None for any other."""
    if not name:
        return None
    m = _ROOT.match(name)
    if m is None:
        return None
    steps, pos = [], m.end()
    while pos < len(name):
        s = _STEP.match(name, pos)
        if s is None:
            return None
        size, stride, offset, attr, key, index = s.groups()
        steps.append(("size", int(size)) if size is not None else
                     ("stride", int(stride)) if stride is not None else
                     ("offset",) if offset is not None else
                     ("attr", attr) if attr is not None else
                     ("item", key) if key is not None else ("item", int(index)))
        pos = s.end()
    return m.group(1), tuple(steps)


def _walk(value: Any, steps: Sequence[tuple]) -> Any:
    for step in steps:
        kind = step[0]
        if kind == "attr":
            value = getattr(value, step[1])
        elif kind == "item":
            value = value[step[1]]
        elif kind == "size":
            value = value.size(step[1])
        elif kind == "stride":
            value = value.stride(step[1])
        else:
            value = value.storage_offset()
    return value


def arg_names(model: torch.nn.Module) -> list[str] | None:
    """The forward's parameter names after `self` (None: it takes *args or
    **kwargs, which a plan cannot name)."""
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def _compiled_global(code: Any) -> str | None:
    names = [n for n in code.co_names if n.startswith("__compiled_fn")]
    return names[0] if len(names) == 1 else None


def _code_reaches_beyond(code: Any, sources: Sequence[tuple[str, tuple]]) -> str | None:
    """Why Dynamo's code for the step may do more than gather inputs, call
    the graph and return (None: it does no more)."""
    if any(inspect.iscode(c) for c in code.co_consts):
        return "it defines functions"
    instructions = list(dis.get_instructions(code))
    written = sorted({i.opname for i in instructions} & _WRITES)
    if written:
        return f"it runs {', '.join(written)}"
    attrs = {s[1] for _, steps in sources for s in steps if s[0] == "attr"} | _UTIL_NAMES
    other = set()
    for i in instructions:
        name = i.argval if isinstance(i.argval, str) else None
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if name != _DYNAMO_UTILS and not (name or "").startswith("__compiled_fn"):
                other.add(f"global {name}")
        elif i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR") and name not in attrs:
            other.add(f"attribute {name}")
    if other:
        return f"it loads {', '.join(sorted(other)[:5])}"
    return None


class FirstCall:
    """What Dynamo's code passed its compiled step, and got, at one call."""

    def __init__(self) -> None:
        self.args: tuple | None = None
        self.outputs: Any = None
        self.returned: Any = None


@contextlib.contextmanager
def recording(aot: Any) -> Iterator[FirstCall]:
    """Around one call of `aot.fn`: its compiled step, swapped in the code's
    globals for a recorder of the step's arguments and outputs."""
    fn, first = aot.fn, FirstCall()
    name = _compiled_global(fn.__code__)
    step = fn.__globals__.get(name) if name else None
    if step is None:
        yield first
        return

    def record(*args: Any) -> Any:
        first.args = args
        first.outputs = step(*args)
        return first.outputs

    fn.__globals__[name] = record
    try:
        yield first
    finally:
        fn.__globals__[name] = step


def plan_for(aot: Any, step: Any, model: torch.nn.Module, args: Sequence[Any],
             first: FirstCall) -> tuple[dict | None, str | None]:
    """(the plan for calling `step` without Dynamo, None) or (None, why not),
    from the compile's first call through Dynamo's code (`recording`)."""
    code = aot.fn.__code__
    name = _compiled_global(code)
    if name is None or aot.fn.__globals__.get(name) is not step:
        return None, "Dynamo's code calls other than one compiled step"
    names = arg_names(model)
    if names is None:
        return None, "the forward takes *args or **kwargs"
    parsed = [parse_source(s) for s in step.input_sources]
    if not parsed or None in parsed:
        bad = [s for s, p in zip(step.input_sources, parsed) if p is None][:1]
        return None, f"a graph input has a source no plan names ({bad or 'none recorded'})"
    why = _code_reaches_beyond(code, parsed)
    if why:
        return None, f"Dynamo's code does more than call the step: {why}"
    if first.args is None:
        return None, "the first call did not reach the step"
    outs = first.outputs
    hits = [i for i, o in enumerate(outs) if o is first.returned] if isinstance(outs, (list, tuple)) else []
    if len(hits) != 1:
        return None, "the forward returns other than one of the step's outputs"
    plan = {"sources": list(step.input_sources), "arg_names": names, "output": hits[0]}
    # Checked by what a warm load will run: `resolve`, then `Inputs.values`.
    try:
        found = resolve(plan, model).values(model, args)
    except ValueError as e:
        return None, f"a source finds nothing: {e}"
    if len(found) != len(first.args) or not all(
            (a is b) if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b)
            for a, b in zip(found, first.args)):
        return None, "the sources do not give the inputs Dynamo passed"
    return plan, None


class Inputs(NamedTuple):
    """A plan resolved against a model (`resolve`): the graph inputs found
    once, and how to find the others at every call."""

    template: list[Any]  # parameters and buffers in place; None where a call fills in
    arguments: list[tuple[int, int]]  # (input, argument position): the argument itself
    walked: list[tuple[int, int, tuple]]  # (input, argument position or -1: the model, steps)
    output: int  # which of the step's outputs the forward returns

    def values(self, model: torch.nn.Module, args: Sequence[Any]) -> list[Any]:
        """The graph inputs of a call with `args`."""
        values = self.template.copy()
        for i, pos in self.arguments:
            values[i] = args[pos]
        for i, pos, steps in self.walked:
            values[i] = _walk(model if pos < 0 else args[pos], steps)
        return values


def resolve(plan: dict, model: torch.nn.Module) -> Inputs:
    """The plan's sources found in `model`: parameters and buffers once (a
    runner promises they stay the same objects, compile/guard_free.py); the
    rest at every call. Raises (ValueError) where a source finds nothing in
    this model, before any step is loaded."""
    names = plan["arg_names"]
    if names != arg_names(model):
        raise ValueError(f"the forward's arguments are {arg_names(model)}, not {names}")
    template: list[Any] = []
    per_call: list[tuple[int, int, tuple]] = []  # (input, argument position, steps)
    for i, source in enumerate(plan["sources"]):
        parsed = parse_source(source)
        if parsed is None:
            raise ValueError(f"graph input {i}: no plan names {source!r}")
        root, steps = parsed
        if root == "self":
            try:
                value = _walk(model, steps)
            except (AttributeError, KeyError, IndexError) as e:
                raise ValueError(f"graph input {i}: {source} finds nothing in this model "
                                 f"({type(e).__name__}: {e})") from None
            if isinstance(value, torch.Tensor):
                template.append(value)
                continue
            per_call.append((i, -1, steps))  # model state that is not a tensor: read at every call
        elif root in names:
            per_call.append((i, names.index(root), steps))
        else:
            raise ValueError(f"graph input {i}: {source} names no argument of the forward {names}")
        template.append(None)
    return Inputs(template, [(i, pos) for i, pos, steps in per_call if not steps],
                  [(i, pos, steps) for i, pos, steps in per_call if steps], int(plan["output"]))


def bind(step: Any, inputs: Inputs, model: torch.nn.Module) -> Callable[..., Any]:
    """`(*args) -> output` calling `step` as Dynamo's code did."""
    values, k = inputs.values, inputs.output
    return lambda *args: step(*values(model, args))[k]
