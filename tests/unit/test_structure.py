"""The rules that keep megarl's code easy to change, read from the source with `ast`:

- packages import each other one way (a circle between packages is a failure even when every
  import on it sits inside a function: it works only until someone moves one to the top);
- no function longer than 80 lines (megarl/train.py: 40: it reads as setup, steps, finish);
- megatron is never imported before `megarl.bootstrap.bootstrap()` has run: entry points
  (files that run as programs) call it before they import anything that imports megatron, and
  the modules that must stay light (config, the CLI, what vLLM loads into every engine
  process) import nothing that imports megatron.

Module-level circles: tests/unit/test_import_cycles.py (its graph is reused here).
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_cycles import PKG, circles, import_graph, module_name

ROOT = PKG.parent
MAX_LINES = 80
MAX_LINES_IN = {"megarl/train.py": 40}
#: modules that must not import megatron, even indirectly at import time
LIGHT = ["megarl", "megarl.cli", "megarl.bootstrap", "megarl.config", "megarl.config.schema",
         "megarl.config.loader", "megarl.config.registry", "megarl.rollout",
         "megarl.rollout.engines.plugin", "megarl.rollout.weights.gloo_backend", "megarl.rollout.engines.held_tokens"]
#: programs outside megarl/ that run megarl code in a process of their own
PROGRAM_DIRS = ["tools", "bench", "tests/dist", "tests/e2e", "tests/gpu"]


def package_of(mod: str) -> str:
    """megarl.ppo.step -> megarl.ppo; a top-level module (megarl.train) is its own node."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """{package: {package it imports: 'module -> module (line n)' of the first such arrow}}."""
    out: dict[str, dict[str, str]] = {}
    for a, edges in graph.items():
        for b, line in edges.items():
            pa, pb = package_of(a), package_of(b)
            if pa != pb and pa != "megarl" and pb != "megarl":
                out.setdefault(pa, {}).setdefault(pb, f"{a} -> {b} (line {line})")
    return out


def test_packages_import_each_other_one_way():
    pg = package_graph(import_graph())
    found = circles({a: dict.fromkeys(es) for a, es in pg.items()})
    detail = " | ".join("; ".join(pg[a][b] for a in comp for b in pg.get(a, {}) if b in comp) for comp in found)
    assert not found, f"import circles between packages (move what both need into a package below both): {detail}"


def test_the_package_check_sees_a_circle_through_submodules(tmp_path):
    pkg = tmp_path / "megarl"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megarl.b.y import g\n")
    (pkg / "b" / "y.py").write_text("def g():\n    pass\n")
    (pkg / "b" / "z.py").write_text("def h():\n    from megarl.a import x\n")  # b.z -> a.x -> b.y
    pg = package_graph(import_graph(pkg))
    assert module_name(pkg / "b" / "z.py", pkg) == "megarl.b.z"
    assert circles({a: dict.fromkeys(es) for a, es in pg.items()}) == [["megarl.a", "megarl.b"]]


#: rollout/'s packages, bottom to top: a module imports only from its own layer and those below.
#: `megarl.rollout` itself (routes.py, the package docstring) sits below all three.
ROLLOUT_LAYERS = ["megarl.rollout", "megarl.rollout.engines", "megarl.rollout.weights", "megarl.rollout.controller"]


def rollout_layer(mod: str) -> int | None:
    """The index in ROLLOUT_LAYERS of the rollout package `mod` belongs to; None outside rollout."""
    parts = mod.split(".")
    if parts[:2] != ["megarl", "rollout"]:
        return None
    sub = ".".join(parts[:3])
    return ROLLOUT_LAYERS.index(sub) if sub in ROLLOUT_LAYERS else 0


def rollout_upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import (top of file or inside a function) from a rollout layer to one above it."""
    out = []
    for a, edges in graph.items():
        for b, line in edges.items():
            la, lb = rollout_layer(a), rollout_layer(b)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} -> {b} (line {line})")
    return out


def test_rollout_packages_import_downward_only():
    """engines < weights < controller: the engines never reach for the weight push or the
    controller, the weight push never for the controller."""
    found = rollout_upward_imports(import_graph())
    assert not found, f"rollout layers are {' < '.join(ROLLOUT_LAYERS)}; these import upward: {'; '.join(found)}"


def test_the_rollout_layer_check_sees_an_upward_import_inside_a_function(tmp_path):
    pkg = tmp_path / "megarl"
    for sub in ("rollout", "rollout/engines", "rollout/controller"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "controller" / "c.py").write_text("from megarl.rollout.engines import e\n")
    (pkg / "rollout" / "engines" / "e.py").write_text("def f():\n    from megarl.rollout.controller import c\n")
    assert rollout_upward_imports(import_graph(pkg)) == [
        "megarl.rollout.engines.e -> megarl.rollout.controller.c (line 2)"]


def long_functions(root: Path = PKG) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        limit = MAX_LINES_IN.get(rel, MAX_LINES)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{rel}:{node.lineno} {node.name} is {n} lines (at most {limit})")
    return out


def test_no_function_is_too_long():
    found = long_functions()
    assert not found, "split these into named steps: " + "; ".join(found)


def test_the_length_check_counts_a_long_function(tmp_path):
    pkg = tmp_path / "megarl"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n" + "    x = 1\n" * MAX_LINES + "\n\ndef g():\n    pass\n")
    assert long_functions(pkg) == [f"megarl/m.py:1 f is {MAX_LINES + 1} lines (at most {MAX_LINES})"]


# -- bootstrap before megatron --------------------------------------------------------------

def top_level_imports(tree: ast.Module) -> list[ast.AST]:
    """Imports that run when the module is imported: module body, including under if/try."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo[:0] = [n for field in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, field, [])]
        elif isinstance(node, ast.ExceptHandler):
            todo[:0] = node.body
    return out


def imported_names(node: ast.AST, package: str = "") -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names] + [base]


def megatron_at_import(root: Path = PKG) -> dict[str, str]:
    """{megarl module: the chain by which importing it imports megatron} for every module that
    does (top-level imports only, transitively; importing a package runs its __init__)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    direct: dict[str, set[str]] = {}
    heavy: dict[str, str] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in top_level_imports(ast.parse(path.read_text(), str(path))):
            for name in imported_names(node, package):
                if name == "megatron" or name.startswith("megatron."):
                    heavy.setdefault(mod, f"{mod} imports {name} (line {node.lineno})")
                parts = name.split(".")
                deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files)
        direct[mod] = deps - {mod}
    changed = True
    while changed:
        changed = False
        for mod, deps in direct.items():
            if mod not in heavy:
                via = next((d for d in sorted(deps) if d in heavy), None)
                if via:
                    heavy[mod] = f"{mod} -> {heavy[via]}"
                    changed = True
    return heavy


def test_light_modules_do_not_import_megatron():
    heavy = megatron_at_import()
    found = [heavy[m] for m in LIGHT if m in heavy]
    assert not found, "these must stay light (imported before bootstrap, or in every vLLM process): " + "; ".join(found)


def is_bootstrap_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and
            (getattr(node.func, "id", None) == "bootstrap" or getattr(node.func, "attr", None) == "bootstrap"))


def early_megatron_imports(path: Path, heavy: dict[str, str]) -> list[str]:
    """In a program: imports of megatron (or of a megarl module that imports it) that come
    before any bootstrap() call in the same function, or at module level before a module-level
    bootstrap() call. Programs under megarl/ count too (`if __name__ == "__main__"`)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    module_first = None
    for scope in [tree] + functions:
        # a scope's own nodes: those of functions nested in it belong to their own scope
        nested = {id(x) for f in ast.walk(scope)
                  if f is not scope and isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in ast.walk(f)}
        own = [n for n in ast.walk(scope) if id(n) not in nested]
        first = min((n.lineno for n in own if is_bootstrap_call(n)), default=None)
        if scope is tree:
            module_first = first
        elif module_first is not None:
            continue   # functions run after the module-level bootstrap() call
        for n in own:
            if isinstance(n, (ast.Import, ast.ImportFrom)) and (first is None or n.lineno < first):
                for name in imported_names(n):
                    if name == "megatron" or name.startswith("megatron.") or name in heavy:
                        out.append(f"{path.relative_to(ROOT)}:{n.lineno} imports {name} before bootstrap()")
                        break
    return out


def programs() -> list[Path]:
    found = [p for d in PROGRAM_DIRS for p in sorted((ROOT / d).glob("*.py"))
             if "__main__" in p.read_text() and not p.name.startswith("test_")]
    found += [p for p in sorted(PKG.rglob("*.py")) if 'if __name__ == "__main__"' in p.read_text()]
    return sorted(set(found) | {PKG / "cli.py"})


def test_programs_bootstrap_before_megatron():
    heavy = megatron_at_import()
    found = [line for p in programs() for line in early_megatron_imports(p, heavy)]
    assert not found, "call megarl.bootstrap.bootstrap() first: " + "; ".join(found)


def test_the_bootstrap_check_sees_an_early_import(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("import os\nfrom megatron.core import parallel_state\n\n"
                    "def main():\n    from megarl.bootstrap import bootstrap\n    bootstrap()\n"
                    "    import megatron.core.models\n\n"
                    "def other():\n    import megatron.core.optimizer\n    bootstrap()\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        found = early_megatron_imports(prog, {})
    finally:
        ROOT = old
    assert found == ["prog.py:2 imports megatron.core.parallel_state before bootstrap()",
                     "prog.py:10 imports megatron.core.optimizer before bootstrap()"]


def test_bootstrap_refuses_to_run_after_megatron():
    """At run time too: a process that imported megatron before bootstrap() gets a named error."""
    code = ("import megatron.core\nfrom megarl.bootstrap import bootstrap\n"
            "try:\n    bootstrap()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "refused: megatron was imported before megarl.bootstrap.bootstrap()" in out.stdout


@pytest.mark.parametrize("module", ["megarl.cli", "megarl.config", "megarl.rollout.engines.plugin"])
def test_light_modules_import_without_megatron_at_run_time(module):
    code = f"import sys, {module}\nprint(sorted(m for m in sys.modules if m.startswith('megatron'))[:3])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} imported megatron: {out.stdout}"
