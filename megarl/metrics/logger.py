"""One sink for per-step metrics: metrics.jsonl, TensorBoard, Weights & Biases when asked
(metrics.wandb, `wandb_sink.py`), and a console progress line."""
from __future__ import annotations

import json
from pathlib import Path

from megarl.config import secrets
from megarl.metrics.progress import progress_bar
from megarl.metrics.wandb_sink import WandbSink


class MetricsLogger:
    """Rank 0 only. `log(step, metrics)` appends a JSON line, writes TensorBoard scalars, logs
    the same row to W&B (`wandb`, a WandbSink) and prints the step's headline numbers under a
    tqdm bar on a terminal, as plain lines elsewhere (a slurm log: `progress.py`)."""

    HEADLINE = ("reward_mean", "response_len_mean", "kl", "policy_loss", "value_loss",
                "logprob_mismatch_mean", "moe_imbalance", "step_time_s")

    def __init__(self, run_dir: str, total_steps: int, tensorboard: bool, progress: bool, start_step: int = 0,
                 wandb: WandbSink | None = None):
        self.dir = Path(run_dir)
        self.wandb = wandb
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_step = start_step
        # opened at the first logged step: a run that trained nothing (its engines never came
        # up, a bad input found late) leaves no metrics.jsonl, and the rows of the run before
        # it stay as they were
        self.jsonl = None
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # here: it loads tensorboard (seconds)
            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        # on a log file the step lines are the progress: no line of its own (every_s=None)
        self.bar = progress_bar(total_steps, "megarl", "step", disable=not progress, initial=start_step,
                                every_s=None, dynamic_ncols=True)

    @classmethod
    def for_run(cls, cfg, start_step: int) -> "MetricsLogger":
        """The run's logger, as cfg.metrics asks (W&B gets the resolved config, its secrets redacted)."""
        m = cfg.metrics
        wandb = None
        if m.wandb.project:
            wandb = WandbSink(m.wandb, cfg.run.dir, secrets.redacted_dict(cfg), hide=secrets.values(cfg),
                              resumed=start_step > 0)
        return cls(cfg.run.dir, cfg.train.steps, m.tensorboard, m.progress, start_step=start_step, wandb=wandb)

    def _open(self):
        """metrics.jsonl for appending: a fresh run starts a fresh file; a resumed one keeps the
        rows before its checkpoint's step (rows logged after that checkpoint, before a crash,
        are about to be redone)."""
        path = self.dir / "metrics.jsonl"
        kept = []
        if self.start_step and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) < self.start_step]
        path.write_text("".join(line + "\n" for line in kept))
        return path.open("a")

    def log(self, step: int, metrics: dict, line: str | None = None) -> None:
        """One row at `step`. `line`: a row beside the step's own (the held-out evaluation,
        megarl/eval/): printed as given, and the bar does not move."""
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self.jsonl is None:
            self.jsonl = self._open()
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(row)
        if line is not None:
            self.bar.write(line)
            return
        headline = " ".join(f"{k.replace('_mean', '').replace('_s', '')}={row[k]:.3g}"
                            for k in self.HEADLINE if isinstance(row.get(k), (int, float)))
        self.bar.update(1)
        self.bar.write(f"step {step:4d} | {headline}")

    def close(self) -> None:
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v
