"""Engines from the rollout config: one builder per rollout.engines.mode, each registered in
`ENGINE_KINDS` (megarl/config/registry.py), which the config validates the setting against.

- inprocess: vLLM AsyncLLM in this process (engine core in a child process).
- local_servers: megarl starts one vLLM HTTP server per engine and stops it on close.
- remote: servers someone else started (rollout.engines.urls); megarl only connects.
Engines are returned unstarted; the pool starts them (concurrently) and closes them.
Importing this module imports no vLLM: the engines import it when they start.
"""
from __future__ import annotations

import os
import secrets

import torch

from megarl.config.registry import ENGINE_KINDS
from megarl.rollout.engines import gpus, vllm_async
from megarl.rollout.engines.engine import Engine
from megarl.rollout.engines.servers import LocalServer, LocalServerEngine
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine
from megarl.rollout.engines.vllm_settings import BIND_ENV, check_expert_parallel, cpu_binds


def build_engines(cfg, model_path: str, seed: int, log_dir: str, weight_backend: str = "",
                  lora_rank: int = 0) -> list[Engine]:
    """`cfg` is a RolloutConfig. Logs of servers megarl starts go to <log_dir>/engine_<i>.log.
    `weight_backend`: the weight-transfer backend engines megarl starts receive with (see
    `weight_backend`); "" for weight_sync.transport=files. `lora_rank`: > 0 for engines that
    serve the trainer's LoRA adapters (`lora_rank`)."""
    check_expert_parallel(cfg.engines.expert_parallel, model_path, torch.cuda.is_available())   # before any starts
    return [build_engine(cfg, model_path, seed, log_dir, i, weight_backend, lora_rank)
            for i in range(cfg.engines.pool_size)]


def lora_rank(model_cfg, ws) -> int:
    """The adapter rank engines megarl starts serve: model.lora.rank when the adapters travel
    alone (weight_sync.lora=adapters), else 0 (merged weights need no LoRA in the engine)."""
    return model_cfg.lora.rank if getattr(ws, "lora", "merged") == "adapters" else 0


def weight_backend(ws, engine_mode: str, own_gpus: bool = False) -> str:
    """The weight-transfer backend engines of rollout.engines.mode `engine_mode` are started
    with, from a WeightSyncConfig ("" for weight_sync.transport=files); `own_gpus`: engines
    megarl starts run on GPUs of their own (gpus.own_gpus)."""
    if ws.transport != "collective":
        return ""
    return ws.resolved_backend(torch.cuda.is_available(), engine_mode, own_gpus)


def build_engine(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str = "",
                 lora_rank: int = 0) -> Engine:
    """Engine i of the pool, unstarted; called again for a replacement of a failed engine i
    (a fresh object: a new server process, or a new connection to the same remote URL).
    An unknown rollout.engines.mode raises ConfigError naming the known kinds."""
    build = ENGINE_KINDS.get(cfg.engines.mode)
    return build(cfg, model_path, seed, log_dir, i, weight_backend, lora_rank)


@ENGINE_KINDS.register("inprocess")
def _inprocess(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str,
               lora_rank: int = 0) -> Engine:
    return vllm_async.AsyncVLLMEngine(f"engine{i}", model_path,
                                      vllm_async.engine_args(cfg, seed, i, weight_backend, lora_rank),
                                      cfg.engines.timeout_s, env=engine_env(cfg, i, weight_backend))


@ENGINE_KINDS.register("local_servers")
def _local_server(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str,
                  lora_rank: int = 0) -> Engine:
    # the server listens on 127.0.0.1 only; the key still keeps other local users off /v1.
    # Its log is appended to: a replacement's lines follow those of the engine it replaces.
    server = LocalServer(model_path, os.path.join(log_dir, f"engine_{i}.log"),
                         api_key=cfg.engines.api_key or secrets.token_hex(16), seed=seed + i,
                         max_model_len=cfg.engines.max_model_len, tp=cfg.engines.tp,
                         enforce_eager=cfg.engines.enforce_eager, kv_cache_mb=cfg.engines.kv_cache_mb,
                         gpu_memory_utilization=cfg.engines.gpu_memory_utilization,
                         weight_backend=weight_backend, env=engine_env(cfg, i, weight_backend),
                         expert_parallel=cfg.engines.expert_parallel, lora_rank=lora_rank)
    return LocalServerEngine(f"engine{i}", server, cfg.engines.timeout_s, cfg.engines.start_timeout_s)


def engine_env(cfg, i: int, weight_backend: str = "") -> dict:
    """Environment for engine i's processes on this machine (a replacement engine i gets the same):
    - on CPU, cores of its own for its workers (vllm_settings.cpu_binds), unless the user binds
      them with VLLM_CPU_OMP_THREADS_BIND (or vLLM's NUMA simulation needs its `auto`);
    - with the ipc weight backend, VLLM_ALLOW_INSECURE_SERIALIZATION=1: vLLM unpickles the CUDA
      IPC handles of each bucket (`ipc_handles_pickled`, rollout/weights/wires.py) only then. They come
      from the trainer over the engine's control API only: in this process for in-process
      engines; a local server listens on 127.0.0.1 and every route but /health needs its API
      key (auth.RequireKey);
    - on a GPU node, CUDA_VISIBLE_DEVICES: the engine's GPUs of its own (gpus.node_split), unless
      the trainer leaves it none (then it inherits, on global rank 0's GPU)."""
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if weight_backend == "ipc" else {}
    split = gpus.node_split(cfg.engines)
    if split is not None:
        return {**env, **split.engine_env(i)}
    if torch.cuda.is_available() or os.environ.get(BIND_ENV, "auto") not in ("", "auto") or \
            os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0":
        return env
    binds = cpu_binds(cfg.engines.count, cfg.engines.tp, sorted(os.sched_getaffinity(0)))
    return {**env, BIND_ENV: binds[i]} if binds else env


@ENGINE_KINDS.register("remote")
def _remote(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str, lora_rank: int = 0) -> Engine:
    api_key = cfg.engines.api_key or os.environ.get("MEGARL_ENGINE_API_KEY", "")
    return HTTPVLLMEngine(f"engine{i}", cfg.engines.urls[i], api_key, cfg.engines.timeout_s,
                          start_timeout_s=cfg.engines.start_timeout_s, max_model_len=cfg.engines.max_model_len)
