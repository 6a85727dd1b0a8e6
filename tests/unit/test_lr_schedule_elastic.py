"""The LR schedule counts weight versions, not updates: a step of k times train.groups_per_step
(partial rollout's elastic steps) makes k times the updates, each moving megatron's scheduler
1/k of a fixed step's update (Trainable.schedule_increment), so a decay reaches its floor at
train.steps, not after the samples a fixed run trains."""
import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarl.models.builders import Trainable
from megarl.ppo.optim import optimizer_step
from megarl.ppo.step import mini_batch_count, pace_schedules


class _Optimizer:
    """megatron's optimizer interface, as optimizer_step reads it: step() -> (ok, grad norm, zeros)."""

    def step(self):
        return True, 0.0, None


def _scheduler(warmup: int, total: int, style: str) -> OptimizerParamScheduler:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(opt, init_lr=0.0 if warmup else 1.0, max_lr=1.0, min_lr=0.1,
                                   lr_warmup_steps=warmup, lr_decay_steps=total, lr_decay_style=style,
                                   start_wd=0.0, end_wd=0.0, wd_incr_steps=total, wd_incr_style="constant")


def _lr_after_each_step(multiples, mini_batches: int, warmup: int, style: str) -> list[float]:
    """The learning rate after each step of a run whose step i trains multiples[i] x the groups
    of a fixed step (samples_per_step 8), advanced as ppo_step and optimizer_step advance it."""
    samples, total = 8, len(multiples) * mini_batches
    sched = _scheduler(warmup, total, style)
    actor = Trainable(model=object(), optimizer=_Optimizer(), scheduler=sched, info=None)
    out = []
    for k in multiples:
        n_mini = mini_batch_count(mini_batches, samples, k * samples)
        assert n_mini == k * mini_batches          # each update the size of a fixed step's
        pace_schedules(mini_batches / n_mini, actor, None)   # as ppo_step paces them
        for _ in range(n_mini):
            optimizer_step(actor, "actor")
        out.append(sched.get_lr(sched.optimizer.param_groups[0]))
    return out


@pytest.mark.parametrize("style,warmup", [("linear", 0), ("cosine", 2), ("linear", 3)])
def test_elastic_steps_follow_the_fixed_schedule_per_version(style, warmup):
    fixed = _lr_after_each_step([1] * 6, 2, warmup, style)
    elastic = _lr_after_each_step([1, 3, 8, 1, 5, 2], 2, warmup, style)
    assert elastic == pytest.approx(fixed, abs=1e-9)
    assert fixed[-1] == pytest.approx(0.1) and fixed[-2] > 0.1 + 1e-3   # the floor at the last step, not before


def test_counting_updates_would_reach_the_floor_early():
    """What the increment prevents: one per update, the elastic run is at its floor by step 3."""
    sched = _scheduler(0, 12, "linear")
    for k in (1, 3, 8):
        for _ in range(2 * k):
            sched.step(increment=1)
    assert sched.get_lr(sched.optimizer.param_groups[0]) == pytest.approx(0.1)


def test_lr_warmup_steps_counts_steps_not_updates():
    """The recipes' lr_warmup_steps=10 with 4 mini-batches warms up over 10 steps (40 updates),
    not 2.5 steps: megatron's scheduler gets it in updates."""
    from pathlib import Path

    from megarl.config import load_config
    from megarl.models.setup import lr_schedule
    recipe = Path(__file__).resolve().parents[2] / "recipes/qwen2.5_7b.yaml"
    cfg = load_config(recipe, ["train.ppo_epochs=2"])
    assert (cfg.train.lr_warmup_steps, cfg.train.mini_batches) == (10, 4)
    s = lr_schedule(cfg)
    assert s["warmup"] == 10 * 2 * 4 and s["total_updates"] == cfg.train.steps * 2 * 4
    lrs = _lr_after_each_step([1] * 12, 4, s["warmup"] // 2, "constant")   # one epoch per step here
    assert lrs[8] < 1.0 and lrs[9] == pytest.approx(1.0)   # full lr after the 10th step
