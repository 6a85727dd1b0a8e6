#!/usr/bin/env python
"""Trainer -> engine weight sync (megarl.rollout.weight_sync.push) against a plain memory copy.

    .venv/bin/python bench/weight_sync.py [--quick] [--sizes small medium large]
        [--bucket-mb 64 256 1024] [--layouts 1x1 tp2 pp2] [--engines 1 2]
        [--bandwidth-gbps 400] [--out bench/out/weight_sync.json]

1. builds random Qwen2-architecture HF folders (vocab 16000/32000, untied, fp32) locally, one
   tensor at a time, with the countdown tokenizer (no downloads; reused when already there):
   small 108 MiB (28M parameters), medium 380 MiB (100M), large 1.04 GiB (278M);
2. per size, runs bench/weight_sync_probe.py under torchrun on gloo in one 2-rank world (1 rank
   when only 1x1 is asked for): rank 0 starts ONE pool of in-process vLLM engines
   (rollout.engine_mode=inprocess) and keeps it for the layouts 1x1 (rank 0 alone, rank 1
   parked in a barrier), TP=2 and PP=2; it pushes into the pool's first 1 and 2 engines at
   every bucket size, and right before each push times tensor.copy_ of the same number of
   bytes in the same process (memcpy_s), so efficiency = memcpy_s / sync_s;
3. writes the rows (model_bytes, bucket_mb, layout, engines, sync_s, memcpy_s, efficiency and
   the split gather_s / convert_s / stage_s / load_s / other_s) to --out, prints a table, and
   projects the sync time of a 7B and a 70B model (bf16 bytes) from the measured per-byte
   costs (least-squares fit of time = fixed + per_byte * bytes over the sizes), beside the
   floor bytes / --bandwidth-gbps and the floor of staging through the shared-memory folder
   (one raw write per byte and one raw read per byte and engine, at this machine's rates).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable

SIZES = {  # Qwen2 shapes; layers divisible by PP=2, KV heads by TP=2
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=16000),
    "medium": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=4, vocab_size=32000),
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=18, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000),
}
LAYOUT_RANKS = {"1x1": 1, "tp2": 2, "pp2": 2}
PROJECT = {"7B": 7e9, "70B": 70e9}  # parameters, pushed as bf16 (2 bytes each)


def make_model(out: Path, shape: dict, shard_bytes: int = 512 << 20) -> int:
    """Random fp32 Qwen2 HF folder (config, safetensors shards + index, countdown tokenizer);
    reused when complete. Returns the weight bytes."""
    import transformers
    from safetensors.torch import save_file

    from megarl.conversion.mapping import mapping_for
    from megarl.data import countdown as cd
    done = out / "bench_done.json"
    if done.exists() and json.loads(done.read_text()).get("shape") == shape:
        return json.loads(done.read_text())["bytes"]
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    cfg = transformers.Qwen2Config(**shape, tie_word_embeddings=False, max_position_embeddings=2048,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False,
                                   bos_token_id=cd.BOS_ID, eos_token_id=cd.EOS_ID, pad_token_id=cd.PAD_ID,
                                   architectures=["Qwen2ForCausalLM"])
    cfg.dtype = torch.float32
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    cd.build_tokenizer(str(out))
    mapping = mapping_for(cfg)
    g = torch.Generator().manual_seed(0)
    pending, size, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal pending, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(pending, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({n: name for n in pending})
        pending, size = {}, 0

    for name in mapping.hf_names():
        shape_ = mapping.dims.hf_shape(name)
        t = torch.randn(shape_, generator=g) * 0.02
        if name.endswith("norm.weight"):
            t = torch.ones(shape_)
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > shard_bytes:
            flush()
        pending[name], size, total = t, size + nbytes, total + nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    done.write_text(json.dumps({"shape": shape, "bytes": total}))
    return total


def run_probe(spec: dict, nproc: int, work: Path, tag: str) -> dict:
    spec_path = work / f"spec_{tag}.json"
    spec["out"] = str(work / f"probe_{tag}.json")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    args = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "bench/weight_sync_probe.py"), str(spec_path)]
    t = time.perf_counter()
    log = work / f"probe_{tag}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if line.startswith("[probe]") or "[probe]" in line[:40]:
                print("   ", line.rstrip().split("[probe] ", 1)[-1], flush=True)
        proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"probe {tag} failed ({proc.returncode}); see {log}:\n"
                         + "".join(log.read_text().splitlines(True)[-40:]))
    result = json.loads(Path(spec["out"]).read_text())
    result["launch_s"] = time.perf_counter() - t
    return result


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b only through the origin when there is a single x)."""
    if len(set(xs)) < 2:
        return 0.0, sum(ys) / sum(xs)
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def human(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def median_memcpy(rows: list[dict]) -> dict:
    """Per size: the median memcpy_s of its rows (one 0.2 s copy can be hit by a scheduling
    spike on a busy machine, which would inflate that row's efficiency)."""
    out = {}
    for size in {r["size"] for r in rows}:
        v = sorted(r["memcpy_s"] for r in rows if r["size"] == size)
        out[size] = v[len(v) // 2]
    return out


def table(rows: list[dict]) -> str:
    med = median_memcpy(rows)
    head = ("| size | model | layout | engines | bucket MB | sync s | memcpy s | efficiency | eff. (median memcpy) "
            "| gather s | convert s | stage s | load s | other s | GB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['size']} | {human(r['model_bytes'])} | {r['layout']} | {r['engines']} | "
                     f"{r['bucket_mb']} | {r['sync_s']:.2f} | {r['memcpy_s']:.3f} | {r['efficiency']:.3f} | "
                     f"{med[r['size']] / r['sync_s']:.3f} | "
                     f"{r['gather_s']:.2f} | {r['convert_s']:.2f} | {r['stage_s']:.2f} | {r['load_s']:.2f} | "
                     f"{r['other_s']:.2f} | {r['model_bytes'] / r['sync_s'] / 1e9:.2f} |")
    return "\n".join(lines)


def projection(rows: list[dict], anatomy: dict, bandwidth_gbps: float) -> tuple[str, list[dict]]:
    """Per (layout, engines): fit time = fixed + per_byte * bytes over the sizes, using each
    size's best bucket size; project 7B / 70B bf16 bytes beside the floors."""
    out, lines = [], []
    link = bandwidth_gbps * 1e9 / 8  # bytes/s
    shm_w = shm_r = None
    if anatomy:
        biggest = max(anatomy.values(), key=lambda a: a["anatomy_bytes"])
        shm_w = biggest["shm_write_s"] / biggest["anatomy_bytes"]
        shm_r = biggest["shm_read_s"] / biggest["anatomy_bytes"]
    memcpy_pb = [r["memcpy_s"] / r["model_bytes"] for r in rows]
    memcpy_pb = sorted(memcpy_pb)[len(memcpy_pb) // 2]
    head = (f"| layout | engines | fixed s | s/GB (sync) | s/GB: gather / convert / stage / load | "
            + " | ".join(f"{m} sync s | {m} floor {bandwidth_gbps:g} Gb/s s | {m} shm floor s | {m} memcpy s"
                         for m in PROJECT) + " |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for key in sorted({(r["layout"], r["engines"]) for r in rows}):
        best = {}
        for r in rows:
            if (r["layout"], r["engines"]) == key:
                cur = best.get(r["size"])
                if cur is None or r["sync_s"] < cur["sync_s"]:
                    best[r["size"]] = r
        pts = list(best.values())
        xs = [p["model_bytes"] for p in pts]
        a, b = fit(xs, [p["sync_s"] for p in pts])
        phases = {ph: fit(xs, [p[f"{ph}_s"] for p in pts])[1] for ph in ("gather", "convert", "stage", "load")}
        entry = {"layout": key[0], "engines": key[1], "fixed_s": a, "s_per_byte": b,
                 "phase_s_per_byte": phases, "bucket_mb_by_size": {s: p["bucket_mb"] for s, p in best.items()}}
        cells = []
        # staging floor: the trainer writes each byte once, every engine reads it once
        shm_pb = shm_w + key[1] * shm_r if shm_w is not None else None
        for m, params in PROJECT.items():
            nbytes = params * 2
            sync = a + b * nbytes
            entry[m] = {"bytes": nbytes, "sync_s": sync, "link_floor_s": nbytes / link,
                        "shm_floor_s": nbytes * shm_pb if shm_pb else None, "memcpy_s": nbytes * memcpy_pb}
            cells.append(f"{sync:.0f} | {nbytes / link:.2f} | "
                         + (f"{nbytes * shm_pb:.1f}" if shm_pb else "-") + f" | {nbytes * memcpy_pb:.1f}")
        out.append(entry)
        lines.append(f"| {key[0]} | {key[1]} | {a:.2f} | {b * 1e9:.2f} | "
                     + " / ".join(f"{phases[p] * 1e9:.2f}" for p in ("gather", "convert", "stage", "load"))
                     + " | " + " | ".join(cells) + " |")
    return "\n".join(lines), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small + medium only, bucket 256 MB, one repeat (a few minutes)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=None)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUT_RANKS), default=["1x1", "tp2", "pp2"])
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--bandwidth-gbps", type=float, default=400.0,
                   help="interconnect for the projection's floor, Gb/s (400: one NCCL-class NIC / link)")
    p.add_argument("--staging", default="/dev/shm", help="weight_sync.staging_dir (engines read it)")
    p.add_argument("--work", default=str(ROOT / "bench/out/weight_sync"), help="models, specs, logs")
    p.add_argument("--out", default=str(ROOT / "bench/out/weight_sync.json"))
    p.add_argument("--report", metavar="JSON", help="only print the tables of an earlier --out file")
    a = p.parse_args()
    if a.report:
        d = json.loads(Path(a.report).read_text())
        a.bandwidth_gbps = d["bandwidth_gbps"] if a.bandwidth_gbps == 400.0 else a.bandwidth_gbps
        report(d["rows"], d["anatomy"], a, d["runtime_s"], a.report)
        return
    sizes = a.sizes or (["small", "medium"] if a.quick else list(SIZES))
    buckets = a.bucket_mb or ([256] if a.quick else [64, 256, 1024])
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rows, anatomy, launches = [], {}, []
    torch.set_num_threads(1)
    for size in sizes:
        t = time.perf_counter()
        model_dir = work / f"model_{size}"
        nbytes = make_model(model_dir, SIZES[size])
        nparams = nbytes // 4
        print(f"{size}: {nparams / 1e6:.0f}M params, {human(nbytes)} fp32 ({time.perf_counter() - t:.1f} s)",
              flush=True)
        # one world per size: its pool of engines serves every layout (an engine start costs
        # far more than the whole sweep of pushes at the small sizes)
        nproc = max(LAYOUT_RANKS[l] for l in a.layouts)
        spec = {"model_dir": str(model_dir), "model_bytes": nbytes, "layouts": a.layouts,
                "engines": a.engines, "bucket_mb": buckets, "repeats": a.repeats,
                "staging": a.staging, "logs": str(work / "logs"), "anatomy": True}
        res = run_probe(spec, nproc, work, size)
        launches.append({"size": size, "ranks": nproc, "layouts": a.layouts, "launch_s": res["launch_s"],
                         "pool_start_s": res.get("pool_start_s")})
        for r in res["rows"]:
            rows.append({"size": size, "params": nparams, **r})
        if "anatomy" in res:
            anatomy[size] = res["anatomy"]
        print(f"  {size}: world of {nproc} rank(s), {res['launch_s']:.0f} s (pool start "
              f"{res.get('pool_start_s', 0):.0f} s)", flush=True)
    runtime = time.perf_counter() - t_all
    _, proj = projection(rows, anatomy, a.bandwidth_gbps)
    result = {"rows": rows, "anatomy": anatomy, "projection": proj, "launches": launches,
              "bandwidth_gbps": a.bandwidth_gbps, "runtime_s": runtime, "argv": sys.argv[1:],
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    report(rows, anatomy, a, runtime, a.out)


def report(rows: list[dict], anatomy: dict, a, runtime: float, where: str) -> None:
    proj_text, _ = projection(rows, anatomy, a.bandwidth_gbps)
    print()
    print(table(rows))
    if anatomy:
        print("\nanatomy of the CPU route (1x1, rank 0, same bytes; GB/s = model bytes / time):")
        print("| size | memcpy | raw shm write | raw shm read | gather+convert (no write) | safetensors save | "
              "safetensors read + copy into params |")
        print("|---|---|---|---|---|---|---|")
        for size, an in anatomy.items():
            nb = an["anatomy_bytes"]
            mc = [r["memcpy_s"] for r in rows if r["size"] == size]
            mc = sorted(mc)[len(mc) // 2]
            cells = [mc, an["shm_write_s"], an["shm_read_s"], an["convert_only_s"], an["st_save_s"], an["st_read_copy_s"]]
            print(f"| {size} ({human(nb)}) | " + " | ".join(f"{c:.3f} s ({nb / c / 1e9:.1f})" for c in cells) + " |")
    big = max(r["model_bytes"] for r in rows)
    med = median_memcpy(rows)
    print(f"\nbest efficiency at the largest size ({human(big)}; against the size's median memcpy):")
    for key in sorted({(r["layout"], r["engines"]) for r in rows}):
        cand = [r for r in rows if r["model_bytes"] == big and (r["layout"], r["engines"]) == key]
        if cand:
            r = min(cand, key=lambda r: r["sync_s"])
            print(f"  {key[0]:4s} engines={key[1]}: {med[r['size']] / r['sync_s']:.3f} (bucket {r['bucket_mb']} MB, sync "
                  f"{r['sync_s']:.2f} s = gather {r['gather_s']:.2f} + convert {r['convert_s']:.2f} + stage "
                  f"{r['stage_s']:.2f} + load {r['load_s']:.2f} + other {r['other_s']:.2f}; memcpy {med[r['size']]:.3f} s)")
    if anatomy:
        an = max(anatomy.values(), key=lambda x: x["anatomy_bytes"])
        nb = an["anatomy_bytes"] / 1e9
        mc = sorted(r["memcpy_s"] / r["model_bytes"] for r in rows)[len(rows) // 2] * 1e9
        print(f"\nper-byte costs on this machine (s/GB): memcpy {mc:.3f}, shm write {an['shm_write_s'] / nb:.3f}, "
              f"shm read {an['shm_read_s'] / nb:.3f}, safetensors save {an['st_save_s'] / nb:.3f}, "
              f"safetensors read + copy {an['st_read_copy_s'] / nb:.3f}, gather+convert (1x1) "
              f"{an['convert_only_s'] / nb:.3f}; interconnect {8 / a.bandwidth_gbps:.3f}")
    print(f"\nprojection (bf16 bytes; per-byte costs fitted over the sizes at each size's best bucket; "
          f"floor = bytes / {a.bandwidth_gbps:g} Gb/s; shm floor = one raw write per byte + one raw read per "
          f"byte and engine, at this machine's rates; memcpy = one copy at the measured rate):")
    print(proj_text)
    print(f"\nruntime {runtime:.0f} s; rows in {where}")


if __name__ == "__main__":
    main()
