"""The MoE router metrics' maths and bookkeeping (megarl/ppo/moe_metrics.py); their reduction
over ranks runs in tests/dist/test_moe_metrics.py."""
from types import SimpleNamespace

import pytest
import torch
from test_conversion_mapping import megatron_world  # noqa: F401  (gloo world of 1, megatron's groups)

from megarl.bootstrap import bootstrap


@pytest.fixture(scope="module")
def mm():
    bootstrap()   # before anything imports megatron
    from megarl.ppo import moe_metrics
    return moe_metrics


def test_summary_of_expert_loads_and_losses(mm):
    counts = [[6, 2, 0, 0],   # layer 0: one expert takes 3/4 of the routed tokens
              [0, 0, 0, 0],   # layer 1: dense (no router), left out of every figure
              [2, 2, 2, 2]]   # layer 2: balanced
    out = mm.summarise({"load_balancing_loss": [1.2, 9.0, 1.0], "z_loss": [3.0, 9.0, 5.0]}, counts)
    assert out["moe_expert_share_max"] == pytest.approx(0.75)
    assert out["moe_expert_share_min"] == 0.0
    assert out["moe_imbalance"] == pytest.approx((3.0 + 1.0) / 2)
    assert out["moe_imbalance_max"] == pytest.approx(3.0)
    assert out["moe_aux_loss"] == pytest.approx(1.1) and out["moe_aux_loss_max"] == pytest.approx(1.2)
    assert out["moe_z_loss"] == pytest.approx(4.0) and out["moe_z_loss_max"] == pytest.approx(5.0)


def test_balanced_routing_reads_one_and_nothing_routed_reports_nothing(mm):
    out = mm.summarise({}, [[5, 5, 5, 5, 5, 5, 5, 5]])
    assert out["moe_imbalance"] == pytest.approx(1.0) and out["moe_expert_share_max"] == pytest.approx(1 / 8)
    assert "moe_aux_loss" not in out
    assert mm.summarise({"z_loss": [1.0]}, [[0, 0]]) == {}


def test_loss_names_follow_the_router_settings(mm):
    def cfg(kind, aux, z):
        return SimpleNamespace(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    assert mm.loss_names(cfg("aux_loss", 0.001, None)) == ["load_balancing_loss"]
    assert mm.loss_names(cfg("seq_aux_loss", 0.001, 0.01)) == ["seq_load_balancing_loss", "z_loss"]
    assert mm.loss_names(cfg("none", 0.0, None)) == []


def config(**kw):
    return SimpleNamespace(num_layers=3, num_moe_experts=4, moe_router_load_balancing_type="aux_loss",
                           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=None, sequence_parallel=False, **kw)


def test_only_the_hooked_model_s_router_calls_with_gradients_count(mm):
    """What megatron's tracker gained during a hooked router's call is the actor's; what another
    model's routers (a critic from the same MoE checkpoint) add between calls is not. Padding
    rows of the routing map do not count; calls without gradients (forward-only passes) neither."""
    from megatron.core.transformer.moe import moe_utils
    stats = mm.RouterStats(torch.nn.Module(), config())
    stats.reset()
    router = SimpleNamespace(training=True, layer_number=2)
    routing = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    pad = torch.tensor([[False], [False], [True]])   # [s, b]: the third token is padding
    try:
        for actor_loss, critic_loss in ((0.5, 7.0), (0.25, 3.0)):
            stats._snapshot(router, (None, pad))
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(actor_loss), 2, 3)
            moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(4 * actor_loss), 2, 3)
            stats._record(router, (None, pad), {}, (None, routing))
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(critic_loss), 2, 3)
        with torch.no_grad():
            stats._snapshot(router, (None, pad))
            stats._record(router, (None, pad), {}, (None, routing))
        assert stats.losses["load_balancing_loss"].tolist() == [0.0, 0.75, 0.0]
        # the z-loss is each call's mean over its real tokens (2 here): kept as their sum
        assert stats.losses["z_loss"].tolist() == [0.0, 2 * (2.0 + 1.0), 0.0]
        assert stats.tokens.tolist() == [0.0, 4.0, 0.0]
        assert stats.counts[1].tolist() == [4, 2, 2, 0]
        assert stats.calls.tolist() == [0, 2, 0]
    finally:
        stats.reset()


def test_collect_reads_the_step_s_figures_and_clears_them(mm, megatron_world):  # noqa: F811
    """At 1 rank (megatron's groups built): the load-balancing loss is the mean over the calls
    of a layer, the z-loss the mean over the real tokens of all of them, the shares the counts';
    the tracker and the figures are cleared for the next step."""
    from megatron.core.transformer.moe import moe_utils
    stats = mm.RouterStats(torch.nn.Module(), SimpleNamespace(**{**vars(config()), "moe_z_loss_coeff": 0.001}))
    stats.reset()
    router = SimpleNamespace(training=True, layer_number=1)
    calls = [(1.0, 3.0, torch.tensor([[1, 1, 0, 0]] * 3, dtype=torch.bool)),   # 3 real tokens, z 3.0 each
             (2.0, 6.0, torch.tensor([[0, 0, 1, 1]], dtype=torch.bool))]        # 1 real token, z 6.0
    for aux, z, routing in calls:
        stats._snapshot(router, (None,))
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(aux), 1, 3)
        moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(z), 1, 3)
        stats._record(router, (None,), {}, (None, routing))
    out = stats.collect()
    assert out["moe_aux_loss"] == pytest.approx(1.5)                 # (1 + 2) / 2 calls
    assert out["moe_z_loss"] == pytest.approx((3 * 3.0 + 6.0) / 4)   # per real token
    assert out["moe_expert_share_max"] == pytest.approx(3 / 8) and out["moe_expert_share_min"] == pytest.approx(1 / 8)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    assert not any(entry["values"].any() for entry in tracker.values())
    assert stats.collect() == {}   # nothing routed since


def test_padding_mask_marks_positions_past_each_row_and_every_filler_token(mm):
    """Padding past each row's prompt + response, and every token of a filler row (a copy
    computed so every DP rank runs as many micro-batches: resp_mask 0 everywhere, no loss, no
    gradient): megatron's router losses and the expert counts see the real tokens only."""
    batch = SimpleNamespace(tokens=torch.zeros(3, 5, dtype=torch.long), seq_lens=torch.tensor([3, 5, 4]),
                            resp_mask=torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    out = mm.padding_mask(SimpleNamespace(config=config()), batch)["padding_mask"]
    assert out.tolist() == [[False, False, False, True, True], [False] * 5, [True] * 5]
    assert mm.padding_mask(SimpleNamespace(config=SimpleNamespace(num_moe_experts=None)), batch) == {}


@pytest.fixture(scope="module")
def tiny_moe(mm, megatron_world):  # noqa: F811
    """The tiny Qwen3-MoE's megatron actor (4 experts, top-2, both layers MoE), load-balancing
    loss and z-loss on, its matrices at N(0, 1/fan_in) (routing far from ties, as
    tiny_archs.save_untied), hooked by RouterStats; in training mode."""
    import transformers

    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config
    from tools import tiny_archs
    hf = transformers.Qwen3MoeConfig(**tiny_archs.model_kwargs("qwen3_moe"), architectures=["Qwen3MoeForCausalLM"])
    config = transformer_config(hf, 1, 1, torch.float32, False, router={"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001})
    torch.manual_seed(0)
    model, _ = build_model(hf, config, 128, "actor")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.train(), mm.RouterStats(model, config)


def routed(mm, tiny_moe, rows: list[tuple[int, bool]]):
    """One micro-batch's update pass: `rows` (length, filler?) of tokens drawn from seed i for
    row i, right-padded; the main loss is 0, so the routers' gradients are the router losses'.
    Returns the router losses recorded, the tokens per expert, the routers' gradients."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.models.masks import causal_mask
    model, stats = tiny_moe
    width = max(n for n, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (n, _) in enumerate(rows):
        tokens[i, :n] = torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(i))
    resp_mask = torch.tensor([[0.0 if filler else 1.0] * 4 for _, filler in rows])
    batch = SimpleNamespace(tokens=tokens, seq_lens=torch.tensor([n for n, _ in rows]), resp_mask=resp_mask)
    stats.reset()
    model.zero_grad(set_to_none=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    out = model(tokens, torch.arange(width).expand_as(tokens), causal_mask(width, tokens.device),
                **mm.padding_mask(model, batch))
    (out * 0).sum().backward()
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    grads = torch.cat([r.weight.grad.flatten() for r in routers])
    return {k: v.clone() for k, v in stats.losses.items()}, stats.counts.clone(), grads


def test_a_filler_row_adds_nothing_to_the_router_losses_or_the_expert_counts(mm, tiny_moe):
    """A real MoE forward and backward: a micro-batch with a filler row records the same
    router losses and expert counts, and gives the routers the same gradient, as the
    micro-batch without it; a micro-batch of a filler row alone (every DP rank runs as many
    micro-batches) records nothing, not even a call (the load-balancing loss is a mean over
    the calls that routed real tokens), and gives a zero, finite gradient (megatron's
    load-balancing loss over no real token is 0 / 0: guarded in moe_metrics).
    Tolerance: relative 1e-5 (of the largest value). Noise: with and without the filler row
    differ by <= 1.1e-7 (at 1 and 2 threads; AMD EPYC). Catch: the filler row counted as real
    tokens (before the fix) moved the load-balancing loss by 11%, the z-loss by 136% and the
    routers' gradient by 76%; without the guard the filler-only micro-batch's loss and
    gradient are NaN."""
    def close(a, b):
        return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    alone = routed(mm, tiny_moe, [(12, False)])
    with_filler = routed(mm, tiny_moe, [(12, False), (9, True)])
    for name in alone[0]:
        assert close(with_filler[0][name], alone[0][name]), (name, with_filler[0][name], alone[0][name])
    assert torch.equal(with_filler[1], alone[1]) and int(alone[1].sum()) == 2 * 12 * 2   # 2 layers, top-2
    assert close(with_filler[2], alone[2])
    losses, counts, grads = routed(mm, tiny_moe, [(9, True)])
    assert all(not v.any() for v in losses.values()) and not counts.any(), (losses, counts)
    assert not tiny_moe[1].calls.any(), tiny_moe[1].calls
    assert torch.isfinite(grads).all() and not grads.any()


def test_a_dense_actor_reports_nothing(mm):
    dense = SimpleNamespace(info=SimpleNamespace(config=SimpleNamespace(num_moe_experts=None)))
    assert mm.RouterStats.of(dense).collect() == {}


def test_the_progress_line_shows_the_expert_imbalance(tmp_path, capsys):
    from megarl.metrics.logger import MetricsLogger
    log = MetricsLogger(str(tmp_path), total_steps=2, tensorboard=False, progress=False)
    log.log(0, {"reward_mean": 0.5, "moe_imbalance": 1.25, "moe_imbalance_max": 1.5})
    log.log(1, {"reward_mean": 0.5})   # a dense model's row: no such figure
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert "moe_imbalance=1.25" in lines[0] and "moe_imbalance" not in lines[1]
