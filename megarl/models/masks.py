"""The attention mask the trainer's GPTModel forward takes (megarl.ppo.schedule's passes and
the conversion's logits check build it the same way)."""
from __future__ import annotations

import torch


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    # megatron's convention: True = masked. Padding is on the right, so causal masking alone
    # keeps real tokens from seeing it.
    return torch.ones(1, 1, length, length, dtype=torch.bool, device=device).triu(diagonal=1)
