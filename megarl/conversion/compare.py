"""transformers' logits of an HF folder vs megarl's megatron forward of a converted checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megarl.conversion.launch import init_world
from megarl.distributed.env import free_port
from megarl.formats.dist_reader import HF_CONFIG_DIR
from megarl.formats.hf_reader import ConversionError, load_hf_config
from megarl.models.masks import causal_mask


def load_megatron_actor(megatron_dir: str, hf_config_dir: str | None = None):
    """The actor GPTModel at TP=1, PP=1 (fp32) loaded from a dist checkpoint (resharded on
    load), with its ModelInfo. Call in a process whose world is this one rank."""
    # megatron, and the megarl modules that import it, inside functions: the CLI
    # (conversion.cli._run_cli) hides the GPUs before megatron reads torch.cuda at import
    from megatron.core import dist_checkpointing

    from megarl.distributed import parallel
    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config

    mdir = Path(megatron_dir)
    if not (mdir / "metadata.json").is_file():
        raise ConversionError(f"{megatron_dir!r} is not a megatron dist checkpoint (no metadata.json)")
    side = Path(hf_config_dir) if hf_config_dir else mdir / HF_CONFIG_DIR
    hf_config = load_hf_config(side)
    metadata = dist_checkpointing.load_tensors_metadata(str(mdir))
    emb = metadata.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError(f"{megatron_dir!r} has no embedding.word_embeddings.weight")
    padded, dtype = emb.global_shape[0], emb.dtype
    parallel.initialize(1, 1, seed=0)
    cfg = transformer_config(hf_config, 1, 1, dtype, on_gpu=False)
    cfg.perform_initialization = False
    # divisible_by = the stored padded size reproduces the checkpoint's vocab padding at TP=1
    model, info = build_model(hf_config, cfg, padded, "actor")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(mdir))
    model.load_state_dict(state["model"], strict=True)
    return model.float().eval(), info


def random_prompts(vocab: int, num: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g)


def logit_stats(hf_logits: torch.Tensor, mg_logits: torch.Tensor) -> dict:
    """Argmax agreement, max / mean |diff| and mean KL(hf || megatron) over all positions."""
    a, b = hf_logits.double(), mg_logits.double()
    diff = (a - b).abs()
    lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "kl_hf_megatron": float(kl.mean()), "positions": int(a[..., 0].numel())}


def compare_logits(hf_dir: str, megatron_dir: str, prompts: int = 4, length: int = 32,
                   seed: int = 0, hf_config_dir: str | None = None) -> dict:
    """transformers' forward of `hf_dir` vs megarl's megatron forward of `megatron_dir`, fp32."""
    if not Path(hf_dir).is_dir():
        raise ConversionError(f"HF checkpoint folder {hf_dir!r} does not exist")
    if not Path(megatron_dir).is_dir():
        raise ConversionError(f"megatron checkpoint folder {megatron_dir!r} does not exist")
    init_world(0, 1, free_port(), max(1, os.cpu_count() or 1))
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model, info = load_megatron_actor(megatron_dir, hf_config_dir)
    tokens = random_prompts(info.vocab_size, prompts, length, seed)
    positions = torch.arange(length).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        mg = model(tokens, positions, causal_mask(length, tokens.device))[..., :info.vocab_size]
    del model
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = hf_model(input_ids=tokens).logits
    if hf.shape != mg.shape:
        raise ConversionError(f"logit shapes differ: HF {tuple(hf.shape)}, megatron {tuple(mg.shape)}")
    dist.destroy_process_group()
    return logit_stats(hf, mg)
