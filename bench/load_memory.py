#!/usr/bin/env python
"""Peak host memory of one trainer rank loading the actor from an HF checkpoint, at TP=2.

    .venv/bin/python bench/load_memory.py [--tp 2] [--pp 1] [--work DIR] [--out FILE]

For two synthetic Llama-architecture HF folders (~26M and ~81M parameters, fp32, ~40 MB
safetensors shards + index json, written locally: nothing is downloaded):
1. (the folders are written by a child process) forks TP x PP gloo ranks; each builds its GPTModel
   shard (no init) and loads it either
   `sliced` (megarl.models.loading.load_hf_shard: only this rank's slices of its stage's
   tensors) or `full` (what the trainer did before: every HF tensor read, every rank's shards
   split, this rank's copied);
2. each rank resets its peak-RSS counter (/proc/self/clear_refs) right before the build, and
   reports the peak RSS (VmHWM, includes the mapped safetensors pages it touched) and the peak
   anonymous RSS (sampled every 2 ms: memory it allocated, not page cache) above its RSS at
   that point, next to its shard's bytes and the full model's bytes;
3. writes bench/out/load_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODELS = {  # name: (hidden, ffn, layers, heads, vocab)
    "small": (384, 1024, 8, 6, 16000),
    "large": (768, 2048, 8, 12, 16000),
}


def make_model(out: Path, hidden: int, ffn: int, layers: int, heads: int, vocab: int,
               shard_bytes: int = 40 << 20) -> int:
    """Random HF Llama folder (untied), safetensors shards of ~shard_bytes + index; the bytes."""
    import transformers
    from safetensors.torch import save_file

    from megarl.formats.mapping import mapping_for
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=heads,
                                   vocab_size=vocab, tie_word_embeddings=False,
                                   max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    cfg.dtype = torch.float32
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(0)
    pending, size, weight_map, total, k = {}, 0, {}, 0, 0

    def flush():
        nonlocal pending, size, k
        name = f"model-{k:05d}.safetensors"
        save_file(pending, str(out / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in pending})
        pending, size, k = {}, 0, k + 1

    mapping = mapping_for(cfg)
    for name in mapping.hf_names():
        t = torch.randn(mapping.dims.hf_shape(name), generator=g) * 0.02
        if pending and size + t.numel() * 4 > shard_bytes:
            flush()
        pending[name], size, total = t, size + t.numel() * 4, total + t.numel() * 4
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def _status() -> dict:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(None, 1)[0].rstrip(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                vals[key] = int(line.split()[1]) << 10
    return vals


def _load_full(model, info, hf_dir: str) -> None:
    """The former trainer path (kept here as the baseline): every tensor of every file read,
    every rank's shards split by the mapping, this rank's copied in."""
    from safetensors import safe_open

    from megarl.distributed import parallel
    from megarl.formats.mapping import mapping_for
    state = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                state[k] = sf.get_tensor(k)
    shards = mapping_for(info.hf_config).hf_to_megatron(
        state, tp=parallel.tp_size(), pp=parallel.pp_size(),
        num_layers=info.hf_config.num_hidden_layers, padded_vocab=info.padded_vocab)
    local = shards[parallel.pp_rank()][parallel.tp_rank()]
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.endswith("_extra_state"):
                t.copy_(local[name])


def _rank(rank: int, world: int, port: int, threads: int, hf_dir: str, tp: int, pp: int,
          mode: str, out_dir: str) -> None:
    from megarl.conversion.launch import init_world
    init_world(rank, world, port, threads)
    import torch.distributed as dist

    from megarl.distributed import parallel
    from megarl.formats.hf_reader import HFCheckpoint, load_hf_config
    from megarl.models.builders import build_model
    from megarl.models.loading import load_hf_shard
    from megarl.models.transformer_config import transformer_config

    parallel.initialize(tp, pp, seed=0)
    hf_config = load_hf_config(hf_dir)
    cfg = transformer_config(hf_config, tp, pp, torch.float32, on_gpu=False)
    cfg.perform_initialization = False
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak below is this load's
    base = _status()
    anon_peak, done = [base["RssAnon"]], threading.Event()

    def sample():
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], _status()["RssAnon"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model, info = build_model(hf_config, cfg, 128, "actor")
    if mode == "sliced":
        load_hf_shard(model, info, HFCheckpoint(hf_dir), "actor")
    else:
        _load_full(model, info, hf_dir)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    end = _status()
    shard = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                if isinstance(t, torch.Tensor) and not n.endswith("_extra_state"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "tp_rank": parallel.tp_rank(), "pp_rank": parallel.pp_rank(),
        "shard_bytes": shard, "rss_before": base["VmRSS"], "anon_before": base["RssAnon"],
        "peak_rss": end["VmHWM"], "peak_anon": max(anon_peak[0], end["RssAnon"]),
        "rss_after": end["VmRSS"], "anon_after": end["RssAnon"], "seconds": round(seconds, 2)}))
    dist.barrier()
    parallel.destroy()
    dist.destroy_process_group()


def bench_one(hf_dir: Path, model_bytes: int, tp: int, pp: int, mode: str, work: Path) -> dict:
    from megarl.conversion.launch import launch
    out = work / f"ranks_{mode}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch(_rank, tp * pp, 1, (str(hf_dir), tp, pp, mode, str(out)), "load_memory")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp * pp)]
    for r in ranks:
        r["load_rss"] = r["peak_rss"] - r["rss_before"]     # this load's peak RSS above the start
        r["load_anon"] = r["peak_anon"] - r["anon_before"]  # ... of memory it allocated
        r["ratio_load_rss_to_shard"] = round(r["load_rss"] / r["shard_bytes"], 3)
        r["ratio_load_anon_to_shard"] = round(r["load_anon"] / r["shard_bytes"], 3)
        r["ratio_load_rss_to_model"] = round(r["load_rss"] / model_bytes, 3)
        r["ratio_load_anon_to_model"] = round(r["load_anon"] / model_bytes, 3)
    return {"mode": mode, "ranks": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--work", default=str(ROOT / ".tmp" / "bench_load_memory"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "load_memory.json"))
    p.add_argument("--make", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.make:
        make_model(Path(a.make[1]), *MODELS[a.make[0]])
        return
    import megatron.core  # noqa: F401 - imported once here, inherited by the forked ranks

    import megarl.models.builders  # noqa: F401
    work = Path(a.work)
    runs = []
    for name in a.models:
        hidden, ffn, layers, heads, vocab = MODELS[name]
        shutil.rmtree(work, ignore_errors=True)
        hf = work / "hf"
        # written by a child process: tensors this process freed would stay in its heap, and
        # the forked ranks would reuse those resident pages, hiding part of their load
        subprocess.run([sys.executable, __file__, "--make", name, str(hf)], check=True)
        model_bytes = json.loads((hf / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        run = {"model": {"name": name, "arch": "LlamaForCausalLM", "hidden": hidden, "ffn": ffn,
                         "layers": layers, "heads": heads, "vocab": vocab, "dtype": "float32",
                         "params": model_bytes // 4, "bytes": model_bytes,
                         "hf_files": len(list(hf.glob("*.safetensors")))},
               "tp": a.tp, "pp": a.pp,
               "loads": [bench_one(hf, model_bytes, a.tp, a.pp, m, work) for m in ("sliced", "full")]}
        runs.append(run)
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        for load in run["loads"]:
            for r in load["ranks"]:
                print(f"{name} ({run['model']['params'] / 1e6:.0f}M params, {mib(model_bytes)}) "
                      f"{load['mode']:6s} rank {r['rank']}: shard {mib(r['shard_bytes'])}, load peak RSS "
                      f"+{mib(r['load_rss'])} (x{r['ratio_load_rss_to_shard']} shard, "
                      f"x{r['ratio_load_rss_to_model']} model), anon +{mib(r['load_anon'])} "
                      f"(x{r['ratio_load_anon_to_shard']} shard, x{r['ratio_load_anon_to_model']} "
                      f"model), {r['seconds']} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": ".venv/bin/python bench/load_memory.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                   f"CPU ({platform.machine()}), torch {torch.__version__}",
        "runs": runs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
