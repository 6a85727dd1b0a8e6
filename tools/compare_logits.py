#!/usr/bin/env python
"""Thin CLI over megarl.conversion.cli.cli_compare_logits; see `--help` and README "Converting checkpoints"."""
import os
import sys

# On two shared cores OpenMP threads must not spin (see tools/make_tiny_model.py); set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.conversion.cli import cli_compare_logits  # noqa: E402

if __name__ == "__main__":  # megatron's dist_checkpointing needs the guarded entry point
    sys.exit(cli_compare_logits())
