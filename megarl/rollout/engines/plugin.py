"""vLLM general plugin (entry point `vllm.general_plugins` in setup.py): registers megarl's
`gloo` weight-transfer backend, the engine core's count of held tokens (`rollout/engines/held_tokens.py`),
the CPU MoE reload fix (`rollout/engines/moe_reload.py`), the workers' route capture methods
(`rollout/engines/route_capture.py`, used only when asked), LoRA adapter swap
(`rollout/engines/lora_slots.py`) and the staged version's readiness (`rollout/engines/staged_swap.py`)
in every vLLM process (API server, engine core, workers), so servers started by megarl, by slurm or
by hand accept `--weight-transfer-config '{"backend": "gloo"}'`. vLLM may call it several times per
process: registering is idempotent. Lazy: the backend module is imported only where an engine is built with it."""
from __future__ import annotations

BACKEND = "gloo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megarl.rollout.engines import lora_slots, moe_reload, route_capture, staged_swap
    from megarl.rollout.engines.held_tokens import install_core_utility
    install_core_utility()     # the engine core's count of held tokens (pause contract)
    moe_reload.install()       # CPU MoE experts keep their kernel layout over weight updates
    route_capture.install_worker_methods()   # routing replay: experts chosen per request (on demand)
    lora_slots.install_worker_method()       # an adapters push's swap (weight_sync.lora=adapters)
    staged_swap.install_worker_method()      # a staged push: prepared before the pause
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megarl.rollout.weights.gloo_backend", "GlooWeightTransferEngine")
