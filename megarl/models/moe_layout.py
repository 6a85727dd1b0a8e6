"""The trainer's expert-parallel layout against an MoE checkpoint, checked before any model is
built: each refusal one line naming the settings and the fix (docs/moe.md "Layouts"). Light: no
torch, no megatron (config.json's facts only), so a check may run it before the ranks start."""
from __future__ import annotations

from megarl.config import ConfigError
from megarl.config.schema.checks import require
from megarl.formats import experts


def check_moe_layout(parallel, hf_config, setting: str = "model.path") -> None:
    """parallel: the ParallelConfig; hf_config: the checkpoint's config (transformers' object).
    A dense checkpoint passes whatever the MoE settings say (they are unused)."""
    n = experts.num_experts(hf_config)
    if not n:
        return
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    try:
        experts.check_moe_options(hf_config, arch)
    except ValueError as err:
        raise ConfigError(f"{setting}: {err}; convert the model to a supported form or pick another") from None
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    require(n % ep == 0, "parallel.ep", ep,
            f"must divide the model's {n} experts (num_experts in {setting}'s config.json): each "
            f"expert-parallel rank holds num_experts / ep of them; pick a divisor of {n}")
    # megatron's MoE layer refuses to train at TP > 1 without sequence parallelism: its token
    # dispatcher takes each TP rank's own slice of the sequence (models/norms.py: on CPU too)
    require(tp == 1 or parallel.sequence_parallel, "parallel.sequence_parallel", parallel.sequence_parallel,
            f"must be true with parallel.tp={tp} on an MoE model (megatron trains MoE layers at TP > 1 "
            f"only with sequence parallelism): set parallel.sequence_parallel=true, or parallel.tp=1")
    # megatron's allgather dispatcher gathers equal token counts from every EP rank; megarl pads
    # each rank's micro-batches to their own longest sequence (and pipeline stages alike)
    require(parallel.moe_dispatcher != "allgather" or (ep == 1 and pp == 1), "parallel.moe_dispatcher",
            parallel.moe_dispatcher,
            f"allgather needs micro-batches of one shape on every rank, which parallel.ep={ep} / "
            f"parallel.pp={pp} do not give: use parallel.moe_dispatcher=alltoall, or allgather with ep=1 and pp=1")
