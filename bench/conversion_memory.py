#!/usr/bin/env python
"""Peak memory of the HF <-> megatron checkpoint converters on a model of a few hundred MB.

    .venv/bin/python bench/conversion_memory.py [--layers 8 16] [--dtype bfloat16] [--work DIR]

For each layer count:
1. writes a random Llama-architecture HF folder (hidden 1024, FFN 2816, 16 heads / 8 KV heads,
   vocab 32000, untied) as ~100 MB safetensors shards with an index json, one tensor at a time;
2. runs `tools/convert_hf_to_megatron.py --tp 1 --pp 1` and `tools/convert_megatron_to_hf.py`
   as subprocesses, sampling every 20 ms the peak RSS (VmHWM) and anonymous RSS of each
   process of the converter's process tree (its rank, megatron's checkpoint writers);
3. measures the idle RSS of a process that only imports what the converters import, so
   the reader can separate it from the conversion's own memory;
4. checks the round trip (every tensor torch.equal) and writes bench/out/conversion_memory.json.
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
PY = sys.executable
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def make_model(out: Path, layers: int, dtype: torch.dtype, shard_bytes: int = 100 << 20) -> int:
    """Random HF Llama folder written shard by shard; returns the weight bytes."""
    import transformers
    from safetensors.torch import save_file

    from megarl.formats.mapping import mapping_for
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                   tie_word_embeddings=False, max_position_embeddings=2048,
                                   architectures=["LlamaForCausalLM"])
    cfg.dtype = dtype
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    mapping = mapping_for(cfg)
    g = torch.Generator().manual_seed(0)
    pending, size, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal pending, size
        name = f"part-{len(files)}.safetensors"
        save_file(pending, str(out / name), metadata={"format": "pt"})
        files.append((name, list(pending)))
        pending, size = {}, 0

    for name in mapping.hf_names():
        shape = mapping.dims.hf_shape(name)
        t = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > shard_bytes:
            flush()
        pending[name], size, total = t, size + nbytes, total + nbytes
    flush()
    for k, (name, names) in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(out / name, out / final)
        weight_map.update({n: final for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def _proc_mem(pid: int) -> tuple[int, int, int]:
    """(VmHWM, VmRSS, RssAnon) in bytes from /proc/<pid>/status. VmHWM is the process's own
    peak RSS so far, so a spike between two samples is not missed."""
    vals = {"VmHWM:": 0, "VmRSS:": 0, "RssAnon:": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(None, 1)[0]
            if key in vals:
                vals[key] = int(line.split()[1]) << 10
    return vals["VmHWM:"], vals["VmRSS:"], vals["RssAnon:"]


def run_measured(args: list[str], interval: float = 0.02) -> dict:
    """Run a command; sample every process of its tree every `interval` s.

    rss_max_process: the largest peak RSS (VmHWM) of any one process of the tree;
    rss_anon_max_process: the largest sampled anonymous RSS (heap, tensors: the memory the
    process itself allocated, not the page cache of mapped files or shared libraries).
    (wait4's ru_maxrss is not used: Linux folds the forking parent's RSS into it at exec.)"""
    import psutil
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = {"rss_max_process": 0, "rss_anon_max_process": 0, "processes": 1}
    done = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                pids = [proc.pid] + [c.pid for c in root.children(recursive=True)]
            except psutil.Error:
                break
            for pid in pids:
                try:
                    hwm, rss, anon = _proc_mem(pid)
                except OSError:
                    continue
                peak["rss_max_process"] = max(peak["rss_max_process"], hwm, rss)
                peak["rss_anon_max_process"] = max(peak["rss_anon_max_process"], anon)
            peak["processes"] = max(peak["processes"], len(pids))
            time.sleep(interval)

    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_r = threading.Thread(target=lambda: peak.__setitem__("stdout", proc.stdout.read()))
    err_r = threading.Thread(target=lambda: peak.__setitem__("stderr", proc.stderr.read()))
    out_r.start(), err_r.start()
    proc.wait()
    done.set()
    sampler.join(), out_r.join(), err_r.join()
    peak["seconds"] = round(time.perf_counter() - t0, 2)
    peak["returncode"] = proc.returncode
    if proc.returncode != 0:
        raise SystemExit(f"{args} failed ({proc.returncode}):\n{peak['stderr'].decode()[-3000:]}")
    peak["stdout"] = (peak["stdout"].decode().strip().splitlines() or [""])[-1]
    del peak["stderr"]
    return peak


BASELINE_MEGATRON = ("import torch, transformers, safetensors, tqdm; "
                     "import megatron.core; from megatron.core import dist_checkpointing; "
                     "import megarl.models.builders, megarl.models.transformer_config, megarl.distributed.cpu; "
                     "import megarl.conversion.cli; import time; time.sleep(2)")
BASELINE_PLAIN = ("import torch, transformers, safetensors, tqdm; "
                  "import torch.distributed.checkpoint; import megarl.conversion.cli; "
                  "from transformers import AutoConfig; import time; time.sleep(2)")


def bench_one(work: Path, layers: int, dtype: str, base_mcore: dict, base_plain: dict) -> dict:
    """Build one model, convert it both ways, check the round trip; the measurements."""
    shutil.rmtree(work, ignore_errors=True)
    hf, mdir, back = work / "hf", work / "megatron", work / "hf_back"
    t0 = time.perf_counter()
    model_bytes = make_model(hf, layers, getattr(torch, dtype))
    shards = sorted(f.name for f in hf.glob("*.safetensors"))
    print(f"model ({layers} layers): {model_bytes / 2**20:.1f} MiB in {len(shards)} shards "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    to_mcore = run_measured([PY, "tools/convert_hf_to_megatron.py", "--hf", str(hf), "--out",
                             str(mdir), "--no-progress"])
    print("  HF -> megatron:", to_mcore["stdout"], flush=True)
    to_hf = run_measured([PY, "tools/convert_megatron_to_hf.py", "--megatron", str(mdir), "--out",
                          str(back), "--shard-mb", "100", "--no-progress"])
    print("  megatron -> HF:", to_hf["stdout"], flush=True)

    # the round trip must be exact, or the memory numbers mean nothing
    from safetensors import safe_open
    index_a = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    index_b = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index_a) == sorted(index_b)
    for name in index_a:
        with safe_open(str(hf / index_a[name]), "pt") as fa, safe_open(str(back / index_b[name]), "pt") as fb:
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name)), name
    shutil.rmtree(work, ignore_errors=True)

    def summary(d: dict, baseline: dict) -> dict:
        return {**d, "baseline_rss": baseline["rss_max_process"],
                "baseline_rss_anon": baseline["rss_anon_max_process"],
                "ratio_peak_rss_to_model": round(d["rss_max_process"] / model_bytes, 3),
                "ratio_peak_rss_minus_baseline_to_model":
                    round((d["rss_max_process"] - baseline["rss_max_process"]) / model_bytes, 3),
                "ratio_peak_anon_rss_to_model": round(d["rss_anon_max_process"] / model_bytes, 3),
                "ratio_peak_anon_rss_minus_baseline_to_model":
                    round((d["rss_anon_max_process"] - baseline["rss_anon_max_process"]) / model_bytes, 3)}

    return {
        "model": {"arch": "LlamaForCausalLM", "hidden": 1024, "ffn": 2816, "layers": layers,
                  "heads": 16, "kv_heads": 8, "vocab": 32000, "dtype": dtype,
                  "bytes": model_bytes, "hf_shards": len(shards),
                  "largest_tensor_bytes": 32000 * 1024 * torch.finfo(getattr(torch, dtype)).bits // 8},
        "hf_to_megatron": summary(to_mcore, base_mcore),
        "megatron_to_hf": summary(to_hf, base_plain),
        "round_trip_bitwise_exact": True,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16],
                   help="one model per layer count (memory should not grow with layers)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--work", default=str(ROOT / ".tmp" / "bench_conversion"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "conversion_memory.json"))
    a = p.parse_args()
    base_mcore = run_measured([PY, "-c", BASELINE_MEGATRON])
    base_plain = run_measured([PY, "-c", BASELINE_PLAIN])
    result = {
        "command": ".venv/bin/python bench/conversion_memory.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                   f"CPU ({platform.machine()}), torch {torch.__version__}",
        "baseline_idle_imports": {"with_megatron": base_mcore, "torch_transformers_only": base_plain},
        "runs": [bench_one(Path(a.work), n, a.dtype, base_mcore, base_plain) for n in a.layers],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    for run in result["runs"]:
        for k in ("hf_to_megatron", "megatron_to_hf"):
            r = run[k]
            print(f"{run['model']['layers']} layers, model {mib(run['model']['bytes'])}, {k}: "
                  f"peak RSS {mib(r['rss_max_process'])} (anon {mib(r['rss_anon_max_process'])}), "
                  f"idle-import baseline {mib(r['baseline_rss'])} (anon {mib(r['baseline_rss_anon'])}): "
                  f"peak/model {r['ratio_peak_rss_to_model']}, (peak-baseline)/model "
                  f"{r['ratio_peak_rss_minus_baseline_to_model']} "
                  f"(anon {r['ratio_peak_anon_rss_minus_baseline_to_model']}), {r['seconds']} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
