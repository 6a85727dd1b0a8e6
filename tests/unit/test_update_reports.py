"""Update reports -> step metrics (megarl.ppo.reports): every statistic a loss reports reduces by
its key's suffix and reaches the step's metrics; the existing metrics keep their formulas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from conftest import ROOT

from megarl.distributed.env import free_port
from megarl.ppo import reports
from megarl.ppo.losses import policy_loss, value_loss


def test_each_suffix_reduces_by_its_rule():
    totals = {"tokens": 8.0, "entropy_sum": 4.0, "clip_frac_sum": 2.0, "grad_norm": 12.0,
              "policy_loss": 3.0, "new_loss": 1.5, "new_grad_norm": 6.0}
    out = reports.to_metrics(totals, updates=3, dp_size=2)
    assert "tokens" not in out
    assert out["entropy"] == 4.0 / 8 and out["clip_frac"] == 2.0 / 8      # token sums / tokens
    assert out["grad_norm"] == 12.0 / 2 / 3 and out["new_grad_norm"] == 1.0  # global: mean over DP, updates
    assert out["policy_loss"] == 1.0 and out["new_loss"] == 0.5            # DP shares: mean over updates
    assert out["value_loss"] == 0.0 and out["critic_grad_norm"] == 0.0     # always there, 0 when not run


def test_the_existing_metrics_keep_their_formulas():
    """Bitwise what ppo_step computed before the generic rule (clip_tokens is now clip_frac_sum)."""
    totals = {"policy_loss": 0.3141, "value_loss": 2.718, "tokens": 337.0, "clip_frac_sum": 17.000001,
              "entropy_sum": 1234.5678, "grad_norm": 3.3333, "critic_grad_norm": 7.77}
    updates, dp = 3, 3
    out = reports.to_metrics(totals, updates, dp)
    tokens = max(totals["tokens"], 1.0)
    assert out["policy_loss"] == totals["policy_loss"] / updates
    assert out["value_loss"] == totals["value_loss"] / updates
    assert out["clip_frac"] == totals["clip_frac_sum"] / tokens
    assert out["entropy"] == totals["entropy_sum"] / tokens
    assert out["grad_norm"] == totals["grad_norm"] / dp / updates
    assert out["critic_grad_norm"] == totals["critic_grad_norm"] / dp / updates


def test_every_statistic_the_losses_report_reaches_the_metrics():
    """policy_loss's dual_clip_frac, ratio_mean and approx_kl and value_loss's value_clip_frac were
    computed and dropped before (only a fixed list of keys was summed): now each is a metric, the
    token-weighted mean over the micro-batches."""
    gen = torch.Generator().manual_seed(0)
    acc: dict = {}
    micro = []
    for rows in (2, 3):    # two micro-batches of different sizes: the mean weighs by tokens
        logp, old, adv = (torch.randn(rows, 4, generator=gen) for _ in range(3))
        mask = torch.ones(rows, 4)
        mask[0, 2:] = 0
        _, stats = policy_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=2.0)
        _, vstats = value_loss(logp, old, adv, mask, clip=0.1)
        tokens = mask.sum()
        reports.add(acc, {"tokens": tokens, **reports.token_sums({**stats, **vstats}, tokens)})
        micro.append((tokens, {**stats, **vstats}))
    out = reports.to_metrics(reports.sum_over_ranks(acc, torch.device("cpu"), own=True), updates=1, dp_size=1)
    names = set(micro[0][1])
    assert {"clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "value_clip_frac"} <= names <= set(out)
    total = sum(float(t) for t, _ in micro)
    for k in names:
        want = sum(float(s[k] * t) for t, s in micro) / total
        assert abs(out[k] - want) < 1e-6, k


def test_actor_and_critic_statistics_divide_by_their_own_tokens():
    """Both models report `tokens`: added into one total (as before), a PPO step with both
    training halved every per-token metric (clip_frac, entropy). Kept apart per model, each
    `_sum` divides by the tokens of the model that reported it."""
    acc: dict = {}
    for _ in range(2):   # two updates over the same 10 tokens
        reports.add(acc, {"tokens": 10.0, "clip_frac_sum": 3.0, "entropy_sum": 5.0, "policy_loss": 0.4}, "actor")
        reports.add(acc, {"tokens": 10.0, "value_clip_frac_sum": 4.0, "value_loss": 0.8}, "critic")
    out = reports.to_metrics(reports.sum_over_ranks(acc, torch.device("cpu"), own=True), updates=2, dp_size=1)
    assert out["clip_frac"] == 0.3 and out["entropy"] == 0.5 and out["value_clip_frac"] == 0.4
    assert out["policy_loss"] == 0.4 and out["value_loss"] == 0.8
    assert not any("/" in k for k in out), out


def test_add_skips_flags_and_keeps_tensors_on_the_device():
    acc: dict = {}
    reports.add(acc, {"x_sum": torch.tensor(2.0), "ok": True, "note": "text", "grad_norm": 1.5})
    reports.add(acc, {"x_sum": torch.tensor(3.0), "grad_norm": 0.5})
    assert set(acc) == {"x_sum", "grad_norm"} and isinstance(acc["x_sum"], torch.Tensor)
    assert float(acc["x_sum"]) == 5.0 and acc["grad_norm"] == 2.0


_RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from megarl.ppo import reports
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # rank 0: a first PP stage (no loss reports, only the gradient norm, not counted);
    # rank 1: the last stage, with a statistic rank 0 has never heard of
    sums = {"grad_norm": 4.0} if rank == 0 else {"grad_norm": 4.0, "tokens": torch.tensor(2.0),
                                                  "brand_new_sum": torch.tensor(1.0)}
    out = reports.sum_over_ranks(sums, torch.device("cpu"), own=rank == 1)
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_ranks_with_different_keys_agree_on_all_of_them():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r)], env=env, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == {"brand_new_sum": 1.0, "grad_norm": 4.0, "tokens": 2.0}
