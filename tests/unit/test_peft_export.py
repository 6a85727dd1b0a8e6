"""`megarl export` of a LoRA run's checkpoint (checkpoint/peft_export.py): the PEFT adapter folder
loads in transformers + peft onto the base model, and the merged full model in transformers, and
both reproduce the trainer's logprobs of the adapted actor. (vLLM loading the same folder:
tests/e2e/test_lora_push.py.)"""
import json
from pathlib import Path

import pytest
import torch
from test_lora_training import config, logprobs, samples
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

peft = pytest.importorskip("peft")
# the bound; fp32 both sides, measured 1.9e-6 (peft) and 3.8e-6 (merged) at most
# (megatron's and transformers' kernels sum in other orders); the base alone misses by > 1e-2
TOL = 5e-5


def lora_run(tiny_model, run_dir):
    """A one-step LoRA run's checkpoint (its adapters set to seeded noise first: B != 0, then one
    PPO step), as the trainer saves it; the config and the actor."""
    from megarl.checkpoint import manager
    from megarl.config.secrets import redacted_yaml
    from megarl.models.lora import lora_layers
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    cfg = config(tiny_model, "algo.name=grpo", "algo.kl_coef=0")
    models = build_all(cfg, with_tokenizer=False)
    for k, layer in enumerate(lora_layers(models.actor.model.module)):
        g = torch.Generator().manual_seed(k)
        a = torch.randn(layer.rank, layer.base.input_size, generator=g) / layer.base.input_size ** 0.5
        layer.set_full(a, 0.05 * torch.randn(layer.base.output_size, layer.rank, generator=g))
    ppo_step(cfg, models.actor, None, None, build_batch(samples(models.actor.info.vocab_size), 0), 0)
    manager.save(run_dir / "checkpoints", 0, models.actor, None, {"step": 0}, redacted_yaml(cfg), 1)
    return cfg, models.actor


def hf_logprobs(model, batch) -> torch.Tensor:
    """[B, R] log p(response token | the tokens before it), as the trainer's logprobs lay them out
    (rows right-padded: a causal model's positions before the padding need no mask)."""
    with torch.no_grad():
        logits = model(input_ids=batch.tokens).logits.float()
    # position p's output predicts token p + 1 (batch.resp_index: the positions predicting the response)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return lp.gather(1, batch.resp_index)


@pytest.mark.usefixtures("megatron_world")
def test_peft_folder_and_merged_model_reproduce_the_trainer(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.hf_export import export_checkpoint
    from megarl.ppo.batch import build_batch
    cfg, actor = lora_run(tiny_model, tmp_path / "run")
    out = export_checkpoint(str(tmp_path / "run"), None, str(tmp_path / "peft"), progress=False, merged=True)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8.0)
    assert adapter["base_model_name_or_path"] == str(tiny_model.resolve())
    assert adapter["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    vocab = actor.info.vocab_size
    batch = build_batch(samples(vocab), 0)
    trainer = logprobs(cfg, actor.model, batch, vocab)
    mask = batch.resp_mask > 0
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    plain = hf_logprobs(base, batch)
    adapted = peft.PeftModel.from_pretrained(base, str(out)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), torch_dtype=torch.float32).eval()
    for m in (adapted, merged):
        assert (hf_logprobs(m, batch) - trainer)[mask].abs().max() < TOL
    assert (plain - trainer)[mask].abs().max() > 1e-2      # the adapters matter: the check is not vacuous


@pytest.mark.usefixtures("megatron_world")
def test_megarl_eval_of_a_lora_run_scores_the_merged_model(tiny_model, tmp_path):
    """`megarl eval --run` of a LoRA run: the engines get a full model folder (the merged one), not
    the PEFT adapter folder they cannot open, and it is the trainer's adapted actor."""
    from transformers import AutoModelForCausalLM

    from megarl.evaluate import checkpoint_model
    from megarl.ppo.batch import build_batch
    cfg, actor = lora_run(tiny_model, tmp_path / "run")
    model, version = checkpoint_model(str(tmp_path / "run"), None, str(tmp_path / "eval"), progress=False)
    assert version == 1 and (tmp_path / "eval" / "model" / "adapter_config.json").is_file()
    assert (Path(model) / "config.json").is_file() and not (Path(model) / "adapter_config.json").exists()
    batch = build_batch(samples(actor.info.vocab_size), 0)
    trainer = logprobs(cfg, actor.model, batch, actor.info.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    assert (hf_logprobs(hf, batch) - trainer)[batch.resp_mask > 0].abs().max() < TOL


def test_merged_is_refused_for_a_full_checkpoint(tmp_path, monkeypatch):
    from conftest import TINY

    from megarl.checkpoint import hf_export
    from megarl.formats.hf_reader import ConversionError
    step = tmp_path / "step_0"
    (step / "actor").mkdir(parents=True)     # no base.json: the full weights
    monkeypatch.setattr(hf_export, "pick_checkpoint", lambda run_dir, n: step)
    with pytest.raises(ConversionError, match=r"^--merged: .* not a LoRA run's .*leave --merged out"):
        hf_export.export_checkpoint(str(tmp_path), None, str(tmp_path / "out"), hf_config=str(TINY), merged=True)
    assert not (tmp_path / "out").exists()
