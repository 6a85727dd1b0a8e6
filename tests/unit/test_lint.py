"""The linter is part of the suite: `ruff check` (rules in ruff.toml) passes on the project's
Python (megarl/, tests/, bench/, tools/, examples/). `make lint` runs the same command, and
`.venv/bin/ruff check --fix <files>` repairs most findings (import order, unused imports)."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
TARGETS = ["megarl", "tests", "bench", "tools", "examples", "setup.py"]


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    assert RUFF, "ruff is not installed: `make venv` installs it (setup.py extra `test`)"
    return subprocess.run([RUFF, "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_code_passes_the_linter():
    out = ruff(*TARGETS)
    assert out.returncode == 0, f"ruff found problems (fix, or `ruff check --fix`):\n{out.stdout[-6000:]}{out.stderr}"


def test_the_linter_runs_with_the_project_rules(tmp_path):
    """The same config finds what it should: an unused import and imports out of order."""
    (tmp_path / "ruff.toml").write_text((ROOT / "ruff.toml").read_text())
    (tmp_path / "bad.py").write_text("import sys\nimport os\n\nprint(os.sep)\n")
    out = ruff("bad.py", cwd=tmp_path)
    assert out.returncode == 1
    assert "F401" in out.stdout and "I001" in out.stdout
