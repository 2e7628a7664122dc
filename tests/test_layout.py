"""The house: sub-packages by stage, imports only downward (read from the
source, function-local imports included), a package import that loads
neither Dynamo nor Triton, one value for "which graph" (StepGraph), op facts
in one registry that core fills with no kernel's name, and the kernels and
passes installed inside the package."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lower stages first; a package may import only packages before it.
ORDER = ["core", "runtime", "kernels", "passes", "debug", "compile", "runner", "demo", "examples"]


def _package(module: str) -> str | None:
    """The stage a module belongs to: compile_backend.<stage>..."""
    parts = module.split(".")
    if parts[0] == "compile_backend" and len(parts) > 1 and parts[1] in ORDER:
        return parts[1]
    return None


def _imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {p: set() for p in ORDER}
    for path in (ROOT / "compile_backend").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        src = _package(module)
        if src is None:
            continue
        for name in _imports(path, module):
            dst = _package(name)
            if dst is not None and dst != src:
                edges[src].add(dst)
    return edges


def test_imports_only_go_down():
    upward = [(src, dst) for src, dsts in _edges().items() for dst in dsts
              if ORDER.index(dst) > ORDER.index(src)]
    assert upward == []


def test_passes_and_kernels_import_only_the_shared_vocabulary():
    edges = _edges()
    assert edges["kernels"] <= {"core"}
    assert edges["passes"] <= {"core"}
    assert edges["core"] == set()


def test_the_tree_is_one_package_as_the_imports_say():
    """The kernels and passes live where their import names say,
    compile_backend/kernels and compile_backend/passes: no folder at the root
    installed under another name (no setuptools package-dir), and no import
    of a top-level `kernels` or `passes` (a package on the public index)."""
    import compile_backend.kernels
    import compile_backend.passes

    for pkg, folder in ((compile_backend.kernels, "kernels"), (compile_backend.passes, "passes")):
        assert pathlib.Path(pkg.__file__).parent == ROOT / "compile_backend" / folder
        assert not (ROOT / folder).exists(), folder
    assert "package-dir" not in (ROOT / "pyproject.toml").read_text()
    top_level = []
    for folder in ("compile_backend", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path, "x.y"):
                if name.split(".")[0] in ("kernels", "passes"):
                    top_level.append(f"{path.relative_to(ROOT)}: {name}")
    assert top_level == []


def test_importing_the_package_or_a_kernel_loads_neither_dynamo_nor_triton():
    code = ("import sys, compile_backend, compile_backend.core.forward_context; "
            "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["False", "False"]


def test_the_public_api_imports_from_the_package():
    import compile_backend as cb

    for name in ["mrv2_backend", "CompilationConfig", "CUDAGraphMode", "ModelRunner",
                 "KVCacheConfig", "InputBatch", "prepare_inputs_to_capture", "register_op_role",
                 "register_metadata_builder", "mark_token_dim", "symbolic_tokens",
                 "write_compile_dump", "depyf_dump", "read_manifest", "backend"]:
        assert getattr(cb, name) is not None, name
    assert sorted(cb.__all__) == cb.__all__


# Names of the forms "which graph" had before StepGraph became the one value.
RETIRED = ["BatchDescriptor", "DraftDescriptor", "batch_descriptor", "cudagraph_runtime_mode",
           "full_cudagraph", "relaxed()", "key_of("]


def _sources():
    for folder in ("compile_backend", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "test_layout.py":
                yield path


def test_one_value_says_which_graph_a_step_runs_in():
    import dataclasses
    import inspect

    from compile_backend.core.forward_context import ForwardContext
    from compile_backend.core.graph_mode import StepGraph
    from compile_backend.runner.capture import prepare_inputs_to_capture
    from compile_backend.runner.model_runner import CaptureRecord

    found = [f"{p.relative_to(ROOT)}: {name}" for p in _sources() for name in RETIRED
             if name in p.read_text()]
    assert found == []
    fields = {f.name: f.type for f in dataclasses.fields(ForwardContext)}
    assert set(fields) == {"attn_metadata", "graph", "capturing", "capture_plans", "trace"}
    assert "StepGraph" in str(fields["graph"])
    assert list(inspect.signature(prepare_inputs_to_capture).parameters) == ["graph", "model_state"]
    assert "StepGraph" in str({f.name: f.type for f in dataclasses.fields(CaptureRecord)}["graph"])
    assert dataclasses.is_dataclass(StepGraph) and StepGraph.__dataclass_params__.frozen
    # One name for the value: every parameter that takes a StepGraph is `graph`.
    misnamed = []
    for path in sorted((ROOT / "compile_backend").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                note = arg.annotation
                text = (note.value if isinstance(note, ast.Constant) and isinstance(note.value, str)
                        else ast.unparse(note) if note is not None else "")
                if text in ("StepGraph", "StepGraph | None") and arg.arg != "graph":
                    misnamed.append(f"{path.relative_to(ROOT)}:{arg.lineno}: {arg.arg}")
    assert misnamed == []


def test_core_names_no_kernel_op():
    """Op facts live in the registry; each kernel registers its own ops when
    imported, so no string constant in core names an `mrv2::` op."""
    named = []
    for path in (ROOT / "compile_backend" / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "mrv2::" in node.value and id(node) not in docstrings):
                named.append(f"{path.name}: {node.value!r}")
    assert named == []


def test_the_docs_cite_files_that_exist():
    """Every repository path README.md and docs/ name (a file under one of the
    top folders) exists: a move that leaves a citation behind fails here."""
    import re

    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\b((?:compile_backend|kernels|passes|tests|bench|docs)/[\w/.]+?\.(?:py|md))\b",
                             doc.read_text()):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.name}: {m.group(1)}")
    assert missing == []


def test_module_docstrings_are_short():
    """A module docstring says what the module is for, its contract and where
    docs/design.md explains it, in at most 15 lines; measurements, lab notes
    and long explanations live in docs/design.md or bench/results/."""
    long = []
    for path in sorted((ROOT / "compile_backend").rglob("*.py")):
        rel = path.relative_to(ROOT / "compile_backend")
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        lines = 0 if doc is None else doc.count("\n") + 1
        if lines > 15:
            long.append(f"{rel}: {lines} lines")
    assert long == []
