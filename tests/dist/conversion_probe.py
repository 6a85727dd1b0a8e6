"""Subprocess body of tests/dist/test_conversion_tools.py (one process, so torch and megatron are
imported once; the multi-rank conversions fork their gloo ranks from it).

usage:
  conversion_probe.py roundtrip WORK TOKENIZER_DIR   tiny random Llama / Qwen2 / Mistral / Qwen3 HF
      models, each converted HF -> megatron at every (TP, PP) in LAYOUTS (ARCH_LAYOUTS) and back;
      writes WORK/results.json
  conversion_probe.py wrong_gate_up HF OUT           HF -> megatron at TP=2 with gate and up
      swapped in megarl.formats.ops (a deliberately wrong mapping)
  conversion_probe.py errors WORK                    the converters' error paths; WORK/errors.json
"""
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen2_moe")
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
# Qwen3 adds only rows of the replicated kind to Llama's table: its widest layout is enough;
# the MoE families at expert parallelism (tp, pp, ep), 4 ranks at most
ARCH_LAYOUTS = {"qwen3": ((2, 2),), "qwen3_moe": ((1, 1, 2), (2, 1, 2)), "qwen2_moe": ((2, 2),)}
QWEN3_HEAD_DIM = 32    # apart from hidden / heads = 16
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)


def make_hf_model(arch: str, out: Path, tokenizer_dir: Path | None, seed: int = 0) -> None:
    """A random tiny HF model with weights scaled so logits are O(1) (a wrong layout shows).

    Llama: untied, sharded with an index json; Qwen2: tied embeddings + qkv bias, sharded, with
    the countdown tokenizer (auto_map -> local tokenization_*.py); Mistral: one
    model.safetensors without an index; Qwen3: QK norms, head_dim apart from hidden / heads."""
    import transformers
    cfg = {"llama": lambda: transformers.LlamaConfig(tie_word_embeddings=False, **SIZES),
           "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=True, **SIZES),
           "mistral": lambda: transformers.MistralConfig(tie_word_embeddings=False, **SIZES),
           "qwen3": lambda: transformers.Qwen3Config(tie_word_embeddings=False,
                                                     head_dim=QWEN3_HEAD_DIM, **SIZES),
           "qwen3_moe": lambda: transformers.Qwen3MoeConfig(tie_word_embeddings=False, norm_topk_prob=True,
                                                            head_dim=QWEN3_HEAD_DIM, **SIZES, **MOE),
           "qwen2_moe": lambda: transformers.Qwen2MoeConfig(tie_word_embeddings=False,
                                                            shared_expert_intermediate_size=48,
                                                            **SIZES, **MOE)}[arch]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(out, max_shard_size="100KB" if arch != "mistral" else "100MB")
    if tokenizer_dir is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py"):
            shutil.copy(tokenizer_dir / f, out / f)


def roundtrip(work: Path, tokenizer_dir: Path) -> None:
    from megarl.conversion.cli import cli_hf_to_megatron, cli_megatron_to_hf
    results = {}
    for arch in ARCHS:
        hf = work / arch
        make_hf_model(arch, hf, tokenizer_dir if arch == "qwen2" else None)
        for tp, pp, *ep in ARCH_LAYOUTS.get(arch, LAYOUTS):
            ep = ep[0] if ep else 1
            name = f"{arch}_tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")
            mdir, back = work / name, work / f"{name}_hf"
            t0 = time.perf_counter()
            rc1 = cli_hf_to_megatron(["--hf", str(hf), "--out", str(mdir), "--tp", str(tp),
                                      "--pp", str(pp), "--ep", str(ep), "--no-progress"])
            t1 = time.perf_counter()
            rc2 = cli_megatron_to_hf(["--megatron", str(mdir), "--out", str(back),
                                      "--shard-mb", "0.1", "--no-progress"])
            results[name] = {
                "hf": str(hf), "megatron": str(mdir), "back": str(back), "rc": [rc1, rc2],
                "seconds": [round(t1 - t0, 2), round(time.perf_counter() - t1, 2)]}
            print(name, results[name]["seconds"], flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))


def wrong_gate_up(hf: str, out: str) -> int:
    from megarl.conversion.cli import cli_hf_to_megatron
    from megarl.formats import ops
    right = ops.fc1_shards_from_gate_up
    ops.fc1_shards_from_gate_up = lambda gate, up, tp: right(up, gate, tp)  # forked ranks inherit it
    return cli_hf_to_megatron(["--hf", hf, "--out", out, "--tp", "2", "--no-progress"])


def errors(work: Path) -> None:
    from megarl.conversion.cli import cli_hf_to_megatron, cli_megatron_to_hf

    good = work / "good"
    make_hf_model("llama", good, None)
    extra = work / "extra"
    make_hf_model("llama", extra, None)
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file, save_file
    last = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(extra / last)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, extra / last, metadata={"format": "pt"})
    index["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = last
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    shape = work / "shape"
    make_hf_model("llama", shape, None)
    cfg = json.loads((shape / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the weights still say 128
    (shape / "config.json").write_text(json.dumps(cfg))
    missing = work / "missing"
    make_hf_model("mistral", missing, None)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    qwen = work / "qwen2"
    make_hf_model("qwen2", qwen, None)
    mdir = work / "good_m"
    assert cli_hf_to_megatron(["--hf", str(good), "--out", str(mdir), "--no-progress"]) == 0

    cases = {
        "unknown_hf_param": (cli_hf_to_megatron, ["--hf", str(extra), "--out", str(work / "o1")]),
        "shape_mismatch": (cli_hf_to_megatron, ["--hf", str(shape), "--out", str(work / "o2")]),
        "missing_hf_param": (cli_hf_to_megatron, ["--hf", str(missing), "--out", str(work / "o3")]),
        "tp_not_dividing_kv_heads": (cli_hf_to_megatron,
                                     ["--hf", str(good), "--out", str(work / "o4"), "--tp", "4"]),
        "out_not_empty": (cli_hf_to_megatron, ["--hf", str(good), "--out", str(mdir)]),
        "megatron_dir_missing": (cli_megatron_to_hf, ["--megatron", str(work / "nope"),
                                                      "--out", str(work / "o5")]),
        "megatron_wrong_config": (cli_megatron_to_hf, ["--megatron", str(mdir), "--out",
                                                       str(work / "o6"), "--hf-config", str(qwen)]),
    }
    out = {}
    for name, (fn, argv) in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = fn(argv + ["--no-progress"])
        out[name] = {"rc": rc, "stderr": err.getvalue()}
    (work / "errors.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":  # megatron's dist_checkpointing needs the guarded entry point
    mode = sys.argv[1]
    if mode == "roundtrip":
        roundtrip(Path(sys.argv[2]), Path(sys.argv[3]))
    elif mode == "wrong_gate_up":
        sys.exit(wrong_gate_up(sys.argv[2], sys.argv[3]))
    elif mode == "errors":
        errors(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
