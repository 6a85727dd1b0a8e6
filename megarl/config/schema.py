"""The one place megarl's config defaults live.

Recipes (YAML) only override fields declared here. Each field's docstring-comment gives its
meaning and unit; `__post_init__` checks what can be checked without knowing the world size
(`validate_world` does the rest once the ranks are up). Errors name the key, the value and the
fix, and are raised before anything expensive starts.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import List, Optional

from megarl.config.errors import ConfigError
from megarl.config.registry import ADVANTAGES, ENVIRONMENTS, IS_LEVELS, IS_MODES, KL_KINDS, LOSS_AGGS, VERIFIERS


def _require(ok: bool, key: str, value, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {fix}")


def _one_of(key: str, value, allowed) -> None:
    _require(value in allowed, key, value, f"must be one of {sorted(allowed)}")


def _plain(value):
    """An omegaconf list / dict as a python one (other values unchanged), for comparing with a default."""
    if hasattr(value, "items"):
        return dict(value.items())
    return list(value) if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") else value


def _changed(obj, names) -> list[str]:
    """The fields among `names` whose value is not the field's default (from the dataclass
    itself, so a default changed in one place is not left stale in a check)."""
    out = []
    for f in fields(obj):
        if f.name in names:
            default = f.default if f.default is not MISSING else f.default_factory()
            if _plain(getattr(obj, f.name)) != default:
                out.append(f.name)
    return out


@dataclass
class RunConfig:
    dir: str = "runs/default"          # run directory: metrics.jsonl, tensorboard/, config.yaml
    seed: int = 0                      # seeds data order, model init, sampling and dropout
    name: str = "megarl"               # shown in logs and TensorBoard


@dataclass
class ArchConfig:
    """Architecture facts of model.path (its config.json), so `megarl plan` can size a run
    without the checkpoint at hand. 0 everywhere (the default): read them from
    model.path/config.json. Recipes keep them in recipes/models/<model>.yaml."""
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0                 # attention (query) heads
    num_kv_heads: int = 0              # GQA key/value heads (= num_heads for MHA)
    head_dim: int = 0                  # 0: hidden_size / num_heads
    ffn_hidden_size: int = 0           # SwiGLU intermediate size
    vocab_size: int = 0                # the tokenizer's vocab (megatron pads it)
    max_position_embeddings: int = 0
    tie_embeddings: bool = False       # output layer shares the input embedding
    qkv_bias: bool = False             # Qwen2 has QKV biases, Llama does not

    @property
    def given(self) -> bool:
        return self.num_layers > 0

    def __post_init__(self):
        sizes = {k: getattr(self, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                 "head_dim", "ffn_hidden_size", "vocab_size",
                                                 "max_position_embeddings")}
        for k, v in sizes.items():
            _require(v >= 0, f"model.arch.{k}", v, "must be >= 0 (0: read from model.path/config.json)")
        if not any(v for k, v in sizes.items() if k != "head_dim"):
            return
        for k, v in sizes.items():
            _require(k == "head_dim" or v > 0, f"model.arch.{k}", v,
                     "give every architecture fact, or none (then config.json is read)")
        _require(self.num_heads % self.num_kv_heads == 0, "model.arch.num_kv_heads", self.num_kv_heads,
                 f"must divide model.arch.num_heads={self.num_heads} (GQA groups)")
        _require(self.head_dim > 0 or self.hidden_size % self.num_heads == 0, "model.arch.head_dim",
                 self.head_dim, f"set it: hidden_size {self.hidden_size} is not a multiple of "
                 f"num_heads {self.num_heads}")


@dataclass
class ModelConfig:
    path: str = "artifacts/tiny_countdown"  # HF checkpoint dir (config.json, safetensors, tokenizer)
    dtype: str = "float32"             # trainer parameter dtype: float32 | bfloat16
    make_vocab_size_divisible_by: int = 128  # megatron pads the vocab to a multiple of this x TP
    arch: ArchConfig = field(default_factory=ArchConfig)  # facts for `megarl plan` (0: from config.json)
    # weights from a megatron dist checkpoint (tools/convert_hf_to_megatron.py --out), at any TP x PP;
    # model.path still gives config.json and the tokenizer. "": weights from model.path's safetensors
    megatron_path: str = ""

    def __post_init__(self):
        _one_of("model.dtype", self.dtype, {"float32", "bfloat16"})
        _require(self.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by",
                 self.make_vocab_size_divisible_by, "must be >= 1")
        _require(self.megatron_path != self.path, "model.megatron_path", self.megatron_path,
                 "is model.path; point it at the output folder of tools/convert_hf_to_megatron.py")


@dataclass
class ParallelConfig:
    tp: int = 1                        # tensor-parallel size of the trainer
    pp: int = 1                        # pipeline-parallel size of the trainer
    sequence_parallel: bool = False    # split LayerNorm/dropout activations over TP ranks (GPU + TE only)
    backend: str = "auto"              # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl
    timeout_s: int = 600               # collective timeout: a hung rank fails loudly after this

    def __post_init__(self):
        _require(self.tp >= 1, "parallel.tp", self.tp, "must be >= 1")
        _require(self.pp >= 1, "parallel.pp", self.pp, "must be >= 1")
        _one_of("parallel.backend", self.backend, {"auto", "gloo", "nccl"})
        _require(not self.sequence_parallel or self.tp > 1, "parallel.sequence_parallel",
                 self.sequence_parallel, "needs parallel.tp > 1")


@dataclass
class AlgoConfig:
    name: str = "ppo"                  # ppo (GAE with a critic) | grpo (group-normalised, no critic)
    gamma: float = 1.0                 # discount per token
    lam: float = 0.95                  # GAE lambda
    clip_low: float = 0.2              # PPO ratio clip below: r >= 1 - clip_low
    clip_high: float = 0.2             # PPO ratio clip above: r <= 1 + clip_high ("clip-higher")
    dual_clip: Optional[float] = None  # cap the loss of negative-advantage tokens at dual_clip*|A| (> 1)
    value_clip: Optional[float] = 0.2  # clip the critic's new values to old +- this; null: no clip
    value_coef: float = 1.0            # weight of the value loss (the critic has its own optimizer)
    kl_coef: float = 0.0               # weight of the KL to the reference policy
    kl_mode: str = "reward"            # reward: per-token penalty in the reward | loss: term in the actor loss
    kl_kind: str = "k1"                # estimator: k1 | k2 | k3 | abs
    entropy_coef: float = 0.0          # entropy bonus in the actor loss
    whiten_advantages: bool = True     # normalise PPO advantages over the batch's tokens
    grpo_std_normalize: bool = True    # GRPO: divide by the group's std (Dr.GRPO sets this false)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO)
    loss_agg: str = "token-mean"
    is_mode: str = "tis"               # behaviour correction: tis (truncate) | mask | none
    is_level: str = "token"            # token | sequence | geo_sequence
    is_cap: float = 2.0                # TIS truncation C for w = exp(l_old - l_mu)
    is_low: float = 0.5                # mask mode: keep tokens with is_low <= w <= is_high
    is_high: float = 2.0
    # Stale-data stabilizers (docs/stabilizers.md), each off by default.
    # M2PO (Zheng et al. 2025): per mini-batch, mask the tokens with the largest squared log
    # ratio log(pi / pi_behaviour) until the rest's mean is <= this; replaces the ratio clip
    m2po_tau: Optional[float] = None
    # BAPO (Xi et al. 2025): per mini-batch clip bounds [c_low, c_high] (ratio bounds, not
    # 1 +- eps), moved from their start toward their limit until the positive-advantage tokens
    # carry at least bapo_rho of the gradient-carrying contribution; replaces clip_low/high
    bapo: bool = False
    bapo_rho: float = 0.4
    bapo_low: List[float] = field(default_factory=lambda: [0.6, 0.9])    # c_low: start, limit
    bapo_high: List[float] = field(default_factory=lambda: [1.2, 3.0])   # c_high: start, limit
    bapo_steps: List[float] = field(default_factory=lambda: [0.02, 0.05])  # c_low, c_high increments
    # gradient-alignment control (GAC, Xu et al. 2026): off | log (the cosine of consecutive
    # actor gradients as grad_cosine) | project (also shrink the component along the previous
    # gradient so the cosine is at most grad_align_threshold)
    grad_align: str = "off"
    grad_align_threshold: float = 0.3

    def __post_init__(self):
        ADVANTAGES.check(self.name)
        _one_of("algo.kl_mode", self.kl_mode, {"reward", "loss"})
        KL_KINDS.check(self.kl_kind)
        LOSS_AGGS.check(self.loss_agg)
        IS_MODES.check(self.is_mode)
        IS_LEVELS.check(self.is_level)
        _require(0 <= self.gamma <= 1, "algo.gamma", self.gamma, "must be in [0, 1]")
        _require(0 <= self.lam <= 1, "algo.lam", self.lam, "must be in [0, 1]")
        _require(self.clip_low > 0 and self.clip_high > 0, "algo.clip_low/clip_high",
                 (self.clip_low, self.clip_high), "both must be > 0")
        _require(self.dual_clip is None or self.dual_clip > 1, "algo.dual_clip", self.dual_clip,
                 "must be > 1 (or null to disable)")
        _require(self.is_low <= 1 <= self.is_high, "algo.is_low/is_high",
                 (self.is_low, self.is_high), "need is_low <= 1 <= is_high")
        self._check_stabilizers()

    def _check_stabilizers(self) -> None:
        _require(self.m2po_tau is None or self.m2po_tau > 0, "algo.m2po_tau", self.m2po_tau,
                 "must be > 0 (the paper uses 0.04), or null to disable M2PO")
        _require(self.m2po_tau is None or not self.bapo, "algo.m2po_tau/bapo", (self.m2po_tau, self.bapo),
                 "M2PO trains without a ratio clip and BAPO adapts that clip: choose one")
        _require(self.m2po_tau is None or self.dual_clip is None, "algo.dual_clip", self.dual_clip,
                 "M2PO (algo.m2po_tau) replaces ratio clipping, dual clip included: remove one of them")
        _one_of("algo.grad_align", self.grad_align, {"off", "log", "project"})
        _require(0 <= self.grad_align_threshold < 1, "algo.grad_align_threshold", self.grad_align_threshold,
                 "must be in [0, 1) (a cosine; 0 removes the whole aligned component)")
        # a setting the chosen options leave unused is refused, not silently ignored
        _require(self.grad_align == "project" or not _changed(self, {"grad_align_threshold"}),
                 "algo.grad_align_threshold",
                 self.grad_align_threshold,
                 "is used only with algo.grad_align=project: set algo.grad_align=project, or remove the threshold")
        replaced = "M2PO (algo.m2po_tau)" if self.m2po_tau is not None else "BAPO (algo.bapo)" if self.bapo else None
        _require(replaced is None or not _changed(self, {"clip_low", "clip_high"}), "algo.clip_low/clip_high",
                 (self.clip_low, self.clip_high), f"{replaced} replaces the fixed ratio clip, so these would be "
                 f"ignored: remove them (BAPO's bounds are algo.bapo_low / algo.bapo_high)")
        if not self.bapo:
            moved = _changed(self, {"bapo_rho", "bapo_low", "bapo_high", "bapo_steps"})
            _require(not moved, f"algo.{moved[0] if moved else ''}", _plain(getattr(self, moved[0])) if moved else None,
                     "is used only with algo.bapo=true: set algo.bapo=true, or remove it")
            return
        for key in ("bapo_low", "bapo_high", "bapo_steps"):
            value = list(getattr(self, key))
            _require(len(value) == 2, f"algo.{key}", value, "must be a list of two numbers")
        (a_lo, b_lo), (a_hi, b_hi), (d_lo, d_hi) = self.bapo_low, self.bapo_high, self.bapo_steps
        _require(0 < self.bapo_rho < 1, "algo.bapo_rho", self.bapo_rho, "must be in (0, 1) (the paper uses 0.4)")
        _require(0 < a_lo <= b_lo < 1, "algo.bapo_low", list(self.bapo_low),
                 "needs 0 < start <= limit < 1 (ratio bounds below 1, e.g. [0.6, 0.9])")
        _require(1 < a_hi <= b_hi, "algo.bapo_high", list(self.bapo_high),
                 "needs 1 < start <= limit (ratio bounds above 1, e.g. [1.2, 3.0])")
        _require(d_lo > 0 and d_hi > 0, "algo.bapo_steps", list(self.bapo_steps),
                 "both increments must be > 0 (e.g. [0.02, 0.05])")


@dataclass
class TrainConfig:
    steps: int = 60                    # optimizer steps of the RL loop (one rollout round each)
    groups_per_step: int = 16          # prompts per step; each has rollout.sampling.n samples
    ppo_epochs: int = 1                # passes over each step's data
    mini_batches: int = 1              # optimizer updates per epoch
    # Micro-batches (gradient accumulation; docs/design.md "Batching"): by default
    # micro_batch_size rows each; with max_tokens_per_micro_batch > 0 as many rows as fit that
    # many tokens (rows x their padded length), and micro_batch_size must stay unset (a budget
    # on the command line replaces a recipe's micro_batch_size: config/loader.py ALTERNATIVES).
    # Either way each micro-batch is padded only to its own longest row and DP ranks get equal tokens.
    micro_batch_size: int = 8          # rows per micro-batch
    max_tokens_per_micro_batch: int = 0  # 0: off; else >= rollout.engines.max_model_len
    # false: every row padded to the step's longest, rows in order (the layout before
    # length-aware batching, for comparisons); a token budget needs true
    remove_padding: bool = True
    actor_lr: float = 1e-4
    critic_lr: float = 5e-4
    lr_warmup_steps: int = 0           # linear warm-up of both learning rates, in optimizer updates
    lr_decay_style: str = "constant"   # after warm-up: constant | linear | cosine (to min_lr_ratio x lr)
    min_lr_ratio: float = 0.1          # floor of the decayed learning rate, as a fraction of the peak
    recompute: str = "none"            # activation recomputation: none | full (recompute every layer in backward)
    offload_idle: bool = False         # keep reference and critic weights in host memory except while used
    weight_decay: float = 0.0
    grad_clip: float = 1.0             # clip the global gradient norm (0: off)
    critic_warmup_steps: int = 0       # steps that train only the critic (PPO)
    # NaN/Inf in rewards, logprobs, values, losses or gradients: stop | skip (the step's update)
    on_nonfinite: str = "stop"

    def __post_init__(self):
        _require(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        _require(self.groups_per_step >= 1, "train.groups_per_step", self.groups_per_step, "must be >= 1")
        _require(self.ppo_epochs >= 1, "train.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _require(self.mini_batches >= 1, "train.mini_batches", self.mini_batches, "must be >= 1")
        _require(self.micro_batch_size >= 1, "train.micro_batch_size", self.micro_batch_size, "must be >= 1")
        self._check_token_budget()
        _one_of("train.lr_decay_style", self.lr_decay_style, {"constant", "linear", "cosine"})
        _one_of("train.recompute", self.recompute, {"none", "full"})
        _one_of("train.on_nonfinite", self.on_nonfinite, {"stop", "skip"})
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _require(self.actor_lr > 0 and self.critic_lr > 0, "train.actor_lr/critic_lr",
                 (self.actor_lr, self.critic_lr), "learning rates must be > 0")


    def _check_token_budget(self) -> None:
        budget = self.max_tokens_per_micro_batch
        _require(budget >= 0, "train.max_tokens_per_micro_batch", budget,
                 "must be >= 0 (0: micro-batches by row count)")
        if budget:
            _require(not _changed(self, {"micro_batch_size"}), "train.micro_batch_size", self.micro_batch_size,
                     f"sizes micro-batches by rows, but train.max_tokens_per_micro_batch={budget} sizes them by "
                     f"tokens: remove train.micro_batch_size, or set train.max_tokens_per_micro_batch=0")
            _require(self.remove_padding, "train.remove_padding", self.remove_padding,
                     f"false pads every row to the step's longest, which train.max_tokens_per_micro_batch={budget} "
                     f"cannot bound: set train.remove_padding=true, or train.max_tokens_per_micro_batch=0")


@dataclass
class SamplingConfig:
    """How each response is sampled (`rollout.sampling.*`): the trainer recomputes logprobs
    under the same settings."""
    n: int = 4                         # samples per prompt (a group)
    max_new_tokens: int = 56           # response budget in tokens
    temperature: float = 1.0           # engine samples from softmax(logits / T); the trainer divides by the same T
    top_p: float = 1.0                 # only 1.0: the trainer cannot yet renormalise over the nucleus

    def __post_init__(self):
        _require(self.n >= 1, "rollout.sampling.n", self.n, "must be >= 1")
        _require(self.max_new_tokens >= 1, "rollout.sampling.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _require(self.temperature > 0, "rollout.sampling.temperature", self.temperature,
                 "must be > 0: PPO needs sampled tokens with their logprobs")
        _require(self.top_p == 1.0, "rollout.sampling.top_p", self.top_p,
                 "must be 1.0: the trainer's logprobs would not be those of the nucleus the engine "
                 "sampled from (wrong PPO ratios); lower rollout.sampling.temperature instead")


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
    # servers' API key; empty: random (local_servers) or $MEGARL_ENGINE_API_KEY (remote)
    api_key: str = ""
    timeout_s: float = 120.0           # an engine call (or a silent stream) longer than this is an error
    start_timeout_s: float = 600.0     # time allowed for an engine to come up (remote: to answer /health)
    # engines retired after a failure before the run stops (it also stops when none is left)
    failures_max: int = 3
    restart: bool = True               # start a fresh engine in place of a failed one; it joins at the next weight push
    max_model_len: int = 256           # engine context (prompt + response), tokens
    kv_cache_mb: int = 64              # CPU KV-cache budget per engine, MiB (GPU: gpu_memory_utilization)
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True         # skip graph capture/compile: faster start, slower decode

    def __post_init__(self):
        _require(self.count >= 1, "rollout.engines.count", self.count, "must be >= 1")
        _require(self.tp >= 1, "rollout.engines.tp", self.tp, "must be >= 1")
        _require(self.kv_cache_mb >= 16, "rollout.engines.kv_cache_mb", self.kv_cache_mb, "must be >= 16")
        _require(0 < self.gpu_memory_utilization <= 1, "rollout.engines.gpu_memory_utilization",
                 self.gpu_memory_utilization, "must be in (0, 1]: the share of each GPU's memory vLLM may use")
        _one_of("rollout.engines.mode", self.mode, {"inprocess", "local_servers", "remote"})
        _require(self.mode != "remote" or bool(self.urls), "rollout.engines.urls",
                 list(self.urls), "rollout.engines.mode=remote needs the servers' URLs, "
                 "e.g. rollout.engines.urls='[http://node1:8000]'")
        for url in self.urls:
            _require(str(url).startswith(("http://", "https://")), "rollout.engines.urls", url,
                     "each URL must start with http:// or https://")
            # megarl adds /v1/completions, /health, ... itself: an OpenAI-style base URL
            # (.../v1) would reach /v1/v1/completions
            _require(str(url).split("://", 1)[-1].partition("/")[2].strip("/") == "", "rollout.engines.urls", url,
                     "give each server's base URL, scheme, host and port only (e.g. http://node1:8000, "
                     "without /v1)")
        # settings another one makes unused: refused, not silently ignored
        _require(self.mode == "remote" or not self.urls, "rollout.engines.urls",
                 list(self.urls), f"are used only with rollout.engines.mode=remote (it is "
                 f"{self.mode!r}, which starts its own engines): add rollout.engines.mode=remote, "
                 f"or remove rollout.engines.urls")
        # remote: one engine per URL; a count that says otherwise is a mistake in one of them
        _require(self.mode != "remote" or self.count in (1, len(self.urls)), "rollout.engines.count", self.count,
                 f"does not match rollout.engines.urls, which lists {len(self.urls)} servers: with "
                 f"rollout.engines.mode=remote the "
                 f"pool has one engine per URL; set rollout.engines.count={len(self.urls)} or leave it out, "
                 f"or list {self.count} URLs")
        _require(self.mode != "inprocess" or not self.api_key, "rollout.engines.api_key", "<set>",
                 "is used only by engine servers (rollout.engines.mode=local_servers or remote); "
                 "in-process engines have no key: remove it, or change rollout.engines.mode")
        _require(self.timeout_s > 0, "rollout.engines.timeout_s", self.timeout_s, "must be > 0")
        _require(self.failures_max >= 0, "rollout.engines.failures_max", self.failures_max,
                 "must be >= 0 (0: the first engine failure stops the run)")
        _require(self.start_timeout_s > 0, "rollout.engines.start_timeout_s", self.start_timeout_s, "must be > 0")

    @property
    def pool_size(self) -> int:
        """Engines in the pool: len(urls) in remote mode, else `count`."""
        return len(self.urls) if self.mode == "remote" else self.count


@dataclass
class PartialConfig:
    """Partial rollout (`rollout.mode=partial`, `rollout.partial.*`, docs/partial_rollout.md):
    fixed concurrency, carry-over, bounded staleness."""
    concurrency: int = 64              # sample requests kept in flight across all engines
    # a token may be at most this many weight versions older than the step training on it
    # (rollout.mode=service keeps it too: megarl/service/bound.py)
    max_staleness: int = 2
    # finish (a sample about to pass max_staleness is finished before the round ends; admission
    # throttled; nothing discarded) | restart (from its prompt) | drop (its whole group)
    stale_policy: str = "finish"
    # `rollout.partial.async` in recipes: round k+1 generates under version k while the trainer
    # trains round k
    asynchronous: bool = False

    def __post_init__(self):
        _require(self.concurrency >= 1, "rollout.partial.concurrency", self.concurrency, "must be >= 1")
        _require(self.max_staleness >= 0, "rollout.partial.max_staleness", self.max_staleness,
                 "must be >= 0 (0: every sample is trained at the version that generated it)")
        _one_of("rollout.partial.stale_policy", self.stale_policy, {"finish", "restart", "drop"})


@dataclass
class RolloutConfig:
    """`rollout.*`: the mode and the three groups of settings. The flat keys of before
    (rollout.n, rollout.engine_mode, ...) still load, with a warning (config/loader.py MOVED)."""
    # partial (fixed concurrency, carry-over; megarl/rollout/controller.py) | sync (wait for every sample)
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
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)

    def __post_init__(self):
        s, e, p = self.sampling, self.engines, self.partial
        _require(s.max_new_tokens < e.max_model_len, "rollout.sampling.max_new_tokens", s.max_new_tokens,
                 f"must be below rollout.engines.max_model_len={e.max_model_len} (the engine's context holds "
                 f"the prompt and the response): lower it, or raise rollout.engines.max_model_len")
        _require(self.dump_every >= 0, "rollout.dump_every", self.dump_every, "must be >= 0 (0: never)")
        _one_of("rollout.mode", self.mode, {"partial", "sync", "service"})
        _one_of("rollout.update_mode", self.update_mode, {"keep", "abort"})
        _require(not self.keep_kv or self.update_mode == "keep", "rollout.keep_kv", self.keep_kv,
                 "applies only to rollout.update_mode=keep (abort mode drops every request at an update): "
                 "remove rollout.keep_kv, or set rollout.update_mode=keep")
        _require(not self.keep_kv or self.mode == "partial", "rollout.keep_kv", self.keep_kv,
                 "applies only to rollout.mode=partial (a sync round has no request running at a weight "
                 "update): remove rollout.keep_kv, or set rollout.mode=partial")
        _require(not self.overlap or self.mode == "partial", "rollout.overlap", self.overlap,
                 "needs rollout.mode=partial (a sync round hands every group over at its end, so "
                 "nothing could overlap): set rollout.mode=partial, or remove rollout.overlap")
        _require(self.lag >= 0, "rollout.lag", self.lag, "must be >= 0 (0: train each round at once)")
        _require(not self.lag or self.mode == "sync", "rollout.lag", self.lag,
                 "needs rollout.mode=sync (partial rollout bounds staleness itself, "
                 "rollout.partial.max_staleness): set rollout.mode=sync, or rollout.lag=0")
        _require(not p.asynchronous or self.mode == "partial", "rollout.partial.async", p.asynchronous,
                 "needs rollout.mode=partial")
        _require(not p.asynchronous or p.max_staleness >= 1, "rollout.partial.max_staleness", p.max_staleness,
                 "rollout.partial.async=true trains tokens one version old: set rollout.partial.max_staleness >= 1")


@dataclass
class EnvConfig:
    """`env.*`: multi-turn episodes (docs/agents.md). Empty name: single-turn samples."""
    name: str = ""                     # a registered environment (megarl/envs): guess | python_tool | ...
    max_turns: int = 4                 # model turns per episode at most (then it ends, cut)
    timeout_s: float = 10.0            # one reset / step call longer than this ends the episode, reward 0
    # how observations become tokens: auto (the chat template if the tokenizer has one, else
    # text) | chat (the template's delta for one user message) | text (encoded as is)
    template: str = "auto"
    options: dict = field(default_factory=dict)   # keyword arguments of the environment's constructor

    def __post_init__(self):
        if self.name:
            ENVIRONMENTS.check(self.name)
        _require(self.max_turns >= 1, "env.max_turns", self.max_turns, "must be >= 1")
        _require(self.timeout_s > 0, "env.timeout_s", self.timeout_s, "must be > 0 (seconds per environment call)")
        _one_of("env.template", self.template, {"auto", "chat", "text"})
        _require(self.name or not _changed(self, {"max_turns", "timeout_s", "template", "options"}),
                 "env.name", self.name, "is empty, so the other env.* settings are unused: name an "
                 "environment, or remove them")


@dataclass
class ServiceConfig:
    """`service.*`: rollout.mode=service, the policy as an OpenAI-compatible endpoint for outside
    agents (docs/agents.md, "Rollout as a service")."""
    host: str = "127.0.0.1"            # bind address: the node's cluster address only when asked, never 0.0.0.0
    port: int = 0                      # 0: a free port (written to <run.dir>/service.json)
    api_key: str = ""                  # empty: $MEGARL_SERVICE_API_KEY, else a new one in <run.dir>/service.json (0600)
    max_episodes: int = 64             # open episodes at once; more are refused (HTTP 429)
    episode_timeout_s: float = 600.0   # an episode with no call for this long is cancelled (counted)
    wait_s: float = 3600.0             # a step waits this long for its groups, then fails naming the service
    max_request_mb: float = 16.0       # a request body larger than this is refused (HTTP 413)
    # complete groups waiting for the trainer at most; past it new episodes are refused (HTTP 429)
    # until a step takes some. At least train.groups_per_step
    max_ready_groups: int = 64

    def __post_init__(self):
        _require(self.max_request_mb >= 0.001, "service.max_request_mb", self.max_request_mb, "must be >= 0.001")
        _require(self.max_ready_groups >= 1, "service.max_ready_groups", self.max_ready_groups, "must be >= 1")
        _require(self.host not in ("0.0.0.0", "::", ""), "service.host", self.host,
                 "bind to 127.0.0.1 or the node's cluster-internal address, not every interface")
        _require(0 <= self.port < 65536, "service.port", self.port, "must be a TCP port (0: a free one)")
        _require(self.max_episodes >= 1, "service.max_episodes", self.max_episodes, "must be >= 1")
        _require(self.episode_timeout_s > 0, "service.episode_timeout_s", self.episode_timeout_s, "must be > 0")
        _require(self.wait_s > 0, "service.wait_s", self.wait_s, "must be > 0")


@dataclass
class DataConfig:
    # .jsonl or .parquet file, one record per row (docs/data.md)
    prompts: str = "artifacts/tiny_countdown/prompts.jsonl"
    prompt_key: str = "prompt"         # field of each record holding the prompt text
    # or: the field holding chat messages [{role, content}], rendered with the tokenizer's chat template
    messages_key: str = "messages"
    answer_key: str = "answer"         # field holding the gold answer (reward.fn=math | exact need it)
    shuffle: bool = True               # reshuffle each epoch (seeded by run.seed)

    def __post_init__(self):
        for key in ("prompt_key", "messages_key", "answer_key"):
            _require(bool(str(getattr(self, key)).strip()), f"data.{key}", getattr(self, key),
                     "must name a field of the data rows")


@dataclass
class RewardConfig:
    fn: str = "countdown"              # verifier: countdown | math | exact | format | none (no verifier; docs/data.md)
    model_path: str = ""               # HF *ForSequenceClassification reward model, scored on the trainer ranks
    model_coef: float = 1.0            # score = verifier + model_coef * reward model
    # a verifier taking longer than this on one sample scores it 0 (counted: reward_timeouts)
    timeout_s: float = 5.0

    def __post_init__(self):
        VERIFIERS.check(self.fn)
        _require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0 (seconds per sample)")
        _require(self.fn != "none" or bool(self.model_path), "reward.fn", self.fn,
                 "with reward.fn=none set reward.model_path, or nothing scores the samples")
        _require(bool(self.model_path) or self.model_coef == 1.0, "reward.model_coef", self.model_coef,
                 "weighs the reward model, but reward.model_path is empty: set reward.model_path, "
                 "or remove reward.model_coef")


@dataclass
class WeightSyncConfig:
    """How the actor's weights reach the engines after each step (docs/engines.md, "Weight sync")."""
    # collective: one broadcast from trainer rank 0 to every engine worker through vLLM's
    # weight-transfer API, nothing on disk | files: safetensors staged in staging_dir, each
    # engine reloads them (for servers started without megarl's weight-transfer config)
    transport: str = "collective"
    # collective: auto | gloo (megarl's backend, CPU) | nccl (vLLM's: engines on GPUs of their own,
    # remote engines) | ipc (vLLM's CUDA IPC: engines megarl starts on the trainer's node read rank 0's
    # GPU memory in place; rollout.engines.tp=1 only). auto: gloo without CUDA; with CUDA ipc for
    # rollout.engines.mode=inprocess | local_servers (their TP=1 engine shares global rank 0's GPU,
    # where NCCL refuses two ranks of one communicator), nccl for remote (`resolved_backend`)
    backend: str = "auto"
    # rendezvous of the weight group, reached by every engine worker: "" = this host's address as
    # the engines see it (127.0.0.1 for engines on this machine, else $MASTER_ADDR or the hostname)
    master_addr: str = ""
    master_port: int = 0               # 0: a free port, new for every group
    bucket_mb: int = 512               # tensors are packed into buffers of about this size per broadcast
    # collective: packed buffers in flight per side (2: gather the next while one is on the wire)
    num_buffers: int = 2
    staging_dir: str = "/dev/shm"      # files: where the safetensors buckets are staged (engines must see it)
    verify: bool = False               # after each push, compare engine and trainer logprobs

    def __post_init__(self):
        _one_of("weight_sync.transport", self.transport, {"collective", "files"})
        _one_of("weight_sync.backend", self.backend, {"auto", "gloo", "nccl", "ipc"})
        _require(self.bucket_mb >= 1, "weight_sync.bucket_mb", self.bucket_mb, "must be >= 1")
        _require(self.num_buffers >= 1, "weight_sync.num_buffers", self.num_buffers,
                 "must be >= 1 (2: the next bucket is gathered while one is sent)")
        _require(0 <= self.master_port < 65536, "weight_sync.master_port", self.master_port,
                 "must be a TCP port (0: pick a free one)")

    def resolved_backend(self, cuda: bool, engine_mode: str) -> str:
        """The collective backend actually used with engines of rollout.engines.mode `engine_mode`:
        `auto` is gloo without CUDA; with CUDA ipc for engines megarl starts (LOCAL_ENGINE_MODES:
        on the trainer's node, a TP=1 engine on global rank 0's GPU), nccl for remote ones.
        ipc with remote engines raises ConfigError (they cannot map this process's GPU memory)."""
        if self.backend == "auto":
            return "gloo" if not cuda else "ipc" if engine_mode in LOCAL_ENGINE_MODES else "nccl"
        _require(self.backend != "ipc" or engine_mode in LOCAL_ENGINE_MODES, "weight_sync.backend",
                 self.backend, f"needs engines megarl starts on the trainer's node (rollout.engines.mode="
                 f"inprocess or local_servers), not rollout.engines.mode={engine_mode}: another machine's engines "
                 f"cannot map this process's GPU memory; use weight_sync.backend=nccl (or auto) for them")
        return self.backend

    def check_engines(self, cuda: bool, engine_mode: str, engine_tp: int) -> str:
        """`resolved_backend`, refused (ConfigError) where it cannot serve engines of TP
        `engine_tp`: ipc needs TP=1 (global rank 0 exports handles of its own GPU only)."""
        backend = self.resolved_backend(cuda, engine_mode)
        why = "resolves to ipc here (CUDA, engines megarl starts), which " if self.backend == "auto" else ""
        _require(backend != "ipc" or engine_tp == 1, "weight_sync.backend", self.backend,
                 f"{why}cannot serve engines of rollout.engines.tp={engine_tp}: global rank 0 exports CUDA IPC "
                 f"handles of its own GPU only, and a TP={engine_tp} engine's other workers run on other GPUs: use "
                 f"rollout.engines.tp=1 (more engines: rollout.engines.count), engines on GPUs of their own "
                 f"(rollout.engines.mode=remote, weight_sync.backend=nccl), or weight_sync.transport=files")
        return backend


@dataclass
class MetricsConfig:
    tensorboard: bool = True           # write TensorBoard event files under <run.dir>/tensorboard
    progress: bool = True              # one console line per step


@dataclass
class CheckpointConfig:
    dir: str = ""                      # where step_<N>/ folders go; empty: <run.dir>/checkpoints
    every: int = 0                     # save every this many steps (0: only at the end and on SIGTERM)
    keep: int = 2                      # newest complete checkpoints kept
    resume: bool = True                # continue from the newest complete checkpoint if one exists
    time_budget_min: float = 0.0       # save and stop after this many minutes of wall clock (0: none)

    def __post_init__(self):
        _require(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        _require(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")
        _require(self.time_budget_min >= 0, "checkpoint.time_budget_min", self.time_budget_min, "must be >= 0")


@dataclass
class ClusterConfig:
    """The hardware a recipe is sized for: `megarl plan` checks placement and memory against
    it, cluster scripts read the node split. gpus_per_node=0 (the default): a CPU-only
    machine, nothing to place."""
    nodes: int = 1                     # machines in the allocation
    gpus_per_node: int = 0             # accelerators per node; 0: CPU only
    gpu_mem_gb: float = 80.0           # memory per GPU, GiB (H100-80GB: 80, H200: 141)
    gpu: str = ""                      # informative name, e.g. H100-SXM-80GB
    trainer_nodes: int = 0             # nodes of the trainer ranks; 0: nodes - engine_nodes
    engine_nodes: int = 0              # nodes of the vLLM engines (their own GPU pool)
    reserve_gb: float = 4.0            # per GPU, left out of every estimate: CUDA context, NCCL buffers, fragmentation

    def __post_init__(self):
        _require(self.nodes >= 1, "cluster.nodes", self.nodes, "must be >= 1")
        _require(self.gpus_per_node >= 0, "cluster.gpus_per_node", self.gpus_per_node,
                 "must be >= 0 (0: CPU only)")
        _require(self.gpu_mem_gb > 0, "cluster.gpu_mem_gb", self.gpu_mem_gb, "must be > 0 (GiB per GPU)")
        _require(self.trainer_nodes >= 0, "cluster.trainer_nodes", self.trainer_nodes, "must be >= 0")
        _require(self.engine_nodes >= 0, "cluster.engine_nodes", self.engine_nodes, "must be >= 0")
        _require(self.trainer_nodes + self.engine_nodes <= self.nodes, "cluster.trainer_nodes + engine_nodes",
                 self.trainer_nodes + self.engine_nodes, f"must be <= cluster.nodes={self.nodes}")
        _require(0 <= self.reserve_gb < self.gpu_mem_gb, "cluster.reserve_gb", self.reserve_gb,
                 f"must be in [0, cluster.gpu_mem_gb={self.gpu_mem_gb})")

    @property
    def trainer_node_count(self) -> int:
        return self.trainer_nodes or self.nodes - self.engine_nodes


@dataclass
class RootConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self):
        self._check_episodes()
        self._check_weight_sync()
        budget, longest = self.train.max_tokens_per_micro_batch, self.rollout.engines.max_model_len
        if self.parallel.sequence_parallel:
            longest = -(-longest // self.parallel.tp) * self.parallel.tp
        _require(not budget or budget >= longest, "train.max_tokens_per_micro_batch", budget,
                 f"cannot hold a sequence of rollout.engines.max_model_len tokens ({longest} padded): "
                 f"raise it to at least {longest}")
        if self.algo.name == "grpo":
            _require(self.rollout.sampling.n >= 2, "rollout.sampling.n", self.rollout.sampling.n,
                     "algo.name=grpo normalises within a group: use rollout.sampling.n >= 2")
            _require(self.train.critic_warmup_steps == 0, "train.critic_warmup_steps",
                     self.train.critic_warmup_steps, "algo.name=grpo has no critic to warm up: "
                     "remove it, or use algo.name=ppo")

    def _check_episodes(self) -> None:
        mode = self.rollout.mode
        if self.env.name:
            _require(mode == "partial", "rollout.mode", mode,
                     f"env.name={self.env.name} runs episodes in the partial-rollout controller: set "
                     f"rollout.mode=partial (rollout.mode=service: outside agents bring their own environments)")
        if self.env.name or mode == "service":
            what = f"env.name={self.env.name}" if self.env.name else "rollout.mode=service"
            _require(not _changed(self.reward, {"fn", "timeout_s"}), "reward.fn", self.reward.fn,
                     f"is unused with {what}: the episode's reward comes from the "
                     f"{'environment' if self.env.name else 'outside agent'}; remove reward.fn / reward.timeout_s")
        unused = [] if mode == "service" else _changed(self.service, {f.name for f in fields(self.service)})
        if unused:
            _require(False, f"service.{unused[0]}", getattr(self.service, unused[0]),
                     "the service.* settings apply only to rollout.mode=service: set it, or remove them")
        if mode == "service":
            _require(not self.rollout.overlap and not self.rollout.partial.asynchronous, "rollout.mode", mode,
                     "outside agents generate continuously already: remove rollout.overlap / rollout.partial.async")
            # a step takes groups_per_step complete groups; fewer may wait before new episodes are refused
            _require(self.service.max_ready_groups >= self.train.groups_per_step, "service.max_ready_groups",
                     self.service.max_ready_groups, f"must be at least train.groups_per_step="
                     f"{self.train.groups_per_step} (a step takes that many complete groups at once)")

    def _check_weight_sync(self) -> None:
        """weight_sync.backend=ipc against the engines (auto's choice of ipc depends on CUDA:
        preflight.check_backends checks it once CUDA is known)."""
        ws, e = self.weight_sync, self.rollout.engines
        if ws.transport == "collective" and ws.backend == "ipc":
            ws.check_engines(True, e.mode, e.tp)

    @property
    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <run.dir>/checkpoints when empty."""
        return self.checkpoint.dir or f"{self.run.dir}/checkpoints"

    @property
    def samples_per_step(self) -> int:
        """Sequences trained per step = train.groups_per_step * rollout.sampling.n."""
        return self.train.groups_per_step * self.rollout.sampling.n


def validate_world(cfg: RootConfig, world_size: int) -> int:
    """Check the parallel layout against the launched ranks; return the data-parallel size.

    dp = world_size / (tp * pp); each DP rank's share of a mini-batch must split into
    micro-batches.
    """
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    _require(world_size % (tp * pp) == 0, "parallel.tp x parallel.pp", f"{tp}x{pp}",
             f"must divide the world size {world_size}: launch a multiple of {tp * pp} ranks "
             f"or change parallel.tp/parallel.pp")
    dp = world_size // (tp * pp)
    per_mini = cfg.samples_per_step // cfg.train.mini_batches
    _require(cfg.samples_per_step % cfg.train.mini_batches == 0, "train.mini_batches",
             cfg.train.mini_batches,
             f"must divide the samples per step ({cfg.samples_per_step} = groups_per_step x rollout.sampling.n)")
    # a token budget sizes micro-batches itself (ppo/microbatch.py); a row count must divide
    _require(cfg.train.max_tokens_per_micro_batch > 0 or per_mini % (dp * cfg.train.micro_batch_size) == 0,
             "train.micro_batch_size",
             cfg.train.micro_batch_size,
             f"a mini-batch of {per_mini} sequences over dp={dp} ranks must split into "
             f"micro-batches of this size: pick a divisor of {per_mini // dp if per_mini % dp == 0 else per_mini}")
    return dp
