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


# -- Mixture of Experts and Qwen3 facts ---------------------------------------------------------
def _hf(config_cls, **kw) -> dict:
    """A config.json as transformers writes it (its own key names and defaults)."""
    d = config_cls(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=128, **kw).to_dict()
    d["architectures"] = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return d


def test_qwen3_moe_config_json_gives_experts_qk_norm_and_no_qkv_bias():
    from transformers import Qwen3MoeConfig
    d = _hf(Qwen3MoeConfig, head_dim=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=48)
    a = arch_from_hf(d)
    assert (a.experts, a.top_k, a.moe_ffn, a.shared_ffn, a.dense_layers) == (8, 2, 48, 0, ())
    assert a.qk_norm and not a.qkv_bias and a.head_dim == 32 and a.moe
    # transformers' rule: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    b = arch_from_hf({**d, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert b.dense_layers == (0, 2, 3) and [b.is_sparse(i) for i in range(4)] == [False, True, False, False]


def test_qwen2_moe_config_json_gives_the_gated_shared_expert():
    from transformers import Qwen2MoeConfig
    a = arch_from_hf(_hf(Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=128))
    assert (a.experts, a.top_k, a.moe_ffn, a.shared_ffn, a.shared_gate) == (4, 2, 32, 128, True)
    assert a.qkv_bias and not a.qk_norm


def test_dense_qwen3_has_qk_norm_and_no_experts():
    from transformers import Qwen3Config
    a = arch_from_hf(_hf(Qwen3Config, head_dim=32, intermediate_size=96))
    assert a.qk_norm and not a.moe and not a.qkv_bias and a.dense_layers == ()


MOE_FACTS = ["model.arch.hidden_size=64", "model.arch.num_layers=4", "model.arch.num_heads=4",
             "model.arch.num_kv_heads=2", "model.arch.head_dim=32", "model.arch.ffn_hidden_size=96",
             "model.arch.vocab_size=128", "model.arch.max_position_embeddings=256", "model.arch.qk_norm=true",
             "model.arch.num_experts=8", "model.arch.moe_top_k=2", "model.arch.moe_ffn_hidden_size=48",
             "model.arch.moe_sparse_step=2", "model.arch.moe_dense_layers=[3]"]


def test_recipe_moe_facts_equal_config_json_and_are_checked_against_it():
    from transformers import Qwen3MoeConfig
    d = _hf(Qwen3MoeConfig, head_dim=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3], max_position_embeddings=256)
    cfg = load_config("recipes/tiny_cpu.yaml", MOE_FACTS)
    assert resolve_arch(cfg)[0] == arch_from_hf(d)
    check_arch_matches(cfg, d)
    with pytest.raises(ConfigError, match=r"model\.arch disagrees.*experts 8 \(recipe\) != 16"):
        check_arch_matches(cfg, {**d, "num_experts": 16})


@pytest.mark.parametrize("extra,match", [
    (["model.arch.moe_top_k=9"], r"model\.arch\.moe_top_k=9: must be between 1 and model\.arch\.num_experts=8"),
    (["model.arch.moe_ffn_hidden_size=0"], r"model\.arch\.moe_ffn_hidden_size=0: must be > 0"),
    (["model.arch.moe_dense_layers=[4]"], r"model\.arch\.moe_dense_layers=\[4\]: layer indices must lie in 0\.\.3"),
    (["model.arch.moe_sparse_step=0"], r"model\.arch\.moe_sparse_step=0: must be >= 1"),
    (["model.arch.shared_expert_gate=true"], r"model\.arch\.shared_expert_gate=True: gates a shared expert"),
    (["model.arch.num_experts=0"], r"model\.arch\.moe_top_k=2: is an MoE fact: set model\.arch\.num_experts"),
])
def test_bad_moe_facts_are_named(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config("recipes/tiny_cpu.yaml", MOE_FACTS + extra)


def test_moe_facts_without_the_others_are_named():
    with pytest.raises(ConfigError, match=r"model\.arch\.num_experts=8: give the other architecture facts"):
        load_config("recipes/tiny_cpu.yaml", ["model.arch.num_experts=8"])
