"""metrics.wandb: the rows of metrics.jsonl and the resolved config in an offline W&B run under
run.dir, the same W&B run continued on resume, and one line naming the extra when the wandb
package is missing. The runs are read back from their .wandb files (tests/wandb_records.py)."""
import json
import os

import pytest
from wandb_records import config, history, run_files

from megarl.config import ConfigError, load_config
from megarl.metrics import wandb_sink
from megarl.metrics.logger import MetricsLogger


def cfg_for(run_dir, *extra):
    return load_config("recipes/tiny_cpu.yaml", [f"run.dir={run_dir}", "metrics.tensorboard=false",
                                                 "metrics.progress=false", "metrics.wandb.project=megarl-test",
                                                 "metrics.wandb.tags=[tiny,unit]", *extra])


def log_steps(cfg, steps, start=0):
    log = MetricsLogger.for_run(cfg, start)
    for step in steps:
        log.log(step, {"reward_mean": step / 10, "kl": 0.5 + step, "eval/held_out/mean@4": step / 4,
                       "reward_errors": 0})
    log.close()


def test_offline_run_has_every_metric_key_and_the_config_and_resume_continues_it(tmp_path, monkeypatch):
    """$WANDB_MODE=offline is honoured with metrics.wandb.mode unset: the run's files are under
    run.dir/wandb, every row of metrics.jsonl is in its history with the same keys and values,
    and its config is the resolved one. A resumed run (start step 2) logs to the same W&B run
    id; a fresh run in the same run.dir starts another."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    log_steps(cfg_for(run_dir, "train.steps=4"), range(3))
    (first,) = run_files(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = history(first)
    assert [{k: r[k] for k in rows[0]} for r in logged] == rows
    got = config(first)
    assert got["train"]["steps"] == 4 and got["metrics"]["wandb"]["tags"] == ["tiny", "unit"]
    assert got["model"]["path"] == os.path.abspath(cfg_for(run_dir).model.path)   # as config.yaml
    run_id = (run_dir / wandb_sink.ID_FILE).read_text().strip()
    assert first.name == f"run-{run_id}.wandb"

    monkeypatch.delenv("WANDB_MODE")
    log_steps(cfg_for(run_dir, "train.steps=4", "metrics.wandb.mode=offline"), [2, 3], start=2)
    files = run_files(run_dir)
    assert len(files) == 2 and files[1].name == first.name      # the same W&B run, continued
    assert [r["step"] for r in history(files[1])] == [2, 3]

    log_steps(cfg_for(run_dir, "metrics.wandb.mode=offline"), [0])   # a fresh run: a new W&B run
    assert (run_dir / wandb_sink.ID_FILE).read_text().strip() != run_id
    assert len({p.name for p in run_files(run_dir)}) == 2


def test_missing_wandb_package_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(wandb_sink.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        wandb_sink.check_installed(cfg_for(tmp_path).metrics.wandb)
    assert str(e.value).startswith("metrics.wandb.project='megarl-test': the wandb package is not installed")
    assert "pip install 'megarl[wandb]'" in str(e.value) and "\n" not in str(e.value)
    wandb_sink.check_installed(load_config("recipes/tiny_cpu.yaml", []).metrics.wandb)   # off: no check


def test_wandb_settings_without_a_project_and_unknown_modes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^metrics\.wandb\.project='': is empty, so the other"):
        load_config("recipes/tiny_cpu.yaml", ["metrics.wandb.mode=offline"])
    with pytest.raises(ConfigError, match=r"^metrics\.wandb\.mode='local': must be one of"):
        cfg_for(tmp_path, "metrics.wandb.mode=local")


def test_a_run_wandb_cannot_start_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    """wandb.init refusing the run (as it does online without credentials, with its UsageError)
    becomes one ConfigError line naming the setting and the ways out (log in, offline)."""
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as e:
        MetricsLogger.for_run(cfg_for(tmp_path / "run", "metrics.wandb.mode=online"), 0)
    msg = str(e.value)
    assert msg.startswith("metrics.wandb.project='megarl-test': W&B did not start the run (No API key configured.")
    assert "metrics.wandb.mode=offline" in msg and "\n" not in msg
