"""`python -m megarl.plan.job_shell RECIPE [key=value ...]`: the slurm job's layout (plan/job.py)
as bash assignments for slurm/common.sh, the environment's values applied; or one line naming
the problem (exit 2)."""
from __future__ import annotations

import sys

from megarl.config import load_config
from megarl.config.schema import ConfigError
from megarl.plan.job import job_layout


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m megarl.plan.job_shell RECIPE [key=value ...]", file=sys.stderr)
        return 2
    try:
        print(job_layout(load_config(argv[0], argv[1:])).shell())
    except ConfigError as err:
        print(f"megarl: job layout: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
