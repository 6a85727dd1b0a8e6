"""The whole config: every section, the checks that span sections, and the world-size check."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.errors import ConfigError
from megarl.config.schema.agents import EnvConfig, ServiceConfig
from megarl.config.schema.algo import AlgoConfig, TrainConfig
from megarl.config.schema.checks import require
from megarl.config.schema.data import DataConfig, RewardConfig
from megarl.config.schema.eval import EvalConfig, check_eval
from megarl.config.schema.model import ModelConfig, ParallelConfig, RunConfig
from megarl.config.schema.moe import MoEConfig
from megarl.config.schema.rollout import RolloutConfig
from megarl.config.schema.run import CheckpointConfig, ClusterConfig, MetricsConfig, WeightSyncConfig
from megarl.config.schema.unused import check_unused

#: the derived token budget (train.max_tokens_per_micro_batch=-1), in rows of the engine's
#: context. Measured on the tiny recipe (bench/RESULTS.md, "The token budget by default"): CPU
#: step time against the row-count layout, and the padding share, which the budget rule caps per
#: micro-batch (ppo/microbatch.MAX_PADDING_FRAC) whatever its size. The cluster recipes set
#: their own (one or two 4096-token rows).
BUDGET_PER_CONTEXT = 2


def token_budget(train: TrainConfig, longest: int) -> int:
    """The micro-batch token budget in force: train.max_tokens_per_micro_batch when set (> 0, or
    0: by rows); when derived (-1), 0 if train.micro_batch_size is set (the recipe chose rows),
    else BUDGET_PER_CONTEXT rows of `longest` (rollout.engines.max_model_len, padded for SP)."""
    budget = train.max_tokens_per_micro_batch
    if budget != -1:
        return budget
    return 0 if train.micro_batch_size is not None else BUDGET_PER_CONTEXT * longest


@dataclass
class RootConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
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
    eval: EvalConfig = field(default_factory=EvalConfig)   # held-out evaluation (docs/evaluation.md)

    def __post_init__(self):
        self._check_episodes()
        self._check_weight_sync()
        check_eval(self)   # eval.* against the rollout and reward.fn (schema/eval.py)
        longest = self.rollout.engines.max_model_len
        if self.parallel.sequence_parallel:
            longest = -(-longest // self.parallel.tp) * self.parallel.tp
        budget = self.train.max_tokens_per_micro_batch = token_budget(self.train, longest)
        require(not budget or budget >= longest, "train.max_tokens_per_micro_batch", budget,
                 f"cannot hold a sequence of rollout.engines.max_model_len tokens ({longest} padded): "
                 f"raise it to at least {longest}")
        if self.algo.name in ("grpo", "rloo"):
            require(self.rollout.sampling.n >= 2, "rollout.sampling.n", self.rollout.sampling.n,
                     f"algo.name={self.algo.name} compares the samples of a group: use rollout.sampling.n >= 2")
        budget_tokens = self.rollout.sampling.max_new_tokens
        require(self.reward.overlong_buffer < budget_tokens, "reward.overlong_buffer", self.reward.overlong_buffer,
                 f"must be below rollout.sampling.max_new_tokens={budget_tokens} (the penalty starts that many "
                 f"tokens before the budget)")
        # r2 records the old-logprob pass's experts micro-batch by micro-batch; the overlap computes it during the round
        require(self.algo.routing_replay != "r2" or not self.rollout.overlap, "algo.routing_replay", "r2",
                 "records the trainer's experts in the step's old-logprob pass, which rollout.overlap computes "
                 "during the round: set rollout.overlap=false, or algo.routing_replay=r3")
        check_unused(self)   # settings of components this run does not build (schema/unused.py)

    def _check_episodes(self) -> None:
        mode = self.rollout.mode
        if self.env.name:
            require(mode == "partial", "rollout.mode", mode,
                     f"env.name={self.env.name} runs episodes in the partial-rollout controller: set "
                     f"rollout.mode=partial (rollout.mode=service: outside agents bring their own environments)")
        # reward.* under an environment or a service, service.* outside one: schema/unused.py CHOICES
        if mode == "service":
            require(not self.rollout.overlap and not self.rollout.partial.asynchronous, "rollout.mode", mode,
                     "outside agents generate continuously already: remove rollout.overlap / rollout.partial.async")
            # a step takes groups_per_step complete groups; fewer may wait before new episodes are refused
            require(self.service.max_ready_groups >= self.train.groups_per_step, "service.max_ready_groups",
                     self.service.max_ready_groups, f"must be at least train.groups_per_step="
                     f"{self.train.groups_per_step} (a step takes that many complete groups at once)")

    def _check_weight_sync(self) -> None:
        """weight_sync.backend=ipc against the engines (auto's choice of ipc depends on CUDA:
        preflight.check_backends checks it once CUDA is known); weight_sync.lora=adapters against
        the transport and backend (auto's nccl / ipc on GPUs: preflight.check_backends too)."""
        ws, e = self.weight_sync, self.rollout.engines
        if ws.transport == "collective" and ws.backend == "ipc":
            ws.check_engines(True, e.mode, e.tp)
        if self.model.lora.rank and ws.lora == "adapters":   # the routes that carry adapters (docs/lora.md)
            refusal = ws.adapters_refusal(ws.backend)
            if refusal:
                raise ConfigError(refusal)

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

    dp = world_size / (tp * pp), parallel.ep must divide it; each DP rank's share of a
    mini-batch must split into micro-batches.
    """
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    require(world_size % (tp * pp) == 0, "parallel.tp x parallel.pp", f"{tp}x{pp}",
             f"must divide the world size {world_size}: launch a multiple of {tp * pp} ranks "
             f"or change parallel.tp/parallel.pp")
    dp = world_size // (tp * pp)
    ep = cfg.parallel.ep   # megatron takes each expert-parallel group within the DP ranks
    require(dp % ep == 0, "parallel.ep", ep,
            f"must divide the data-parallel size dp={dp} (world {world_size} / (parallel.tp {tp} x "
            f"parallel.pp {pp})): launch a multiple of {tp * pp * ep} ranks or change parallel.ep")
    per_mini = cfg.samples_per_step // cfg.train.mini_batches
    require(cfg.samples_per_step % cfg.train.mini_batches == 0, "train.mini_batches",
             cfg.train.mini_batches,
             f"must divide the samples per step ({cfg.samples_per_step} = groups_per_step x rollout.sampling.n)")
    # a token budget sizes micro-batches itself (ppo/microbatch.py); a row count must divide
    rows = cfg.train.rows_per_micro_batch
    require(cfg.train.max_tokens_per_micro_batch > 0 or per_mini % (dp * rows) == 0,
             "train.micro_batch_size",
             rows,
             f"a mini-batch of {per_mini} sequences over dp={dp} ranks must split into "
             f"micro-batches of this size: pick a divisor of {per_mini // dp if per_mini % dp == 0 else per_mini}")
    return dp
