"""LoRA in the trainer (models/setup.py, ppo/step.py, models/lora.py's merge) on one rank: the
actor is built once and holds the reference as its adapters off, the base is frozen with no
gradient, main grad or optimizer state, the reference logprobs are a separately built base
model's, and the weight push sends W + (alpha / r) B A under the base names. The TP / PP / DP
runs are tests/dist/test_lora_train.py's."""
import pytest
import torch
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

from megarl.config import load_config

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.01", "train.groups_per_step=4",
        "rollout.sampling.n=2", "train.mini_batches=1", "train.micro_batch_size=4", "train.actor_lr=1e-2",
        "algo.is_mode=none"]


def config(tiny_model, *extra):
    return load_config("recipes/tiny_cpu.yaml", [f"model.path={tiny_model}", *LORA, *extra])


def samples(vocab, groups=4, n=2):
    from megarl.data.sample import Sample
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(groups):
        prompt = [1] + torch.randint(5, vocab, (4,), generator=g).tolist()
        for i in range(n):
            resp = torch.randint(5, vocab, (3 + i + k,), generator=g).tolist()
            out.append(Sample(prompt, resp, [-2.0] * len(resp), [0] * len(resp), True, k, reward=float(i)))
    return out


def counted_build(monkeypatch):
    """build_all with megatron's GPTModel builder counted (role of each call)."""
    from megarl.models import setup
    built = []
    real = setup.build_model

    def counting(hf_config, tcfg, divisible_by, role):
        built.append(role)
        return real(hf_config, tcfg, divisible_by, role)
    monkeypatch.setattr(setup, "build_model", counting)
    return built


def logprobs(cfg, model, batch, vocab):
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.microbatch import batching_of
    from megarl.ppo.schedule import forward_all
    return forward_all(lambda m, b, s: actor_ops.logprobs(m, b, s, vocab), model, batch, batching_of(cfg))


@pytest.mark.usefixtures("megatron_world")
def test_one_model_for_actor_and_reference_and_the_reference_is_the_base(tiny_model, monkeypatch):
    """kl_coef > 0 with LoRA: one GPTModel built for actor and reference together (the builder's
    calls counted; without LoRA there are two). After an update that moved the adapters, the
    step's reference logprobs (the actor's forward under adapters_disabled) equal those of a
    base model built separately for this comparison within 1e-6, while the adapted actor's differ."""
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import forward_passes, ppo_step
    cfg = config(tiny_model, "algo.name=grpo")
    built = counted_build(monkeypatch)
    models = build_all(cfg, with_tokenizer=False)
    assert built == ["actor"] and models.reference is models.actor.model
    vocab = models.actor.info.vocab_size
    batch = build_batch(samples(vocab), 0)
    m = ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
    assert m["grad_norm"] > 0
    ref = forward_passes(cfg, models.actor, models.reference, None)["ref"].run(batch, 4)
    actor = logprobs(cfg, models.actor.model, batch, vocab)

    built.clear()
    base = build_all(load_config("recipes/tiny_cpu.yaml", [f"model.path={tiny_model}", "algo.name=grpo",
                                                           "algo.kl_coef=0.01"]), with_tokenizer=False)
    assert built == ["actor", "reference"]   # the full fine-tune builds its reference apart
    expected = logprobs(cfg, base.reference, batch, vocab)
    mask = batch.resp_mask > 0
    assert (ref - expected)[mask].abs().max() <= 1e-6
    assert (actor - expected)[mask].abs().max() > 1e-3   # the adapters moved: the check is not vacuous


@pytest.mark.usefixtures("megatron_world")
def test_base_frozen_and_the_optimizer_holds_adapters_only(tiny_model):
    """After two updates: the base weights are bitwise unchanged and have no .grad, no main_grad
    and no optimizer state; megatron DDP's grad buffers hold the adapters' elements only; every
    adapter moved. The critic (model.lora.critic=false) is fine-tuned in full; with
    model.lora.critic=true it gets adapters and a trained value head."""
    from megarl.models.lora import lora_layers
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    cfg = config(tiny_model, "algo.name=ppo", "train.critic_warmup_steps=0")
    models = build_all(cfg, with_tokenizer=False)
    module = models.actor.model.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    adapters = {n for n, p in module.named_parameters() if p.requires_grad}
    assert adapters and all(n.endswith((".lora_a", ".lora_b")) for n in adapters)
    layers = list(lora_layers(module))
    assert len(layers) == 4 * models.actor.info.config.num_layers   # qkv, proj, fc1, fc2 per layer
    batch = build_batch(samples(models.actor.info.vocab_size), 0)
    for step in range(2):
        ppo_step(cfg, models.actor, models.reference, models.critic, batch, step)
    for n, p in module.named_parameters():
        if n in adapters:
            assert not torch.equal(p, before[n]), f"{n} did not train"
        else:
            assert torch.equal(p, before[n]), f"frozen {n} changed"
            assert p.grad is None and getattr(p, "main_grad", None) is None, n
    adapter_elements = sum(p.numel() for n, p in module.named_parameters() if n in adapters)
    assert sum(b.numel_unpadded for b in models.actor.model.buffers) == adapter_elements
    held = {id(p) for g in models.actor.optimizer.optimizer.param_groups for p in g["params"]}
    assert len(held) == len(adapters)   # one fp32 main copy per adapter (the distributed optimizer's)
    critic = models.critic.model.module
    assert all(p.requires_grad for p in critic.parameters()) and not list(lora_layers(critic))

    models = build_all(config(tiny_model, "algo.name=ppo", "model.lora.critic=true"), with_tokenizer=False)
    critic = models.critic.model.module
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert list(lora_layers(critic)) and "output_layer.weight" in trained
    assert all(n.endswith((".lora_a", ".lora_b")) for n in trained - {"output_layer.weight"})


@pytest.mark.usefixtures("megatron_world")
def test_recompute_reaches_the_adapters(tiny_model):
    """train.recompute=full with a frozen embedding: the first update's gradient norm equals
    the one without recompute (megatron's reentrant recompute would give the adapters none if
    the embedding's output did not ask for a gradient)."""
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    norms = []
    for recompute in ("none", "full"):
        cfg = config(tiny_model, "algo.name=grpo", f"train.recompute={recompute}")
        models = build_all(cfg, with_tokenizer=False)
        batch = build_batch(samples(models.actor.info.vocab_size), 0)
        norms.append(ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)["grad_norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_merged_weight_is_the_full_merge_split_per_shard():
    """merged_weight on each TP shard (column: B split by rows; row: A split by columns) gives
    exactly the shard of W + s B A computed on the full tensors, in W's dtype."""
    from megarl.models.lora import merged_weight, shard
    g = torch.Generator().manual_seed(0)
    w, a, b, s = torch.randn(8, 6, generator=g), torch.randn(2, 6, generator=g), torch.randn(8, 2, generator=g), 4.0
    full = w + s * b @ a
    for r in range(2):
        col = merged_weight(shard(w, 0, r, 2), a, shard(b, 0, r, 2), s)
        row = merged_weight(shard(w, 1, r, 2), shard(a, 1, r, 2), b, s)
        torch.testing.assert_close(col, shard(full, 0, r, 2), rtol=0, atol=1e-6)
        torch.testing.assert_close(row, shard(full, 1, r, 2), rtol=0, atol=1e-6)
    assert merged_weight(w.bfloat16(), a, b, s).dtype == torch.bfloat16


@pytest.mark.usefixtures("megatron_world")
def test_push_sends_the_merged_weights_under_the_base_names(tiny_model):
    """source.hf_tensors and the sharded push's pieces of an adapted actor: the HF names of the
    full fine-tune (no adapter among them), each adapted weight the base's + s B A through the
    same mapping, every other tensor the base's; stage_bytes counts the merged model's bytes."""
    from megarl.formats.mapping import mapping_for
    from megarl.models.lora import lora_layers
    from megarl.models.setup import build_all
    from megarl.rollout.weights import sharded, source
    cfg = config(tiny_model, "algo.name=grpo", "algo.kl_coef=0")
    models = build_all(cfg, with_tokenizer=False)
    model, info = models.actor.model, models.actor.info
    base = dict(source.hf_tensors(model, info))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model.module):
            layer.lora_b.normal_(0, 0.1, generator=g)
    pushed = dict(source.hf_tensors(model, info))
    assert set(pushed) == set(base) and not any("lora" in n for n in pushed)
    table = mapping_for(info.hf_config)
    expected = dict(base)
    for name, p in model.module.named_parameters():
        layer = next((m for m in lora_layers(model.module) if m.weight is p), None)
        if layer is not None:
            expected.update(table.megatron_to_hf(name, [p.detach() + layer.scale * layer.lora_b @ layer.lora_a],
                                                 info.layer_offset, 0))
    changed = [n for n in pushed if not torch.equal(pushed[n], base[n])]
    assert changed and all("proj" in n for n in changed)   # q/k/v/o, gate/up/down: the adapted ones
    for n in pushed:
        torch.testing.assert_close(pushed[n], expected[n], rtol=0, atol=1e-6)
    pieces = {p.name: p.tensor for p in sharded.own_pieces(model, info, {})}
    assert set(pieces) == set(pushed) and all(torch.equal(pieces[n], pushed[n]) for n in pushed)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.module.named_parameters() if "lora" not in n)
    assert source.stage_bytes(model) == base_bytes


@pytest.mark.parametrize("change", ["model.path=artifacts/another_base", "model.lora.rank=8", "model.lora.rank=0",
                                    "model.lora.targets=[qkv]"])
def test_resuming_adapters_onto_another_base_or_other_adapters_is_refused(tiny_model, tmp_path, change):
    """A LoRA checkpoint holds the adapters only and loads them onto model.path's weights: another
    base (same architecture: nothing would fail on shapes) or other adapter settings are breaking
    changes, one line naming the setting; the same settings resume without a word."""
    from megarl.checkpoint import compat
    from megarl.config import ConfigError
    from megarl.config.loader import save_config
    step = tmp_path / "step_1"
    step.mkdir()
    save_config(config(tiny_model), step / "config.yaml")
    assert compat.check_resume(config(tiny_model, "train.steps=9"), step) == []
    key = change.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^checkpoint\.resume: .* another {key} .*holds the adapters only") as err:
        compat.check_resume(config(tiny_model, change), step)
    assert "\n" not in str(err.value)


def test_offload_idle_with_only_the_lora_reference_is_refused(tiny_model):
    """With LoRA the reference is the actor (never idle): GRPO with a KL term builds nothing to offload."""
    from megarl.config import ConfigError
    with pytest.raises(ConfigError, match=r"^train\.offload_idle=True: .*model\.lora\.rank > 0"):
        config(tiny_model, "algo.name=grpo", "train.offload_idle=true")
    assert config(tiny_model, "algo.name=ppo", "train.offload_idle=true").train.offload_idle   # the critic is


@pytest.fixture
def gpu_with_te(monkeypatch):
    """A GPU machine with Transformer Engine installed, as far as `use_te` can tell."""
    import sys
    import types

    from megarl.models import builders
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    builders.local_layers(False)   # (this process's earlier LoRA builds set it)
    yield builders
    builders.local_layers(False)


def test_a_lora_process_builds_megatron_local_layers_where_te_is_installed(gpu_with_te):
    # LoRALinear wraps the local spec's Column/RowParallelLinear: with TE installed a LoRA run
    # would otherwise build TE's fused layers and stop at apply_lora
    builders = gpu_with_te
    assert builders.use_te()
    builders.local_layers(True)
    assert not builders.use_te()
    builders.local_layers(False)
    assert builders.use_te()


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("rank", [0, 4])
def test_build_all_chooses_the_layers_by_model_lora(tiny_model, rank):
    from megarl.models import builders
    from megarl.models.setup import build_all
    try:
        build_all(config(tiny_model, f"model.lora.rank={rank}", "algo.kl_coef=0"), with_tokenizer=False)
        assert builders._LOCAL_LAYERS == (rank > 0)
    finally:
        builders.local_layers(False)


def test_local_layers_on_a_gpu_fuse_the_softmax_only_with_its_kernels(tiny_model):
    # megatron-core's wheel ships no fused-softmax extensions: the local spec's attention on a GPU
    # must not ask for them (FusedScaleMaskSoftmax would import them at the first bf16 forward)
    from transformers import AutoConfig

    from megarl.models.transformer_config import softmax_kernels, transformer_config
    tcfg = transformer_config(AutoConfig.from_pretrained(tiny_model), 1, 1, torch.bfloat16, on_gpu=True)
    assert tcfg.masked_softmax_fusion == softmax_kernels() and not softmax_kernels()
