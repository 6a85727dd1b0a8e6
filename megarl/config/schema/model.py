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
            return
        for k, v in sizes.items():
            require(k == "head_dim" or v > 0, f"model.arch.{k}", v,
                     "give every architecture fact, or none (then config.json is read)")
        require(self.num_heads % self.num_kv_heads == 0, "model.arch.num_kv_heads", self.num_kv_heads,
                 f"must divide model.arch.num_heads={self.num_heads} (GQA groups)")
        require(self.head_dim > 0 or self.hidden_size % self.num_heads == 0, "model.arch.head_dim",
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
        one_of("model.dtype", self.dtype, {"float32", "bfloat16"})
        require(self.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by",
                 self.make_vocab_size_divisible_by, "must be >= 1")
        require(self.megatron_path != self.path, "model.megatron_path", self.megatron_path,
                 "is model.path; point it at the output folder of tools/convert_hf_to_megatron.py")


@dataclass
class ParallelConfig:
    tp: int = 1                        # tensor-parallel size of the trainer
    pp: int = 1                        # pipeline-parallel size of the trainer
    sequence_parallel: bool = False    # split LayerNorm/dropout activations over TP ranks (GPU + TE only)
    backend: str = "auto"              # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl
    timeout_s: int = 600               # collective timeout: a hung rank fails loudly after this

    def __post_init__(self):
        require(self.tp >= 1, "parallel.tp", self.tp, "must be >= 1")
        require(self.pp >= 1, "parallel.pp", self.pp, "must be >= 1")
        one_of("parallel.backend", self.backend, {"auto", "gloo", "nccl"})
        require(not self.sequence_parallel or self.tp > 1, "parallel.sequence_parallel",
                 self.sequence_parallel, "needs parallel.tp > 1")
