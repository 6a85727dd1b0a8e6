"""Sharded weight sends (issue 47): one rank's megatron shards -> pieces of HF tensors
(`megarl.formats.shard_slices`). The shards come from the project's own split
(`ArchMapping.hf_to_megatron`) of a random HF state dict; every rank's pieces, assembled, give the
HF state dict back bitwise, each tensor exactly once, at TP x PP x EP layouts of every table."""
from __future__ import annotations

import functools

import pytest
import torch

from megarl.formats.mapping import mapping_for, padded_vocab_size
from megarl.formats.shard_slices import (
    Coverage,
    HFSlice,
    assemble,
    place,
    rank_to_hf_slices,
    shard_to_hf_slices,
)

transformers = pytest.importorskip("transformers")

DIVISIBLE_BY = 64   # vocab 100 -> padded 128 (tp 1, 2) or 256 (tp 4): a last rank of padding only
BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=100, max_position_embeddings=64)
MOE = dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           mlp_only_layers=[1])
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe"]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2),
           (4, 2, 2)]


def hf_config(arch: str):
    """Small configs: GQA 8/4 (TP up to 4), Qwen2 MHA 4/4 with q/k/v biases and tied embeddings,
    Mistral GQA 8/2 (TP up to 2), Qwen3 head_dim 16 with q/k norm, the MoE pair with a dense
    layer (mlp_only_layers) and Qwen2-MoE's shared expert."""
    if arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **BASE)
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**BASE, "num_attention_heads": 4}, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(tie_word_embeddings=False, head_dim=16, **BASE)
    if arch == "mistral":
        return transformers.MistralConfig(**{**BASE, "num_key_value_heads": 2}, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=16, **{**BASE, **MOE})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=24, **{**BASE, **MOE})
        cfg.architectures = ["Qwen2MoeForCausalLM"]
    cfg.tie_word_embeddings = False
    return cfg


@functools.lru_cache(maxsize=None)
def hf_state_dict(arch: str) -> dict[str, torch.Tensor]:
    """Every HF tensor the table names (what transformers writes: test_conversion_mapping and
    test_moe_mapping check the names against it; transformers 5 fuses the experts in memory, so
    a model's own state dict is not the on-disk layout), filled with random values; without the
    tied lm_head, which the mapping does not expect."""
    m = mapping_for(hf_config(arch))
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(m.dims.hf_shape(n), generator=gen) for n in m.hf_names()}


def all_pieces(m, stages, tp, pp, ep, swap_tp=False):
    """Every rank's pieces, as each rank would produce them: replicated tensors from TP rank 0,
    dense tensors from EP rank 0 (the others hold DP copies of them)."""
    k, n_exp = m.dims.num_layers // pp, m.dims.num_experts // ep
    pieces = []
    for s in range(pp):
        for g in range(ep):
            for r in range(tp):
                rank = (tp - 1 - r) if swap_tp else r   # the shards of another TP rank
                pieces += rank_to_hf_slices(m, stages[s][g * tp + rank], tp_rank=r, tp_size=tp,
                                            layer_offset=s * k, expert_offset=g * n_exp,
                                            sends_replicated=r == 0, experts_only=g > 0)
    return pieces


def layouts():
    for arch in ARCHS:
        for tp, pp, ep in LAYOUTS:
            cfg = hf_config(arch)
            if (ep > 1 and "moe" not in arch) or cfg.num_key_value_heads % tp:
                continue
            yield pytest.param(arch, tp, pp, ep, id=f"{arch}-tp{tp}-pp{pp}-ep{ep}")


@pytest.mark.parametrize("arch,tp,pp,ep", list(layouts()))
def test_every_ranks_pieces_assemble_to_the_hf_state_dict(arch, tp, pp, ep):
    """Bitwise, every HF tensor exactly once (assemble raises on an overlap)."""
    cfg, hf = hf_config(arch), hf_state_dict(arch)
    m = mapping_for(cfg)
    stages = m.hf_to_megatron(hf, tp, pp, cfg.num_hidden_layers,
                              padded_vocab_size(cfg.vocab_size, DIVISIBLE_BY, tp), ep=ep)
    pieces = all_pieces(m, stages, tp, pp, ep)
    assert len({(p.name, p.start) for p in pieces}) == len(pieces)
    back = assemble(pieces, expected=m.hf_names())
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_te_names(arch):
    """The Transformer Engine spec's fused norm names map the same way."""
    cfg, hf = hf_config(arch), hf_state_dict(arch)
    m = mapping_for(cfg, te_names=True)
    stages = m.hf_to_megatron(hf, 2, 2, 4, 128, ep=2 if "moe" in arch else 1)
    assert any("layer_norm_weight" in n for n in stages[0][0])
    back = assemble(all_pieces(m, stages, 2, 2, 2 if "moe" in arch else 1), expected=m.hf_names())
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], t) for n, t in hf.items())


def test_swapped_tp_ranks_are_caught():
    """Rank 0's shards sent as rank 1's (and back) cover every tensor, but every TP-split tensor
    comes out wrong while the replicated ones stay right."""
    cfg, hf = hf_config("qwen2_moe"), hf_state_dict("qwen2_moe")
    m = mapping_for(cfg)
    stages = m.hf_to_megatron(hf, 2, 1, 4, 128)
    back = assemble(all_pieces(m, stages, 2, 1, 1, swap_tp=True), expected=m.hf_names())
    split = {h.format(i=0, e=0) for row in m.table if row.kind != "replicated" and row.per_layer
             and row.in_layer(True) for h in row.hf} | {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(split) >= 12
    for name in split:
        assert not torch.equal(back[name], hf[name]), name
    assert torch.equal(back["model.layers.0.mlp.gate.weight"], hf["model.layers.0.mlp.gate.weight"])


def test_wrong_offsets_are_caught():
    """PP stage 1's layers sent with stage 0's layer offset overlap stage 0's and leave layers
    2..3 uncovered; EP rank 1's experts with offset 0 overlap EP rank 0's."""
    cfg, hf = hf_config("qwen3_moe"), hf_state_dict("qwen3_moe")
    m = mapping_for(cfg)
    stages = m.hf_to_megatron(hf, 1, 2, 4, 128, ep=2)
    same_layers = rank_to_hf_slices(m, stages[0][0], tp_rank=0, tp_size=1) + \
        rank_to_hf_slices(m, stages[1][0], tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\..*overlapping pieces"):
        assemble(same_layers)
    same_experts = rank_to_hf_slices(m, stages[0][0], tp_rank=0, tp_size=1) + \
        rank_to_hf_slices(m, stages[0][1], tp_rank=0, tp_size=1, experts_only=True)
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\..*overlapping"):
        assemble(same_experts)


def test_missing_and_overlapping_pieces_raise():
    cfg, hf = hf_config("llama"), hf_state_dict("llama")
    m = mapping_for(cfg)
    pieces = all_pieces(m, m.hf_to_megatron(hf, 2, 1, 4, 128), 2, 1, 1)
    q1 = next(i for i, p in enumerate(pieces) if p.name == "model.layers.2.self_attn.q_proj.weight"
              and p.start > 0)
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.self_attn\.q_proj\.weight' misses \[\(16, 32\)\]"):
        assemble(pieces[:q1] + pieces[q1 + 1:])
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.self_attn\.q_proj\.weight'.*overlapping "
                                         r"pieces \[16, 32\) and \[16, 32\)"):
        assemble(pieces + [pieces[q1]])
    down = next(p for p in pieces if p.name == "model.layers.0.mlp.down_proj.weight")
    whole = HFSlice(down.name, down.shape, 0, 0, hf[down.name])
    with pytest.raises(ValueError, match=r"down_proj\.weight.*overlapping pieces along dims 1 and 0"):
        assemble([down, whole])
    # a tensor no piece covers, when the caller says what to expect
    with pytest.raises(ValueError, match=r"no piece of \['model\.norm\.weight'\]"):
        assemble([p for p in pieces if p.name != "model.norm.weight"], expected=m.hf_names())
    # a piece that does not fit the shape it claims
    with pytest.raises(ValueError, match=r"'model\.norm\.weight': piece of shape \(32,\) at 8"):
        assemble([HFSlice("model.norm.weight", (32,), 0, 8, hf["model.norm.weight"])])


def test_place_into_preallocated_staging():
    """A receiver's path: `Coverage` checks each piece, `place` copies it into its block."""
    cfg, hf = hf_config("mistral"), hf_state_dict("mistral")
    m = mapping_for(cfg)
    pieces = all_pieces(m, m.hf_to_megatron(hf, 2, 1, 4, 128), 2, 1, 1)
    staging = {n: torch.zeros(m.dims.hf_shape(n)) for n in m.hf_names()}
    coverage = Coverage()
    for p in reversed(pieces):
        coverage.add(p)
        place(p, staging[p.name])
    coverage.check_complete(m.hf_names())
    assert all(torch.equal(staging[n], t) for n, t in hf.items())
    with pytest.raises(ValueError, match=r"q_proj\.weight.*placed into a tensor of \(64, 32\) torch\.bfloat16"):
        place(next(p for p in pieces if p.name.endswith("q_proj.weight")),
              torch.zeros(64, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_sends_its_share(tp):
    """A layer's TP-split bytes come 1/tp from each rank; the replicated ones once, from rank 0;
    every piece is a block of the rank's own shard (no rank produces the whole model), and the
    vocab's padding-only ranks send no embedding rows."""
    cfg, hf = hf_config("qwen3"), hf_state_dict("qwen3")
    m = mapping_for(cfg)
    stages = m.hf_to_megatron(hf, tp, 1, 4, padded_vocab_size(100, DIVISIBLE_BY, tp))
    layer = [n for n in hf if n.startswith("model.layers.1.")]
    replicated = {n for n in layer if n.endswith("norm.weight")}
    split_bytes = sum(hf[n].numel() * 4 for n in layer if n not in replicated)
    total, sent = sum(t.numel() * 4 for t in hf.values()), 0
    for r in range(tp):
        pieces = rank_to_hf_slices(m, stages[0][r], tp_rank=r, tp_size=tp, sends_replicated=r == 0)
        mine = sum(p.nbytes for p in pieces if p.name.startswith("model.layers.1."))
        own_replicated = sum(hf[n].numel() * 4 for n in replicated) if r == 0 else 0
        assert mine == split_bytes // tp + own_replicated
        # no more than the rank's own shards (padding and TP copies of replicated tensors dropped)
        assert sum(p.nbytes for p in pieces) <= sum(t.numel() * 4 for t in stages[0][r].values())
        sent += sum(p.nbytes for p in pieces)
        assert all(p.whole == (p.name in replicated or p.name == "model.norm.weight")
                   for p in pieces if "layers.1." in p.name or p.name == "model.norm.weight")
        embed = [p for p in pieces if p.name == "model.embed_tokens.weight"]
        rows = 256 // tp if tp == 4 else 64
        assert [p.length for p in embed] == [n for n in [min(rows, 100 - r * rows)] if n > 0]
    assert sent == total   # each byte of the model once, over the TP ranks together


def test_tied_duplicate_output_layer_yields_nothing():
    """Qwen2 with tied embeddings at PP 2: the last stage's output_layer.weight is ignored, as
    megatron_to_hf ignores it; the first stage's embedding is the source."""
    cfg, hf = hf_config("qwen2"), hf_state_dict("qwen2")
    m = mapping_for(cfg)
    stages = m.hf_to_megatron(hf, 2, 2, 4, 128)
    assert "output_layer.weight" in stages[1][0]
    assert shard_to_hf_slices(m, "output_layer.weight", stages[1][0]["output_layer.weight"],
                              tp_rank=0, tp_size=2) == []


def test_shard_errors_name_the_parameter():
    m = mapping_for(hf_config("llama"))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(ValueError, match=rf"{name}.*shape \(48, 32\)"):
        shard_to_hf_slices(m, name, torch.zeros(48, 32), tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=rf"{name}.*tp_rank=2 outside 0\.\.1"):
        shard_to_hf_slices(m, name, torch.zeros(64, 32), tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match=r"word_embeddings\.weight.*fewer rows than vocab_size=100"):
        shard_to_hf_slices(m, "embedding.word_embeddings.weight", torch.zeros(32, 32), tp_rank=0,
                           tp_size=2)
    with pytest.raises(ValueError, match=r"num_kv_heads=4 is not a multiple of tp=8"):
        shard_to_hf_slices(m, name, torch.zeros(16, 32), tp_rank=0, tp_size=8)
