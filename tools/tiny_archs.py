"""The tiny countdown models' architectures (tools/make_tiny_model.py --arch NAME).

Every architecture shares the countdown tokenizer's vocab and special ids, and has head_dim
>= 32 (vLLM's CPU attention refuses 16). `qwen2` is the default policy of the CPU recipes;
`qwen3` adds per-head query / key norms with head_dim apart from hidden / heads; `qwen3_moe`
is Qwen3 with a Mixture-of-Experts block in every layer (`make moe-model`).
"""
from __future__ import annotations

import torch

from megarl.data import countdown as cd

# Shared shape (the Qwen2 policy's). head_dim = 128 / 4 = 32.
COMMON = dict(
    vocab_size=cd.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
    use_sliding_window=False,
    bos_token_id=cd.BOS_ID,
    eos_token_id=cd.EOS_ID,
    pad_token_id=cd.PAD_ID,
)

# name -> (transformers config class name, model class name, kwargs on top of COMMON)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # 4 heads of 64: the attention is 256 wide over a hidden size of 128
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64)),
    # 4 experts of 256, 2 per token (as many active MLP weights as the dense 512), renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)),
}
DEFAULT = "qwen2"


def model_kwargs(arch: str) -> dict:
    """The config kwargs of one tiny architecture."""
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {sorted(ARCHS)}")
    return {**COMMON, **ARCHS[arch][2]}


def make_model(seed: int, arch: str = DEFAULT):
    """A random-init tiny model (fp32) of `arch`; deterministic in seed."""
    import transformers

    config_cls, model_cls, _ = ARCHS[arch]
    config = getattr(transformers, config_cls)(**model_kwargs(arch), dtype="float32")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    model.generation_config.bos_token_id = cd.BOS_ID
    model.generation_config.eos_token_id = cd.EOS_ID
    model.generation_config.pad_token_id = cd.PAD_ID
    return model


def save_untied(folder, arch: str = "qwen3_moe", seed: int = 0):
    """A random `arch` saved in `folder` with its matrices drawn at N(0, 1/fan_in): logits and
    router scores far from ties, so an fp32 engine, the trainer and transformers pick the same
    tokens' experts (the MoE tests' model: no skill needed). Returns `folder`."""
    model = make_model(seed, arch)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(folder)
    return folder
