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
from megarl.rollout import vllm_async
from megarl.rollout.engine import Engine
from megarl.rollout.servers import LocalServer, LocalServerEngine
from megarl.rollout.vllm_http import HTTPVLLMEngine


def build_engines(cfg, model_path: str, seed: int, log_dir: str, weight_backend: str = "") -> list[Engine]:
    """`cfg` is a RolloutConfig. Logs of servers megarl starts go to <log_dir>/engine_<i>.log.
    `weight_backend`: the weight-transfer backend engines megarl starts receive with (see
    `weight_backend`); "" for weight_sync.transport=files."""
    return [build_engine(cfg, model_path, seed, log_dir, i, weight_backend) for i in range(cfg.engines.pool_size)]


def weight_backend(ws) -> str:
    """The weight-transfer backend engines are started with, from a WeightSyncConfig."""
    return ws.resolved_backend(torch.cuda.is_available()) if ws.transport == "collective" else ""


def build_engine(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str = "") -> Engine:
    """Engine i of the pool, unstarted; called again for a replacement of a failed engine i
    (a fresh object: a new server process, or a new connection to the same remote URL).
    An unknown rollout.engines.mode raises ConfigError naming the known kinds."""
    build = ENGINE_KINDS.get(cfg.engines.mode)
    return build(cfg, model_path, seed, log_dir, i, weight_backend)


@ENGINE_KINDS.register("inprocess")
def _inprocess(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str) -> Engine:
    return vllm_async.AsyncVLLMEngine(f"engine{i}", model_path, vllm_async.engine_args(cfg, seed, i, weight_backend),
                                      cfg.engines.timeout_s)


@ENGINE_KINDS.register("local_servers")
def _local_server(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str) -> Engine:
    # the server listens on 127.0.0.1 only; the key still keeps other local users off /v1.
    # Its log is appended to: a replacement's lines follow those of the engine it replaces.
    server = LocalServer(model_path, os.path.join(log_dir, f"engine_{i}.log"),
                         api_key=cfg.engines.api_key or secrets.token_hex(16), seed=seed + i,
                         max_model_len=cfg.engines.max_model_len, tp=cfg.engines.tp,
                         enforce_eager=cfg.engines.enforce_eager, kv_cache_mb=cfg.engines.kv_cache_mb,
                         gpu_memory_utilization=cfg.engines.gpu_memory_utilization,
                         weight_backend=weight_backend)
    return LocalServerEngine(f"engine{i}", server, cfg.engines.timeout_s, cfg.engines.start_timeout_s)


@ENGINE_KINDS.register("remote")
def _remote(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str) -> Engine:
    api_key = cfg.engines.api_key or os.environ.get("MEGARL_ENGINE_API_KEY", "")
    return HTTPVLLMEngine(f"engine{i}", cfg.engines.urls[i], api_key, cfg.engines.timeout_s,
                          start_timeout_s=cfg.engines.start_timeout_s)
