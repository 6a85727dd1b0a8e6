"""A plan (`make_plan`'s dict) as the lines `megarl plan` prints, and its problems as one line."""
from __future__ import annotations

from megarl.plan.memory import gib


def micro_batches(p: dict) -> str:
    budget = p.get("max_tokens_per_micro_batch")
    return f"micro-batches of up to {budget} tokens" if budget else f"micro batch {p['micro_batch_size']}"


def format_plan(p: dict) -> str:
    c, pl, m = p["cluster"], p["placement"], p["model"]
    tr, en = pl["trainer"], pl["engines"]
    lines = [f"model: {m['params'] / 1e9:.2f}B params, {m['layers']} layers, hidden {m['hidden']}, "
             f"heads {m['heads']}/{m['kv_heads']} kv, ffn {m['ffn']}, vocab {m['vocab']} (from {m['source']})"
             + (f"; MoE: {m['experts']} experts of ffn {m['moe_ffn']}, {m['top_k']} per token, "
                f"{m['active_params'] / 1e9:.2f}B active" if m.get("experts") else ""),
             f"cluster: {c['nodes']} nodes x {c['gpus_per_node']} GPUs x {c['gpu_mem_gb']} GiB {c['gpu']}".rstrip()
             + f", {c['reserve_gb']} GiB reserved per GPU",
             f"trainer: {tr['nodes']} nodes = {tr['gpus']} GPUs, TP={tr['tp']} PP={tr['pp']} DP={tr['dp'] or '-'}"
             + (f", experts over EP={tr['ep']} x expert TP={tr['etp']} (expert DP={tr['edp'] or '-'})"
                if "ep" in tr else ""),
             f"engines: {en['count']} x TP={en['tp']} = {en['gpus_used']} of {en['gpus']} GPUs on {en['nodes']} nodes"
             if "gpu_split" not in pl else f"engines: {en['count']} x TP={en['tp']} on the trainer's node; GPU split: "
             + pl["gpu_split"]["line"],
             f"sequence {p['sequence_tokens']} tokens, {micro_batches(p)}, "
             f"recompute {p['recompute']}, offload_idle {p['offload_idle']}"]
    t = p["trainer"]
    if t:
        lines.append(f"trainer GPU (worst: PP stage {t['stage']}, {t['in_flight']} of {t['microbatches']} "
                     f"micro-batches in flight), GiB:")
        for role in ("actor", "critic"):
            parts = t["roles"][role]
            if sum(parts.values()):
                lines.append(f"  {role:12s}{gib(sum(parts.values())):8.2f}  (weights {gib(parts['weights'])}, "
                             f"grads {gib(parts['grads'])}, optimizer {gib(parts['optimizer'])})")
            if role == "actor" and t.get("lora"):
                lines.append(lora_line(t["lora"], p["lora"]))
        for role in ("reference", "reward"):
            if t["roles"][role]:
                lines.append(f"  {role:12s}{gib(t['roles'][role]):8.2f}")
        if p.get("lora") and p["lora"]["reference"]:
            lines.append(f"  {'reference':12s}{0:8.2f}  (LoRA: the actor with its adapters off, no second copy)")
        if t["roles"]["weight_transfer"]:
            lines.append(f"  {'transfer':12s}{gib(t['roles']['weight_transfer']):8.2f}  (weight transfer buffers, "
                         f"on global rank 0: {p['weight_transfer']})")
        if t["roles"].get("routes"):
            lines.append(f"  {'routes':12s}{gib(t['roles']['routes']):8.2f}  (routing replay: the step's batch of "
                         f"routes and the int64 expert indices of its largest pass)")
        lines.append(f"  {'activations':12s}{gib(t['roles']['activations']):8.2f}  (at the peak phase)")
        for name, b in t["phases"].items():
            lines.append(f"  phase {name:30s}{gib(b):8.2f}" + ("  <- peak" if name == t["phase"] else ""))
        lines.append(f"  peak {gib(t['peak_bytes'])} of {gib(t['usable_bytes'])} usable: "
                     + ("fits" if t["fits"] else "DOES NOT FIT"))
        if t.get("route_host_bytes"):
            lines.append(f"  global rank 0's host also holds {gib(t['route_host_bytes'])} GiB of the engines' routes "
                         f"per step (with the samples, algo.routing_replay=r3)")
        if t["sender_bytes"] and t["stage"] != 0:
            lines.append(f"  global rank 0 (PP stage 0) also holds {gib(t['sender_bytes'])} GiB of weight transfer "
                         f"buffers ({p['weight_transfer']}): peak {gib(t['sender_peak_bytes'])} GiB")
    e = p["engine"]
    if e:
        b = e["per_gpu_bytes"]
        lines.append(f"engine GPU, GiB: weights {gib(b['weights'])}, "
                     + (f"LoRA slot {gib(b['lora'])} (the adapters, served beside the base), " if b["lora"] else "")
                     + f"KV cache {gib(b['kv_cache'])} "
                     f"({e['requests_per_engine']} requests x {p['sequence_tokens']} tokens), workspace "
                     f"{gib(b['workspace'])}; {gib(e['need_bytes'])} of {gib(e['budget_bytes'])} budget: "
                     + ("fits" if e["need_bytes"] <= e["budget_bytes"] else "DOES NOT FIT"))
        if e["transfer_bytes"]:
            lines.append(f"  + weight transfer buffers {gib(e['transfer_bytes'])} ({p['weight_transfer']}) outside "
                         f"vLLM's share, {gib(max(e['transfer_room_bytes'], 0))} left there after the reserve: "
                         + ("fits" if e["transfer_bytes"] <= e["transfer_room_bytes"] else "DOES NOT FIT"))
    if e and e.get("staging_bytes"):
        lines.append(f"  + staging area {gib(e['staging_bytes'])} (weight_sync.staged: the next version beside the "
                     f"weights, in the budget): " + ("fits" if e["staging_fits"] else "DOES NOT FIT"))
    if e and e.get("staging_warning"):
        lines.append(f"warning: {e['staging_warning']}")
    if p.get("lora"):
        lines.append(push_line(p["lora"]))
    for n in p["notes"]:
        lines.append(f"note: {n}")
    lines.append("fits" if p["fits"] else "DOES NOT FIT")
    return "\n".join(lines)


def problems_message(p: dict) -> str:
    return "; ".join(f"{x['role']}: {x['what']}" + (f" ({x['short_gib']} GiB short)" if x["short_gib"] else "")
                     + f"; to fix: {x['fix']}" for x in p["problems"])


def lora_line(t: dict, whole: dict) -> str:
    """The actor's LoRA share of a trainer GPU: the adapter-only optimizer state and gradients,
    and the frozen base beside them."""
    critic = "; the critic has adapters too (model.lora.critic)" if t["critic"] else ""
    return (f"  {'  adapters':12s}{gib(t['adapter_bytes'] + t['grads'] + t['optimizer']):8.2f}  (LoRA rank {t['rank']} "
            f"on {'/'.join(t['targets'])}: {t['adapter_params'] / 1e6:.1f}M adapter params on this GPU of "
            f"{whole['adapter_params'] / 1e6:.1f}M; adapter-only optimizer {gib(t['optimizer'])} GiB, grads "
            f"{gib(t['grads'])} GiB; the base's {gib(t['base_bytes'])} GiB frozen: weights only{critic})")


def push_line(lora: dict) -> str:
    """What a push of a LoRA run carries (weight_sync.lora), against the whole model."""
    what = ("the adapters only, per HF layer as PEFT and vLLM take them (a fused layer's A once per part)"
            if lora["push"] == "adapters" else "the full model, adapters merged")
    return (f"weight push per sync: {gib(lora['push_bytes'])} GiB = {lora['push_bytes'] / lora['model_bytes']:.1%} of "
            f"the model's {gib(lora['model_bytes'])} GiB: {what} (weight_sync.lora={lora['push']}; the trainer's "
            f"adapters {gib(lora['adapter_bytes'])} GiB)")
