"""The run's identity, the model it trains and the trainer's parallel layout."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.schema.checks import one_of, require


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
    qk_norm: bool = False              # RMSNorm on each query and key head (Qwen3)
    # Mixture of Experts (config.json names in comments); 0 / empty: a dense model
    num_experts: int = 0               # routed experts per MoE layer (num_experts, num_local_experts)
    moe_top_k: int = 0                 # experts each token is routed to (num_experts_per_tok)
    moe_ffn_hidden_size: int = 0       # one routed expert's SwiGLU intermediate size (moe_intermediate_size)
    shared_expert_ffn_hidden_size: int = 0  # the shared expert beside the routed ones (Qwen2-MoE)
    shared_expert_gate: bool = False   # a sigmoid gate (1 x hidden) on the shared expert's output (Qwen2-MoE)
    moe_sparse_step: int = 1           # every step-th layer is MoE (decoder_sparse_step)
    moe_dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP (mlp_only_layers)

    @property
    def given(self) -> bool:
        return self.num_layers > 0

    def __post_init__(self):
        sizes = {k: getattr(self, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                 "head_dim", "ffn_hidden_size", "vocab_size",
                                                 "max_position_embeddings")}
        for k, v in sizes.items():
            require(v >= 0, f"model.arch.{k}", v, "must be >= 0 (0: read from model.path/config.json)")
        if not any(v for k, v in sizes.items() if k != "head_dim"):
            require(not self.num_experts, "model.arch.num_experts", self.num_experts,
                     "give the other architecture facts too, or none (then config.json is read)")
            return
        for k, v in sizes.items():
            require(k == "head_dim" or v > 0, f"model.arch.{k}", v,
                     "give every architecture fact, or none (then config.json is read)")
        require(self.num_heads % self.num_kv_heads == 0, "model.arch.num_kv_heads", self.num_kv_heads,
                 f"must divide model.arch.num_heads={self.num_heads} (GQA groups)")
        require(self.head_dim > 0 or self.hidden_size % self.num_heads == 0, "model.arch.head_dim",
                 self.head_dim, f"set it: hidden_size {self.hidden_size} is not a multiple of "
                 f"num_heads {self.num_heads}")
        self._check_experts()

    def _check_experts(self):
        """The MoE facts: all or none of them, the top-k within the experts, dense layers that exist."""
        require(self.num_experts >= 0, "model.arch.num_experts", self.num_experts, "must be >= 0 (0: a dense model)")
        require(self.moe_sparse_step >= 1, "model.arch.moe_sparse_step", self.moe_sparse_step,
                 "must be >= 1 (1: every layer is MoE)")
        if not self.num_experts:
            for k in ("moe_top_k", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size", "shared_expert_gate",
                      "moe_dense_layers"):
                require(not getattr(self, k), f"model.arch.{k}", getattr(self, k),
                         "is an MoE fact: set model.arch.num_experts too, or leave it out for a dense model")
            return
        require(1 <= self.moe_top_k <= self.num_experts, "model.arch.moe_top_k", self.moe_top_k,
                 f"must be between 1 and model.arch.num_experts={self.num_experts}")
        require(self.moe_ffn_hidden_size > 0, "model.arch.moe_ffn_hidden_size", self.moe_ffn_hidden_size,
                 "must be > 0 for an MoE model (config.json's moe_intermediate_size)")
        require(self.shared_expert_ffn_hidden_size >= 0, "model.arch.shared_expert_ffn_hidden_size",
                 self.shared_expert_ffn_hidden_size, "must be >= 0 (0: no shared expert)")
        require(not self.shared_expert_gate or self.shared_expert_ffn_hidden_size > 0, "model.arch.shared_expert_gate",
                 self.shared_expert_gate, "gates a shared expert: set model.arch.shared_expert_ffn_hidden_size")
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.num_layers]
        require(not bad, "model.arch.moe_dense_layers", list(self.moe_dense_layers),
                 f"layer indices must lie in 0..{self.num_layers - 1}")


#: model.lora.targets' names -> megatron's layers (megarl/models/lora.py TARGETS)
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor's linear layers (megarl/models/lora.py, docs/lora.md): with
    rank > 0 the actor's base weights are frozen (no gradient, no optimizer state), only the
    adapters train, and the reference policy (a KL term) is the base with the adapters off."""
    rank: int = 0                      # adapter rank r; 0: off (full fine-tuning)
    # the adapters' output is scaled by alpha / rank; 16: veRL's and OpenRLHF's default lora_alpha
    alpha: float = 16.0
    # on the adapters' input only, in [0, 1); 0 keeps the trainer's logprobs the engine's
    dropout: float = 0.0
    # megatron's layers: qkv (linear_qkv), proj (linear_proj), fc1 (linear_fc1), fc2 (linear_fc2)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    seed: int = 0                      # the adapters' init (A), the same at every TP x PP layout
    # the critic (algo.name=ppo) with adapters too (its value head, new, trained in full); false: the
    # critic is fine-tuned in full whatever the actor does
    critic: bool = False

    def __post_init__(self):
        require(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0 (0: LoRA off)")
        require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must lie in [0, 1) (0: no dropout)")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        require(not bad, "model.lora.targets", list(self.targets),
                 f"unknown {bad}: name megatron's layers among {list(LORA_TARGETS)}")
        if self.rank > 0:
            require(self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0 when model.lora.rank > 0")
            require(len(self.targets) > 0, "model.lora.targets", list(self.targets),
                     f"name at least one of {list(LORA_TARGETS)} when model.lora.rank > 0")


@dataclass
class ModelConfig:
    path: str = "artifacts/tiny_countdown"  # HF checkpoint dir (config.json, safetensors, tokenizer)
    dtype: str = "float32"             # trainer parameter dtype: float32 | bfloat16
    make_vocab_size_divisible_by: int = 128  # megatron pads the vocab to a multiple of this x TP
    arch: ArchConfig = field(default_factory=ArchConfig)  # facts for `megarl plan` (0: from config.json)
    # weights from a megatron dist checkpoint (tools/convert_hf_to_megatron.py --out), at any TP x PP;
    # model.path still gives config.json and the tokenizer. "": weights from model.path's safetensors
    megatron_path: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)   # LoRA adapters on the actor (docs/lora.md)

    def __post_init__(self):
        one_of("model.dtype", self.dtype, {"float32", "bfloat16"})
        require(self.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by",
                 self.make_vocab_size_divisible_by, "must be >= 1")
        require(self.megatron_path != self.path, "model.megatron_path", self.megatron_path,
                 "is model.path; point it at the output folder of tools/convert_hf_to_megatron.py")
        self._check_lora()

    def _check_lora(self):
        """What model.lora cannot do with this model."""
        lora = self.lora
        if not lora.rank:
            return
        mlp = sorted({"fc1", "fc2"} & set(lora.targets))
        require(not (self.arch.num_experts and mlp), "model.lora.targets", list(lora.targets),
                 f"expert MLPs are not supported yet (model.arch.num_experts={self.arch.num_experts}): "
                 f"target qkv and proj only")


@dataclass
class ParallelConfig:
    tp: int = 1                        # tensor-parallel size of the trainer
    pp: int = 1                        # pipeline-parallel size of the trainer
    sequence_parallel: bool = False    # split LayerNorm/dropout activations over TP ranks (MoE at tp > 1 needs it)
    backend: str = "auto"              # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl
    timeout_s: int = 600               # collective timeout: a hung rank fails loudly after this
    # expert-parallel size (Mixture-of-Experts models): each MoE layer's experts are split over ep
    # ranks taken within the data-parallel ones, so ep divides dp = world / (tp x pp) and the experts
    ep: int = 1
    # how tokens reach their experts' EP ranks: alltoall (each rank sends each other rank its
    # tokens) | allgather (every rank gathers every token, keeps its experts' ones)
    moe_dispatcher: str = "alltoall"

    def __post_init__(self):
        require(self.tp >= 1, "parallel.tp", self.tp, "must be >= 1")
        require(self.pp >= 1, "parallel.pp", self.pp, "must be >= 1")
        require(self.ep >= 1, "parallel.ep", self.ep, "must be >= 1 (1: every rank holds every expert)")
        one_of("parallel.moe_dispatcher", self.moe_dispatcher, {"alltoall", "allgather"})
        one_of("parallel.backend", self.backend, {"auto", "gloo", "nccl"})
        require(not self.sequence_parallel or self.tp > 1, "parallel.sequence_parallel",
                 self.sequence_parallel, "needs parallel.tp > 1")
