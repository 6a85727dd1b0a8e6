"""Old and alternative spellings of settings, a table each: the loader accepts them (with a
warning for MOVED), and whatever reads overrides without loading a config (the secrets' redaction
of a slurm job's overrides) resolves them the same way."""

# keys a recipe may spell as in docs/design.md but that cannot be Python field names
ALIASES = {"rollout.partial.async": "rollout.partial.asynchronous"}

# rollout's flat keys from before they were grouped into sampling / engines / partial: still
# accepted in recipes and on the command line, each with one warning naming its new key
MOVED = {
    # first: the old count has the name of the new section, which the moves below fill
    "rollout.engines": "rollout.engines.count",
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("n", "max_new_tokens", "temperature", "top_p")},
    **{f"rollout.{k}": f"rollout.engines.{k}" for k in ("max_model_len", "api_key", "kv_cache_mb",
                                                        "gpu_memory_utilization", "enforce_eager")},
    **{f"rollout.engine_{k}": f"rollout.engines.{k}" for k in ("tp", "mode", "urls", "timeout_s",
                                                               "start_timeout_s", "failures_max", "restart")},
    **{f"rollout.{k}": f"rollout.partial.{k}" for k in ("concurrency", "max_staleness", "stale_policy",
                                                        "asynchronous")},
    "rollout.async": "rollout.partial.asynchronous",
}
