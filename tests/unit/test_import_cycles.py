"""megarl's own modules import each other one way: no circle of imports.

A circle (A imports B imports ... imports A) works only while every import on it but one
sits inside a function, and breaks the day someone moves one to the top of its file; it also
means none of its modules can be read, tested or moved without the others. The graph here is
read with `ast` from the source (nothing is imported), counting every import, at the top of a
file or inside a function, as an arrow from the importing module to the module it names:
`from megarl.a import b` names megarl/a/b.py when that file exists, else megarl/a/__init__.py.

The circle this test was written for: conversion/to_hf.py -> conversion/to_megatron.py
(HF_CONFIG_DIR) -> models/loading.py (load_hf_shard) -> conversion/to_hf.py
(DistCheckpointReader), broken by moving the constant and the reader down into
conversion/dist_reader.py (now formats/dist_reader.py: the weight formats sit below both the
trainer's models and the conversion tools, `test_weight_formats_sit_below_models_and_conversion`).
"""
import ast
import gc
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megarl"


def module_name(path: Path, root: Path = PKG) -> str:
    """megarl/a/b.py -> megarl.a.b; megarl/a/__init__.py -> megarl.a (root: the megarl folder)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse(path):
    """ast.parse with the garbage collector off: on CPython 3.11 a finalizer that runs Python
    code in the middle of the AST constructor (objects left by earlier tests in this worker)
    can trip its recursion check ("AST constructor recursion depth mismatch", a SystemError,
    seen once in `make test`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


def import_graph(root: Path = PKG) -> dict[str, dict[str, int]]:
    """{module: {imported megarl module: line of the first such import}}."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        """The module `name` is, or the package it is a name of (megarl.a.b.C -> megarl.a.b)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for node in ast.walk(_parse(path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: up level - 1 packages from this one
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                dest = known(t) if t.startswith("megarl") else None
                if dest and dest != mod:
                    edges.setdefault(dest, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(graph, comp: list[str]) -> str:
    inside = set(comp)
    return "; ".join(f"{a} -> {b} (line {line})" for a in comp for b, line in sorted(graph[a].items())
                     if b in inside)


def test_megarl_has_no_import_circles():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles among megarl's modules (move what both sides need into a module " \
                      "below them): " + " | ".join(describe(graph, c) for c in found)


def test_weight_formats_sit_below_models_and_conversion():
    """megarl.formats (mapping table, HF and dist-checkpoint readers, tensor ops) imports no other
    megarl package; megarl.models imports neither the conversion tools nor what sits above them."""
    graph = import_graph()
    above_models = ("megarl.conversion", "megarl.ppo", "megarl.plan", "megarl.rollout", "megarl.preflight")
    wrong = [f"{a} -> {b} (line {line})" for a, edges in graph.items() for b, line in edges.items()
             if (a.startswith("megarl.formats") and not b.startswith("megarl.formats"))
             or (a.startswith("megarl.models") and b.startswith(above_models))]
    assert not wrong, "imports against the layers (formats < models < conversion): " + "; ".join(wrong)


def test_the_checker_sees_a_circle_made_of_imports_inside_functions(tmp_path):
    """The checker itself: a circle whose imports all sit inside functions, one through a
    `from package import module` and one relative, is found; a one-way chain is not."""
    pkg = tmp_path / "megarl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from megarl.a import y\n")
    (pkg / "a" / "y.py").write_text("def g():\n    from .z import h\n")
    (pkg / "a" / "z.py").write_text("def h():\n    import megarl.a.x\n")
    (pkg / "b.py").write_text("from megarl.a.x import f\n")
    graph = import_graph(pkg)
    assert graph["megarl.b"] == {"megarl.a.x": 1}
    assert circles(graph) == [["megarl.a.x", "megarl.a.y", "megarl.a.z"]]
    (pkg / "a" / "z.py").write_text("def h():\n    pass\n")
    assert circles(import_graph(pkg)) == []
