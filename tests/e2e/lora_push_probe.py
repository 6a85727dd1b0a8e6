"""Subprocess body of test_lora_push: adapters-only weight pushes (weight_sync.lora=adapters)
from a TP=2 and then a PP=2 trainer into real vLLM engines with LoRA on
(megarl/rollout/weights/adapters.py).

Run under torchrun with 2 ranks. Every rank builds the tiny model's actor at TP=2 with LoRA
adapters (apply_lora, as the trainer does), sets the adapters to seeded noise (B != 0: the
adapted model differs from the base), and pushes only the adapters, over megarl's gloo wire,
to one engine of each mode in ENGINE_MODES (rank 0 opens them, vLLM's LoRA on). After each of
two pushes (the second with other adapters, with a request in flight on the engine during it:
rollout.update_mode=keep) it measures the engine's mean |engine - trainer| logprob
(weight_sync.engine_mismatch, what weight_sync.verify checks) and, as a control, the gap to the
trainer with its adapters off (the base the engine would serve if the adapters missed it).
Then the same world rebuilds the actor at PP=2 with other adapters and pushes a third version.
usage: lora_push_probe.py MODEL_DIR OUT_JSON ENGINE_MODES LOG_DIR
ENGINE_MODES: comma-separated, each inprocess or local_servers
"""
import dataclasses
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # pool_sync_probe's held-request helpers

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

TEMPERATURE = 0.7
RANK, ALPHA = 4, 8.0


def set_adapters(model, seed: int, b_scale: float) -> None:
    """Every LoRA layer's full A and B from `seed` (the same on every rank; each keeps its shard)."""
    from megarl.models.lora import lora_layers
    for k, layer in enumerate(lora_layers(model)):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        a = torch.randn(layer.rank, layer.base.input_size, generator=g) / layer.base.input_size ** 0.5
        b = b_scale * torch.randn(layer.base.output_size, layer.rank, generator=g)
        layer.set_full(a, b)


def peft_folder_gaps(actor, info, pool, prompts, logs: str) -> dict:
    """Collective: the trainer's adapters written as a PEFT folder (the export's writer,
    formats/lora_peft.write_adapter), loaded by the in-process engine from the folder (a
    LoRARequest with its path: vLLM's own loader) in place of the pushed adapter; the engine's
    gap to the trainer's adapted model over the probe prompts."""
    from megarl.formats import lora_peft
    from megarl.rollout.weights import adapters
    from megarl.rollout.weights import sync as weight_sync
    tensors = adapters.gathered(actor.model, info)
    if pool is not None:
        folder = f"{logs}/peft"
        spec = adapters.spec(actor.model)
        lora_peft.write_adapter(folder, tensors, spec["r"], spec["alpha"], "base")
        from vllm.lora.request import LoRARequest
        pool.engines[0]._lora = LoRARequest("peft-folder", 2, lora_path=folder)   # vLLM loads it from there
    return weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE)


def main(model_dir: str, out_path: str, modes: str, logs: str) -> None:
    from pool_sync_probe import close_all, held_gaps, hold_at_the_swap
    from transformers import AutoConfig

    from megarl.config import load_config
    from megarl.config.schema import LoraConfig
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    from megarl.formats.hf_reader import HFCheckpoint
    from megarl.models.builders import build_model
    from megarl.models.loading import load_hf_shard
    from megarl.models.lora import adapters_disabled, apply_lora
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import sync as weight_sync

    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"data.prompts={model_dir}/prompts.jsonl", "run.dir=unused",
        "rollout.engines.count=1", f"rollout.sampling.temperature={TEMPERATURE}",
        "weight_sync.transport=collective", "weight_sync.backend=gloo", "rollout.engines.timeout_s=120"])
    ws = cfg.weight_sync
    if getattr(ws, "lora", None) != "adapters":
        object.__setattr__(ws, "lora", "adapters")
    env = init_distributed("gloo")
    cpu.apply()
    torch.set_num_threads(1)
    hf_config = AutoConfig.from_pretrained(model_dir)

    def lora_actor(tp: int, pp: int):
        parallel.initialize(tp, pp, 0)
        tcfg = transformer_config(hf_config, tp, pp, torch.float32, False, "none", False)
        model, info = build_model(hf_config, tcfg, 128, "actor")
        load_hf_shard(model, info, HFCheckpoint(model_dir), "actor")
        apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA))
        return model, info
    model, info = lora_actor(2, 1)
    actor = SimpleNamespace(model=model, info=info)
    pools = {}
    for mode in modes.split(","):
        engines = dataclasses.replace(cfg.rollout.engines, mode=mode)
        c = dataclasses.replace(cfg.rollout, engines=engines)
        pools[mode] = open_pool(c, model_dir, 0, f"{logs}/{mode}", "gloo", lora_rank=RANK) if env.rank == 0 else None
    transports = {m: weight_sync.open_transport(ws, p) for m, p in pools.items()}
    prompts = [[1, 5 + i, 9, 12 + 3 * i] for i in range(6)]
    full_bytes = os.path.getsize(Path(model_dir) / "model.safetensors")
    result = {"pushes": [], "full_model_bytes": full_bytes}
    try:
        for version, (seed, scale) in enumerate([(1, 0.05), (2, 0.08)], start=1):
            set_adapters(model, seed, scale)
            held = {} if version == 2 and env.rank == 0 else None
            for mode, pool in pools.items():
                if held is not None:
                    hold_at_the_swap(mode, pool, held)
                sync = transports[mode].push(model, info, version)
                gaps = weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE)
                with adapters_disabled(model):
                    base_gaps = weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE)
                verified = weight_sync.verify(actor, pool, prompts, 8, 1, TEMPERATURE, tol=1e-4)
                result["pushes"].append({"mode": mode, "version": version, "gaps": gaps, "base_gaps": base_gaps,
                                         "verify_gap": verified, "sync_bytes": sync["sync_bytes"],
                                         "engine_version": pool.version if pool is not None else None})
            if version == 2:
                result["held_over_push"] = held_gaps(actor, info, held, version)
        # PP=2: each stage's adapters reach rank 0 (the object gather over the PP group)
        model, info = lora_actor(1, 2)
        actor = SimpleNamespace(model=model, info=info)
        set_adapters(model, 3, 0.08)
        for mode, pool in pools.items():
            sync = transports[mode].push(model, info, 3)
            result["pp2"] = {**result.get("pp2", {}), mode: {
                "gaps": weight_sync.engine_mismatch(actor, pool, prompts, 16, 1, TEMPERATURE),
                "sync_bytes": sync["sync_bytes"]}}
        result["peft_folder_gaps"] = peft_folder_gaps(actor, info, pools.get("inprocess"), prompts, logs)
    finally:
        close_all(transports, pools)
    if env.rank == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
