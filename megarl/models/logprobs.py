"""Per-token logprobs and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The softmax
normaliser, the target logit and the entropy's expectation are sums over the vocabulary, so
each rank computes its part and one all-reduce per quantity finishes it. The reduction is
megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward),
which is the correct gradient of a sum whose terms each live on one rank.

With a top-k / top-p cut (rollout.sampling.top_k / top_p, models/sampling_cut.py) the
normaliser runs over the engine's kept set only. That set is a property of the whole
vocabulary, so it is the one step that does see every column: `_kept_threshold` finds it
(forward only) from the TP group's gathered logits, and the sums above stay vocab-parallel.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megarl.distributed import parallel
from megarl.models.sampling_cut import NO_CUT, Cut, kept_threshold, top_k_threshold

# rows of the TP group's gathered logits a cut's threshold search holds at once: 2**24 float32
# values (64 MiB, e.g. 110 rows of a 152k vocabulary) plus, with top_p < 1, the sort's values,
# indices (int64) and cumulative sums, ~6x that transient on each TP rank; top-k alone gathers
# only each rank's k best candidates per position
GATHER_ELEMENTS = 1 << 24


def _gather_vocab(part: torch.Tensor) -> torch.Tensor:
    """[N, V_local] of each TP rank -> [N, tp * V_local], the ranks' slices in vocabulary order."""
    if parallel.tp_size() == 1:
        return part
    parts = [torch.empty_like(part) for _ in range(parallel.tp_size())]
    dist.all_gather(parts, part.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=-1)


def _kept_threshold(logits: torch.Tensor, true_vocab: int, cut: Cut) -> torch.Tensor:
    """[...] per position of `logits` [..., V_local] (this rank's slice, padding at the dtype's
    min) the least logit the engine's cut keeps, over the whole vocabulary: the same on every TP
    rank. Collective over the TP group, forward only.

    top-k alone: each rank's k best (k clamped to its slice) are gathered, N x k x tp values, and
    the k-th of those is the global k-th. With top-p the cumulative mass needs every column in
    order: the TP group's slices are all-gathered GATHER_ELEMENTS at a time (rows in chunks, the
    same chunks on every TP rank), so the extra memory is bounded whatever the batch, at the
    cost of one all-gather per chunk; at TP=1 nothing is gathered, only chunked."""
    with torch.no_grad():
        rows = logits.reshape(-1, logits.shape[-1])
        if cut.top_p >= 1.0:
            k = min(cut.top_k, true_vocab)
            best = rows.topk(min(k, rows.shape[-1]), dim=-1).values
            return top_k_threshold(_gather_vocab(best), k).reshape(logits.shape[:-1])
        step = max(1, GATHER_ELEMENTS // (rows.shape[-1] * parallel.tp_size()))
        out = [kept_threshold(_gather_vocab(rows[i:i + step])[:, :true_vocab], cut)
               for i in range(0, rows.shape[0], step)]
        return torch.cat(out).reshape(logits.shape[:-1])


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, true_vocab: int,
                            with_entropy: bool = True, temperature: float = 1.0, cut: Cut = NO_CUT,
                            report: dict | None = None):
    """logits [b, s, V_local] (this TP rank's vocab slice), labels [b, s] (global ids).

    `temperature`: the distribution is softmax(logits / temperature), the one the engine
    samples from (and reports behaviour logprobs of); PPO ratios, entropy and KL must all be
    taken under it, or a tempered rollout trains on the wrong ratio.

    Returns (logprobs [b, s], entropy [b, s] or None), float32. Columns at or beyond
    `true_vocab` are megatron's vocab padding: they are excluded from the softmax, as the
    engine (which has no padding) excludes them.

    `cut` (rollout.sampling.top_k / top_p): the logprob is taken under the engine's kept set
    renormalised (models/sampling_cut.py), as vLLM's processed logprobs are. NO_CUT (top_k=-1,
    top_p=1) leaves the computation exactly as it was, at no extra cost. The entropy stays that
    of the whole tempered distribution softmax(logits / T), cut or not: a measure of how
    peaked the policy is, unchanged by the sampling settings (metric `entropy`, and
    algo.entropy_coef's bonus). `report`, when given with a cut on, receives "cut_outside"
    [b, s] bool: the positions whose label the trainer's cut left out (see below).
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
    local = labels - start
    in_slice = (local >= 0) & (local < v_local)
    column = local.clamp(0, v_local - 1).unsqueeze(-1)
    kept_exp = exp
    if cut.active:
        threshold = _kept_threshold(logits.detach(), true_vocab, cut)
        kept = logits.detach() >= threshold.unsqueeze(-1)
        # The engine only samples inside its kept set, but the trainer's logits differ from the
        # engine's by rounding (~1e-6), so a sampled token at the set's boundary can fall just
        # outside the trainer's cut. -inf there would make its ratio infinite; it gets the
        # logprob of the kept set renormalised with it added instead (within the rounding of
        # the engine's), and is counted (report["cut_outside"], metric cut_outside).
        kept = kept | ((torch.arange(v_local, device=logits.device) == local.unsqueeze(-1))
                       & in_slice.unsqueeze(-1))
        if report is not None:
            with torch.no_grad():
                label_logit = logits.detach().gather(-1, column).squeeze(-1) * in_slice
                if parallel.tp_size() > 1:
                    dist.all_reduce(label_logit, group=parallel.tp_group())
                report["cut_outside"] = label_logit < threshold
        kept_exp = exp.masked_fill(~kept, 0.0)
    sum_exp = reduce_from_tensor_model_parallel_region(kept_exp.sum(dim=-1))
    lse = sum_exp.log()
    target = shifted.gather(-1, column).squeeze(-1)
    target = reduce_from_tensor_model_parallel_region(target * in_slice)
    logp = target - lse
    if not with_entropy:
        return logp, None
    if cut.active:   # the entropy is the whole distribution's (docstring)
        sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
        lse = sum_exp.log()
    probs = exp / sum_exp.unsqueeze(-1)
    entropy = lse - reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))
    return logp, entropy
