"""The engine's top-k / top-p cut (rollout.sampling.top_k / top_p), as the trainer reproduces it.

vLLM samples from softmax(logits / T) restricted to a kept set and renormalised, and with
logprobs_mode=processed_logprobs it reports the sampled token's logprob under that renormalised
distribution. The trainer must take its logprobs over the same set, or every PPO ratio is off
by the log of the kept mass. The kept set follows vLLM's own order and conventions
(vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch, the path of its CPU
sampler and of every non-Triton build):
- top-k first: the k-th largest logit is a threshold and every logit >= it is kept (ties at the
  k-th value are all kept, so the set may hold more than k tokens);
- then top-p over the top-k set renormalised: the logits sorted ascending, their softmax summed
  cumulatively in that order, and a token is dropped when that sum (itself and every token
  below it) is <= 1 - top_p, in float32 as vLLM computes it; the likeliest token is always
  kept. So the token whose mass crosses the boundary is kept: the nucleus is the smallest set
  of likeliest tokens whose mass reaches top_p.
The kept set is therefore "every logit >= a threshold" per position, which `kept_threshold`
returns. One difference, by design: tokens exactly tied with the nucleus' last kept logit are
all kept here, while vLLM splits them by where its (unstable) sort put them; no rule could
follow that, and the sampled token is kept in any case (models/logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cut:
    """rollout.sampling.top_k / top_p: -1 and 1.0 are off."""
    top_k: int = -1
    top_p: float = 1.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @classmethod
    def of(cls, sampling) -> "Cut":
        """The cut of a SamplingConfig (rollout.sampling)."""
        return cls(sampling.top_k, sampling.top_p)


NO_CUT = Cut()


def top_k_threshold(z: torch.Tensor, k: int) -> torch.Tensor:
    """[N] the k-th largest of each row of z [N, V] (k clamped to V): keep z >= it."""
    k = min(k, z.shape[-1])
    return z.topk(k, dim=-1).values[:, -1]


def kept_threshold(z: torch.Tensor, cut: Cut) -> torch.Tensor:
    """[N] per row of z [N, V] (float32 logits after temperature, the whole vocabulary, no
    padding) the least logit the engine keeps under `cut`: token v is kept iff z[:, v] >= it.
    Forward only (the set is a discrete choice; the gradient flows through the renormalised
    logprob, not through the threshold)."""
    with torch.no_grad():
        if cut.top_p >= 1.0:
            return top_k_threshold(z, cut.top_k)
        zs = z.sort(dim=-1).values          # ascending, as vLLM sorts
        v = zs.shape[-1]
        if 0 < cut.top_k < v:
            kth = zs[:, v - cut.top_k].unsqueeze(-1)
            zs = zs.masked_fill(zs < kth, float("-inf"))
        cum = zs.softmax(dim=-1).cumsum(dim=-1)
        # 1 - p in float32, as vLLM's p tensor is float32
        dropped = cum <= 1 - torch.tensor(cut.top_p, dtype=torch.float32, device=z.device)
        dropped[:, -1] = False             # at least one token: the likeliest
        # the cumulative sum never decreases, so the dropped tokens are a prefix of the sort
        first_kept = dropped.sum(dim=-1, keepdim=True)
        return zs.gather(-1, first_kept).squeeze(-1)

