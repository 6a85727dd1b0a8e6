"""HF <-> megatron-core GPTModel parameters through the per-architecture tables of
`megarl.formats.tables`.

A table row (`ParamMapping`) names one megatron parameter, the HF parameter(s) it holds and
how it is laid out over tensor parallelism (`kind`). `ArchMapping` applies the rows with the
pure ops in `megarl.formats.ops`; it is used by the trainer -> vLLM weight sync (one
gathered parameter at a time: `partition_dim`, `megatron_to_hf`) and by the checkpoint
conversion tools (`megarl.conversion`; whole state dicts: `hf_to_megatron`, `megatron_shards_to_hf`).

Megatron layer indices are local to the pipeline stage ("decoder.layers.{i}" with i from 0 on
every stage); HF indices are global (local + the stage's layer offset). The embedding lives on
the first stage, the final norm and output layer on the last. With tied embeddings and PP > 1
megatron keeps a duplicate `output_layer.weight` on the last stage (kept equal to the
embedding by an all-reduce); it is written on HF -> megatron and ignored on megatron -> HF,
where the first stage's embedding is the source. Experts ("{e}") are local to their
expert-parallel rank in megatron's names (local + the rank's expert offset is the HF index).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from megarl.formats import experts as moe
from megarl.formats import ops
from megarl.formats.tables import (  # noqa: F401  (the tables' names, re-exported)
    _HF_IGNORED_SUFFIXES,
    _L,
    _MCORE_EXPERT,
    _MCORE_LAYER,
    _MODEL_TYPES,
    _OUTPUT,
    _TIED_OUTPUT,
    EXPERT_ROWS,
    LLAMA_TABLE,
    MISTRAL_TABLE,
    QWEN2_MOE_TABLE,
    QWEN2_TABLE,
    QWEN3_MOE_TABLE,
    QWEN3_TABLE,
    SHARED_EXPERT_ROWS,
    TABLES,
    TE_NAMES,
    Kind,
    ModelDims,
    ParamMapping,
    is_extra_state,
    padded_vocab_size,
)


def refuse_unsupported(hf_config, arch: str) -> None:
    """Raise naming the config.json option when the config asks for something the table and
    megatron's GPT layout do not reproduce (the model would load and compute other logits)."""
    for flag in ("attention_bias", "mlp_bias"):  # Llama options megatron's GPT layout lacks
        if getattr(hf_config, flag, False):
            raise ValueError(f"{arch} with {flag}=true in config.json is not supported by the "
                             f"megatron mapping; only Qwen2's q/k/v biases are")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{arch} with use_sliding_window=true in config.json is not supported: "
                         f"megarl's trainer attends over the whole sequence; set it to false only "
                         f"if the model was trained without the window")


def mapping_for(hf_config, te_names: bool = False) -> "ArchMapping":
    """The mapping for an HF config (an architecture of `TABLES`).

    te_names=True uses the Transformer Engine spec's fused-norm names
    (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) instead of the local spec's
    `input_layernorm.weight`, `pre_mlp_layernorm.weight`.
    """
    archs = getattr(hf_config, "architectures", None)
    model_type = getattr(hf_config, "model_type", None)
    arch = archs[0] if archs else _MODEL_TYPES.get(model_type, f"model_type={model_type!r}")
    if arch not in TABLES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(TABLES)}")
    refuse_unsupported(hf_config, arch)
    moe.check_moe_options(hf_config, arch)
    dims = ModelDims.from_hf_config(hf_config)
    rows = tuple(ParamMapping(TE_NAMES.get(m.megatron, m.megatron) if te_names else m.megatron,
                              m.hf, m.kind, m.mlp)
                 for m in TABLES[arch] if not (dims.tied and m.megatron == _OUTPUT))
    return ArchMapping(arch=arch, dims=dims, table=rows, te_names=te_names)


@dataclass(frozen=True)
class ArchMapping:
    """One architecture's table bound to a model's sizes; see the module docstring."""
    arch: str
    dims: ModelDims
    table: tuple[ParamMapping, ...]
    te_names: bool = False
    _by_megatron: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        by_name = {m.megatron: m for m in self.table}
        if self.te_names:   # TE's MoE layers keep a pre-MLP norm of their own (no fc1 to fuse it in)
            by_name.update({local: by_name[te] for local, te in TE_NAMES.items() if te in by_name})
        object.__setattr__(self, "_by_megatron", by_name)

    # ---- names -------------------------------------------------------------------------

    def _describe(self) -> str:
        return f"{self.arch} (te_names={self.te_names}, tied={self.dims.tied})"

    def find(self, mcore_name: str) -> tuple[ParamMapping, int | None]:
        """The table row of a megatron name and its stage-local layer index (None if not a layer)."""
        row, local, _ = self.locate(mcore_name)
        return row, local

    def locate(self, mcore_name: str) -> tuple[ParamMapping, int | None, int | None]:
        """The table row of a megatron name, its stage-local layer index and its local expert
        index (None where the name has none)."""
        if self.dims.tied and mcore_name == _OUTPUT:
            return _TIED_OUTPUT, None, None
        match = _MCORE_LAYER.match(mcore_name)
        template, local = (_L + match.group(2), int(match.group(1))) if match else (mcore_name, None)
        expert = None
        if match and (x := _MCORE_EXPERT.match(match.group(2))):
            template, expert = _L + x.group(1) + "{e}" + x.group(3), int(x.group(2))
        row = self._by_megatron.get(template)
        if row is None:
            raise ValueError(f"unknown megatron parameter {mcore_name!r} for {self._describe()}; "
                             f"known: {sorted(self._by_megatron)}")
        return row, local, expert

    def partition_dim(self, mcore_name: str) -> int | None:
        """The dim TP splits `mcore_name` along (0 or 1), or None if every TP rank holds all of it."""
        return self.find(mcore_name)[0].partition_dim

    def megatron_names(self, num_local_layers: int, first_stage: bool, last_stage: bool,
                       pp: int = 1, layer_offset: int = 0, local_experts: int | None = None) -> list[str]:
        """Parameter names (no `_extra_state`) of one PP stage's megatron GPTModel state dict
        (its first global layer `layer_offset`, `local_experts` experts per EP rank: default all)."""
        return [m.megatron.format(i=i, e=e) for m, i, e in self._stage_rows(
            num_local_layers, first_stage, last_stage, pp, layer_offset, local_experts)]

    def hf_names(self, num_layers: int | None = None) -> list[str]:
        """All HF parameter names of the model (no `lm_head.weight` when tied)."""
        n = self.dims.num_layers if num_layers is None else num_layers
        return [h.format(i=i, e=e) for m, i, e in self._stage_rows(n, True, True, 1, 0, None)
                for h in m.hf]

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.dims.moe_layers

    def _stage_rows(self, num_local_layers, first_stage, last_stage, pp, layer_offset=0,
                    local_experts=None):
        """(row, local layer or None, local expert or None) of every parameter of one stage."""
        experts = self.dims.num_experts if local_experts is None else local_experts
        for m in self.table:
            if m.per_layer:
                for i in range(num_local_layers):
                    if m.in_layer(self.is_moe_layer(i + layer_offset)):
                        yield from ((m, i, e) for e in (range(experts) if m.per_expert else [None]))
            elif m.megatron.startswith("embedding.") and first_stage:
                yield m, None, None
            elif not m.megatron.startswith("embedding.") and last_stage:
                yield m, None, None
        if self.dims.tied and last_stage and pp > 1:
            yield _TIED_OUTPUT, None, None

    # ---- one parameter -----------------------------------------------------------------

    def _megatron_full_shape(self, m: ParamMapping) -> tuple:
        """Full (TP-merged) megatron shape; vocab dim 0 is None (padded size not known here)."""
        d = self.dims
        if m.kind == "vocab":
            return (None, d.hidden)
        shapes = [d.hf_shape(h) for h in m.hf]
        if m.kind == "qkv" or m.kind == "gate_up":
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return shapes[0]

    def _check_shards(self, name: str, m: ParamMapping, shards: Sequence[Tensor]) -> None:
        tp, pdim = len(shards), m.partition_dim
        if tp == 0:
            raise ValueError(f"megatron parameter {name!r}: no TP shards given")
        if m.kind == "qkv" and self.dims.num_kv_heads % tp:
            raise ValueError(f"megatron parameter {name!r}: num_kv_heads={self.dims.num_kv_heads} "
                             f"is not a multiple of tp={tp} (fused QKV is split by whole GQA groups)")
        expected = list(self._megatron_full_shape(m))
        if pdim is not None and expected[pdim] is not None:
            if expected[pdim] % tp:
                raise ValueError(f"megatron parameter {name!r}: dim {pdim} of size {expected[pdim]} "
                                 f"cannot be split into {tp} TP shards")
            expected[pdim] //= tp
        first = tuple(shards[0].shape)
        for r, s in enumerate(shards):
            shape = tuple(s.shape)
            ok = len(shape) == len(expected) and all(e is None or e == a
                                                     for e, a in zip(expected, shape))
            if not ok or shape != first:
                want = tuple("V_pad/tp" if e is None else e for e in expected)
                raise ValueError(f"megatron parameter {name!r}: TP shard {r} of {tp} has shape "
                                 f"{shape}, expected {want} for {self._describe()}")

    def megatron_to_hf(self, mcore_name: str, shards: Sequence[Tensor],
                       layer_offset: int = 0, expert_offset: int = 0) -> dict[str, Tensor]:
        """Full HF tensors from the TP shards of ONE megatron parameter.

        shards: the parameter on each TP rank, in TP-rank order (for a replicated parameter, one
        tensor or all TP copies). layer_offset: the PP stage's first global layer; expert_offset:
        the EP rank's first global expert. Returns {hf_name: full tensor} with vocab padding
        removed; {} for the tied duplicate `output_layer.weight` of the last PP stage.
        """
        m, local, expert = self.locate(mcore_name)
        if m is _TIED_OUTPUT:
            return {}
        shards = list(shards)
        self._check_shards(mcore_name, m, shards)
        d = self.dims
        if m.kind == "replicated":
            tensors = [shards[0]]
        elif m.kind in ("column", "row"):
            tensors = [ops.cat_along(shards, m.partition_dim)]
        elif m.kind == "vocab":
            full = ops.cat_along(shards, 0)
            if full.shape[0] < d.vocab:
                raise ValueError(f"megatron parameter {mcore_name!r}: merged shape "
                                 f"{tuple(full.shape)} has fewer rows than vocab_size={d.vocab}")
            tensors = [ops.unpad_vocab(full, d.vocab)]
        elif m.kind == "qkv":
            tensors = ops.qkv_from_megatron(ops.cat_along(shards, 0), d.num_heads,
                                            d.num_kv_heads, d.head_dim)
        else:  # gate_up
            tensors = ops.gate_up_from_fc1_shards(shards)
        layer = None if local is None else local + layer_offset
        e = None if expert is None else expert + expert_offset
        return {h.format(i=layer, e=e): t for h, t in zip(m.hf, tensors)}

    def to_shards(self, m: ParamMapping, tensors: list[Tensor], tp: int,
                  padded_vocab: int) -> list[Tensor]:
        """Full HF tensors of one table row (in `m.hf` order) -> the megatron tensor's TP shards."""
        d = self.dims
        if m.kind == "replicated":
            return [tensors[0]] * tp
        if m.kind in ("column", "row"):
            return ops.split_along(tensors[0], m.partition_dim, tp)
        if m.kind == "vocab":
            return ops.split_along(ops.pad_vocab(tensors[0], padded_vocab), 0, tp)
        if m.kind == "qkv":
            fused = ops.qkv_to_megatron(*tensors, d.num_heads, d.num_kv_heads, d.head_dim)
            return ops.qkv_shards(fused, d.num_kv_heads, tp)
        return ops.fc1_shards_from_gate_up(*tensors, tp)

    # ---- whole state dicts -------------------------------------------------------------

    def check_hf(self, hf_tensors: Mapping[str, Tensor], num_layers: int) -> dict[str, Tensor]:
        """The HF tensors the table expects, with unknown / missing names and wrong shapes raised
        as ValueError naming them (accepts shape-only stand-ins, e.g. meta tensors)."""
        expected = {n: self.dims.hf_shape(n) for n in self.hf_names(num_layers)}
        out = {}
        for name, t in hf_tensors.items():
            if name.endswith(_HF_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.dims.tied:
                emb = hf_tensors.get("model.embed_tokens.weight")
                if emb is None or not (t is emb or torch.equal(t, emb)):
                    raise ValueError("tie_word_embeddings=True but 'lm_head.weight' differs from "
                                     "'model.embed_tokens.weight'; fix the config or the weights")
                continue
            if name not in expected:
                raise ValueError(f"unknown HF parameter {name!r} for {self._describe()} with "
                                 f"{num_layers} layers")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"HF parameter {name!r} has shape {tuple(t.shape)}, expected "
                                 f"{expected[name]} from the config of {self._describe()}")
            out[name] = t
        missing = sorted(expected.keys() - out.keys())
        if missing:
            raise ValueError(f"missing HF parameters for {self._describe()}: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
        return out

    def local_experts(self, ep: int) -> int:
        """Experts per expert-parallel rank; raises naming parallel.ep when ep does not divide them."""
        if self.dims.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} must divide the model's {self.dims.num_experts} experts "
                             f"(num_experts in config.json): each EP rank holds an equal share")
        return self.dims.num_experts // ep

    def hf_to_megatron(self, hf_tensors: Mapping[str, Tensor], tp: int, pp: int,
                       num_layers: int, padded_vocab: int, ep: int = 1) -> list[list[dict[str, Tensor]]]:
        """Split a full HF state dict into megatron local state dicts: result[pp_stage][rank],
        rank = ep_rank * tp + tp_rank (TP fastest, as megatron orders an expert group).

        Layers are split evenly over PP (stage s holds HF layers s*k .. s*k+k-1 as local 0..k-1,
        k = num_layers / pp). Vocab tensors [V, H] are zero-padded to [padded_vocab, H] and
        split on dim 0. Replicated tensors are shared (not copied) between TP ranks. Experts
        are split over EP (rank e holds experts e*n .. e*n+n-1 as local 0..n-1); every other
        parameter is the same on each EP rank.
        """
        if num_layers % pp:
            raise ValueError(f"num_layers={num_layers} is not divisible by pp={pp}; pick a "
                             f"pipeline-parallel size that divides the layer count")
        if padded_vocab < self.dims.vocab or padded_vocab % tp:
            raise ValueError(f"padded_vocab={padded_vocab} must be >= vocab_size={self.dims.vocab} "
                             f"and a multiple of tp={tp}; use padded_vocab_size()")
        n_exp = self.local_experts(ep) if self.dims.num_experts else 0
        hf = self.check_hf(hf_tensors, num_layers)
        k = num_layers // pp
        out: list[list[dict[str, Tensor]]] = [[{} for _ in range(tp * ep)] for _ in range(pp)]
        for s in range(pp):
            for m, local, expert in self._stage_rows(k, s == 0, s == pp - 1, pp, s * k, n_exp):
                layer = None if local is None else s * k + local
                for g in range(ep):
                    e = None if expert is None else g * n_exp + expert
                    shards = self.to_shards(m, [hf[h.format(i=layer, e=e)] for h in m.hf], tp,
                                            padded_vocab)
                    for r in range(tp):
                        out[s][g * tp + r][m.megatron.format(i=local, e=expert)] = shards[r]
        return out

    def megatron_shards_to_hf(
            self, stage_rank_state_dicts: Sequence[Sequence[Mapping[str, Tensor]]], ep: int = 1
    ) -> dict[str, Tensor]:
        """Merge megatron local state dicts [pp_stage][rank] (rank = ep_rank * tp + tp_rank)
        into one full HF state dict.

        Inverse of `hf_to_megatron`. Layer offsets come from each stage's layer count, so
        uneven PP splits work too; `_extra_state` keys are ignored. Every rank must hold
        exactly the expected names (missing or unknown ones raise); experts come from their
        EP rank, every other parameter from EP rank 0.
        """
        pp = len(stage_rank_state_dicts)
        sizes = sorted({len(ranks) for ranks in stage_rank_state_dicts})
        if pp == 0 or len(sizes) != 1 or sizes[0] == 0 or sizes[0] % ep:
            raise ValueError(f"expected [pp_stage][rank] state dicts with the same EP x TP size on "
                             f"every stage (ep={ep}), got sizes {sizes} over {pp} stages")
        tp = sizes[0] // ep
        n_exp = self.local_experts(ep) if self.dims.num_experts else 0
        out: dict[str, Tensor] = {}
        offset = 0
        for s, ranks in enumerate(stage_rank_state_dicts):
            names = [{n for n in sd if not is_extra_state(n)} for sd in ranks]
            for r, rank_names in enumerate(names):
                if rank_names != names[0]:
                    raise ValueError(f"PP stage {s}: rank {r} (ep {r // tp}, tp {r % tp}) and rank 0 "
                                     f"hold different parameters: {sorted(rank_names ^ names[0])[:8]}")
            layers = {int(mt.group(1)) for n in names[0] if (mt := _MCORE_LAYER.match(n))}
            n_local = max(layers) + 1 if layers else 0
            expected = set(self.megatron_names(n_local, s == 0, s == pp - 1, pp, offset, n_exp))
            unknown, missing = sorted(names[0] - expected), sorted(expected - names[0])
            if unknown or missing:
                raise ValueError(f"PP stage {s} of {pp} for {self._describe()}: unknown megatron "
                                 f"parameters {unknown[:8]}, missing {missing[:8]}")
            for name in sorted(names[0]):
                groups = range(ep) if self.locate(name)[2] is not None else [0]
                for g in groups:
                    out.update(self.megatron_to_hf(name, [sd[name] for sd in ranks[g * tp:(g + 1) * tp]],
                                                   offset, g * n_exp))
            offset += n_local
        return out
