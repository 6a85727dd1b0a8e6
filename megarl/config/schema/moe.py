"""How the trainer trains a Mixture-of-Experts model's routers (docs/moe.md). The layout
(parallel.ep, parallel.moe_dispatcher) lives with the other parallel settings."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema.checks import one_of, require


@dataclass
class MoEConfig:
    # load-balancing loss added to the policy loss, per MoE layer (megatron's moe_aux_loss_coeff):
    # < 0 (the default): the checkpoint's router_aux_loss_coef (config.json; 0.001 for Qwen3-MoE
    # and Qwen2-MoE), else this value; 0 turns it off
    aux_loss_coeff: float = -1.0
    # aux_loss: per micro-batch (megatron's default) | seq_aux_loss: per sequence |
    # global_aux_loss: over the whole global batch | none
    load_balancing: str = "aux_loss"
    # router z-loss (logits kept small; megatron's moe_z_loss_coeff, off by default)
    z_loss_coeff: float = 0.0

    def __post_init__(self):
        one_of("moe.load_balancing", self.load_balancing,
               {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"})
        require(self.z_loss_coeff >= 0, "moe.z_loss_coeff", self.z_loss_coeff, "must be >= 0 (0: off)")

    def aux_coeff(self, hf_config) -> float:
        """The load-balancing coefficient for a checkpoint (see aux_loss_coeff)."""
        if self.load_balancing == "none":
            return 0.0
        if self.aux_loss_coeff >= 0:
            return self.aux_loss_coeff
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
