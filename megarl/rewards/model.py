"""A reward model served on the trainer ranks: an HF `*ForSequenceClassification` checkpoint
(one label) loaded into the same megatron backbone as the critic, scoring each sequence by
the value at its last token (what transformers' sequence classifiers pool).
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoConfig

from megarl.models.builders import build_model, load_hf_weights
from megarl.models.config import transformer_config
from megarl.ppo.batch import Batch
from megarl.ppo.schedule import forward_per_token, gather_dp


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
    """GPTModel backbone + scalar head holding the checkpoint's `score.weight`; frozen."""
    from megarl.distributed import parallel
    from megarl.models.setup import read_hf_state

    hf_config = _as_causal_lm(AutoConfig.from_pretrained(path))
    state = read_hf_state(path)
    score = state.pop("score.weight")  # [1, hidden]
    model, info = build_model(hf_config, transformer_config(hf_config, tp, pp, dtype, torch.cuda.is_available()),
                              divisible_by, role="critic")
    load_hf_weights(model, info, state, role="critic")
    if parallel.is_last_stage():
        with torch.no_grad():
            model.output_layer.weight.copy_(score)
    model.eval().requires_grad_(False)
    return model


def _last_token_scores(batch: Batch, out: torch.Tensor) -> torch.Tensor:
    """out [b, L, 1] -> [b, R] holding each row's score in column 0 (shape of forward_per_token)."""
    lengths = batch.resp_mask.sum(dim=1).long()
    rows = torch.arange(batch.size, device=batch.device)
    last_pos = batch.resp_index[rows, (lengths - 1).clamp(min=0)] + 1
    scores = out[rows, last_pos.clamp(max=out.shape[1] - 1), 0].float()
    result = torch.zeros_like(batch.resp_mask)
    result[:, 0] = scores
    return result


def score(model, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    """[B] reward-model score of each sequence (prompt + response). Collective over all ranks;
    each DP rank scores its rows, and every rank gets all of them."""
    from megarl.models.offload import resident
    from megarl.ppo.step import dp_rows
    local = batch.select(dp_rows(batch.size))
    with resident(model):
        out = forward_per_token(model, local, micro_batch_size, lambda mb, o: _last_token_scores(mb["batch"], o))
    return gather_dp(out)[:, 0]
