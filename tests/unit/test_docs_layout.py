"""docs/architecture.md's "Where things live" table lists every module of megarl/, so the map
a newcomer reads cannot fall behind the code: a module added, moved or renamed without its row
fails here, and so does a row for a module that no longer exists."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def defines_code(path: Path) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in ast.parse(path.read_text()).body)


def modules() -> tuple[set[str], set[str]]:
    """(modules that need a row, modules that may have one): megarl/a/b.py -> a/b.py; a
    package's __init__.py needs a row only when it defines functions or classes (not when it
    only re-exports names)."""
    need, may = set(), set()
    for p in (ROOT / "megarl").rglob("*.py"):
        rel = p.relative_to(ROOT / "megarl").as_posix()
        may.add(rel)
        if p.name != "__init__.py" or defines_code(p):
            need.add(rel)
    return need, may


def table_rows(text: str) -> set[str]:
    """Module paths named in the first column of the table under "## Where things live"."""
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            named.update(re.findall(r"`([\w/]+\.py)`", first))
    return named


def test_every_module_has_a_row_and_every_row_a_module():
    rows, (need, may) = table_rows(DOC.read_text()), modules()
    assert not need - rows, f"modules missing from docs/architecture.md 'Where things live': {sorted(need - rows)}"
    assert not rows - may, f"rows for modules that do not exist: {sorted(rows - may)}"


def test_the_row_reader_finds_paths_in_the_first_column_only():
    text = ("# x\n## Where things live\n| module | holds |\n|---|---|\n"
            "| `a/b.py`, `a/c.py` | see `z/y.py` |\n## Next\n| `q/r.py` | no |\n")
    assert table_rows(text) == {"a/b.py", "a/c.py"}
