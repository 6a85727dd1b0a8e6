"""The tiny countdown architectures (tools/tiny_archs.py): each is one megarl maps, with the
head size vLLM's CPU attention accepts, sharing the countdown tokenizer's vocab."""
import pytest

from megarl.data import countdown as cd
from megarl.formats.mapping import mapping_for
from tools import tiny_archs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", sorted(tiny_archs.ARCHS))
def test_every_tiny_arch_is_mapped_and_served(arch):
    config_cls, model_cls, _ = tiny_archs.ARCHS[arch]
    cfg = getattr(transformers, config_cls)(**tiny_archs.model_kwargs(arch))
    cfg.architectures = [model_cls]
    mapping = mapping_for(cfg)
    assert mapping.arch == model_cls
    assert mapping.dims.head_dim >= 32          # vLLM's CPU attention refuses 16
    assert mapping.dims.vocab == cd.VOCAB_SIZE


def test_qwen3_head_dim_is_apart_from_hidden_over_heads():
    kw = tiny_archs.model_kwargs("qwen3")
    assert kw["head_dim"] != kw["hidden_size"] // kw["num_attention_heads"]


def test_unknown_arch_names_the_choices():
    with pytest.raises(ValueError, match=r"--arch 'gpt2'.*qwen3"):
        tiny_archs.model_kwargs("gpt2")
