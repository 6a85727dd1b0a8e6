"""megarl: PPO / GRPO post-training of LLMs with megatron-core trainers and vLLM rollout engines."""
from megarl.distributed import megatron_jit as _megatron_jit

__version__ = "0.1.0"

# before any megarl module imports megatron: its fused kernels compile on first use, not at import
_megatron_jit.install()
