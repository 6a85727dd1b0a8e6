"""Cost models for the simulator: engines (per decode step) and the trainer (per step).

Two calibrations:
- `MeasuredEngine` / `MeasuredTrainer`: what `bench/rollout_speedup.py` measures on this
  machine (the decode-step curve t(b), prefill seconds per token, per-request overhead, the
  weight push, train seconds per trained token). `from_bench(result_json)` reads them.
- `RooflineEngine` / `RooflineTrainer`: a GPU estimate from published hardware figures
  (docs/simulator.md cites them). A decode step reads every weight once plus the KV cache of
  every running sequence from HBM, and does 2 x params FLOPs per token: its time is the larger
  of bytes / bandwidth and FLOPs / peak, over the engine's TP GPUs, plus a fixed per-step
  launch/scheduling cost. Training costs 6 x params FLOPs per trained token (forward +
  backward) for each trained model and 2 x params for each forward-only pass, at an achieved
  fraction (MFU) of peak. A Mixture of Experts computes with its active parameters (attention,
  router, top-k experts: `Model.active_params`) but holds and sends all of them: FLOPs follow
  the active count, a decode step reads the weights of every expert some token of its batch
  is routed to (`Model.step_weight_bytes`), and the weight push moves the total. `forward_s`
  is the forward-only share of that (old and reference logprobs, values): what
  rollout.overlap runs while the round still generates.
- `WeightSyncCosts` (megarl/sim/push.py): a weight sync by the route the recipe's weight_sync
  settings take (a broadcast or sharded sends, staged or not; or files read by every engine).
All pure functions of their inputs: the simulator's clock only ever advances by them.
"""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from megarl.config import load_config
from megarl.models.arch import Arch, resolve_arch
from megarl.plan.experts import expert_params
from megarl.plan.memory import active_params, total_params
from megarl.ppo.microbatch import Batching, plan_rows, round_up

# the weight push lives in its own module; its callers of before import it from here too
from megarl.sim.push import TRANSPORTS, PushCost, WeightSyncCosts, weight_push_s  # noqa: F401

# architecture facts of published models (config.json of each), one file per model
MODEL_FACTS = Path(__file__).resolve().parents[2] / "recipes" / "models"


def interp(curve: dict[int, float], x: float) -> float:
    """Piecewise-linear t(x) through measured points: flat below the smallest, linear
    extrapolation above the largest."""
    xs = sorted(curve)
    if x <= xs[0]:
        return curve[xs[0]]
    if len(xs) == 1:
        return curve[xs[0]] * x / xs[0]
    if x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        i = bisect.bisect_right(xs, x)
        lo, hi = xs[i - 1], xs[i]
    return max(0.0, curve[lo] + (curve[hi] - curve[lo]) * (x - lo) / (hi - lo))


# -- engines --------------------------------------------------------------------------------
@dataclass
class MeasuredEngine:
    """curve: seconds per decode step by running batch; prefill_s_per_token; request_s: extra
    seconds per request admitted (client + scheduler work beyond its decode share)."""
    curve: dict[int, float]
    prefill_s_per_token: float
    request_s: float
    load_weights_s: float

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int, new_requests: int) -> float:
        return interp(self.curve, batch) + self.prefill_s_per_token * prefill_tokens + self.request_s * new_requests


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float          # dense peak
    memory_bytes: float
    link_bytes_per_s: float    # NVLink, per direction


# NVIDIA's published figures (docs/simulator.md has the sources); dense BF16 (the datasheets'
# 1979 TFLOP/s are with 2:4 sparsity)
H100 = GPU("H100-SXM", 3.35e12, 989e12, 80e9, 450e9)
H200 = GPU("H200-SXM", 4.8e12, 989e12, 141e9, 450e9)
GPUS = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class Model:
    """What the cost of a decoder depends on (from its HF config). params: all of them (what
    is held and pushed); active_params: those one token computes with (0: all, a dense model);
    routed_params: every MoE layer's routed experts together (0: dense), of `experts` per
    layer with `top_k` per token."""
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2   # bf16
    active_params: float = 0.0
    routed_params: float = 0.0
    experts: int = 0
    top_k: int = 0

    @classmethod
    def from_arch(cls, name: str, a: Arch) -> "Model":
        routed = sum(a.experts for i in range(a.layers) if a.is_sparse(i)) * expert_params(a)
        return cls(name, float(total_params(a)), a.layers, a.hidden, a.kv_heads, a.head_dim,
                   active_params=float(active_params(a)), routed_params=float(routed), experts=a.experts,
                   top_k=a.top_k)

    @property
    def active(self) -> float:
        """Parameters one token computes with: FLOPs per token are 2x (forward), 6x (+ backward)."""
        return self.active_params or self.params

    @property
    def weight_bytes(self) -> float:
        """Every weight, experts included: what an engine holds and a weight sync sends."""
        return self.params * self.bytes_per_param

    def experts_touched(self, tokens: int) -> float:
        """The expected share of a layer's experts that `tokens` tokens route to, each to top_k
        of them uniformly (balanced routing): 1 - (1 - k/E)^tokens. 1 for a dense model."""
        if not self.experts:
            return 1.0
        return 1.0 - (1.0 - self.top_k / self.experts) ** max(tokens, 1)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a forward of `tokens` tokens reads from memory: every dense weight, and of
        the routed experts the share some token is sent to (a decode step of one sequence reads
        top_k / E of them; 64 sequences at 8 of 128 experts, 98%)."""
        dense = self.params - self.routed_params
        return (dense + self.routed_params * self.experts_touched(tokens)) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@lru_cache(maxsize=1)
def published_models() -> dict[str, Model]:
    """{name: Model} from recipes/models/*.yaml (the facts the recipes and `megarl plan` use),
    named after the file: llama3.1_70b.yaml -> "llama3.1-70b"."""
    models = {}
    for path in sorted(MODEL_FACTS.glob("*.yaml")):
        arch, _ = resolve_arch(load_config(str(path)))
        name = path.stem.replace("_", "-")
        models[name] = Model.from_arch(name, arch)
    return models


@dataclass
class RooflineEngine:
    model: Model
    gpu: GPU
    tp: int
    bandwidth_eff: float = 0.7     # achieved share of HBM bandwidth in decode
    flops_eff: float = 0.5         # achieved share of peak in prefill
    step_overhead_s: float = 4e-3  # scheduling, sampling, launch per decode step (no CUDA graphs: more)
    request_s: float = 2e-4        # per admitted request (tokenisation, scheduling, output)
    load_weights_s: float = 0.0    # set from the weight-sync model

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int, new_requests: int) -> float:
        bw = self.gpu.hbm_bytes_per_s * self.bandwidth_eff * self.tp
        flops = self.gpu.bf16_flops * self.flops_eff * self.tp
        read = self.model.step_weight_bytes(batch + prefill_tokens) + context_tokens * self.model.kv_bytes_per_token
        decode = max(read / bw, 2 * self.model.active * batch / flops)
        prefill = 2 * self.model.active * prefill_tokens / flops
        # TP all-reduces per layer: 2 x hidden x batch bytes over NVLink, twice per layer
        comm = 0.0 if self.tp == 1 else (4 * self.model.layers * self.model.hidden * 2 * max(batch, 1)
                                         / self.gpu.link_bytes_per_s + 2 * self.model.layers * 8e-6)
        return decode + prefill + comm + self.step_overhead_s + self.request_s * new_requests


# -- trainer --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """What the trainer computes of a step's rows: the batching rule (ppo/microbatch.py: the
    plans ppo_step makes, padding and filler rows included) over `dp` data-parallel ranks and
    `mini_batches` updates. The slowest DP rank sets the pace: a pass costs dp x its tokens."""
    batching: Batching
    dp: int = 1
    mini_batches: int = 1

    def positions(self, seq_lens: list[int], resp_lens: list[int]) -> tuple[int, int]:
        """(positions of the update passes: each mini-batch planned over DP; positions of one
        forward-only pass over the whole batch), as dp x the busiest rank's. Mini-batches take
        the rows in a fixed shuffled order (ppo_step shuffles them); the padded layout pads
        every row to the step's longest."""
        if not seq_lens:
            return 0, 0
        full = (round_up(max(seq_lens), self.batching.multiple), max(1, max(resp_lens)))
        forward = self._pass(seq_lens, resp_lens, full)
        order = list(range(len(seq_lens)))
        random.Random(len(order)).shuffle(order)
        size = -(-len(order) // self.mini_batches)   # torch.chunk's split
        update = sum(self._pass([seq_lens[i] for i in chunk], [resp_lens[i] for i in chunk], full)
                     for chunk in (order[j:j + size] for j in range(0, len(order), size)))
        return update, forward

    def _pass(self, seq_lens, resp_lens, full) -> int:
        plan = plan_rows(seq_lens, resp_lens, self.batching, self.dp, full)
        return self.dp * max(plan.rank_tokens())


@dataclass
class MeasuredTrainer:
    """train seconds = fixed + per_token * trained tokens (+ stitch_per_token * carried tokens
    whose l_old the trainer computes at the round's end); push seconds on the trainer side.
    forward_frac: the share of per_token that is forward-only passes (old / reference logprobs,
    values). A measured train time does not split itself, so it is 0 (nothing to overlap)
    unless a measurement of the passes sets it. frozen_frac: the share of those that is frozen
    models' (the reference: kept over weight updates); 1/3 assumes PPO's three equal passes."""
    fixed_s: float
    per_token_s: float
    stitch_per_token_s: float = 0.0
    push_s: float = 0.0
    route: str = "measured"      # how the weight sync was measured, for the printed result
    forward_frac: float = 0.0
    frozen_frac: float = 1 / 3

    def __post_init__(self):
        for name in ("forward_frac", "frozen_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"MeasuredTrainer {name}={getattr(self, name)}: a share, between 0 and 1")

    def train_s(self, trained_tokens: int, stitch_tokens: int = 0, samples: int = 0, lengths=None) -> float:
        """`lengths` (response tokens of each sample) is not used: a measured per-token cost
        holds the padding of the batching it was measured with."""
        return self.fixed_s + self.per_token_s * trained_tokens + self.stitch_per_token_s * stitch_tokens

    def forward_s(self, trained_tokens: int, samples: int = 0, lengths=None) -> float:
        """The forward-only passes of these samples (a part of train_s of them)."""
        return self.forward_frac * self.per_token_s * trained_tokens


@dataclass
class RooflineTrainer:
    """PPO with actor and critic trained (6 x active params FLOPs per token each) and forward
    passes for old logprobs, reference logprobs and values (2 x active params each); GRPO has
    no critic.
    LoRA (`adapter_params` > 0: the actor's adapters; `critic_adapters`: the critic's too): a model
    with a frozen base trains at 4 x active params + 6 x its adapters per token, its forward and
    the backward to its inputs only (megatron's linear layers skip a frozen weight's gradient
    GEMM: linear_with_frozen_weight); forward-only passes stay 2 x active params (the adapters'
    2 x r x (in + out) per layer is left out, < 1% at rank 64 on 70B). The optimizer step is not
    priced, LoRA or not (an elementwise pass over the trained parameters).
    `shape`: the positions the trainer computes (StepShape: padding by the batching rule, the
    busiest DP rank) when the samples' lengths are given; None: their real tokens."""
    model: Model
    gpu: GPU
    gpus: int
    mfu: float = 0.4
    critic: bool = True
    push_s: float = 0.0
    prompt_tokens: int = 256    # per sample: the trainer processes prompt + response
    route: str = "collective"   # the weight_sync.transport push_s was modelled for
    shape: StepShape | None = None
    push_cost: PushCost | None = None   # the sync push_s is the trainer side of (staged, sharded, bytes)
    adapter_params: float = 0.0   # LoRA: the actor's adapter parameters (model.lora); 0: trained in full
    critic_adapters: bool = False  # LoRA on the critic too (model.lora.critic)

    def positions(self, trained_tokens: int, samples: int, lengths: list[int] | None) -> tuple[int, int]:
        """(positions of the update passes, of each forward-only pass): prompt + response
        tokens, or with `shape` and the samples' response `lengths` what the plans compute."""
        if self.shape is None or lengths is None:
            real = trained_tokens + samples * self.prompt_tokens
            return real, real
        return self.shape.positions([self.prompt_tokens + n for n in lengths], list(lengths))

    def _passes(self) -> tuple[int, int]:
        """(models trained, forward-only passes): PPO trains actor and critic and runs old
        logprobs, reference logprobs and values; GRPO trains the actor, runs old and reference."""
        return (2, 3) if self.critic else (1, 2)

    def update_flops(self) -> float:
        """FLOPs per position of the update passes, every trained model together: 6 x active params
        each trained in full; 4 x active + 6 x adapters each with a frozen base (LoRA)."""
        full, lora = 6 * self.model.active, 4 * self.model.active + 6 * self.adapter_params
        actor = lora if self.adapter_params else full
        critic = (lora if self.adapter_params and self.critic_adapters else full) if self.critic else 0.0
        return actor + critic

    def flops_per_token(self) -> float:
        return self.update_flops() + 2 * self._passes()[1] * self.model.active

    @property
    def forward_frac(self) -> float:
        """Forward-only share of a trained token's FLOPs: 6 / 18 = 1/3 for PPO, 4 / 10 for GRPO
        (in full; with LoRA's cheaper updates a larger share)."""
        return 2 * self._passes()[1] * self.model.active / self.flops_per_token()

    @property
    def frozen_frac(self) -> float:
        """Share of the forward-only passes that is the frozen reference's (kept over updates)."""
        return 1 / self._passes()[1]

    def _rate(self) -> float:
        return self.gpu.bf16_flops * self.mfu * self.gpus

    def train_s(self, trained_tokens: int, stitch_tokens: int = 0, samples: int = 0, lengths=None) -> float:
        update, forward = self.positions(trained_tokens, samples, lengths)
        flops = self.update_flops() * update + 2 * self._passes()[1] * forward * self.model.active
        return (flops + 2 * self.model.active * stitch_tokens) / self._rate()

    def forward_s(self, trained_tokens: int, samples: int = 0, lengths=None) -> float:
        """The forward-only passes of these samples over prompt + response (a part of their
        train_s; the stitched l_old of carried tokens is not: it runs when the round ends).
        With `lengths`, planned over these samples alone, as rollout.overlap computes a group."""
        forward = self.positions(trained_tokens, samples, lengths)[1]
        return 2 * self._passes()[1] * self.model.active * forward / self._rate()


# -- weight sync: megarl/sim/push.py (re-exported here for the callers of before) ---------------


def engines_to_keep_trainer_busy(train_s: float, push_s: float, tokens_per_step: float,
                                  engine_tokens_per_s: float, waste: float = 0.0) -> int:
    """Provisioning rule (async mode, staleness bound >= 1): round k+1 generates while the
    trainer trains step k and pushes its weights, so the trainer never waits when E engines
    generate a step's tokens (plus the share `waste` generated but not trained: aborted
    continuations re-prefilled, the carry) within train_s + push_s:
        E >= tokens_per_step * (1 + waste) / (engine_tokens_per_s * (train_s + push_s)).
    engine_tokens_per_s is one engine's decode throughput at its share of the concurrency.
    Sync and partial modes add the rollout to every step whatever E is (bound S = 0)."""
    return max(1, math.ceil(tokens_per_step * (1 + waste) / (engine_tokens_per_s * (train_s + push_s))))
