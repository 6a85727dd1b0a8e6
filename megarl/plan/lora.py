"""LoRA adapters' sizes (model.lora, docs/lora.md "Planning"): pure arithmetic on the model's
facts (`Arch`, from its HF config) and the adapters' rank and targets, laid out as
megarl/models/lora.py builds them, so that `megarl plan` and `megarl simulate` price what the
trainer holds and what a push of the adapters carries.

Per layer, for each target, A [r, in] and B [out, r] of the linear layer it adapts (SwiGLU's
fc1 is gate|up, 2 x intermediate wide):
    qkv:  A [r, hidden]        B [q + k + v, r]
    proj: A [r, q]             B [hidden, r]
    fc1:  A [r, hidden]        B [2 x intermediate, r]
    fc2:  A [r, intermediate]  B [hidden, r]
On one TP rank (`tp`) the column-parallel layers (qkv, fc1) split B along its output and keep
A whole; the row-parallel ones (proj, fc2) split A along its input and keep B whole (Megatron-
Bridge's split, LoRALinear's). Mixture-of-Experts models: attention only (expert MLPs are not
adapted: the schema and apply_lora refuse fc1 / fc2 there).
"""
from __future__ import annotations

from megarl.config.schema import ConfigError
from megarl.models.arch import Arch


def target_shapes(a: Arch, rank: int, target: str, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """(A's shape, B's shape) of one layer's adapters on `target` on one of `tp` TP ranks."""
    q, kv = a.heads * a.head_dim, 2 * a.kv_heads * a.head_dim
    # target -> (input features, output features, column-parallel)
    dims = {"qkv": (a.hidden, q + kv, True), "proj": (q, a.hidden, False),
            "fc1": (a.hidden, 2 * a.ffn, True), "fc2": (a.ffn, a.hidden, False)}
    if target not in dims:
        raise ConfigError(f"model.lora.targets: unknown target {target!r}: name megatron's layers among {list(dims)}")
    fan_in, fan_out, column = dims[target]
    if column:
        return (rank, fan_in), (fan_out // tp, rank)
    return (rank, fan_in // tp), (fan_out, rank)


def check_targets(a: Arch, targets) -> None:
    """What apply_lora refuses of a model: fc1 / fc2 on an MoE model (its MLPs are experts)."""
    mlp = sorted({"fc1", "fc2"} & set(targets))
    if a.moe and mlp:
        raise ConfigError(f"model.lora.targets={list(targets)}: expert MLPs are not supported yet (this model has "
                          f"{a.experts} experts): target qkv and proj only")


def layer_adapter_params(a: Arch, rank: int, targets, tp: int = 1) -> int:
    """Adapter elements of one layer on one TP rank (A and B of every target)."""
    check_targets(a, targets)
    total = 0
    for t in targets:
        (ar, ac), (br, bc) = target_shapes(a, rank, t, tp)
        total += ar * ac + br * bc
    return total


def adapter_params(a: Arch, rank: int, targets, tp: int = 1, layers: int | None = None) -> int:
    """Adapter elements of the model (`layers`: of that many layers, e.g. one PP stage's) on one
    of `tp` TP ranks; tp=1: the whole adapter set, what a PEFT folder holds. 0 when rank is 0."""
    if rank <= 0:
        return 0
    return layer_adapter_params(a, rank, targets, tp) * (a.layers if layers is None else layers)


#: how many HF layers share a fused megatron layer's A: q, k, v (qkv); gate, up (fc1)
PEFT_PARTS = {"qkv": 3, "proj": 1, "fc1": 2, "fc2": 1}


def peft_params(a: Arch, rank: int, targets, tp: int = 1) -> int:
    """Adapter elements as PEFT, transformers and vLLM hold them (formats/lora_peft.py): per HF
    linear layer, so a fused layer's shared A is copied for each part (q, k, v: 3 x [r, hidden];
    gate, up: 2 x [r, hidden]) and B is split among them (the same elements). What a push of the
    adapters carries (tp=1) and what vLLM's LoRA slot holds per engine GPU (tp: the engine's;
    vLLM splits the A / B of column / row layers as megatron does). 0 when rank is 0."""
    if rank <= 0:
        return 0
    extra = sum((PEFT_PARTS[t] - 1) * target_shapes(a, rank, t, tp)[0][0] * target_shapes(a, rank, t, tp)[0][1]
                for t in targets)
    return adapter_params(a, rank, targets, tp) + extra * a.layers


def largest_adapter_tensor(a: Arch, rank: int, targets) -> int:
    """Elements of the largest single adapter tensor (whole, TP gathered): fc1's B when fc1 is
    targeted (2 x intermediate x r)."""
    return max((x * y for t in targets for x, y in target_shapes(a, rank, t)), default=0)


def layer_activation_bytes(a: Arch, lora, tokens: float, tp: int, act_bytes: int = 2, mask_bytes: int = 1) -> float:
    """What one layer's adapters keep for backward beyond what the layer keeps fine-tuned in
    full, for `tokens` tokens on one of `tp` TP ranks: each target's A x (r values per token, B's
    input). A frozen base layer keeps no input (megatron's linear_with_frozen_weight needs none),
    and A keeps the one the trained base would have kept; with model.lora.dropout > 0 A keeps the
    dropped input instead, and dropout its mask: 1 byte per input feature on a GPU (a bool mask),
    act_bytes on the CPU (torch multiplies by a mask of the input's dtype there)."""
    per_token = 0.0
    for t in lora.targets:
        per_token += lora.rank * act_bytes
        if lora.dropout > 0:
            per_token += target_shapes(a, lora.rank, t, tp)[0][1] * mask_bytes
    return tokens * per_token


def lora_of(cfg):
    """The recipe's model.lora when on (rank > 0), else None."""
    lora = cfg.model.lora
    return lora if lora.rank > 0 else None


def push_mode(cfg) -> str:
    """What a push of a LoRA run carries: weight_sync.lora (adapters: only the adapters, into
    vLLM's LoRA slots; merged: the full merged weights, as without LoRA); "" without LoRA."""
    if not lora_of(cfg):
        return ""
    return cfg.weight_sync.lora


def check_push_route(cfg, backend: str) -> None:
    """What the run refuses of an adapters push: it travels on the collective transport over
    megarl's gloo wire only, unstaged and gathered on rank 0 (vLLM's nccl and ipc receivers load
    every tensor into the model; files reload whole weights). `backend`: the wire the plan
    resolved. Raises ConfigError with the line the config, preflight and the push give
    (WeightSyncConfig.adapters_refusal)."""
    refusal = cfg.weight_sync.adapters_refusal(backend) if adapters_pushed(cfg) else ""
    if refusal:
        raise ConfigError(refusal)


def adapters_pushed(cfg) -> bool:
    """Whether a push carries only the adapters (LoRA on, weight_sync.lora=adapters)."""
    return push_mode(cfg) == "adapters"


def pushed_params(cfg, a: Arch, total: int) -> int:
    """Elements one push carries: the adapters alone, in PEFT's per-layer form (`peft_params`),
    with weight_sync.lora=adapters, else `total` (the whole model: full fine-tuning, or merged
    LoRA weights)."""
    lora = lora_of(cfg)
    if adapters_pushed(cfg):
        return peft_params(a, lora.rank, lora.targets)
    return total


def adapted(cfg, role: str):
    """model.lora when `role`'s model carries adapters: the actor whenever LoRA is on, the critic
    with model.lora.critic too; else None (fine-tuned in full)."""
    lora = lora_of(cfg)
    if lora and (role == "actor" or (role == "critic" and lora.critic)):
        return lora
    return None


def adapted_model_bytes(base: float, adapters: float, trained: float, per_param: dict[str, float],
                        w_bytes: int) -> dict[str, float]:
    """Bytes of one GPU's share of a model with frozen base and trained adapters, by part:
    `base` frozen elements hold their weights only (no gradient, no fp32 main copy, no Adam
    moments: megatron's DDP and distributed optimizer cover only parameters that require a
    gradient); `adapters` and `trained` (a critic's new value head) hold what a trained
    parameter holds (`per_param`: memory.trainable_bytes_per_param at the model's dtype and DP)."""
    own = adapters + trained
    return {"weights": base * w_bytes + own * per_param["weights"], "grads": own * per_param["grads"],
            "optimizer": own * per_param["optimizer"]}
