"""The trainer's sliced HF loading (megarl/models/loading.py) gives exactly the TP shards of the
full-tensor mapping (`ArchMapping.to_shards`), for every row kind, and reads only slices."""
import pytest
import torch
import transformers
from safetensors.torch import save_file

from megarl.formats.hf_reader import HFCheckpoint
from megarl.formats.mapping import mapping_for, padded_vocab_size
from megarl.models.loading import shard_from_hf

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=100, max_position_embeddings=64)


def _write(tmp_path, cfg):
    """Random tensors for every HF name, split over two safetensors files (no index json)."""
    mapping = mapping_for(cfg)
    g = torch.Generator().manual_seed(0)
    names = mapping.hf_names()
    tensors = {n: torch.randn(mapping.dims.hf_shape(n), generator=g) for n in names}
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "b.safetensors"))
    cfg.save_pretrained(tmp_path)
    return mapping, tensors


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sliced_shards_equal_full_mapping(tmp_path, arch, tp):
    cfg = {"llama": lambda: transformers.LlamaConfig(tie_word_embeddings=False, **SIZES),
           "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=True, **SIZES)}[arch]()
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    mapping, tensors = _write(tmp_path, cfg)
    hf = HFCheckpoint(tmp_path)
    padded = padded_vocab_size(mapping.dims.vocab, 16, tp)
    kinds = set()
    for row in mapping.table:
        for layer in (range(mapping.dims.num_layers) if row.per_layer else [None]):
            full = mapping.to_shards(row, [tensors[h.format(i=layer)] for h in row.hf], tp, padded)
            for r in range(tp):
                got = shard_from_hf(mapping, row, hf, layer, tp, r, padded)
                assert torch.equal(got, full[r]), (row.megatron, layer, r)
            kinds.add(row.kind)
    hf.close()
    assert kinds >= {"replicated", "row", "vocab", "qkv", "gate_up"}


def test_part_reads_a_slice(tmp_path):
    t = torch.arange(24.).reshape(4, 6)
    save_file({"w": t}, str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    hf = HFCheckpoint(tmp_path)
    assert torch.equal(hf.get_part("w", 0, 1, 3), t[1:3])
    assert torch.equal(hf.get_part("w", 1, 2, 6), t[:, 2:6])
    hf.close()
