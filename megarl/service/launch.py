"""Starting the agent service for `rollout.mode=service` (the driver calls this; rollout
only receives the started service, so `megarl.rollout` never imports `megarl.service`)."""
from __future__ import annotations

import json
import os
import secrets

from megarl.config.secrets import from_env


def open_service(cfg, pool, tokenizer, next_task):
    """rollout.mode=service: the policy's OpenAI-compatible endpoint on the pool's loop. Its
    URL, model name and API key go to <run.dir>/service.json (owner-only), where the outside
    agents' launcher reads them; the key is service.api_key (or service.api_key_file's, read when the
    config loaded), else $MEGARL_SERVICE_API_KEY, else new. service.json is the one file that holds it."""
    from megarl.service.service import AgentService
    sv, r = cfg.service, cfg.rollout
    key = sv.api_key or from_env("service.api_key") or secrets.token_urlsafe(24)
    service = AgentService(pool.pool, tokenizer, next_task=next_task, n=r.sampling.n, api_key=key, host=sv.host,
                           port=sv.port, max_episodes=sv.max_episodes, max_new_tokens=r.sampling.max_new_tokens,
                           max_model_len=r.engines.max_model_len, temperature=r.sampling.temperature,
                           top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                           seed=cfg.run.seed, episode_timeout_s=sv.episode_timeout_s,
                           max_request_bytes=int(sv.max_request_mb * (1 << 20)), max_ready_groups=sv.max_ready_groups,
                           max_requests=sv.requests_bound)
    pool.call(service.start(), f"starting the rollout service on {sv.host}:{sv.port}")
    path = os.path.join(cfg.run.dir, "service.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": service.url, "base_url": service.url + "/v1", "model": service.model_name,
                   "api_key": key}, f)
    os.chmod(path, 0o600)
    return service
