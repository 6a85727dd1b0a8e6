"""GPU routes of the collective weight transport (rollout/weights/wires.py), each skipped without a
CUDA build of vLLM (the device machine of tests/gpu/device_check.sh has no vLLM, so these run
on a real cluster node):
- nccl: vLLM's `nccl` backend on the engine side, megarl's NCCL wire on the sender; two GPUs
  (trainer on GPU 0, the engine on GPU 1).
- ipc: the trainer and an in-process engine on ONE GPU, as `rollout.engines.mode=inprocess`
  places them; weight_sync.backend=auto resolves to vLLM's `ipc` backend, the engine reads the
  trainer's packed buffers in place.

Contract: after one collective push of perturbed weights into an in-process AsyncLLM, every
engine tensor equals the trainer's (the engine's greedy continuation and logprobs follow the
new weights within bf16/fp32 tolerance), and the push time is reported against a plain
device-to-device copy of the same bytes."""
import json

import pytest
import torch
from conftest import run_py

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBE = r'''
import asyncio, json, sys, time, torch
from safetensors.torch import load_file

def main(model_dir, out):
    from megarl.config import load_config
    from megarl.config.schema import WeightSyncConfig
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import collective, packing, source
    from megarl.rollout.engines.engine import GenRequest
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", "rollout.engines.count=1"])
    torch.cuda.set_device(0)
    import os
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"      # the engine's core process takes GPU 1
    pool = open_pool(cfg.rollout, model_dir, 0, "/tmp/megarl-gpu-engines", "nccl")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    sd = {k: v.cuda() for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    new = {k: (v * 0.9).contiguous() for k, v in sd.items()}
    def sender_buckets(model, info, bucket_bytes, timers=None, buffers=None):   # source.sender_buckets's signature
        items = list(new.items())
        for k in range(0, len(items), 4):
            yield packing.pack(items[k:k + 4])
    source.sender_buckets = sender_buckets
    t = collective.CollectiveTransport(WeightSyncConfig(backend="nccl", bucket_mb=64), pool)
    t.push(None, None, 1)                         # forms the group
    t0 = time.perf_counter()
    stats = t.push(None, None, 2)
    push_s = time.perf_counter() - t0
    nbytes = sum(v.numel() * v.element_size() for v in new.values())
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize(); t1 = time.perf_counter()
    dst.copy_(src); torch.cuda.synchronize()
    copy_s = time.perf_counter() - t1
    res = pool.generate_many([GenRequest("g", [1, 20, 4], 8, temperature=1.0, seed=0)])[0]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    hf.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
    with torch.no_grad():
        ids = [1, 20, 4] + res.token_ids
        lp = torch.log_softmax(hf(torch.tensor([ids]).cuda()).logits[0].float(), -1)
    ref = [lp[2 + i, tok].item() for i, tok in enumerate(res.token_ids)]
    gap = max(abs(a - b) for a, b in zip(ref, res.logprobs))
    json.dump({"version": pool.version, "gap": gap, "push_s": push_s, "copy_s": copy_s,
               "bytes": nbytes, "sync": stats}, open(out, "w"))
    t.close(); pool.close()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_push_reaches_a_gpu_engine(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE)
    proc = run_py([str(script), str(tiny_model), str(out)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["version"] == 2 and r["sync"]["sync_bytes"] >= r["bytes"]
    assert r["gap"] < 1e-3, r
    print(f"nccl push {r['push_s']:.4f} s for {r['bytes']} bytes; device-to-device copy {r['copy_s']:.4f} s")


PROBE_IPC = r'''
import json, sys, time, torch
from safetensors.torch import load_file


def logprob_gap(model_dir, weights, res):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    hf.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    with torch.no_grad():
        ids = [1, 20, 4] + res.token_ids
        lp = torch.log_softmax(hf(torch.tensor([ids]).cuda()).logits[0].float(), -1)
    ref = [lp[2 + i, tok].item() for i, tok in enumerate(res.token_ids)]
    return max(abs(a - b) for a, b in zip(ref, res.logprobs))


def main(model_dir, out):
    from megarl.config import load_config
    from megarl.config.schema import WeightSyncConfig
    from megarl.rollout.engines.build import weight_backend
    from megarl.rollout.engines.engine import GenRequest
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import collective, packing, source
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", "rollout.engines.count=1",
                                                "rollout.engines.mode=inprocess"])
    torch.cuda.set_device(0)
    ws = WeightSyncConfig(bucket_mb=1)            # auto; several buckets, all held until the finish
    backend = weight_backend(ws, "inprocess")
    pool = open_pool(cfg.rollout, model_dir, 0, "/tmp/megarl-gpu-engines-ipc", backend)   # on GPU 0 too
    sd = {k: v.cuda() for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    old = {k: (v * 0.9).contiguous() for k, v in sd.items()}
    new = {k: (v * 0.8).contiguous() for k, v in sd.items()}
    state = {"weights": old}

    def sender_buckets(model, info, bucket_bytes, timers=None, buffers=None):
        items = list(state["weights"].items())
        for k in range(0, len(items), 4):
            named = items[k:k + 4]
            yield packing.pack(named, out=buffers.take(packing.layout(named).nbytes, "cuda:0"))
    source.sender_buckets = sender_buckets
    t = collective.CollectiveTransport(ws, pool, "inprocess")
    t.push(None, None, 1)                         # the old weights, into buffers the next push reuses
    state["weights"] = new
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stats = t.push(None, None, 2)
    push_s = time.perf_counter() - t0
    held_peak = torch.cuda.max_memory_allocated() - base
    nbytes = sum(v.numel() * v.element_size() for v in new.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize(); t1 = time.perf_counter()
    dst.copy_(src); torch.cuda.synchronize()
    copy_s = time.perf_counter() - t1
    res = pool.generate_many([GenRequest("g", [1, 20, 4], 8, temperature=1.0, seed=0)])[0]
    json.dump({"backend": backend, "wire": t.wire.name, "version": pool.version,
               "gap": logprob_gap(model_dir, new, res), "stale_gap": logprob_gap(model_dir, old, res),
               "held": len(t._held), "free_buffers": len(t.buffers._free), "push_s": push_s, "copy_s": copy_s,
               "bytes": nbytes, "held_peak_bytes": held_peak, "sync": stats}, open(out, "w"))
    t.close(); pool.close()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def test_ipc_push_reaches_an_engine_on_the_trainers_gpu(tiny_model, tmp_path):
    """Contract: with the trainer and an in-process engine on one GPU, backend auto is ipc;
    after two pushes (the second into the buffers the first gave back after its finish) the
    engine's logprobs follow the second push's weights, not the first's; every buffer is back
    in the pool. Reported: push time vs a device-to-device copy of the same bytes, and the
    extra GPU memory the push held (the model once more)."""
    pytest.importorskip("vllm")
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE_IPC)
    proc = run_py([str(script), str(tiny_model), str(out)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["backend"] == r["wire"] == "ipc" and r["version"] == 2
    assert r["sync"]["sync_bytes"] >= r["bytes"] and r["sync"]["sync_buckets"] > 1
    assert r["gap"] < 1e-3 and r["stale_gap"] > r["gap"], r
    assert r["held"] == 0 and 1 <= r["free_buffers"] <= 2
    print(f"ipc push {r['push_s']:.4f} s for {r['bytes']} bytes ({r['sync']['sync_buckets']} buckets, "
          f"{r['held_peak_bytes']} bytes held at the peak); device-to-device copy {r['copy_s']:.4f} s")
