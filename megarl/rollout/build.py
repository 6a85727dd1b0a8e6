"""Engines from the rollout config: one place that maps rollout.engine_mode to engine objects.

- inprocess: vLLM AsyncLLM in this process (engine core in a child process).
- local_servers: megarl starts one vLLM HTTP server per engine and stops it on close.
- remote: servers someone else started (rollout.engine_urls); megarl only connects.
Engines are returned unstarted; the pool starts them (concurrently) and closes them.
"""
from __future__ import annotations

import os
import secrets

from megarl.rollout.engine import Engine


def build_engines(cfg, model_path: str, seed: int, log_dir: str, weight_backend: str = "") -> list[Engine]:
    """`cfg` is a RolloutConfig. Logs of servers megarl starts go to <log_dir>/engine_<i>.log.
    `weight_backend`: the weight-transfer backend engines megarl starts receive with (see
    `weight_backend`); "" for weight_sync.transport=files."""
    return [build_engine(cfg, model_path, seed, log_dir, i, weight_backend) for i in range(cfg.engine_count)]


def weight_backend(ws) -> str:
    """The weight-transfer backend engines are started with, from a WeightSyncConfig."""
    import torch
    return ws.resolved_backend(torch.cuda.is_available()) if ws.transport == "collective" else ""


def build_engine(cfg, model_path: str, seed: int, log_dir: str, i: int, weight_backend: str = "") -> Engine:
    """Engine i of the pool, unstarted; called again for a replacement of a failed engine i
    (a fresh object: a new server process, or a new connection to the same remote URL)."""
    mode = cfg.engine_mode
    if mode == "inprocess":
        from megarl.rollout import vllm_async
        return vllm_async.AsyncVLLMEngine(f"engine{i}", model_path, vllm_async.engine_args(cfg, seed, i, weight_backend),
                                          cfg.engine_timeout_s)
    if mode == "local_servers":
        from megarl.rollout.servers import LocalServer, LocalServerEngine
        # the server listens on 127.0.0.1 only; the key still keeps other local users off /v1.
        # Its log is appended to: a replacement's lines follow those of the engine it replaces.
        server = LocalServer(model_path, os.path.join(log_dir, f"engine_{i}.log"),
                             api_key=cfg.api_key or secrets.token_hex(16), seed=seed + i,
                             max_model_len=cfg.max_model_len, tp=cfg.engine_tp,
                             enforce_eager=cfg.enforce_eager, kv_cache_mb=cfg.kv_cache_mb,
                             gpu_memory_utilization=cfg.gpu_memory_utilization,
                             weight_backend=weight_backend)
        return LocalServerEngine(f"engine{i}", server, cfg.engine_timeout_s, cfg.engine_start_timeout_s)
    if mode == "remote":
        from megarl.rollout.vllm_http import HTTPVLLMEngine
        api_key = cfg.api_key or os.environ.get("MEGARL_ENGINE_API_KEY", "")
        return HTTPVLLMEngine(f"engine{i}", cfg.engine_urls[i], api_key, cfg.engine_timeout_s,
                              start_timeout_s=cfg.engine_start_timeout_s)
    raise ValueError(f"rollout.engine_mode={mode!r}: expected inprocess, local_servers or remote")
