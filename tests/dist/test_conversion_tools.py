"""HF <-> megatron checkpoint conversion tools (tools/convert_*.py, tools/compare_logits.py).

Real gloo ranks and real dist checkpoints in subprocesses. One probe process
(tests/dist/conversion_probe.py roundtrip) builds the three tiny random models once and runs all
12 (arch, TP, PP) round trips, so torch and megatron are imported once.
"""
import json
from pathlib import Path

import pytest
import torch
from conftest import run_py
from safetensors import safe_open

ARCHS = ("llama", "qwen2", "mistral")
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
PROBE = "tests/dist/conversion_probe.py"


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                assert k not in out, f"{k} stored twice in {folder}"
                out[k] = sf.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def roundtrips(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("conversion")
    proc = run_py([PROBE, "roundtrip", str(work), str(tiny_model)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((work / "results.json").read_text())


CASES = ([f"{a}_tp{tp}pp{pp}" for a in ARCHS for tp, pp in LAYOUTS]
         + ["qwen3_tp2pp2", "qwen3_moe_tp1pp1ep2", "qwen3_moe_tp2pp1ep2", "qwen2_moe_tp2pp2"])


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bitwise_exact(roundtrips, case):
    """HF -> megatron dist checkpoint at (TP, PP, EP) -> HF gives the same tensor names and
    torch.equal tensors (Llama untied, Qwen2 tied + qkv bias, Mistral, Qwen3 QK norms with
    head_dim apart from hidden / heads, Qwen3-MoE with its experts over 2 and over 2 x TP 2
    ranks and a dense layer, Qwen2-MoE's shared expert and gate at TP=2 x PP=2; vocab 100
    padded)."""
    r = roundtrips[case]
    assert r["rc"] == [0, 0]
    before, after = hf_tensors(r["hf"]), hf_tensors(r["back"])
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        assert torch.equal(before[name], after[name]), name


def test_output_folders_are_complete(roundtrips):
    """The megatron folder records hf_config/ (config, generation config, tokenizer files incl.
    the auto_map'd tokenization_*.py) and megarl_conversion.json; the HF output is sharded by
    size with an index json naming every tensor, and carries config + tokenizer files."""
    r = roundtrips["qwen2_tp2pp2"]
    mdir, back = Path(r["megatron"]), Path(r["back"])
    side = {p.name for p in (mdir / "hf_config").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "tokenization_countdown.py"} <= side
    rec = json.loads((mdir / "megarl_conversion.json").read_text())
    assert (rec["tp"], rec["pp"], rec["architecture"]) == (2, 2, "Qwen2ForCausalLM")
    assert Path(rec["source"]) == Path(r["hf"]).resolve()
    assert rec["padded_vocab_size"] == 256 and rec["vocab_size"] == 100
    assert (mdir / "metadata.json").is_file() and list(mdir.glob("*.distcp"))
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in back.glob("*.safetensors")) == shards
    assert sorted(index["weight_map"]) == sorted(hf_tensors(back))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json",
            "tokenization_countdown.py"} <= {p.name for p in back.iterdir()}


def test_round_trip_output_loads_in_transformers(roundtrips):
    """transformers.AutoModelForCausalLM / AutoTokenizer load the converted-back folder and the
    model's weights are the original ones (tied lm_head included)."""
    transformers = pytest.importorskip("transformers")
    r = roundtrips["qwen2_tp1pp2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(r["back"], dtype=torch.float32)
    original = hf_tensors(r["hf"])
    state = model.state_dict()
    for name, t in original.items():
        assert torch.equal(state[name], t), name
    assert torch.equal(state["lm_head.weight"], original["model.embed_tokens.weight"])
    tok = transformers.AutoTokenizer.from_pretrained(r["back"], trust_remote_code=True)
    assert len(tok("<bos> n7 =")["input_ids"]) > 0


@pytest.mark.parametrize("arch,layout", [("qwen2", "tp2pp2"), ("llama", "tp1pp2"),
                                         ("mistral", "tp2pp1"), ("qwen3", "tp2pp2"),
                                         ("qwen3_moe", "tp2pp1ep2"), ("qwen2_moe", "tp2pp2")])
def test_megatron_forward_matches_transformers(roundtrips, tmp_path, arch, layout):
    """compare_logits: megarl's GPTModel forward of the converted checkpoint (resharded to
    TP=PP=1 on load) matches transformers' within 1e-4 max abs logit difference (fp32). The two
    forwards' reduction orders differ: 6.2e-6 apart at most (the tiny countdown model converted
    at TP=2; also with MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default), KL 3e-13; a wrong
    mapping moves the logits by more than 0.1 (test_wrong_gate_up_mapping_fails_comparison)."""
    r = roundtrips[f"{arch}_{layout}"]
    out = tmp_path / "cmp.json"
    proc = run_py(["tools/compare_logits.py", "--hf", r["hf"], "--megatron", r["megatron"],
                   "--prompts", "3", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stats = json.loads(out.read_text())
    assert stats["max_abs_diff"] < 1e-4 and stats["argmax_agreement"] == 1.0
    assert stats["kl_hf_megatron"] < 1e-8
    assert "argmax_agreement=1.0000" in proc.stdout and "OK" in proc.stdout


def test_wrong_gate_up_mapping_fails_comparison(roundtrips, tmp_path):
    """A deliberately wrong mapping (gate and up swapped in megarl.formats.ops while writing
    the checkpoint) makes compare_logits exit 1 with a large max abs diff."""
    r = roundtrips["llama_tp1pp1"]
    bad = tmp_path / "bad"
    proc = run_py([PROBE, "wrong_gate_up", r["hf"], str(bad)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "cmp.json"
    proc = run_py(["tools/compare_logits.py", "--hf", r["hf"], "--megatron", str(bad),
                   "--prompts", "2", "--json", str(out)])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FAIL: max abs logit difference" in proc.stderr
    assert "Traceback" not in proc.stderr
    stats = json.loads(out.read_text())
    assert stats["max_abs_diff"] > 0.1 and not stats["ok"]


def test_user_errors_exit_2_with_one_line(tmp_path):
    """Unknown / missing HF tensors, shape mismatches, TP not dividing the KV heads, a
    non-empty --out, a missing or mismatched megatron checkpoint: exit code 2 and a one-line
    message naming the problem, no traceback."""
    proc = run_py([PROBE, "errors", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads((tmp_path / "errors.json").read_text())
    expect = {
        "unknown_hf_param": "unknown HF parameter 'model.layers.0.mlp.extra_proj.weight'",
        "shape_mismatch": "from the config of LlamaForCausalLM",
        "missing_hf_param": "missing HF parameters",
        "tp_not_dividing_kv_heads": "must divide the model's 2 KV heads",
        "out_not_empty": "is not empty (pass --force",
        "megatron_dir_missing": "does not exist",
        "megatron_wrong_config": "does not match Qwen2ForCausalLM",
    }
    for case, text in expect.items():
        e = errors[case]
        assert e["rc"] == 2, (case, e)
        assert text in e["stderr"], (case, e["stderr"])
        assert "Traceback" not in e["stderr"], case
    assert "model.layers.2.mlp.up_proj.weight" in errors["missing_hf_param"]["stderr"]
    assert "96" in errors["shape_mismatch"]["stderr"]  # intermediate_size of the edited config


def test_missing_hf_folder_message(tmp_path):
    """The CLI itself: a nonexistent --hf folder is a one-line error and exit code 2."""
    proc = run_py(["tools/convert_hf_to_megatron.py", "--hf", str(tmp_path / "nope"),
                   "--out", str(tmp_path / "out")])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"convert_hf_to_megatron: error: HF checkpoint folder '{tmp_path / 'nope'}' does not exist")
    assert "Traceback" not in proc.stderr
