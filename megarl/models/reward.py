"""Build a reward model on the trainer ranks: an HF `*ForSequenceClassification` checkpoint (one
label) loaded into the critic's megatron backbone (GPTModel + scalar head holding `score.weight`).
Scoring lives in `megarl.rewards.model`.
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoConfig

from megarl.distributed import parallel
from megarl.formats.mapping import mapping_for
from megarl.models.builders import build_model, use_te
from megarl.models.loading import load_hf_shard, open_checked
from megarl.models.transformer_config import transformer_config

SCORE = "score.weight"  # the classifier head of transformers' sequence classifiers


def _as_causal_lm(hf_config):
    """The mapping tables are keyed by the causal-LM architecture of the same backbone."""
    arch = (hf_config.architectures or ["?"])[0]
    if not arch.endswith("ForSequenceClassification"):
        raise ValueError(f"reward.model_path holds a {arch}: a reward model must be a "
                         f"*ForSequenceClassification checkpoint with num_labels=1")
    if getattr(hf_config, "num_labels", 1) != 1:
        raise ValueError(f"reward.model_path has num_labels={hf_config.num_labels}; a reward model has 1")
    lm = copy.deepcopy(hf_config)
    lm.architectures = [arch.replace("ForSequenceClassification", "ForCausalLM")]
    lm.tie_word_embeddings = True   # there is no LM head to map
    return lm


def build_reward_model(path: str, tp: int, pp: int, dtype: torch.dtype, divisible_by: int):
    """GPTModel backbone + scalar head holding the checkpoint's `score.weight`; frozen. Each rank
    reads only its shard's HF slices (megarl.models.loading)."""
    hf_config = _as_causal_lm(AutoConfig.from_pretrained(path))
    mapping = mapping_for(hf_config, te_names=use_te())
    hf = open_checked(path, mapping, ignore=(SCORE,))
    model, info = build_model(hf_config, transformer_config(hf_config, tp, pp, dtype, torch.cuda.is_available()),
                              divisible_by, role="critic")
    load_hf_shard(model, info, hf, "critic", mapping)
    if parallel.is_last_stage():
        with torch.no_grad():
            model.output_layer.weight.copy_(hf.get(SCORE))  # [1, hidden]
    hf.close()
    model.eval().requires_grad_(False)
    return model
