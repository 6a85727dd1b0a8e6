"""Per-token logprobs and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The softmax
normaliser, the target logit and the entropy's expectation are sums over the vocabulary, so
each rank computes its part and one all-reduce per quantity finishes it. The reduction is
megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward),
which is the correct gradient of a sum whose terms each live on one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megarl.distributed import parallel


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, true_vocab: int,
                            with_entropy: bool = True, temperature: float = 1.0):
    """logits [b, s, V_local] (this TP rank's vocab slice), labels [b, s] (global ids).

    `temperature`: the distribution is softmax(logits / temperature), the one the engine
    samples from (and reports behaviour logprobs of); PPO ratios, entropy and KL must all be
    taken under it, or a tempered rollout trains on the wrong ratio.

    Returns (logprobs [b, s], entropy [b, s] or None), float32. Columns at or beyond
    `true_vocab` are megatron's vocab padding: they are excluded from the softmax, as the
    engine (which has no padding) excludes them.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    start = parallel.tp_rank() * v_local
    if start + v_local > true_vocab:   # decided on the host: no device sync per micro-batch
        pad = torch.arange(start, start + v_local, device=logits.device) >= true_vocab
        logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    with torch.no_grad():
        gmax = logits.max(dim=-1).values
        if parallel.tp_size() > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=parallel.tp_group())
    shifted = logits - gmax.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    lse = sum_exp.log()
    local = labels - start
    in_slice = (local >= 0) & (local < v_local)
    target = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target = reduce_from_tensor_model_parallel_region(target * in_slice)
    logp = target - lse
    if not with_entropy:
        return logp, None
    probs = exp / sum_exp.unsqueeze(-1)
    entropy = lse - reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))
    return logp, entropy
