"""megarl: PPO / GRPO post-training of LLMs with megatron-core trainers and vLLM rollout engines."""
__version__ = "0.1.0"
