"""One place for a slurm job's layout (megarl/plan/job.py): the recipe's `cluster:` section, with
sbatch's environment on top (each replacement named); the servers the job starts replace
rollout.engines.count, and `megarl plan RECIPE` plans with the count the job will run, so it
answers what the job's own plan (mode=remote, one URL per server) answers."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.plan import make_plan
from megarl.plan.job import job_layout

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_RECIPES = [p for p in sorted((ROOT / "recipes").glob("*.yaml"))
                   if p.name != "base.yaml" and load_config(p).cluster.gpus_per_node]
SCRIPTS = {"ppo_7b.sh": "qwen2.5_7b.yaml", "ppo_32b.sh": "qwen2.5_32b.yaml", "ppo_70b.sh": "llama3.1_70b.yaml",
           "grpo_qwen3_30b_a3b.sh": "qwen3_30b_a3b.yaml", "grpo_qwen3_235b_a22b.sh": "qwen3_235b_a22b.yaml"}


def job_overrides(cfg, env=None) -> list[str]:
    """What slurm/common.sh passes the job's own `megarl plan` (addresses made up)."""
    layout = job_layout(cfg, env or {})
    urls = ",".join(f"http://10.0.0.{i // 8}:{8100 + i % 8}" for i in range(layout.engines))
    return [*layout.overrides(), "rollout.engines.mode=remote", f"rollout.engines.urls=[{urls}]"]


def _same_plan(recipe, overrides=(), env=None):
    cfg = load_config(recipe, list(overrides))
    ours, job = make_plan(cfg), make_plan(load_config(recipe, [*overrides, *job_overrides(cfg, env)]))
    for key in ("fits", "per_gpu_bytes", "placement", "cluster"):
        assert ours[key] == job[key], (key, ours[key], job[key])
    return ours


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES, ids=lambda p: p.name)
def test_plan_of_a_recipe_is_the_jobs_plan(recipe):
    _same_plan(recipe)


def test_a_count_the_job_replaces_is_stated_and_planned_as_the_job_runs_it():
    """7B recipe with 4 engines on an 8-GPU engine node of TP=1: the job starts 8 servers; the
    plan says so and plans 8, as the job's own plan does."""
    p = _same_plan(ROOT / "recipes/qwen2.5_7b.yaml", ["rollout.engines.count=4"])
    assert p["placement"]["engines"]["count"] == 8
    assert any(re.search(r"rollout\.engines\.count=4 is replaced by the 8 servers the slurm job starts", n)
               for n in p["notes"]), p["notes"]
    layout = job_layout(load_config(ROOT / "recipes/qwen2.5_7b.yaml", ["rollout.engines.count=4"]), {})
    assert layout.engines == 8 and any("rollout.engines.count=4" in n for n in layout.notes)


def test_layout_is_the_recipes_and_the_environment_replaces_a_value_by_name():
    cfg = load_config(ROOT / "recipes/llama3.1_70b.yaml")
    plain = job_layout(cfg, {})
    assert (plain.trainer_nodes, plain.engine_nodes, plain.gpus_per_node, plain.engine_tp) == (5, 3, 8, 4)
    assert plain.engines_per_node == 2 and plain.engines == cfg.rollout.engines.count and not plain.notes
    moved = job_layout(cfg, {"ENGINE_NODES": "4", "TRAINER_NODES": "4"})
    assert moved.nodes == 8 and moved.engines == 8
    assert "ENGINE_NODES=4 from the environment replaces the recipe's cluster.engine_nodes=3" in moved.notes
    assert "TRAINER_NODES=4 from the environment replaces the recipe's cluster.trainer_nodes=5" in moved.notes
    assert any("rollout.engines.count=6 is replaced by the 8 servers" in n for n in moved.notes)
    # the job's plan for a layout equals `megarl plan` with that layout given as the recipe's
    _same_plan(ROOT / "recipes/llama3.1_70b.yaml", ["cluster.engine_nodes=4", "cluster.trainer_nodes=4"])


@pytest.mark.parametrize("env, line", [
    ({"ENGINE_NODES": "two"}, r"ENGINE_NODES='two' \(environment\): must be a whole number"),
    ({"ENGINES_PER_NODE": "3", "ENGINE_TP": "4"}, r"ENGINES_PER_NODE=3 x ENGINE_TP=4: more than the 8 GPUs"),
    ({"ENGINE_NODES": "0"}, r"cluster\.engine_nodes=0: a slurm job runs its vLLM servers on nodes of their own"),
])
def test_a_bad_layout_is_one_line(env, line):
    with pytest.raises(ConfigError, match=line):
        job_layout(load_config(ROOT / "recipes/qwen2.5_32b.yaml"), env)


@pytest.mark.parametrize("script", sorted(SCRIPTS), ids=str)
def test_sbatch_lines_match_the_recipes_cluster(script):
    """#SBATCH --nodes / --gpus-per-node are read by sbatch before the job runs: they must be the
    recipe's cluster.nodes / gpus_per_node, the one place the layout is set."""
    text = (ROOT / "slurm" / script).read_text()
    c = load_config(ROOT / "recipes" / SCRIPTS[script]).cluster
    assert f"RECIPE=${{RECIPE:-recipes/{SCRIPTS[script]}}}" in text
    assert re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1) == str(c.nodes)
    assert re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1) == str(c.gpus_per_node)
    assert not re.search(r"^(TRAINER_NODES|ENGINE_NODES|ENGINE_TP)=", text, re.M)


def test_job_shell_prints_the_layout_for_bash():
    out = subprocess.run([sys.executable, "-m", "megarl.plan.job_shell", "recipes/qwen2.5_7b.yaml",
                          "rollout.engines.count=4"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "ENGINE_TP": "2"})
    assert out.returncode == 0, out.stderr
    shell = subprocess.run(["bash", "-c", out.stdout + '\necho "$ENGINES_PER_NODE ${#LAYOUT_NOTES[@]} '
                            '${LAYOUT_OVERRIDES[*]}"'], capture_output=True, text=True, check=True).stdout
    assert shell.startswith("4 1 ") and "rollout.engines.tp=2" in shell and "rollout.engines.count=4" in shell
    bad = subprocess.run([sys.executable, "-m", "megarl.plan.job_shell", "recipes/tiny_cpu.yaml"], cwd=ROOT,
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "cluster.engine_nodes=0" in bad.stderr


@pytest.mark.parametrize("recipe", ["recipes/qwen2.5_7b.yaml", "my_recipes/qwen2.5_7b_long.yaml"])
def test_the_default_run_dir_holds_the_recipes_name(recipe):
    """Two recipes sent through one script (RECIPE=...) get run folders of their own: neither
    resumes the other's checkpoint. Two submissions of the same recipe (job ids of their own)
    share it: the second resumes where the first left, through the same resume a requeued run
    takes (tests/e2e/test_slurm.py)."""
    for job in (11, 12):
        shell = ('set -euo pipefail; MEGARL_ROOT=.; source slurm/common.sh; SLURM_JOB_NAME=megarl-ppo-7b; '
                 f'SLURM_JOB_ID={job}; RECIPE={recipe}; megarl_settings; echo "$RUN_DIR"')
        out = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"runs/megarl-ppo-7b-{Path(recipe).stem}"
