"""The decoder facts of a recipe's model (megarl/models/arch.py): read from config.json or from
the recipe's model.arch, and checked against each other before a run builds its models."""
import pytest
from transformers import AutoConfig

from megarl.config import ConfigError, load_config
from megarl.models.arch import Arch, arch_from_hf, check_arch_matches, resolve_arch

FACTS = ["model.arch.hidden_size=128", "model.arch.num_layers=2", "model.arch.num_heads=4",
         "model.arch.num_kv_heads=2", "model.arch.ffn_hidden_size=512", "model.arch.vocab_size=128",
         "model.arch.max_position_embeddings=256", "model.arch.qkv_bias=true"]


def test_arch_from_hf_fills_the_defaults_of_config_json():
    """No num_key_value_heads: MHA; no head_dim: hidden / heads; a Qwen2 has a QKV bias."""
    d = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96,
         "vocab_size": 100, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True}
    assert arch_from_hf(d) == Arch(hidden=64, layers=3, heads=4, kv_heads=4, head_dim=16, ffn=96, vocab=100,
                                   max_positions=0, tied=True, qkv_bias=True)
    assert not arch_from_hf({**d, "architectures": ["LlamaForCausalLM"]}).qkv_bias


def test_recipe_facts_and_config_json_give_the_same_arch(tiny_model):
    from_json, src = resolve_arch(load_config("recipes/tiny_cpu.yaml"))
    from_recipe, how = resolve_arch(load_config("recipes/tiny_cpu.yaml", FACTS))
    assert src.endswith("config.json") and how == "model.arch (recipe)"
    assert from_json == from_recipe


def test_without_facts_an_unreadable_config_json_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.arch is not set and .*config\.json is not readable "
                                          r"\(FileNotFoundError\): give the architecture in the recipe"):
        resolve_arch(load_config("recipes/tiny_cpu.yaml", [f"model.path={tmp_path}"]))


def test_recipe_arch_is_checked_against_the_checkpoint(tiny_model):
    """model.arch stated in a recipe must match model.path/config.json (models/setup.build_all)."""
    hf = AutoConfig.from_pretrained(str(tiny_model)).to_dict()
    check_arch_matches(load_config("recipes/tiny_cpu.yaml", FACTS), hf)
    check_arch_matches(load_config("recipes/tiny_cpu.yaml"), hf)      # no facts: nothing to check
    with pytest.raises(ConfigError, match=r"model\.arch disagrees.*layers 3 \(recipe\) != 2"):
        check_arch_matches(load_config("recipes/tiny_cpu.yaml", FACTS + ["model.arch.num_layers=3"]), hf)
