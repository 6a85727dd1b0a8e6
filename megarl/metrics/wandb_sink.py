"""Weights & Biases as a second home of the metrics rows (metrics.wandb.*): the optional `wandb`
package, imported only when metrics.wandb.project is set.

Each row of metrics.jsonl is logged as is, its `step` key the x-axis of every chart
(`define_metric`): a resumed run redoes the steps after its checkpoint, and W&B's own step
counter only moves forward, so the rows carry their step themselves (a redone step shows twice in
W&B's history; the later one is the one that trained). The run's id is kept in
<run.dir>/wandb_run_id: a resumed run continues the same W&B run (resume="allow"), a fresh run in
the same folder starts a new one. Files go under <run.dir>/wandb; offline mode
(metrics.wandb.mode=offline or $WANDB_MODE=offline) writes only them, for `wandb sync` later.
W&B gets the config with its secrets redacted (config/secrets.py), and keeps the command line
(sys.argv, in the run's metadata) with them redacted too.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import sys
from pathlib import Path
from typing import Sequence

from megarl.config.errors import ConfigError
from megarl.config.secrets import scrub

ID_FILE = "wandb_run_id"
INSTALL = "pip install 'megarl[wandb]'"


def check_installed(w) -> None:
    """ConfigError when metrics.wandb (a WandbConfig) is on and the wandb package is missing."""
    if w.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.wandb.project={w.project!r}: the wandb package is not installed: {INSTALL} "
                          f"(or remove metrics.wandb.* to log to metrics.jsonl and TensorBoard only)")


def run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of this run: the stored one when resuming, else a new one, stored."""
    path = run_dir / ID_FILE
    if resumed and path.exists():
        stored = path.read_text().strip()
        if stored:
            return stored
    new = secrets.token_hex(6)     # W&B ids: letters and digits, unique within the project
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


@contextlib.contextmanager
def argv_without(hide: Sequence[str]):
    """sys.argv with each of `hide` redacted, while W&B's init reads it into its metadata."""
    kept = sys.argv
    sys.argv = [scrub(arg, hide) for arg in kept]
    try:
        yield
    finally:
        sys.argv = kept


class WandbSink:
    """One W&B run for one megarl run (rank 0): `log(row)` per step, `close()` at the end.
    `config` goes to W&B as given (redacted by the caller); `hide`: the secrets its record of
    the command line must not hold."""

    def __init__(self, w, run_dir: str, config: dict, resumed: bool, hide: Sequence[str] = ()):
        check_installed(w)
        import wandb
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with argv_without(hide):
                self.run = wandb.init(project=w.project, entity=w.entity or None,
                                      name=w.name or folder.resolve().name, tags=list(w.tags) or None,
                                      mode=w.mode or None, dir=str(folder), id=run_id(folder, resumed),
                                      resume="allow", config=config,
                                      # the console stays megarl's own (progress bar, one line per step)
                                      settings=wandb.Settings(console="off"))
        except wandb.errors.Error as err:   # not logged in, no network, a project of someone else's
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(f"metrics.wandb.project={w.project!r}: W&B did not start the run ({first}): log in "
                              f"(`wandb login` or $WANDB_API_KEY), check metrics.wandb.entity, or set "
                              f"metrics.wandb.mode=offline and `wandb sync` later") from err
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        self.run.log(row)

    def close(self) -> None:
        """Finish the W&B run and wait until its files are written: `finish` returns before
        W&B's service process has written the last rows (seen under load); its atexit hook does
        the same, which is not reliable under torchrun's or multiprocessing's exits."""
        import wandb
        self.run.finish()
        wandb.teardown()
