"""The fault-injection hook: the N-th arrival at a named point kills the process like a node loss."""
import os
import signal
import subprocess
import sys

import pytest

from megarl.distributed import faults

BODY = """
from megarl.distributed import faults
for i in range(1, 6):
    faults.point("update")
    print(i, flush=True)
"""


def _run(env):
    return subprocess.run([sys.executable, "-c", BODY], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def test_nth_arrival_is_a_sigkill():
    proc = _run({"MEGARL_FAULT": "save@1,update@3"})
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["1", "2"]      # arrivals 1 and 2 passed, the 3rd never printed


def test_other_ranks_and_unset_plans_run_through():
    assert _run({"MEGARL_FAULT": "update@2", "MEGARL_FAULT_RANK": "1", "RANK": "0"}).returncode == 0
    proc = _run({"MEGARL_FAULT": ""})
    assert proc.returncode == 0 and proc.stdout.split() == ["1", "2", "3", "4", "5"]


def test_bad_plan_is_named():
    with pytest.raises(ValueError, match="MEGARL_FAULT"):
        faults._parse("update@three")
