"""Sampling, the vLLM engines and the partial-rollout controller."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.registry import GROUP_FILTERS
from megarl.config.schema.checks import one_of, require


@dataclass
class SamplingConfig:
    """How each response is sampled (`rollout.sampling.*`): the trainer recomputes logprobs
    under the same settings."""
    n: int = 4                         # samples per prompt (a group)
    max_new_tokens: int = 56           # response budget in tokens
    temperature: float = 1.0           # engine samples from softmax(logits / T); the trainer divides by the same T
    # nucleus: the engine samples from the smallest set of likeliest tokens whose probability
    # reaches top_p (after top_k), renormalised; the trainer takes every logprob (old, new,
    # reference) over the same set (models/sampling_cut.py, docs/algorithms.md "Sampling").
    # 1.0: off. In (0, 1]
    top_p: float = 1.0
    # the k likeliest tokens (ties at the k-th all kept), renormalised, applied before top_p;
    # the trainer's logprobs likewise. -1: off; else >= 1
    top_k: int = -1

    def __post_init__(self):
        require(self.n >= 1, "rollout.sampling.n", self.n, "must be >= 1")
        require(self.max_new_tokens >= 1, "rollout.sampling.max_new_tokens", self.max_new_tokens, "must be >= 1")
        require(self.temperature > 0, "rollout.sampling.temperature", self.temperature,
                 "must be > 0: PPO needs sampled tokens with their logprobs")
        require(0 < self.top_p <= 1, "rollout.sampling.top_p", self.top_p,
                 "must be in (0, 1]: the probability mass of the likeliest tokens kept (1.0: no nucleus cut)")
        require(self.top_k == -1 or self.top_k >= 1, "rollout.sampling.top_k", self.top_k,
                 "must be -1 (off) or >= 1: the number of likeliest tokens kept")


# rollout.engines.mode values whose engines megarl starts itself, on the trainer's node
# (inheriting CUDA_VISIBLE_DEVICES): the ones weight_sync.backend=ipc can serve


LOCAL_ENGINE_MODES = ("inprocess", "local_servers")


@dataclass
class EnginesConfig:
    """The vLLM engines that generate (`rollout.engines.*`, docs/engines.md): where they run,
    their size, and how long megarl waits for them."""
    # inprocess (vLLM AsyncLLM) | local_servers (megarl starts vLLM servers) | remote (servers at `urls`)
    mode: str = "inprocess"
    count: int = 1                     # number of vLLM engines (inprocess / local_servers)
    tp: int = 1                        # tensor-parallel size of each engine
    urls: list[str] = field(default_factory=list)  # remote: base URLs of running vLLM servers
    # servers' API key; empty: read from api_key_file, else random (local_servers) or
    # $MEGARL_ENGINE_API_KEY (remote). Never written: saved configs and W&B hold <redacted>
    # (config/secrets.py); on the command line it shows in the process list, so prefer the file
    # or the environment
    api_key: str = ""
    api_key_file: str = ""             # a file holding the key, readable by you only (chmod 600)
    timeout_s: float = 120.0           # an engine call (or a silent stream) longer than this is an error
    start_timeout_s: float = 600.0     # time allowed for an engine to come up (remote: to answer /health)
    # engines retired after a failure before the run stops (it also stops when none is left)
    failures_max: int = 3
    restart: bool = True               # start a fresh engine in place of a failed one; it joins at the next weight push
    max_model_len: int = 256           # engine context (prompt + response), tokens
    kv_cache_mb: int = 64              # CPU KV-cache budget per engine, MiB (GPU: gpu_memory_utilization)
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True         # skip graph capture/compile: faster start, slower decode
    # an MoE model's experts split over each engine's TP ranks instead of each expert over them
    # (vLLM's enable_expert_parallel; its EP size is TP x DP = rollout.engines.tp: megarl's engines
    # have no DP). Engines megarl starts only (schema/unused.py): remote servers take vLLM's
    # --enable-expert-parallel
    expert_parallel: bool = False
    # engines megarl starts on a GPU node: the GPUs (ids as CUDA_VISIBLE_DEVICES lists them) they run
    # on, rollout.engines.tp per engine in order; empty: the node's GPUs the trainer ranks do not use
    # (none left: every engine on global rank 0's GPU). rollout/engines/gpus.py, docs/engines.md
    gpus: list[int] = field(default_factory=list)

    def __post_init__(self):
        require(self.count >= 1, "rollout.engines.count", self.count, "must be >= 1")
        require(self.tp >= 1, "rollout.engines.tp", self.tp, "must be >= 1")
        require(self.kv_cache_mb >= 16, "rollout.engines.kv_cache_mb", self.kv_cache_mb, "must be >= 16")
        require(0 < self.gpu_memory_utilization <= 1, "rollout.engines.gpu_memory_utilization",
                 self.gpu_memory_utilization, "must be in (0, 1]: the share of each GPU's memory vLLM may use")
        one_of("rollout.engines.mode", self.mode, {"inprocess", "local_servers", "remote"})
        require(self.mode != "remote" or bool(self.urls), "rollout.engines.urls",
                 list(self.urls), "rollout.engines.mode=remote needs the servers' URLs, "
                 "e.g. rollout.engines.urls='[http://node1:8000]'")
        for url in self.urls:
            require(str(url).startswith(("http://", "https://")), "rollout.engines.urls", url,
                     "each URL must start with http:// or https://")
            # megarl adds /v1/completions, /health, ... itself: an OpenAI-style base URL
            # (.../v1) would reach /v1/v1/completions
            require(str(url).split("://", 1)[-1].partition("/")[2].strip("/") == "", "rollout.engines.urls", url,
                     "give each server's base URL, scheme, host and port only (e.g. http://node1:8000, "
                     "without /v1)")
        # settings another one makes unused: refused, not silently ignored
        require(self.mode == "remote" or not self.urls, "rollout.engines.urls",
                 list(self.urls), f"are used only with rollout.engines.mode=remote (it is "
                 f"{self.mode!r}, which starts its own engines): add rollout.engines.mode=remote, "
                 f"or remove rollout.engines.urls")
        # remote: one engine per URL; a count that says otherwise is a mistake in one of them
        require(self.mode != "remote" or self.count in (1, len(self.urls)), "rollout.engines.count", self.count,
                 f"does not match rollout.engines.urls, which lists {len(self.urls)} servers: with "
                 f"rollout.engines.mode=remote the "
                 f"pool has one engine per URL; set rollout.engines.count={len(self.urls)} or leave it out, "
                 f"or list {self.count} URLs")
        require(self.mode != "inprocess" or not self.api_key, "rollout.engines.api_key", "<set>",
                 "is used only by engine servers (rollout.engines.mode=local_servers or remote); "
                 "in-process engines have no key: remove it, or change rollout.engines.mode")
        require(self.mode != "inprocess" or not self.api_key_file, "rollout.engines.api_key_file",
                 self.api_key_file, "is used only by engine servers (rollout.engines.mode=local_servers or "
                 "remote); in-process engines have no key: remove it, or change rollout.engines.mode")
        require(self.timeout_s > 0, "rollout.engines.timeout_s", self.timeout_s, "must be > 0")
        require(self.failures_max >= 0, "rollout.engines.failures_max", self.failures_max,
                 "must be >= 0 (0: the first engine failure stops the run)")
        require(self.start_timeout_s > 0, "rollout.engines.start_timeout_s", self.start_timeout_s, "must be > 0")
        require(self.tp > 1 or not self.expert_parallel, "rollout.engines.expert_parallel", self.expert_parallel,
                 "splits each engine's experts over its rollout.engines.tp ranks, and tp=1 leaves nothing to "
                 "split: set rollout.engines.tp > 1, or expert_parallel=false")

    @property
    def pool_size(self) -> int:
        """Engines in the pool: len(urls) in remote mode, else `count`."""
        return len(self.urls) if self.mode == "remote" else self.count


@dataclass
class PartialConfig:
    """Partial rollout (`rollout.mode=partial`, `rollout.partial.*`, docs/partial_rollout.md):
    fixed concurrency, carry-over, bounded staleness."""
    # sample requests kept in flight across all engines. 64: the tiny recipe's step (16 x 4);
    # with elastic steps the engines stay at it under the bound, so raising it only pays where
    # the engines' decode step grows slower than the batch (bench/RESULTS.md "Elastic steps")
    concurrency: int = 64
    # a token may be at most this many weight versions older than the step training on it
    # (rollout.mode=service keeps it too: megarl/service/bound.py). 2: with elastic steps the
    # engines stay full at 2 on the long-tailed benchmark workloads (slot use >= 0.9), so a
    # larger bound buys no throughput there, only older tokens (the tiny task degrades mildly
    # only at lag 16: bench/RESULTS.md "Staleness study")
    max_staleness: int = 2
    # finish (a sample about to pass max_staleness is finished before the round ends; admission
    # throttled; nothing discarded) | restart (from its prompt) | drop (its whole group)
    stale_policy: str = "finish"
    # `rollout.partial.async` in recipes: round k+1 generates under version k while the trainer
    # trains round k
    asynchronous: bool = False
    # elastic steps: a step trains every complete group it may, from train.groups_per_step up to
    # this many times that, in whole multiples (each optimizer update keeps the size of a fixed
    # step's: train.mini_batches per groups_per_step), and admission counts that room per step.
    # At a bounded staleness the engines then keep generating while a round waits for a due
    # long sample, instead of idling; every trained token stays within max_staleness.
    # 1: exactly groups_per_step per step (docs/partial_rollout.md "Elastic steps")
    max_step_multiple: int = 8

    def __post_init__(self):
        require(self.concurrency >= 1, "rollout.partial.concurrency", self.concurrency, "must be >= 1")
        require(self.max_staleness >= 0, "rollout.partial.max_staleness", self.max_staleness,
                 "must be >= 0 (0: every sample is trained at the version that generated it)")
        one_of("rollout.partial.stale_policy", self.stale_policy, {"finish", "restart", "drop"})
        require(self.max_step_multiple >= 1, "rollout.partial.max_step_multiple", self.max_step_multiple,
                 "must be >= 1 (1: every step trains exactly train.groups_per_step groups)")


@dataclass
class RolloutConfig:
    """`rollout.*`: the mode and the three groups of settings. The flat keys of before
    (rollout.n, rollout.engine_mode, ...) still load, with a warning (config/renames.py MOVED)."""
    # partial (fixed concurrency, carry-over; megarl/rollout/controller/partial.py) | sync (wait for every sample)
    mode: str = "partial"
    dump_every: int = 0                # write <run.dir>/samples/step_<N>.jsonl every this many steps (0: never)
    # how partial rollout's requests live through a weight update (docs/partial_rollout.md):
    # keep (the engines pause with them held, load, and resume them under the new version: no
    # abort, no resubmission, no re-prefill; each token carries the version that produced it) |
    # abort (abort them; the controller resubmits each as a continuation after the update)
    update_mode: str = "keep"
    # update_mode=keep: true keeps the KV the held requests computed under the old weights (no
    # recompute; their next tokens attend to old-weight KV, which the IS weight sees); false
    # drops it and the engine recomputes it under the new weights on resume (exact)
    keep_kv: bool = False
    # forward-only passes (old/reference logprobs, values) of the groups a round emits run on
    # the trainer ranks while the round still generates (intra-step overlap)
    overlap: bool = False
    # train each step on the round generated this many versions earlier (a queue of rounds,
    # filled at the start; rollout.mode=sync): staleness held fixed, for studies (bench/staleness_study.py)
    lag: int = 0
    # judge each group the moment it is scored, in every mode (DAPO's dynamic sampling; docs/partial_rollout.md
    # "Group filters"): none | zero_variance (drop a group whose rewards are all equal: zero group-relative
    # advantage) | your own, package.module:attr or file.py:attr, a function of the group's samples
    # returning True (train it) or False (drop it). A dropped group is never trained; its room in the
    # step goes to the next prompt, and concurrency stays fixed
    group_filter: str = "none"
    # the prompts a step may draw per trained group before the run stops with one line (a task the
    # policy has solved, or cannot solve at all, ends the run instead of spinning). 1: any dropped group stops it
    group_filter_max_draws: int = 10
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)

    def __post_init__(self):
        s, e, p = self.sampling, self.engines, self.partial
        require(s.max_new_tokens < e.max_model_len, "rollout.sampling.max_new_tokens", s.max_new_tokens,
                 f"must be below rollout.engines.max_model_len={e.max_model_len} (the engine's context holds "
                 f"the prompt and the response): lower it, or raise rollout.engines.max_model_len")
        require(self.dump_every >= 0, "rollout.dump_every", self.dump_every, "must be >= 0 (0: never)")
        one_of("rollout.mode", self.mode, {"partial", "sync", "service"})
        one_of("rollout.update_mode", self.update_mode, {"keep", "abort"})
        require(not self.keep_kv or self.update_mode == "keep", "rollout.keep_kv", self.keep_kv,
                 "applies only to rollout.update_mode=keep (abort mode drops every request at an update): "
                 "remove rollout.keep_kv, or set rollout.update_mode=keep")
        require(not self.keep_kv or self.mode == "partial", "rollout.keep_kv", self.keep_kv,
                 "applies only to rollout.mode=partial (a sync round has no request running at a weight "
                 "update): remove rollout.keep_kv, or set rollout.mode=partial")
        require(not self.overlap or self.mode == "partial", "rollout.overlap", self.overlap,
                 "needs rollout.mode=partial (a sync round hands every group over at its end, so "
                 "nothing could overlap): set rollout.mode=partial, or remove rollout.overlap")
        require(self.lag >= 0, "rollout.lag", self.lag, "must be >= 0 (0: train each round at once)")
        GROUP_FILTERS.check(self.group_filter, "rollout.group_filter")
        require(self.group_filter_max_draws >= 1, "rollout.group_filter_max_draws", self.group_filter_max_draws,
                 "must be >= 1 (the prompts a step may draw per trained group; 1: any dropped group stops the run)")
        require(not self.lag or self.mode == "sync", "rollout.lag", self.lag,
                 "needs rollout.mode=sync (partial rollout bounds staleness itself, "
                 "rollout.partial.max_staleness): set rollout.mode=sync, or rollout.lag=0")
        require(not p.asynchronous or self.mode == "partial", "rollout.partial.async", p.asynchronous,
                 "needs rollout.mode=partial")
        require(not p.asynchronous or p.max_staleness >= 1, "rollout.partial.max_staleness", p.max_staleness,
                 "rollout.partial.async=true trains tokens one version old: set rollout.partial.max_staleness >= 1")
