"""Mixture-of-Experts sizing (megarl/plan/experts.py, memory.py, trainer.py; sim/costs.py): the
parameter split, megatron's optimizer sharding of experts over expert-data-parallel ranks,
activations, active vs total parameters and the costs that follow them, on hand-computed cases."""
import pytest

from megarl.config import ConfigError, load_config
from megarl.models.arch import Arch, resolve_arch
from megarl.plan import experts
from megarl.plan import memory as mem
from megarl.plan.trainer import Layout, candidate_layouts, check_expert_world, check_layout, trainer_memory
from megarl.sim.costs import H100, Model, RooflineEngine, RooflineTrainer, weight_push_s

DENSE = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16)
# layer 0 dense (ffn 8), layer 1 MoE: 4 experts of moe_ffn 3, top-2
MOE = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16, experts=4, top_k=2, moe_ffn=3,
           dense_layers=(0,))


# -- parameters ------------------------------------------------------------------------------
def test_moe_layer_params_by_hand():
    # attention 48 + norms 8 (as DENSE); router 4 experts x 4 = 16; experts 4 x (3 x 4 x 3) = 144
    assert mem.layer_param_split(MOE, layer=0) == (48 + 96 + 8, 0)         # the dense layer
    assert mem.layer_param_split(MOE, layer=1) == (48 + 8 + 16, 144)
    # TP splits attention, not router or norms; EP holds 4 / 2 experts, ETP splits each
    assert mem.layer_param_split(MOE, layer=1, tp=2, ep=2) == (48 / 2 + 8 + 16, 72)
    assert mem.layer_param_split(MOE, layer=1, tp=2, ep=2, etp=2) == (48 / 2 + 8 + 16, 36)
    # 152 + 216 + embedding and LM head 2 x 16 x 4 + final norm 4
    assert mem.total_params(MOE) == 152 + 216 + 128 + 4
    # a token uses 2 of the 4 experts: 2 x 36 idle
    assert mem.active_params(MOE) == mem.total_params(MOE) - 2 * 36
    assert mem.active_params(DENSE) == mem.total_params(DENSE)


def test_shared_expert_and_qk_norm_params_by_hand():
    a = Arch(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16, experts=4, top_k=1, moe_ffn=3,
             shared_ffn=2, shared_gate=True, qk_norm=True)
    # attention 48 + norms 8 + q/k norms 2 x 2; router 16; shared 3 x 4 x 2 = 24 over TP, its gate 4 replicated
    assert mem.layer_param_split(a, 0, tp=2) == (48 / 2 + 8 + 4 + 16 + 24 / 2 + 4, 144)
    assert mem.active_params(a) == mem.total_params(a) - 3 * 36


def test_published_moe_parameter_counts():
    """Qwen3 model cards: 30.5B total / 3.3B active (29.9B non-embedding), 235B / 22B."""
    counts = {"qwen3_30b_a3b": (30_532_122_624, 3_353_032_704), "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520)}
    for name, (total, active) in counts.items():
        a = resolve_arch(load_config(f"recipes/models/{name}.yaml"))[0]
        assert (mem.total_params(a), mem.active_params(a)) == (total, active)
        assert mem.total_params(a) - 2 * a.vocab * a.hidden == pytest.approx(29.9e9 if "30b" in name else 234e9,
                                                                           rel=0.01)


# -- optimizer sharding (megatron's distributed optimizer) ---------------------------------------
def test_expert_optimizer_state_is_sharded_over_expert_dp_not_dp():
    """TP=1 x DP=4 with EP=2: EDP = 2. Actor (bf16): weights 2 and fp32 grads 4 per local parameter;
    Adam + fp32 main weights 12 per parameter / DP for dense parameters, / EDP for experts.
    One stage (PP=1), vocab 16 padded to 128: dense 152 + 72 + embedding 512 + norm 4 + head 512
    = 1252, experts 144 / 2 = 72."""
    cfg = load_config("recipes/qwen2.5_7b.yaml", ["parallel.tp=1", "algo.name=grpo"])
    r = trainer_memory(cfg, MOE, Layout(tp=1, pp=1, dp=4, ep=2, etp=1), fused=True)
    actor = r["roles"]["actor"]
    assert actor["weights"] == 2 * (1252 + 72) and actor["grads"] == 4 * (1252 + 72)
    assert actor["optimizer"] == 12 * 1252 / 4 + 12 * 72 / 2
    assert r["roles"]["reference"] == 2 * (1252 + 72)
    assert Layout(4, 1, 8, 4, 2).edp == 4 and experts.expert_data_parallel(8, 16, 8, 8) == 2


def test_ep_moves_expert_weights_but_not_their_optimizer_state_per_gpu():
    """Per GPU the experts' Adam state is 12 x experts / (TP x DP) whatever EP is (EP x EDP is
    constant): raising EP lowers weights and gradients only."""
    cfg = load_config("recipes/qwen2.5_7b.yaml", ["parallel.tp=1", "algo.name=grpo"])
    low, high = (trainer_memory(cfg, MOE, Layout(1, 1, 4, ep, 1))["roles"]["actor"] for ep in (1, 4))
    assert low["optimizer"] == high["optimizer"]
    assert low["weights"] - high["weights"] == 2 * (144 - 36) and low["grads"] - high["grads"] == 4 * (144 - 36)


# -- activations -------------------------------------------------------------------------------
def test_moe_layer_activations_by_hand():
    """Per token at 2 bytes: attention as a dense layer less its MLP (4h + q + 2kv + h = 28
    values); router logits and probabilities 2 x 4 experts fp32 = 32 bytes; 2 routed copies
    each keeping three hidden-wide tensors (3h) and gate|up + SwiGLU output (3 x 3): 2 x 21 values."""
    per_token = 2 * 28 + 32 + 2 * 2 * 21
    assert mem.layer_activation_bytes(MOE, seq=10, mbs=1, tp=1, layer=1) == 10 * per_token
    assert mem.layer_activation_bytes(MOE, seq=10, mbs=1, tp=1, layer=0) == mem.layer_activation_bytes(DENSE, 10, 1, 1)
    # the dispatcher's send + receive buffers: 2 x 2 copies x h per token, once per pass
    assert experts.dispatcher_bytes(MOE, 10, 1, tp=1, etp=1, act_bytes=2, sequence_parallel=False) == 2 * 10 * 2 * 4 * 2
    fwd = mem.forward_only_bytes(MOE, 10, 1, tp=1, pp=1, stage=0, with_logits=False)
    assert fwd == 10 * per_token + 320 + mem.head_bytes(MOE, 10, 1, 1, logits=False)


def test_sequence_parallel_splits_routed_tokens_and_etp_gathers_them():
    """Under TP=2 with sequence parallelism a GPU routes half the tokens; ETP=2 gathers its
    peer's copies back and halves each expert's width."""
    assert experts.routed_copies_per_token(MOE, tp=2, etp=1, sequence_parallel=True) == 1
    assert experts.routed_copies_per_token(MOE, tp=2, etp=2, sequence_parallel=True) == 2
    # 2 copies x (3h + 3 x 3/2) x 2 bytes + router 2 x 4 x 4 / 2
    assert experts.sparse_layer_activation_bytes(MOE, 2, 2, 2, True, True) == 2 * (12 + 4.5) * 2 + 16


def test_qk_norm_activations_by_hand():
    """Qwen3's query/key norms keep q + kv values per token fused (their inputs), 3 x (q + kv)
    + a statistic per head unfused (measured on the CPU path: tests/dist/test_plan_moe_memory.py)."""
    qk = Arch(**{**DENSE.__dict__, "qk_norm": True})
    assert mem.layer_activation_bytes(qk, 10, 1, 1) - mem.layer_activation_bytes(DENSE, 10, 1, 1) == 2 * 10 * (4 + 2)
    unfused = mem.layer_activation_bytes(qk, 10, 1, 1, fused=False) - mem.layer_activation_bytes(DENSE, 10, 1, 1,
                                                                                               fused=False)
    assert unfused == 2 * 10 * (3 * (4 + 2) + 2 + 1)


# -- layouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,kw,match", [
    (MOE, dict(ep=3), r"parallel\.ep=3 must divide the model's 4 experts .*use one of \[1, 2, 4\]"),
    (DENSE, dict(ep=2), r"parallel\.ep=2: the model has no experts"),
    (Arch(hidden=8, layers=2, heads=2, kv_heads=2, head_dim=4, ffn=8, vocab=16, experts=4, top_k=2, moe_ffn=3),
     dict(tp=2), r"parallel\.tp=2 with an MoE model needs parallel\.sequence_parallel=true"),
])
def test_bad_expert_layouts_are_named(arch, kw, match):
    args = dict(tp=1, pp=1, ep=1, etp=1, sequence_parallel=False) | kw
    with pytest.raises(ConfigError, match=match):
        check_layout(arch, **args)


def test_expert_groups_must_divide_a_stage():
    assert check_expert_world(MOE, Layout(1, 1, 4, 4, 1)) == ""
    why = check_expert_world(MOE, Layout(2, 1, 1, 2, 2))
    assert "parallel.ep=2 x expert TP 2 must divide the 2 GPUs of a pipeline stage" in why and "[1]" in why
    lays = list(candidate_layouts(MOE, gpus=4, gpus_per_node=4))
    assert {(lay.tp, lay.pp, lay.ep) for lay in lays} == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2)}


# -- simulator costs ---------------------------------------------------------------------------
def _pair():
    """An MoE model and a dense one of the same total parameters and shape."""
    moe = Model.from_arch("moe", resolve_arch(load_config("recipes/models/qwen3_30b_a3b.yaml"))[0])
    dense = Model(moe.name, moe.params, moe.layers, moe.hidden, moe.kv_heads, moe.head_dim)
    return moe, dense


def test_moe_model_has_active_and_routed_parameters():
    moe, dense = _pair()
    assert moe.active == 3_353_032_704 and dense.active == dense.params
    assert moe.routed_params == 48 * 128 * 3 * 2048 * 768
    assert moe.weight_bytes == dense.weight_bytes == 2 * moe.params


def test_decode_reads_the_experts_its_batch_touches():
    """One sequence reads the dense weights and top_k / E of the experts; a batch of many reads
    nearly all: 1 - (1 - 8/128)^b."""
    moe, dense = _pair()
    fixed = moe.params - moe.routed_params
    assert moe.step_weight_bytes(1) == pytest.approx(2 * (fixed + moe.routed_params * 8 / 128))
    assert moe.experts_touched(64) == pytest.approx(1 - (120 / 128) ** 64)
    assert moe.step_weight_bytes(4096) == pytest.approx(dense.step_weight_bytes(4096), rel=1e-9)
    e_moe, e_dense = RooflineEngine(moe, H100, 1), RooflineEngine(dense, H100, 1)
    # memory-bound at batch 1: the dense model reads 120/128 of the experts more
    saved = 2 * moe.routed_params * 120 / 128 / (H100.hbm_bytes_per_s * 0.7)
    assert e_dense.step_s(1, 0, 0, 0) - e_moe.step_s(1, 0, 0, 0) == pytest.approx(saved, rel=1e-9)
    # prefill is compute: 2 x active params per token
    big = 100_000
    gap = e_dense.step_s(1, 0, big, 0) - e_moe.step_s(1, 0, big, 0)
    assert gap == pytest.approx(2 * (dense.params - moe.active) * big / (H100.bf16_flops * 0.5), rel=1e-3)


def test_training_flops_follow_active_and_the_push_total_parameters():
    moe, dense = _pair()
    t_moe, t_dense = (RooflineTrainer(m, H100, 16, critic=False) for m in (moe, dense))
    assert t_moe.flops_per_token() == 10 * moe.active and t_dense.flops_per_token() == 10 * dense.params
    assert t_moe.train_s(1000, 0, 4) / t_dense.train_s(1000, 0, 4) == pytest.approx(moe.active / moe.params)
    assert weight_push_s(moe, H100, 8, 2) == weight_push_s(dense, H100, 8, 2)


# -- the MoE recipes on their clusters ----------------------------------------------------------
MOE_RECIPES = {"recipes/qwen3_30b_a3b.yaml": "TP=1 PP=1 DP=16, experts over EP=8 x expert TP=1 (expert DP=2)",
               "recipes/qwen3_235b_a22b.yaml": "TP=4 PP=2 DP=8, experts over EP=8 x expert TP=4 (expert DP=1)"}


def _plan_cli(*args):
    import subprocess
    import sys

    from conftest import ROOT
    return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("recipe", sorted(MOE_RECIPES))
def test_moe_recipe_fits_on_its_cluster(recipe):
    r = _plan_cli(recipe)
    assert r.returncode == 0, r.stderr
    assert MOE_RECIPES[recipe] in r.stdout and "active" in r.stdout and r.stdout.rstrip().endswith("fits")


@pytest.mark.parametrize("recipe", sorted(MOE_RECIPES))
def test_moe_recipe_on_half_the_nodes_does_not_fit(recipe):
    """Half the nodes: no layout of the trainer's half fits (the experts' Adam state alone is 12
    bytes x their parameters / the GPUs of a stage); the message says by how much and what to change."""
    cfg = load_config(recipe)
    r = _plan_cli(recipe, "--nodes", str(cfg.cluster.nodes // 2))
    assert r.returncode == 2
    assert "plan does not fit" in r.stderr and "trainer" in r.stderr
    assert "GiB" in r.stderr and ("short" in r.stderr or "over" in r.stderr)
    assert "parallel.ep=" in r.stderr or "trainer nodes" in r.stderr


def test_moe_half_cluster_fits_by_no_layout():
    """On the half of the 30B cluster (8 trainer GPUs) every layout the code accepts is over the
    usable memory: the recipe's size is needed, not a better layout."""
    from megarl.plan.trainer import best_layout
    cfg = load_config("recipes/qwen3_30b_a3b.yaml")
    arch = resolve_arch(cfg)[0]
    usable = (cfg.cluster.gpu_mem_gb - cfg.cluster.reserve_gb) * mem.GiB
    assert best_layout(cfg, arch, 8, 8, True, None)[1] > usable
    full, peak = best_layout(cfg, arch, 16, 8, True, None)
    assert peak <= usable and full.ep > 1   # on the recipe's 16 GPUs the lightest layout spreads the experts
