"""Subprocess body of test_lora_train: layout_probe.py's PPO steps with LoRA on the actor (the
same synthetic batch at every layout), plus what LoRA adds, written per case:
- `pushed`: per HF tensor name, the sum and the sum of squares of what the weight push sends
  (source.hf_tensors: merged per TP shard, then gathered) and of what the sharded push's pieces
  assemble to (`pieces_*`), with every adapter's B set from seeded full tensors first (so the
  merge is not W + 0); every PP stage's tensors gathered to rank 0.
- `frozen_changed` / `adapters_unchanged`: over the case, how many base tensors changed and how
  many adapters did not (this rank's shards, summed over ranks).
- `grad_buffer_elements` / `optimizer_elements`: megatron DDP's grad-buffer elements and the
  distributed optimizer's fp32 main-parameter elements (its shard of the trained tensors, split
  over DP), against `adapter_elements` (each summed over ranks).
A case whose first argument is `push` builds the models only and writes `pushed`.
usage: as layout_probe.py (torchrun ... lora_train_probe.py MODEL_DIR OUT_JSON --case NAME ...)
"""
import sys
import zlib
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

sys.path.insert(0, str(Path(__file__).parent))
import layout_probe  # noqa: E402

R = 4


def seeded_b(models) -> None:
    """Every actor adapter's B from a full tensor (HF row order) seeded by the layer's global
    name: the same merged model at any layout (LoRALinear.set_full keeps this rank's shard)."""
    from megarl.models.lora import LoRALinear
    module = models.actor.model.module
    for layer in module.decoder.layers:
        for name, m in layer.named_modules():
            if isinstance(m, LoRALinear):
                seed = zlib.crc32(f"{layer.layer_number}.{name}".encode())
                b = torch.randn(m.base.output_size, R, generator=torch.Generator().manual_seed(seed)) * 0.05
                a = m.lora_a.detach()
                if not m.column:   # the row layer's A is split: the full A from every TP rank
                    a = gather(a, 1)
                m.set_full(a, b)


def gather(t, dim):
    import torch.distributed as dist

    from megarl.distributed import parallel
    parts = [torch.empty_like(t) for _ in range(parallel.tp_size())]
    dist.all_gather(parts, t.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim)


def pushed_stats(models) -> dict:
    """{hf name: [sum, sum of squares]} of the push's tensors and of the sharded pieces assembled,
    every stage's, on every rank."""
    import torch.distributed as dist

    from megarl.distributed import parallel
    from megarl.formats.shard_slices import assemble
    from megarl.rollout.weights import sharded, source
    model, info = models.actor.model, models.actor.info
    mine = {}
    if parallel.dp_rank() == 0:
        for name, t in source.hf_tensors(model, info):
            mine[name] = [t.double().sum().item(), t.double().square().sum().item()]
    pieces = [(p.name, p.shape, p.dim, p.start, p.tensor) for p in sharded.own_pieces(model, info, {})]
    every, all_pieces = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.all_gather_object(all_pieces, pieces)
    from megarl.formats.shard_slices import HFSlice
    full = assemble(HFSlice(*p) for ps in all_pieces for p in ps)
    out = {k: v for d in every for k, v in d.items()}
    out.update({f"pieces_{k}": [t.double().sum().item(), t.double().square().sum().item()] for k, t in full.items()})
    return out


def run_case(model_dir: str, args: list[str], world_size: int) -> dict:
    import torch.distributed as dist

    from megarl.models import setup
    captured = {}
    real = setup.build_all

    def capturing(cfg, with_tokenizer=True):
        models = real(cfg, with_tokenizer)
        captured["models"] = models
        module = models.actor.model.module
        captured["before"] = {n: p.detach().clone() for n, p in module.named_parameters()}
        return models
    setup.build_all = capturing
    try:
        history = layout_probe.run_case(model_dir, [f"model.lora.rank={R}", "model.lora.alpha=8",
                                                    "train.actor_lr=2e-3", *args], world_size)
    finally:
        setup.build_all = real
    models, before = captured["models"], captured["before"]
    module = models.actor.model.module
    adapters = {n for n, p in module.named_parameters() if p.requires_grad}
    counts = torch.tensor([
        sum(not torch.equal(p, before[n]) for n, p in module.named_parameters() if n not in adapters),
        sum(torch.equal(p, before[n]) for n, p in module.named_parameters() if n in adapters),
        len(adapters), sum(p.numel() for n, p in module.named_parameters() if n in adapters),
        sum(b.numel_unpadded for b in models.actor.model.buffers),
        sum(p.numel() for g in models.actor.optimizer.optimizer.param_groups for p in g["params"]),
        models.reference is models.actor.model,
    ], dtype=torch.float64)
    # parallel.destroy() ran; the world group is still there for the sums
    dist.all_reduce(counts)
    keys = ("frozen_changed", "adapters_unchanged", "adapters", "adapter_elements", "grad_buffer_elements",
            "optimizer_elements", "reference_is_actor")
    facts = {k: int(v) for k, v in zip(keys, counts.tolist())}
    return {"history": history, "facts": facts}


def pushed_case(model_dir: str, args: list[str], world_size: int) -> dict:
    """The models at the launched layout, B seeded: the push's tensors (no training)."""
    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", f"model.lora.rank={R}",
                                                "model.lora.alpha=8", "algo.name=grpo", *args])
    validate_world(cfg, world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, cfg.run.seed, cfg.parallel.ep)
    from megarl.models.setup import build_all
    models = build_all(cfg, with_tokenizer=False)
    seeded_b(models)
    out = pushed_stats(models)
    parallel.destroy()
    return out


def main(model_dir, out_path, args):
    def case(model_dir, case_args, world_size):
        if case_args and case_args[0] == "push":
            return pushed_case(model_dir, case_args[1:], world_size)
        return run_case(model_dir, case_args, world_size)
    layout_probe.probe_main(case, model_dir, out_path, args)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
