"""LoRA in `megarl plan` (megarl/plan/lora.py, docs/lora.md "Planning"): the adapters' sizes
against the adapters apply_lora really builds on a tiny megatron model made from an HF config
(GQA; an MoE one with attention adapters), at TP=1 and in TP=2's shapes."""
import pytest
import torch
import transformers
from test_moe_mapping import hf_config as moe_hf_config
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

from megarl.config.schema import ConfigError, LoraConfig
from megarl.models.arch import arch_from_hf
from megarl.plan import lora as plan_lora

ALL = ["qkv", "proj", "fc1", "fc2"]


def llama_config():
    """GQA (8 heads, 2 KV heads), head_dim 8 x 8 = hidden 64, SwiGLU of 96: every target's A
    and B differ in shape."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def built_adapters(hf, lora: LoraConfig) -> dict[str, int]:
    """{layer name: A + B elements} of the adapters apply_lora builds on the trainer's model."""
    from megarl.models.builders import build_model
    from megarl.models.lora import apply_lora, lora_layers
    from megarl.models.transformer_config import transformer_config
    model, _ = build_model(hf, transformer_config(hf, 1, 1, torch.float32, on_gpu=False), 128, "actor")
    held = apply_lora(model, lora)
    layers = {n: m for n, m in model.named_modules() if m in set(lora_layers(model))}
    sizes = {n: m.lora_a.numel() + m.lora_b.numel() for n, m in layers.items()}
    assert sum(sizes.values()) == held
    # the adapters are the only trainable parameters
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == held
    return sizes


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("targets", [ALL, ["qkv"], ["proj", "fc2"], ["fc1"]])
def test_adapter_count_is_what_apply_lora_builds(targets):
    hf = llama_config()
    arch = arch_from_hf(hf.to_dict())
    sizes = built_adapters(hf, LoraConfig(rank=4, targets=targets))
    assert sum(sizes.values()) == plan_lora.adapter_params(arch, 4, targets)
    assert len(sizes) == 3 * len(targets)
    for t in targets:   # each target's share, not only the sum
        (ar, ac), (br, bc) = plan_lora.target_shapes(arch, 4, t)
        name = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}[t]
        assert {v for k, v in sizes.items() if k.endswith(name)} == {ar * ac + br * bc}


@pytest.mark.usefixtures("megatron_world")
def test_moe_model_attention_adapters_and_refused_mlps():
    hf = moe_hf_config("qwen3_moe")   # head_dim 16 x heads != hidden: q is heads x head_dim
    arch = arch_from_hf({**hf.to_dict(), "architectures": hf.architectures})
    assert arch.moe and arch.heads * arch.head_dim != arch.hidden
    sizes = built_adapters(hf, LoraConfig(rank=2, targets=["qkv", "proj"]))
    assert sum(sizes.values()) == plan_lora.adapter_params(arch, 2, ["qkv", "proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.targets=.*expert MLPs.*qkv and proj only"):
        plan_lora.adapter_params(arch, 2, ALL)


def _base_linear(fan_in: int, fan_out: int, column: bool):
    """A megatron column- (B split over TP) or row-parallel (A split) linear layer to wrap."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=False)
    init = torch.nn.init.normal_
    if column:
        return ColumnParallelLinear(fan_in, fan_out, config=cfg, init_method=init, bias=False, gather_output=False)
    return RowParallelLinear(fan_in, fan_out, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=False)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("kind,target", [("column", "qkv"), ("column", "fc1"), ("row", "proj"), ("row", "fc2")])
def test_tp2_shapes_are_the_layers(monkeypatch, kind, target):
    """On one of 2 TP ranks LoRALinear splits B of a column-parallel layer and A of a row-parallel
    one: the shapes it builds (TP size read from megarl.distributed.parallel) are target_shapes'."""
    from megarl.models import lora as layers
    arch = arch_from_hf(llama_config().to_dict())
    (ar, ac), (br, bc) = plan_lora.target_shapes(arch, 4, target, tp=1)
    fan_in, fan_out = ac, br
    base = _base_linear(fan_in, fan_out, column=kind == "column")
    monkeypatch.setattr(layers.parallel, "tp_size", lambda: 2)
    monkeypatch.setattr(layers.parallel, "tp_rank", lambda: 1)
    layer = layers.LoRALinear(base, 4, 8.0, 0.0, seed=0)
    want_a, want_b = plan_lora.target_shapes(arch, 4, target, tp=2)
    assert (tuple(layer.lora_a.shape), tuple(layer.lora_b.shape)) == (want_a, want_b)
    # the column layer's B and the row layer's A are the halves
    assert (want_b[0] * 2 == fan_out) if kind == "column" else (want_a[1] * 2 == fan_in)


def test_llama_70b_adapters_by_hand():
    """Llama-3.1-70B at rank 64 on all four targets: 80 x 64 x (8192 + 10240 + 8192 + 8192 + 8192 +
    57344 + 28672 + 8192) = 702,545,920 elements, 1.0% of the model's 70.55B."""
    from megarl.config import load_config
    from megarl.models.arch import resolve_arch
    arch, _ = resolve_arch(load_config("recipes/models/llama3.1_70b.yaml"))
    n = plan_lora.adapter_params(arch, 64, ALL)
    assert n == 80 * 64 * (8192 + 10240 + 8192 + 8192 + 8192 + 57344 + 28672 + 8192) == 702_545_920
    assert plan_lora.adapter_params(arch, 0, ALL) == 0
    assert plan_lora.largest_adapter_tensor(arch, 64, ALL) == 2 * 28672 * 64
    # a PP stage's layers: the share of them
    assert plan_lora.adapter_params(arch, 64, ALL, layers=16) * 5 == n


def test_peft_count_is_what_peft_builds():
    """The adapters as PEFT holds them per HF layer (a fused layer's A once per part: q, k, v;
    gate, up): get_peft_model on the tiny Llama, its lora_A / lora_B elements counted."""
    peft = pytest.importorskip("peft")
    hf = llama_config()
    arch = arch_from_hf(hf.to_dict())
    model = transformers.LlamaForCausalLM(hf)
    modules = {"qkv": ["q_proj", "k_proj", "v_proj"], "proj": ["o_proj"], "fc1": ["gate_proj", "up_proj"],
               "fc2": ["down_proj"]}
    for targets in (ALL, ["qkv", "fc2"]):
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=sum(
            (modules[t] for t in targets), [])))
        held = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
        assert held == plan_lora.peft_params(arch, 4, targets) > plan_lora.adapter_params(arch, 4, targets)
        model = wrapped.unload()


# ---- megarl plan and megarl simulate with LoRA ------------------------------------------------
R70 = "recipes/llama3.1_70b.yaml"
LORA = ["model.lora.rank=64", "model.lora.alpha=128", "weight_sync.lora=merged"]


def adapters_push(cfg, backend="gloo"):
    """`cfg` with weight_sync.lora=adapters on weight_sync.backend `backend` (the gloo wire: the one
    that carries adapters), set past the schema's checks so that a plan meets every wire."""
    cfg.weight_sync.lora, cfg.weight_sync.backend = "adapters", backend
    return cfg


def plan_of(overrides, adapters=False):
    from megarl.config import load_config
    from megarl.plan import make_plan
    cfg = load_config(R70, overrides)
    return make_plan(adapters_push(cfg) if adapters else cfg)


def test_frozen_base_holds_weights_only_and_the_adapters_the_optimizer():
    """The 70B recipe's layout (TP=8 x PP=5 x DP=1) with LoRA on the actor: its gradients and Adam
    state are the adapters' alone (4 and 12 bytes per adapter element on this GPU), its weights the
    stage's base + adapters at 2 bytes; the critic unchanged; no reference copy under the KL term."""
    from megarl.config import load_config
    from megarl.models.arch import resolve_arch
    from megarl.plan import memory as mem
    full, lora = plan_of([]), plan_of(LORA)
    arch, _ = resolve_arch(load_config(R70))
    t, f = lora["trainer"], full["trainer"]
    stage = t["stage"]
    n = plan_lora.adapter_params(arch, 64, ALL, tp=8, layers=16)
    assert t["lora"]["adapter_params"] == n
    base = mem.stage_params(arch, 8, 5, stage, "actor")
    actor = t["roles"]["actor"]
    assert actor == {"weights": (base + n) * 2, "grads": n * 4, "optimizer": n * 12}
    assert f["roles"]["actor"]["optimizer"] == base * 12 > 30 * actor["optimizer"]
    assert t["roles"]["critic"] == full["trainer"]["roles"]["critic"]
    assert f["roles"]["reference"] > 0 and t["roles"]["reference"] == 0
    assert t["peak_bytes"] < f["peak_bytes"]
    # no KL term: no reference either way
    assert plan_of(["algo.kl_coef=0"])["trainer"]["roles"]["reference"] == 0


def test_critic_with_adapters_trains_its_value_head_in_full():
    """model.lora.critic: the critic's base frozen too; its value head (new, hidden elements on the
    last stage) trained with the adapters."""
    p = plan_of([*LORA, "model.lora.critic=true", "parallel.pp=1", "cluster.trainer_nodes=1",
                 "cluster.nodes=4"])
    t = p["trainer"]
    n = t["lora"]["adapter_params"]
    assert t["roles"]["critic"]["grads"] == (n + 8192) * 4
    assert t["roles"]["critic"]["optimizer"] == (n + 8192) * 12
    assert t["lora"]["critic"] and p["fits"]
    # with the critic in full the same GPUs do not fit, and the plan names the fix
    full_critic = plan_of([*LORA, "parallel.pp=1", "cluster.trainer_nodes=1", "cluster.nodes=4"])
    assert not full_critic["fits"]
    assert "model.lora.critic=true (the critic's base frozen too) -> " in full_critic["problems"][0]["fix"]


def test_printed_plan_names_the_adapter_only_optimizer():
    from megarl.plan import format_plan
    p = plan_of(LORA)
    text = format_plan(p)
    opt = p["trainer"]["lora"]["optimizer"]
    assert f"adapter-only optimizer {round(opt / 2 ** 30, 2)} GiB" in text
    assert "the actor with its adapters off, no second copy" in text
    assert "weight push per sync: 131.42 GiB" in text and "weight_sync.lora=merged" in text
    assert "adapter" not in format_plan(plan_of([]))
    assert "no second copy" not in format_plan(plan_of([*LORA, "algo.kl_coef=0"]))   # no reference at all


def test_adapters_push_carries_the_peft_adapters():
    """weight_sync.lora=adapters (the gloo wire): a push is the PEFT adapters (828,375,040 elements at
    rank 64 = 1.2% of the model), unstaged (no staging area), its buffers host memory; each engine
    GPU holds vLLM's LoRA slot of its TP rank's share; merged: the full model as without LoRA. The
    wires that cannot carry adapters are refused naming the setting, as the run refuses them."""
    from megarl.config import ConfigError, load_config
    from megarl.models.arch import resolve_arch
    from megarl.plan import make_plan
    from megarl.plan.transfer import push_bytes, transfer_buffers, transfer_formula
    arch, _ = resolve_arch(load_config(R70))
    peft = plan_lora.peft_params(arch, 64, ALL)
    assert peft == 702_545_920 + 80 * 3 * 64 * 8192
    ads, merged, full = plan_of(LORA, adapters=True), plan_of(LORA), plan_of([])
    assert ads["lora"]["push_bytes"] == peft * 2 and merged["lora"]["push_bytes"] == full["model"]["params"] * 2
    assert ads["lora"]["push_bytes"] / merged["lora"]["push_bytes"] < 0.02
    cfg = adapters_push(load_config(R70, LORA))
    assert push_bytes(cfg, arch) == peft * 2 and transfer_buffers(cfg, arch) == 0   # gloo: host buffers
    assert "largest adapter" in transfer_formula(cfg, arch)
    e = ads["engine"]
    assert e["per_gpu_bytes"]["lora"] == plan_lora.peft_params(arch, 64, ALL, tp=4) * 2 > 0
    assert e["staging_bytes"] == 0 and ads["per_gpu_bytes"]["engine_lora"] == e["per_gpu_bytes"]["lora"]
    assert merged["engine"]["per_gpu_bytes"]["lora"] == 0
    assert merged["engine"]["staging_bytes"] == full["engine"]["staging_bytes"] > 0
    # auto is nccl for this cluster's remote engines (the plan refuses it); nccl named: the schema
    for backend in ("auto", "nccl"):
        with pytest.raises(ConfigError, match=r"weight_sync\.lora=.?adapters.*nccl.*weight_sync\.lora=merged"):
            make_plan(adapters_push(load_config(R70, LORA), backend))
    files = adapters_push(load_config(R70, [*LORA, "weight_sync.transport=files"]))
    with pytest.raises(ConfigError, match=r"weight_sync\.lora=.?adapters.*weight_sync\.transport=(files|collective)"):
        make_plan(files)


def test_simulator_prices_frozen_base_training_and_adapter_pushes():
    """A LoRA trainer's updates cost 4 x active + 6 x adapters FLOPs per position per model (a frozen
    weight's gradient GEMM skipped), forward-only passes unchanged; an adapters push moves the
    PEFT adapters' bytes, a merged one the model's."""
    from megarl.config import load_config
    from megarl.sim.costs import H100, Model, RooflineTrainer
    from megarl.sim.recipe import roofline_costs
    m = Model("m", 1e9, 16, 2048, 8, 128)
    full = RooflineTrainer(m, H100, 8, critic=False)
    lora = RooflineTrainer(m, H100, 8, critic=False, adapter_params=1e7)
    assert lora.update_flops() == 4e9 + 6e7 and full.update_flops() == 6e9
    assert lora.train_s(1000) / full.train_s(1000) == pytest.approx((4e9 + 6e7 + 2 * 2e9) / (6e9 + 2 * 2e9))
    assert lora.forward_s(1000) == full.forward_s(1000)
    ppo = RooflineTrainer(m, H100, 8, adapter_params=1e7, critic_adapters=False)
    assert ppo.update_flops() == 4e9 + 6e7 + 6e9
    assert RooflineTrainer(m, H100, 8, adapter_params=1e7, critic_adapters=True).update_flops() == 2 * (4e9 + 6e7)

    arch_peft = 702_545_920 + 80 * 3 * 64 * 8192
    merged = roofline_costs(load_config(R70, LORA), "h100", "", 4, 40)
    ads = roofline_costs(adapters_push(load_config(R70, LORA)), "h100", "", 4, 40)
    plain = roofline_costs(load_config(R70), "h100", "", 4, 40)
    assert merged[1].push_cost == plain[1].push_cost
    # the adapters travel unstaged and gathered on rank 0, whatever weight_sync.staged / sharded say
    assert ads[1].push_cost.send_bytes == ads[1].push_cost.recv_bytes == arch_peft * 2
    assert not ads[1].push_cost.staged and not ads[1].push_cost.sharded and merged[1].push_cost.staged
    assert ads[0].load_weights_s < plain[1].push_cost.wire_s + plain[0].load_weights_s
    assert merged[1].adapter_params == 702_545_920 and plain[1].adapter_params == 0
    # vLLM serves base + adapters: the engine's model holds them beside the base
    assert ads[0].model.params == plain[0].model.params + arch_peft and merged[0].model == plain[0].model
    # the printed route says what travels
    from megarl.sim.recipe import route_name
    assert route_name(adapters_push(load_config(R70, LORA)), ads[1].push_cost).endswith(", LoRA adapters")
    assert route_name(load_config(R70, LORA), merged[1].push_cost).endswith(", LoRA merged")
    assert "LoRA" not in route_name(load_config(R70), plain[1].push_cost)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("critic_adapters", [False, True])
def test_plan_bytes_are_the_built_trainers(tiny_model, critic_adapters):
    """The tiny recipe (fp32, one rank) with LoRA built by the trainer's own build_all: the plan's
    actor and critic weights are the modules' parameter bytes, their gradients megatron DDP's grad
    buffers (4 bytes per element), their optimizer the Adam m, v (fp32: 8 bytes) of the parameters
    the optimizer holds: the adapters (and a LoRA critic's value head) only."""
    from megarl.config import load_config
    from megarl.models.arch import resolve_arch
    from megarl.models.setup import build_all
    from megarl.plan.trainer import Layout, trainer_memory
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={tiny_model}", "model.lora.rank=4", "algo.name=ppo",
                                                "algo.kl_coef=0.01", f"model.lora.critic={critic_adapters}"])
    models = build_all(cfg, with_tokenizer=False)
    plan = trainer_memory(cfg, resolve_arch(cfg)[0], Layout(1, 1, 1), fused=False)
    for role in ("actor", "critic"):
        model = getattr(models, role)
        real = {"weights": sum(p.numel() * p.element_size() for p in model.model.module.parameters()),
                "grads": sum(b.numel_unpadded for b in model.model.buffers) * 4,
                "optimizer": sum(p.numel() for g in model.optimizer.optimizer.param_groups for p in g["params"]) * 8}
        assert plan["roles"][role] == real, role
    assert plan["roles"]["reference"] == 0 and plan["lora"]["adapter_params"] * 8 == plan["roles"]["actor"]["optimizer"]


R70_LORA = "recipes/lora_llama3.1_70b.yaml"


def test_lora_70b_recipe_fits_on_fewer_trainer_gpus(capsys):
    """`megarl plan recipes/lora_llama3.1_70b.yaml` fits on 16 trainer GPUs (the full fine-tune's
    recipe: 40) and prints the adapter-only optimizer memory; the same layout trained in full does
    not fit."""
    from megarl.cli import main
    from megarl.config import load_config
    from megarl.plan import make_plan
    assert main(["plan", R70_LORA]) == 0
    out = capsys.readouterr().out
    lora, full = make_plan(load_config(R70_LORA)), make_plan(load_config(R70))
    opt = lora["trainer"]["lora"]["optimizer"]
    assert f"adapter-only optimizer {round(opt / 2 ** 30, 2)} GiB" in out and out.rstrip().endswith("fits")
    assert lora["placement"]["trainer"]["gpus"] == 16 < full["placement"]["trainer"]["gpus"] == 40
    assert lora["trainer"]["lora"]["adapter_params"] * 12 / 2 == opt   # Adam over DP=2, adapters only
    assert not make_plan(load_config(R70_LORA, ["model.lora.rank=0"]))["fits"]


def test_plan_search_on_the_lora_recipe():
    """`megarl plan --search` plans and simulates the LoRA recipe's splits (the recipe's own among
    the simulated rows, fitting)."""
    from megarl.config import load_config
    from megarl.sim.search import format_search, search
    result = search(load_config(R70_LORA), steps=1)
    own = next(r for r in result["rows"] if r["recipe"])
    assert own["fits"] and own["tokens_per_s"] > 0
    assert "*" in format_search(result)


def saved_activation_bytes(fn, x, params) -> int:
    """Bytes of the distinct tensors autograd saves for backward in fn(x), parameters left out."""
    skip = {p.data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.data_ptr() not in skip:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("target", ["qkv", "fc2"])
def test_adapter_activations_are_what_autograd_saves(target, dropout):
    """lora.layer_activation_bytes for one target: the bytes autograd saves in LoRALinear's forward
    beyond those of its base layer trained in full (fp32 on the CPU, 4 bytes a value and a mask
    value): A x, and with dropout the mask (the dropped input takes the place of the input the
    trained base keeps; the frozen base keeps none)."""
    from megarl.models.lora import LoRALinear
    arch = arch_from_hf(llama_config().to_dict())
    (_, fan_in), (fan_out, _) = plan_lora.target_shapes(arch, 4, target)
    base = _base_linear(fan_in, fan_out, column=target == "qkv")
    x = torch.randn(10, 3, fan_in, requires_grad=True)
    trained = saved_activation_bytes(base, x, list(base.parameters()))   # the weight trained: x kept
    layer = LoRALinear(base, 4, 8.0, dropout, seed=0).train()
    params = list(layer.parameters())
    assert saved_activation_bytes(base, x, params) == 0   # frozen: megatron keeps no input
    extra = saved_activation_bytes(layer, x, params) - trained
    lora = LoraConfig(rank=4, dropout=dropout, targets=[target])
    assert extra == plan_lora.layer_activation_bytes(arch, lora, 30, 1, act_bytes=4, mask_bytes=4) > 0


@pytest.mark.usefixtures("megatron_world")
def test_frozen_base_skips_its_weight_gradient_gemms():
    """What the simulator prices (RooflineTrainer.update_flops): a training pass with a frozen base
    and adapters costs the full fine-tune's matmul FLOPs less 2 x (the linear weights) per token,
    megatron's skipped weight-gradient GEMMs, plus 6 x (the adapters) per token: counted by torch's
    FlopCounterMode on the trainer's model, forward and backward, attention's own matmuls alike in
    both."""
    from torch.utils.flop_counter import FlopCounterMode

    from megarl.models.builders import build_model
    from megarl.models.lora import apply_lora
    from megarl.models.masks import causal_mask
    from megarl.models.transformer_config import transformer_config
    hf = llama_config()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    t = tokens.numel()

    def flops(lora):
        model, _ = build_model(hf, transformer_config(hf, 1, 1, torch.float32, on_gpu=False), 128, "actor")
        adapters = apply_lora(model, LoraConfig(rank=4, targets=ALL)) if lora else 0
        linear = sum(p.numel() for n, p in model.named_parameters()
                     if n.endswith("weight") and ("linear_" in n or n.startswith("output_layer")))
        with FlopCounterMode(display=False) as counter:
            model(tokens, torch.arange(12).expand(2, 12), causal_mask(12, tokens.device)).sum().backward()
        return counter.get_total_flops(), linear, adapters

    full, linear, _ = flops(False)
    lora, same, adapters = flops(True)
    assert same == linear and adapters == plan_lora.adapter_params(arch_from_hf(hf.to_dict()), 4, ALL)
    assert lora == full - 2 * linear * t + 6 * adapters * t
