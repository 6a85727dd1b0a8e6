"""`megarl plan`: placement and memory per GPU (megarl/plan), its formulas on hand-computed
cases, the acceptance cases of the 70B recipe, and the errors for bad inputs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import load_config
from megarl.formats.mapping import padded_vocab_size
from megarl.models.arch import Arch, resolve_arch
from megarl.plan import make_plan
from megarl.plan import memory as mem
from megarl.plan.memory import GiB

ROOT = Path(__file__).resolve().parents[2]
R70 = "recipes/llama3.1_70b.yaml"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# -- formulas on a hand-computed case --------------------------------------------------------
SMALL = Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=16)


def test_layer_params_by_hand():
    # q: 4x4, k+v: 4x(2x1x2), o: 4x4 -> 48; SwiGLU 3 x 4 x 8 = 96; two norms 2 x 4 (replicated)
    assert mem.layer_params(SMALL) == 48 + 96 + 8
    assert mem.layer_params(SMALL, tp=2) == (48 + 96) / 2 + 8
    # 2 layers + embedding and LM head 16 x 4 each + final norm
    assert mem.total_params(SMALL) == 2 * 152 + 2 * 64 + 4


def test_stage_params_split_embedding_head_and_value_head():
    a, div = SMALL, 8   # vocab 16 padded to a multiple of 8 x tp
    first = mem.stage_params(a, 1, 2, 0, "actor", div)
    last = mem.stage_params(a, 1, 2, 1, "actor", div)
    assert first == 152 + 16 * 4                 # one layer + embedding
    assert last == 152 + 4 + 16 * 4              # one layer + final norm + LM head
    assert mem.stage_params(a, 1, 2, 1, "critic", div) == 152 + 4 + 4   # value head 1 x hidden
    assert mem.padded_vocab(17, 8, 2) == 32


def test_padded_vocab_matches_the_converter():
    for v, d, tp in [(152064, 128, 8), (128256, 128, 4), (128, 128, 1), (1000, 64, 3)]:
        assert mem.padded_vocab(v, d, tp) == padded_vocab_size(v, d, tp)


def test_bytes_per_param_mixed_precision_and_fp32():
    # bf16 weight + fp32 grad buffer + (fp32 main + Adam m, v) / DP: ZeRO's 16 plus 2 for fp32 grads
    assert mem.trainable_bytes_per_param("bfloat16", 1) == {"weights": 2, "grads": 4, "optimizer": 12}
    assert mem.trainable_bytes_per_param("bfloat16", 4) == {"weights": 2, "grads": 4, "optimizer": 3}
    assert mem.trainable_bytes_per_param("float32", 2) == {"weights": 4, "grads": 4, "optimizer": 4}


def test_activations_by_hand():
    # per token (x act_bytes x s x b): 4h replicated + (q + 2kv + h + 3f)/t = 16 + (4 + 4 + 4 + 24)/t
    assert mem.layer_activation_bytes(SMALL, seq=10, mbs=2, tp=1) == 2 * 10 * 2 * (16 + 36)
    assert mem.layer_activation_bytes(SMALL, seq=10, mbs=2, tp=2) == 2 * 10 * 2 * (16 + 18)
    assert mem.layer_activation_bytes(SMALL, 10, 2, 2, sequence_parallel=True) == 2 * 10 * 2 * (8 + 18)
    # recompute keeps each layer's input (2sbh) + one layer's full set; 1F1B: pp - stage in flight
    full = mem.layer_activation_bytes(SMALL, 10, 2, 1)
    kept = mem.stage_activation_bytes(SMALL, 10, 2, 1, 2, 0, microbatches=8, recompute="full")
    assert kept == 2 * 1 * (2 * 10 * 2 * 4) + full
    assert mem.stage_activation_bytes(SMALL, 10, 2, 1, 2, 0, microbatches=8) == 2 * 1 * full
    assert [mem.in_flight_microbatches(4, s, 128) for s in range(4)] == [4, 3, 2, 1]
    assert mem.in_flight_microbatches(4, 0, 2) == 2 and mem.in_flight_microbatches(1, 0, 64) == 1


def test_activations_reduce_to_korthikanti_for_mha_with_a_gelu_sized_mlp():
    """MHA (q = kv = h) and 3f = 8h (the GeLU MLP's 2 x 4h): Korthikanti's sbh(10 + 24/t) less
    the two dropout masks (sbh each), i.e. sbh(8 + 24/t) bytes at 2 bytes per value."""
    h, s, b = 12, 16, 3
    a = Arch(hidden=h, layers=1, heads=3, kv_heads=3, head_dim=4, ffn=8 * h // 3, vocab=8)
    for t in (1, 2, 4):
        assert mem.layer_activation_bytes(a, s, b, t) == pytest.approx(s * b * h * (8 + 24 / t))


def test_kv_cache_per_token():
    a = Arch(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)
    assert mem.kv_bytes_per_token(a, 1) == 2 * 80 * 8 * 128 * 2          # 320 KiB per token
    assert mem.kv_bytes_per_token(a, 8) == 2 * 80 * 1 * 128 * 2
    assert mem.kv_bytes_per_token(a, 16) == mem.kv_bytes_per_token(a, 8)  # replicated past kv_heads


def test_published_parameter_counts():
    """Parameter counts from the recipes' model facts equal the published ones."""
    counts = {"qwen2.5_7b": 7_615_616_512, "llama3.1_70b": 70_553_706_496}
    for name, n in counts.items():
        cfg = load_config(f"recipes/models/{name}.yaml")
        assert mem.total_params(resolve_arch(cfg)[0]) == n


# -- the acceptance cases ----------------------------------------------------------------------
def test_70b_fits_on_its_stated_cluster():
    r = cli(R70)
    assert r.returncode == 0, r.stderr
    assert "TP=8 PP=5 DP=1" in r.stdout and "6 x TP=4" in r.stdout and r.stdout.rstrip().endswith("fits")


def test_70b_on_half_the_nodes_says_why_not():
    r = cli(R70, "--nodes", "4")
    assert r.returncode == 2
    err = r.stderr
    assert "plan does not fit" in err and "trainer" in err
    assert "GiB" in err and "over" in err                 # by how much
    assert "trainer nodes" in err and "engine" in err     # what to change


def test_70b_memory_shortfall_names_reason_and_fixes():
    """At a layout that divides the GPUs but is too small (PP=4 on 4 trainer nodes, the
    brief's first guess), the message names the phase, the GiB short and fixes that fit."""
    cfg = load_config(R70, ["cluster.trainer_nodes=4", "cluster.engine_nodes=4", "parallel.pp=4"])
    p = make_plan(cfg)
    assert not p["fits"]
    (prob,) = [x for x in p["problems"] if x["role"] == "trainer"]
    assert prob["short_gib"] > 0 and "critic update" in prob["what"]
    assert "(fits)" in prob["fix"] and "dp=2" in prob["fix"]


def test_json_shape():
    r = cli(R70, "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] is True and p["problems"] == []
    for role in ("actor", "critic", "reference", "activations", "engine_weights", "kv_cache"):
        assert p["per_gpu_bytes"][role] > 0, role
    assert p["placement"]["trainer"] == {"nodes": 5, "gpus": 40, "tp": 8, "pp": 5, "dp": 1}
    assert p["placement"]["engines"]["count"] == 6 and p["placement"]["engines"]["tp"] == 4
    assert p["trainer"]["peak_bytes"] <= p["trainer"]["usable_bytes"] == 76 * GiB
    assert p["model"]["params"] == 70_553_706_496


def test_json_not_fitting_still_prints_json_and_exits_2():
    r = cli(R70, "--json", "--nodes", "4")
    assert r.returncode == 2
    p = json.loads(r.stdout)
    assert p["fits"] is False and p["problems"]


def test_engine_kv_shortfall_names_concurrency():
    cfg = load_config(R70, ["rollout.partial.concurrency=4096"])
    p = make_plan(cfg)
    (prob,) = p["problems"]
    assert prob["role"] == "engines" and "rollout.partial.concurrency <=" in prob["fix"] and prob["short_gib"] > 0


# -- weight transfer buffers (weight_sync.transport=collective) -------------------------------------
R7 = "recipes/qwen2.5_7b.yaml"


def test_transfer_buffers_by_hand():
    """num_buffers x (bucket + the largest tensor): a buffer is closed only after the tensor
    that takes it past bucket_mb. SMALL's largest tensor is the embedding, 16 x 4."""
    assert mem.largest_hf_tensor(SMALL) == 16 * 4
    assert mem.transfer_buffer_bytes(SMALL, bucket_mb=1, num_buffers=2, w_bytes=2) == 2 * (2**20 + 64 * 2)
    a = Arch(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)
    assert mem.largest_hf_tensor(a) == 128256 * 8192          # Llama-3.1-70B: the embedding, 1.96 GiB in bf16


@pytest.mark.parametrize("num_buffers,bucket_mb", [(2, 512), (3, 1024), (1, 64)])
def test_collective_buffers_grow_the_estimate_by_exactly_their_size(num_buffers, bucket_mb):
    """On the sending trainer GPU (global rank 0, PP stage 0: the worst stage here) and on every
    engine GPU; nothing with transport=files, which stages the model on disk instead."""
    sync = [f"weight_sync.num_buffers={num_buffers}", f"weight_sync.bucket_mb={bucket_mb}"]
    # files reads bucket_mb only (num_buffers would be refused as unused there)
    files = make_plan(load_config(R7, [f"weight_sync.bucket_mb={bucket_mb}", "weight_sync.transport=files"]))
    coll = make_plan(load_config(R7, sync + ["weight_sync.transport=collective"]))
    arch = resolve_arch(load_config(R7))[0]
    size = num_buffers * (bucket_mb * 2**20 + mem.largest_hf_tensor(arch) * 2)   # bf16
    assert coll["trainer"]["peak_bytes"] - files["trainer"]["peak_bytes"] == size
    assert all(coll["trainer"]["phases"][k] - files["trainer"]["phases"][k] == size for k in files["trainer"]["phases"])
    assert coll["per_gpu_bytes"]["weight_transfer"] == coll["per_gpu_bytes"]["engine_weight_transfer"] == size
    assert files["per_gpu_bytes"]["weight_transfer"] == files["per_gpu_bytes"]["engine_weight_transfer"] == 0
    # the engine's share of the GPU is unchanged: the buffers come at each sync, after vLLM has
    # filled its share with the KV cache, so they are checked against what is left outside it
    assert coll["engine"]["need_bytes"] == files["engine"]["need_bytes"]
    assert coll["engine"]["transfer_bytes"] == size
    assert any("staging_dir" in n and "shared file system" in n for n in files["notes"])
    assert not any("staging_dir" in n for n in coll["notes"])


def test_only_global_rank_0_holds_the_trainer_side_buffers():
    """PP=2 with micro-batches of 8: the last stage (logits) is the worst and holds no buffers;
    stage 0, where global rank 0 sends from, is reported with them."""
    over = ["parallel.pp=2", "train.max_tokens_per_micro_batch=0", "train.micro_batch_size=8"]
    coll = make_plan(load_config(R7, over))["trainer"]
    files = make_plan(load_config(R7, over + ["weight_sync.transport=files"]))["trainer"]
    assert coll["stage"] == files["stage"] == 1 and coll["roles"]["weight_transfer"] == 0
    assert coll["peak_bytes"] == files["peak_bytes"]
    assert coll["sender_peak_bytes"] - files["sender_peak_bytes"] == coll["sender_bytes"] > 0


def test_gloo_buffers_are_host_memory():
    p = make_plan(load_config(R7, ["weight_sync.backend=gloo"]))
    assert p["per_gpu_bytes"]["weight_transfer"] == p["per_gpu_bytes"]["engine_weight_transfer"] == 0
    assert any("backend=gloo" in n and "host memory" in n for n in p["notes"])


def test_trainer_that_fits_only_without_buffers_exits_2_naming_the_setting(capsys):
    """7B: 63.9 GiB per trainer GPU without buffers, + 2 x (6 GiB + 1.02 GiB) with them > 76 usable.
    The engines have room (their share lowered to 0.6), so the trainer is the one problem."""
    over = ["weight_sync.bucket_mb=6144", "rollout.engines.gpu_memory_utilization=0.6"]
    assert main(["plan", R7, *over, "weight_sync.transport=files"]) == 0
    capsys.readouterr()
    assert main(["plan", R7, *over]) == 2
    err = capsys.readouterr().err
    assert "trainer:" in err and "engines:" not in err
    assert "weight transfer buffers on global rank 0" in err and "weight_sync.bucket_mb=6144" in err
    assert "weight_sync.bucket_mb=128 -> " in err and "weight_sync.num_buffers=1" in err


def test_engine_without_room_for_buffers_exits_2_naming_the_setting(capsys):
    """vLLM's share is 0.85 x 80 GiB: 80 - 68 - 4 (reserve) = 8 GiB remain for 2 x (4 + 1.02) GiB."""
    assert main(["plan", R7, "weight_sync.bucket_mb=4096"]) == 2
    err = capsys.readouterr().err
    assert "trainer:" not in err and "engines:" in err and "outside vLLM's share" in err
    # (80 - 4 - 10.03) / 80 = 0.8246: the share that leaves them room, rounded down
    assert "weight_sync.bucket_mb=4096" in err and "rollout.engines.gpu_memory_utilization <= 0.82" in err
    assert main(["plan", R7, "weight_sync.bucket_mb=4096", "rollout.engines.gpu_memory_utilization=0.82"]) == 0


# -- bad inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,match", [
    (["--nodes", "-1"], r"--nodes=-1: must be >= 1"),
    (["--gpus-per-node", "-8"], r"--gpus-per-node=-8: must be >= 0"),
    (["cluster.nodes=-2"], r"cluster\.nodes=-2: must be >= 1"),
    (["--gpu-mem-gb", "0"], r"--gpu-mem-gb=0.0: must be > 0"),
    (["parallel.tp=3"], r"parallel\.tp=3 must divide the model's 64 heads and 8 KV heads"),
    (["parallel.pp=3"], r"parallel\.pp=3 must divide the model's 80 layers"),
    (["rollout.engines.tp=16"], r"rollout\.engines\.tp=16 > cluster\.gpus_per_node=8"),
    (["train.micro_batch_size=3"], r"train\.micro_batch_size=3"),
    (["cluster.trainer_nodes=6"], r"cluster\.trainer_nodes \+ engine_nodes=9: must be <= cluster\.nodes=8"),
])
def test_bad_inputs_are_config_errors(args, match, capsys):
    assert main(["plan", R70, *args]) == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def test_world_not_divisible_is_named(capsys):
    """TP x PP that does not divide the trainer's GPUs: named, with the node count that works."""
    assert main(["plan", "recipes/qwen2.5_7b.yaml", "parallel.pp=7"]) == 2
    err = capsys.readouterr().err
    assert "TP x PP = 14 GPUs" in err and "does not divide the trainer's 8" in err
    assert "multiple of 7 trainer nodes" in err


def test_cpu_recipe_prints_the_config_as_before(capsys):
    assert main(["plan", "recipes/tiny_cpu.yaml"]) == 0
    assert "run:" in capsys.readouterr().out


def test_tiny_model_on_one_gpu_reads_config_json(tiny_model, capsys):
    assert main(["plan", "recipes/tiny_cpu.yaml", "--gpus-per-node", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fits"] and p["model"]["source"].endswith("config.json")
