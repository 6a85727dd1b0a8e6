"""Check `megarl plan`'s memory formulas against the real code path on the tiny model (CPU).

Builds actor, reference and critic exactly as a run does (models/setup.build_all: megatron DDP
+ distributed optimizer, one process, TP = PP = DP = 1), then measures:
- weights and gradient buffers: megatron DDP's flat buffers;
- optimizer state: Adam's m, v (created as on a checkpoint load) plus fp32 main weights that
  are not views of the model's own buffer;
- activations kept for backward by one training micro-batch of the actor (forward + the
  vocab-parallel logprobs and entropy), recorded with autograd's saved-tensor hooks (each
  storage counted once, parameters excluded);
and writes them next to what megarl/plan/memory.py predicts for the same model and settings.

usage: python bench/plan_check.py [--out bench/out/plan_check.json] [--dtype float32|bfloat16] [key=value ...]
Takes a few seconds; needs artifacts/tiny_countdown (`python tools/make_tiny_model.py`).
`--recipe recipes/tiny_lora_cpu.yaml`: the same with LoRA (frozen base, adapter-only gradients
and optimizer state, the reference the actor itself, the adapters' activations).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def buffer_bytes(ddp) -> dict:
    w = sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.buffers if b.param_data is not None)
    g = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers if b.grad_data is not None)
    if not w:   # fp32 without a param buffer: the parameters themselves
        w = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    elif any(not p.requires_grad for p in ddp.module.parameters()):
        # LoRA: DDP's buffers hold the trained parameters only; the frozen base holds its own
        w += sum(p.numel() * p.element_size() for p in ddp.module.parameters() if not p.requires_grad)
    return {"weights": w, "grads": g}


def optimizer_bytes(trainable) -> int:
    """Adam state + main weights that own their storage (bf16: fp32 copies; fp32: none, the
    optimizer steps the model's own weights)."""
    model_ptrs = {p.untyped_storage().data_ptr() for p in trainable.model.module.parameters()}
    for b in trainable.model.buffers:
        if b.param_data is not None:
            model_ptrs.add(b.param_data.untyped_storage().data_ptr())
    total, seen = 0, set()
    for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                ptr = p.untyped_storage().data_ptr()
                if ptr not in model_ptrs and ptr not in seen:
                    seen.add(ptr)
                    total += p.numel() * p.element_size()
                for k, v in opt.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v) and k != "step" and v.untyped_storage().data_ptr() not in seen:
                        seen.add(v.untyped_storage().data_ptr())
                        total += v.numel() * v.element_size()
    return total


def saved_activation_bytes(model, vocab: int, mbs: int, seq: int, temperature: float) -> int:
    """Bytes autograd keeps for backward of one actor micro-batch (loss = logprobs + entropy)."""
    from megarl.models.logprobs import vocab_parallel_logprobs
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (mbs, seq), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, positions, mask)
        logp, ent = vocab_parallel_logprobs(logits, tokens, vocab, with_entropy=True, temperature=temperature)
        loss = logp.sum() + ent.sum()
    loss.backward()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="bench/out/plan_check.json")
    ap.add_argument("overrides", nargs="*", help="settings of the recipe, key=value (e.g. model.lora.rank=8)")
    args = ap.parse_args()
    from megarl.config import load_config
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    from megarl.models.setup import build_all
    from megarl.plan import Layout, resolve_arch, trainer_memory
    from megarl.plan import memory as mem
    from megarl.plan.trainer import adapter_activation_bytes

    torch.set_num_threads(1)
    cfg = load_config(args.recipe, [f"model.dtype={args.dtype}", "train.offload_idle=false",
                                    "train.recompute=none", *args.overrides])
    init_distributed("gloo")
    cpu.apply()
    parallel.initialize(1, 1, cfg.run.seed)
    models = build_all(cfg, with_tokenizer=False)

    measured = {}
    for role in ("actor", "critic"):
        t = getattr(models, role)
        measured[role] = {**buffer_bytes(t.model), "optimizer": optimizer_bytes(t)}
    # LoRA: the reference is the actor itself (its adapters off), no second copy
    measured["reference"] = 0 if models.reference is None or models.reference is models.actor.model else sum(
        p.numel() * p.element_size() for p in models.reference.parameters())
    seq, mbs = cfg.rollout.engines.max_model_len, cfg.train.rows_per_micro_batch   # rows of one micro-batch
    measured["activations_actor_microbatch"] = saved_activation_bytes(
        models.actor.model, models.actor.info.vocab_size, mbs, seq, cfg.rollout.sampling.temperature)

    arch, _ = resolve_arch(cfg)
    est = trainer_memory(cfg, arch, Layout(1, 1, 1), fused=False)
    # a LoRA actor's adapters keep A x (and with dropout its mask) beyond the base's activations
    adapters = adapter_activation_bytes(cfg, arch, Layout(1, 1, 1), "actor", 0, seq * mbs, 1, fused=False)
    predicted = {"actor": est["roles"]["actor"], "critic": est["roles"]["critic"],
                 "reference": est["roles"]["reference"],
                 "activations_actor_microbatch": mem.stage_activation_bytes(
                     arch, seq, mbs, 1, 1, 0, 1, act_bytes=mem.DTYPE_BYTES[args.dtype], fused=False,
                     divisible_by=cfg.model.make_vocab_size_divisible_by) + adapters}

    def ratio(m, p):
        return round(m / p, 4) if p else None

    compare = {}
    for role in ("actor", "critic"):
        for k in ("weights", "grads", "optimizer"):
            compare[f"{role}.{k}"] = {"measured": measured[role][k], "predicted": predicted[role][k],
                                      "ratio": ratio(measured[role][k], predicted[role][k])}
    for k in ("reference", "activations_actor_microbatch"):
        compare[k] = {"measured": measured[k], "predicted": predicted[k], "ratio": ratio(measured[k], predicted[k])}
    result = {"recipe": args.recipe, "overrides": args.overrides, "dtype": args.dtype, "seq": seq,
              "micro_batch_size": mbs,
              "params": mem.total_params(arch), "compare": compare}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for k, v in compare.items():
        print(f"{k:32s} measured {v['measured']:>12,}  predicted {v['predicted']:>14,.0f}  ratio {v['ratio']}")
    parallel.destroy()


if __name__ == "__main__":
    main()
