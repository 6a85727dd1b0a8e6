"""Secret settings (megarl/config/secrets.py): the engines' and the agent service's API keys
given as settings authenticate the run but are never written nor sent: not in the run dir's
config.yaml, not in a checkpoint's, not in W&B's records (its config nor the command line it
keeps), not in `megarl plan --config`'s output, not in an error message. A key may come from an
owner-only file instead (`*.api_key_file`, refused when others may read it). The end-to-end
check of a whole run's files is tests/e2e/test_train_cli.py
(test_a_key_given_on_the_command_line_authenticates_and_is_written_nowhere)."""
import os
import sys

import pytest
from omegaconf import OmegaConf
from wandb_records import config, run_files

from megarl.config import ConfigError, load_config, save_config
from megarl.config import secrets as secret_settings

ENGINE_KEY, SERVICE_KEY = "engine-key-5f3a9c1e77", "service-key-0b8d2e6f41"
SERVICE_RECIPE = "recipes/tiny_agent_service_cpu.yaml"


def keyed(run_dir, *extra, engine_key=ENGINE_KEY, service_key=SERVICE_KEY):
    """The overrides of a service run whose engines are servers megarl starts, both keys given."""
    keys = [f"rollout.engines.api_key={engine_key}"] * bool(engine_key) + [f"service.api_key={service_key}"] * bool(
        service_key)
    return [f"run.dir={run_dir}", "rollout.engines.mode=local_servers", *keys, "metrics.tensorboard=false",
            "metrics.progress=false", *extra]


def assert_nowhere(folder, *keys):
    """No file under `folder` holds any of `keys`' bytes."""
    found = [(str(p), k) for p in folder.rglob("*") if p.is_file() for k in keys if k.encode() in p.read_bytes()]
    assert not found, f"secrets written in clear: {found}"


def test_the_keys_authenticate_and_the_saved_config_holds_neither(tmp_path):
    cfg = load_config(SERVICE_RECIPE, keyed(tmp_path))
    assert (cfg.rollout.engines.api_key, cfg.service.api_key) == (ENGINE_KEY, SERVICE_KEY)   # the run uses them
    save_config(cfg, tmp_path / "config.yaml")
    assert_nowhere(tmp_path, ENGINE_KEY, SERVICE_KEY)
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.rollout.engines.api_key == saved.service.api_key == secret_settings.REDACTED
    assert cfg.service.api_key == SERVICE_KEY, "redacting the saved copy changed the run's own config"
    text = secret_settings.redacted_yaml(cfg)      # what a checkpoint's config.yaml holds
    assert ENGINE_KEY not in text and SERVICE_KEY not in text and "steps: 20" in text


def test_a_saved_config_reloads_without_its_keys(tmp_path):
    """The placeholder is no key: a saved config reloads as if no key were set (the key then comes
    from the environment, or is a new one), and never authenticates with the placeholder."""
    save_config(load_config(SERVICE_RECIPE, keyed(tmp_path)), tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.rollout.engines.api_key == again.service.api_key == ""
    plain = load_config("recipes/tiny_cpu.yaml", [])        # no key set: nothing changes
    assert plain.rollout.engines.api_key == ""


def test_the_wandb_run_holds_neither_key(tmp_path, monkeypatch):
    """W&B gets the config with the keys redacted, and the command line it records (sys.argv, in
    the run's metadata) without them."""
    from megarl.metrics.logger import MetricsLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    overrides = keyed(tmp_path / "run", "metrics.wandb.project=megarl-test", "train.steps=2")
    monkeypatch.setattr(sys, "argv", ["megarl", "train", SERVICE_RECIPE, *overrides])
    log = MetricsLogger.for_run(load_config(SERVICE_RECIPE, overrides), 0)
    log.log(0, {"reward_mean": 0.5})
    log.close()
    assert sys.argv[-1] == overrides[-1] and ENGINE_KEY in " ".join(sys.argv)   # the process's own argv is kept
    (recorded,) = run_files(tmp_path / "run")
    got = config(recorded)
    assert got["rollout"]["engines"]["api_key"] == got["service"]["api_key"] == secret_settings.REDACTED
    assert_nowhere(tmp_path / "run", ENGINE_KEY, SERVICE_KEY)


def test_plan_config_prints_no_key(tmp_path, capsys):
    from megarl import cli
    assert cli.main(["plan", "--config", SERVICE_RECIPE, *keyed(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "api_key: " + secret_settings.REDACTED in out
    assert ENGINE_KEY not in out and SERVICE_KEY not in out


def test_an_error_about_a_key_does_not_show_it():
    with pytest.raises(ConfigError) as e:
        load_config("recipes/tiny_cpu.yaml", [f"service.api_key={SERVICE_KEY}"])
    assert str(e.value).startswith("service.api_key='<redacted>': is not used with rollout.mode=partial")
    assert SERVICE_KEY not in str(e.value)


def write_key(path, key, mode):
    path.write_text(key + "\n")
    os.chmod(path, mode)
    return path


def test_a_key_file_must_be_owner_only(tmp_path):
    """A key read from `*.api_key_file`: the run uses it; a file others may read is refused in
    one line naming the setting, the file and the fix; the saved config names the file, not the key."""
    engine_file = write_key(tmp_path / "engine.key", ENGINE_KEY, 0o600)
    service_file = write_key(tmp_path / "service.key", SERVICE_KEY, 0o644)
    files = [f"rollout.engines.api_key_file={engine_file}", f"service.api_key_file={service_file}"]
    with pytest.raises(ConfigError) as e:
        load_config(SERVICE_RECIPE, keyed(tmp_path, *files, engine_key="", service_key=""))
    msg = str(e.value)
    assert msg.startswith(f"service.api_key_file='{service_file}': others may read it (mode 0644)")
    assert f"chmod 600 {service_file}" in msg and "\n" not in msg and SERVICE_KEY not in msg
    os.chmod(service_file, 0o400)
    cfg = load_config(SERVICE_RECIPE, keyed(tmp_path / "run", *files, engine_key="", service_key=""))
    assert (cfg.rollout.engines.api_key, cfg.service.api_key) == (ENGINE_KEY, SERVICE_KEY)
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert_nowhere(tmp_path / "run", ENGINE_KEY, SERVICE_KEY)
    again = load_config(tmp_path / "run" / "config.yaml")    # the saved config reads the files again
    assert (again.rollout.engines.api_key, again.service.api_key) == (ENGINE_KEY, SERVICE_KEY)


def test_a_key_file_that_cannot_serve_is_one_line(tmp_path):
    missing = tmp_path / "nope.key"
    with pytest.raises(ConfigError, match=rf"^rollout\.engines\.api_key_file='{missing}': cannot be read"):
        load_config(SERVICE_RECIPE, keyed(tmp_path, f"rollout.engines.api_key_file={missing}", engine_key=""))
    empty = write_key(tmp_path / "empty.key", "", 0o600)
    with pytest.raises(ConfigError, match=rf"^rollout\.engines\.api_key_file='{empty}': is empty"):
        load_config(SERVICE_RECIPE, keyed(tmp_path, f"rollout.engines.api_key_file={empty}", engine_key=""))
    both = write_key(tmp_path / "both.key", ENGINE_KEY, 0o600)
    with pytest.raises(ConfigError) as e:
        load_config(SERVICE_RECIPE, keyed(tmp_path, f"rollout.engines.api_key_file={both}"))
    assert str(e.value).startswith("rollout.engines.api_key='<redacted>': rollout.engines.api_key_file is set too")
    assert ENGINE_KEY not in str(e.value)
    with pytest.raises(ConfigError, match=r"^rollout\.engines\.api_key_file="):   # in-process engines have no key
        load_config("recipes/tiny_cpu.yaml", [f"rollout.engines.api_key_file={both}"])


def test_a_slurm_jobs_overrides_file_holds_no_key(tmp_path):
    """slurm/common.sh keeps the job's overrides in <job log>/overrides.txt: a key among them is redacted."""
    import subprocess
    job = ("source slurm/common.sh; SLURM_JOB_ID=1 RECIPE=r MEGARL_ROOT=. TRAINER_NODE_LIST=(a) "
           "ENGINE_NODE_LIST=(b) TRAINER_PROCS_PER_NODE=1 ENGINES_PER_NODE=1 ENGINE_TP=1 MASTER_ADDR=a "
           "MASTER_PORT=1 LAYOUT_NOTES=() ENGINE_URLS=(u); write_job_info \"$@\"")
    overrides = ["train.steps=3", f"rollout.engines.api_key={ENGINE_KEY}", f"service.api_key={SERVICE_KEY}",
                 f"rollout.api_key={ENGINE_KEY}", "service.api_key_file=/keys/service"]
    subprocess.run(["bash", "-c", job, "job", str(tmp_path), *overrides], check=True)
    assert (tmp_path / "overrides.txt").read_text().split() == [
        "train.steps=3", "rollout.engines.api_key=<redacted>", "service.api_key=<redacted>",
        "rollout.api_key=<redacted>", "service.api_key_file=/keys/service"]
    assert_nowhere(tmp_path, ENGINE_KEY, SERVICE_KEY)
    # a Python that cannot redact them (a broken MEGARL_PY): no overrides written at all
    subprocess.run(["bash", "-c", "MEGARL_PY=/bin/false; " + job, "job", str(tmp_path), *overrides], check=True)
    assert (tmp_path / "overrides.txt").read_text().startswith("(not written")
    assert_nowhere(tmp_path, ENGINE_KEY, SERVICE_KEY)
