#!/usr/bin/env python
"""Trainer -> engine weight sync: the collective and the files transport side by side.

    .venv/bin/python bench/weight_sync.py [--quick] [--sizes small medium large]
        [--bucket-mb 64 256] [--repeats 2] [--layouts 1x1 tp2 pp2] [--engines 1 2]
        [--transports collective files] [--out bench/out/weight_sync.json]
    .venv/bin/python bench/weight_sync.py --report bench/out/weight_sync.json   # tables only
    .venv/bin/python bench/weight_sync.py --staged-compare [--sizes medium] [--repeats 3]
        [--in-flight 4] [--out bench/out/weight_sync_staged.json]   # weight_sync.staged on / off

1. builds random Qwen2-architecture HF folders (vocab 16000/32000, untied, fp32) locally, one
   tensor at a time, with the countdown tokenizer (no downloads; reused when already there):
   small 108 MiB (28M parameters), medium 380 MiB (100M), large 1.04 GiB (278M);
2. per size, runs bench/weight_sync_probe.py under torchrun on gloo in one 2-rank world: rank 0
   starts ONE pool of in-process vLLM engines (rollout.engines.mode=inprocess) with megarl's gloo
   weight-transfer backend, so every engine takes both routes, and keeps it for the layouts 1x1
   (TP=1 x PP=1; the second rank is a DP replica, which sits out of a sync), TP=2 and PP=2. Per
   layout and engine count (the pool's first 1 and 2 engines) it opens both transports through
   `megarl.rollout.weights.sync.open_transport` and, at every bucket size and repeat, pushes with
   each back to back (alternating which goes first); right before each push it times
   tensor.copy_ of the same number of bytes (memcpy_s: efficiency = memcpy_s / sync_s);
3. per push: the transport's split (gather / convert / pack / wire for collective, gather /
   convert / stage / load for files), the engine's own load apart (collective: per bucket, the
   end of the last engine's update_weights after the broadcast's end, plus start / finish of the
   session; files: the slowest engine's reload_weights), and bytes written to disk during it
   (write_bytes of every trainer and engine process; files that appeared under the staging and
   the temp folder; growth of /dev/shm);
4. writes rows to --out and prints: the rows; collective vs files per size / layout / engines;
   the targets of issue 17 (collective not slower than files at the largest size, 1x1, one
   engine; two engines at most 1.3x one on the collective route; 0 bytes on disk); the bounds
   measured (gloo broadcast over loopback to one and two receivers, memcpy); the per-byte fit
   time = a + b x bytes per transport / layout / engines (over the sizes, each at its fastest
   bucket, median over repeats) and the projection to 7B / 70B bf16 bytes with the engine's own
   load cost apart.

--staged-compare: today's push (weight_sync.staged=false: the engines pause for the whole push)
against the staged one (the version travels into each engine's staging area and is loaded into
a shadow of its model while it generates; the engines pause only for the swap), into the same 2 local vLLM servers
(rollout.engines.mode=local_servers, rollout.update_mode=keep) with --in-flight requests per
engine generating through the push, from a 1-rank trainer (TP=1), --repeats pushes per route,
the order alternating (bench/staged_push_probe.py). Reports per route the median pause
(sync_paused_s), total push (sync_time_s) and tokens generated during the push, the ratios
(targets: paused staged / unstaged <= 0.25, total <= 1.2) and the pause by parts (begin_update,
the worker's wait for its last staged receive and for the prepared version, the swap, the load
(unstaged), the prefix reset, end_update).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
LAYOUTS = ("1x1", "tp2", "pp2")
TRANSPORTS = ("collective", "files")
PROJECT = {"7B": 15.2e9, "70B": 141e9}  # bytes pushed as bf16 (Qwen2-7B 7.6B, Llama-70B 70.6B params)
TWO_ENGINES_MAX = 1.3                    # issue 17: two engines cost at most 1.3x one (collective)
STAGED_PAUSE_MAX, STAGED_TOTAL_MAX = 0.25, 1.2   # weight_sync.staged: pause and whole push vs unstaged


def make_model(out: Path, shape: dict, shard_bytes: int = 512 << 20) -> int:
    """Random fp32 Qwen2 HF folder (config, safetensors shards + index, countdown tokenizer);
    reused when complete. Returns the weight bytes."""
    import transformers
    from safetensors.torch import save_file

    from megarl.data import countdown as cd
    from megarl.formats.mapping import mapping_for
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


def run_probe(spec: dict, work: Path, tag: str, resume: bool = False, script: str = "bench/weight_sync_probe.py",
              nproc: int = 2) -> dict:
    """Run one probe world; its result (rows so far, `complete` false, when it died: the size's
    rows are kept and the failure noted). With `resume`, a complete earlier result of the same
    spec is reused instead."""
    spec_path = work / f"spec_{tag}.json"
    spec["out"] = str(work / f"probe_{tag}.json")
    if resume and Path(spec["out"]).exists() and spec_path.exists() and json.loads(spec_path.read_text()) == spec:
        prev = json.loads(Path(spec["out"]).read_text())
        if prev.get("complete", "probe_s" in prev):
            print(f"    reusing {spec['out']} (same spec, complete)", flush=True)
            prev.setdefault("launch_s", prev.get("probe_s", 0.0))
            prev["reused"] = True
            return prev
    Path(spec["out"]).unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    args = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / script), str(spec_path)]
    t = time.perf_counter()
    log = work / f"probe_{tag}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if "[probe]" in line[:40]:
                print("   ", line.rstrip().split("[probe] ", 1)[-1], flush=True)
        proc.wait()
    if proc.returncode != 0:
        why = f"probe {tag} failed ({proc.returncode}); see {log}"
        if not Path(spec["out"]).exists():
            raise SystemExit(why + ":\n" + "".join(log.read_text().splitlines(True)[-40:]))
        print(f"    {why}: keeping the rows it wrote", flush=True)
        result = json.loads(Path(spec["out"]).read_text())
        result["failed"] = why
    else:
        result = json.loads(Path(spec["out"]).read_text())
    result["launch_s"] = time.perf_counter() - t
    return result


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b only through the origin when there is a single x)."""
    if len(set(xs)) < 2:
        return 0.0, sum(ys) / sum(xs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def human(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def med(v):
    return statistics.median(v) if v else float("nan")


def attribute(r: dict) -> dict:
    """Rows of a probe that did not attribute new entries (older JSON): by name only, the
    files route's staging folders are this run's, anything else is counted as foreign."""
    if "foreign_entries_n" not in r:
        ours = [e for e in r["new_entries"] if "megarl-weights-" in e]
        r["foreign_entries"] = [e for e in r["new_entries"] if e not in ours]
        r["foreign_entries_n"] = len(r["foreign_entries"])
        r["foreign_bytes_peak"] = r["new_file_bytes_peak"] if not ours else 0
        r["new_file_bytes_peak"] = r["new_file_bytes_peak"] if ours else 0
        r["new_entries"], r["new_entries_n"] = ours, len(ours)
    return r


def disk_bytes(r: dict) -> int:
    """Bytes on disk a push caused: files that appeared (staging / temp folders, at their peak)
    plus what the trainer and engine processes dirtied on block devices."""
    return r["new_file_bytes_peak"] + r["write_bytes"]["trainer"] + r["write_bytes"]["engines"]


def best(rows: list[dict]) -> dict:
    for r in rows:
        attribute(r)
    """(transport, size, layout, engines) -> the fastest bucket's rows' medians (repeats)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["transport"], r["size"], r["layout"], r["engines"], r["bucket_mb"]), []).append(r)
    out: dict = {}
    for (kind, size, layout, n, bmb), rs in groups.items():
        m = {k: med([r[k] for r in rs]) for k in ("sync_s", "engine_load_s", "trainer_only_s", "wire_s",
                                                   "eng_tail_s", "gather_s", "convert_s", "pack_s",
                                                   "stage_s", "load_s", "memcpy_s")}
        m.update(bucket_mb=bmb, model_bytes=rs[0]["model_bytes"], n=len(rs),
                 disk_max=max(disk_bytes(r) for r in rs))
        key = (kind, size, layout, n)
        if key not in out or m["sync_s"] < out[key]["sync_s"]:
            out[key] = m
    return out


def table(rows: list[dict]) -> str:
    head = ("| transport | size | layout | engines | bucket MB | rep | sync s | gather s | convert s | pack s | "
            "wire s | stage s | engine load s | trainer-side s | new files MiB | write_bytes KiB | "
            "GB/s | efficiency |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        wb = (r["write_bytes"]["trainer"] + r["write_bytes"]["engines"]) / 2**10
        lines.append(f"| {r['transport']} | {r['size']} | {r['layout']} | {r['engines']} | {r['bucket_mb']} | "
                     f"{r['repeat']} | {r['sync_s']:.2f} | {r['gather_s']:.2f} | {r['convert_s']:.2f} | "
                     f"{r['pack_s']:.2f} | {r['wire_s']:.2f} | {r['stage_s']:.2f} | {r['engine_load_s']:.2f} | "
                     f"{r['trainer_only_s']:.2f} | {r['new_file_bytes_peak'] / 2**20:.1f} | {wb:.0f} | "
                     f"{r['model_bytes'] / r['sync_s'] / 1e9:.2f} | {r['efficiency']:.3f} |")
    return "\n".join(lines)


def side_by_side(b: dict, sizes: list[str]) -> str:
    head = ("| size | layout | engines | collective s (bucket) | files s (bucket) | collective / files | "
            "coll. engine load s | files engine load s | coll. trainer-side s | files trainer-side s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = sorted({k[1:] for k in b}, key=lambda k: (sizes.index(k[0]), LAYOUTS.index(k[1]), k[2]))
    for size, layout, n in keys:
        c, f = b.get(("collective", size, layout, n)), b.get(("files", size, layout, n))
        if not c or not f:
            continue
        lines.append(f"| {size} | {layout} | {n} | {c['sync_s']:.2f} ({c['bucket_mb']}) | {f['sync_s']:.2f} "
                     f"({f['bucket_mb']}) | {c['sync_s'] / f['sync_s']:.2f} | {c['engine_load_s']:.2f} | "
                     f"{f['engine_load_s']:.2f} | {c['trainer_only_s']:.2f} | {f['trainer_only_s']:.2f} |")
    return "\n".join(lines)


def targets(rows: list[dict], b: dict, sizes: list[str]) -> tuple[str, dict]:
    """Issue 17's three targets, at the largest size measured."""
    big = max(sizes, key=lambda s: SIZES[s]["hidden_size"] * SIZES[s]["num_hidden_layers"])
    out, lines = {"size": big}, []
    c, f = b.get(("collective", big, "1x1", 1)), b.get(("files", big, "1x1", 1))
    if c and f:
        ratio = c["sync_s"] / f["sync_s"]
        # the same comparison push by push: each collective push against the files push next to it
        pairs = []
        for r in rows:
            if (r["size"], r["layout"], r["engines"], r["transport"]) == (big, "1x1", 1, "collective"):
                o = [x for x in rows if (x["size"], x["layout"], x["engines"], x["transport"], x["bucket_mb"],
                                         x["repeat"]) == (big, "1x1", 1, "files", r["bucket_mb"], r["repeat"])]
                if o:
                    pairs.append(r["sync_s"] / o[0]["sync_s"])
        out["collective_vs_files"] = {"collective_s": c["sync_s"], "files_s": f["sync_s"], "ratio": ratio,
                                      "paired_ratios": pairs, "met": ratio <= 1.0}
        lines.append(f"- collective vs files ({big}, 1x1, one engine, fastest bucket, median of repeats): "
                     f"{c['sync_s']:.2f} s vs {f['sync_s']:.2f} s = {ratio:.2f}x "
                     f"(push-by-push ratios {', '.join(f'{p:.2f}' for p in pairs)}) -> "
                     f"{'MET' if ratio <= 1.0 else 'MISSED'} (target <= 1.0)")
    out["two_vs_one"] = {}
    for layout in LAYOUTS:
        one, two = b.get(("collective", big, layout, 1)), b.get(("collective", big, layout, 2))
        if not one or not two:
            continue
        ratio = two["sync_s"] / one["sync_s"]
        parts = {k: (two[k] / one[k] if one[k] > 0 else float("nan"))
                 for k in ("wire_s", "engine_load_s", "trainer_only_s")}
        out["two_vs_one"][layout] = {"one_s": one["sync_s"], "two_s": two["sync_s"], "ratio": ratio,
                                     "parts": parts, "met": ratio <= TWO_ENGINES_MAX}
        lines.append(f"- collective, two engines vs one ({big}, {layout}): "
                     f"{two['sync_s']:.2f} s vs {one['sync_s']:.2f} s "
                     f"= {ratio:.2f}x (wire {parts['wire_s']:.2f}x, engine load {parts['engine_load_s']:.2f}x, "
                     f"trainer-side {parts['trainer_only_s']:.2f}x) -> "
                     f"{'MET' if ratio <= TWO_ENGINES_MAX else 'MISSED'} (target <= {TWO_ENGINES_MAX})")
        f1, f2 = b.get(("files", big, layout, 1)), b.get(("files", big, layout, 2))
        if f1 and f2:
            out["two_vs_one"][layout]["files_ratio"] = f2["sync_s"] / f1["sync_s"]
    for kind in TRANSPORTS:
        rs = [r for r in rows if r["transport"] == kind]
        if not rs:
            continue
        d = {"pushes": len(rs),
             "new_file_bytes_peak_max": max(r["new_file_bytes_peak"] for r in rs),
             "new_entries_max": max(r["new_entries_n"] for r in rs),
             "new_file_bytes_peak_median": med([r["new_file_bytes_peak"] for r in rs]),
             "foreign_entries": sorted({e for r in rs for e in r["foreign_entries"]})[:10],
             "foreign_bytes_peak_max": max(r["foreign_bytes_peak"] for r in rs),
             "write_bytes_trainer_max": max(r["write_bytes"]["trainer"] for r in rs),
             "write_bytes_engines_max": max(r["write_bytes"]["engines"] for r in rs),
             "shm_growth_max": max(r["fs_used_growth_peak"].get("/dev/shm", 0) for r in rs),
             "unreadable_procs_max": max(r["write_bytes"]["unreadable"] for r in rs)}
        out[f"disk_{kind}"] = d
        lines.append(f"- bytes on disk, {kind} ({d['pushes']} pushes, worst push): new files under the staging / "
                     f"temp folders {d['new_file_bytes_peak_max']:,} B ({d['new_entries_max']} entries; median push "
                     f"{d['new_file_bytes_peak_median']:,.0f} B), "
                     f"/dev/shm growth {d['shm_growth_max']:,} B, "
                     f"write_bytes trainer {d['write_bytes_trainer_max']:,} B, "
                     f"engines {d['write_bytes_engines_max']:,} B"
                     + (f" ({d['unreadable_procs_max']} process(es) unreadable)" if d["unreadable_procs_max"] else "")
                     + (f"; not this run's (neither named after nor held open by its processes): up to "
                        f"{d['foreign_bytes_peak_max']:,} B in {', '.join(d['foreign_entries'])}"
                        if d["foreign_entries"] else ""))
    if "disk_collective" in out:
        d = out["disk_collective"]
        rs = [r for r in rows if r["transport"] == "collective"]
        writers = [(r["size"], r["layout"], r["engines"], r["bucket_mb"], r["repeat"], v)
                   for r in rs for v in r["write_bytes"].get("by_process", {}).values()]
        worst = max(d["write_bytes_trainer_max"], d["write_bytes_engines_max"])
        d["writers"] = writers
        d["met"] = d["new_file_bytes_peak_max"] == 0 and d["new_entries_max"] == 0 and worst < 64 << 10
        lines.append(f"  collective: no file of this run created under the staging / temp folders in any push, and "
                     f"block-device writes by its processes at most {worst:,} B in a push (a bucket is >= 64 MiB) -> "
                     f"{'MET' if d['met'] else 'MISSED'}"
                     + ("; pushes with writes: " + "; ".join(_writer(w) for w in writers[:4]) if writers else "")
                     + " (/dev/shm growth includes other users' files)")
    return "\n".join(lines), out


def _writer(w) -> str:
    """One push that wrote to a block device: layout, engines, transport, size, rep, who wrote."""
    who = "a trainer rank" if "weight_sync_probe" in w[5][0] else w[5][0][:40]
    return f"{w[0]} {w[1]} n={w[2]} {w[3]} MB rep {w[4]}: {w[5][1]:,} B by {who}"


def baselines(probes: dict) -> str:
    lines = ["| size | bytes | memcpy GB/s | gloo bcast, 1 receiver, fresh buffers GB/s | 1 receiver, reused buffer | "
             "2 receivers, fresh buffers | 2 receivers, reused buffers | 2 vs 1 receiver time (fresh / reused) | "
             "bucket MB |", "|---|---|---|---|---|---|---|---|---|"]
    for size, p in probes.items():
        g = p.get("gloo_baseline")
        if not g:
            continue
        nb, nan = g["bytes"], float("nan")
        rate = {k: nb / g[k] / 1e9 if g.get(k) else nan
                for k in ("memcpy_s", "recv1_fresh_s", "recv1_reused_s", "recv2_fresh_s", "recv2_reused_s")}
        lines.append(f"| {size} | {human(nb)} | {rate['memcpy_s']:.2f} | {rate['recv1_fresh_s']:.2f} | "
                     f"{rate['recv1_reused_s']:.2f} | {rate['recv2_fresh_s']:.2f} | {rate['recv2_reused_s']:.2f} | "
                     f"{rate['recv1_fresh_s'] / rate['recv2_fresh_s']:.2f} / "
                     f"{rate['recv1_reused_s'] / rate['recv2_reused_s']:.2f} | {g['bucket_mb']} |")
    return "\n".join(lines)


def bounds_table(probes: dict) -> str:
    """Per-byte steps of both routes, measured alone (`--bounds`): GB/s."""
    lines = ["| size | bytes | bucket MB | memcpy | pack, fresh buffer per bucket | pack, reused buffer | "
             "gloo chain 1 receiver, fresh | 1 receiver, reused | 2 receivers, fresh | 2 receivers, reused | "
             "gloo's tree, 2 receivers, fresh | tree, 2 receivers, reused | "
             "file write (new files, staging folder) | file read into fresh buffers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, p in probes.items():
        g = p.get("gloo_baseline") or {}
        if "pack_fresh_s" not in g:
            continue
        nb = g["bytes"]
        keys = ("memcpy_s", "pack_fresh_s", "pack_reused_s", "recv1_fresh_s", "recv1_reused_s", "recv2_fresh_s",
                "recv2_reused_s", "recv2_fresh_tree_s", "recv2_reused_tree_s", "file_write_s", "file_read_fresh_s")
        cells = [nb / g[k] / 1e9 if g.get(k) else float("nan") for k in keys]
        lines.append(f"| {size} | {human(nb)} | {g['bucket_mb']} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def projection(b: dict) -> tuple[str, list[dict]]:
    """Per (transport, layout, engines): fit time = a + b x bytes over the sizes (each at its
    fastest bucket) for the whole sync, the engine's own load and the rest; project."""
    out = []
    head = ("| transport | layout | engines | a s | b s/GB | of which engine load s/GB | trainer-side s/GB | "
            + " | ".join(f"{m} sync s | {m} engine load s | {m} trainer-side s" for m in PROJECT) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind, layout, n in sorted({(k[0], k[2], k[3]) for k in b}, key=lambda k: (k[0], LAYOUTS.index(k[1]), k[2])):
        pts = [v for k, v in b.items() if (k[0], k[2], k[3]) == (kind, layout, n)]
        xs = [p["model_bytes"] for p in pts]
        fits = {part: fit(xs, [p[part] for p in pts]) for part in ("sync_s", "engine_load_s", "trainer_only_s")}
        entry = {"transport": kind, "layout": layout, "engines": n, "sizes": len(pts),
                 **{f"{part}_fit": {"a_s": a, "b_s_per_byte": bb} for part, (a, bb) in fits.items()}}
        cells = []
        for m, nbytes in PROJECT.items():
            proj = {part: a + bb * nbytes for part, (a, bb) in fits.items()}
            entry[m] = {"bytes": nbytes, **proj}
            cells.append(f"{proj['sync_s']:.0f} | {proj['engine_load_s']:.0f} | {proj['trainer_only_s']:.0f}")
        out.append(entry)
        a, bb = fits["sync_s"]
        lines.append(f"| {kind} | {layout} | {n} | {a:.2f} | {bb * 1e9:.2f} | {fits['engine_load_s'][1] * 1e9:.2f} | "
                     f"{fits['trainer_only_s'][1] * 1e9:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small + large only, bucket 256 MB, one repeat (about 8 minutes)")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--no-baseline", action="store_true", help="skip the gloo loopback / memcpy baseline")
    p.add_argument("--staging", default="/dev/shm", help="weight_sync.staging_dir (files route; engines read it)")
    p.add_argument("--work", default=str(ROOT / "bench/out/weight_sync"), help="models, specs, logs")
    p.add_argument("--out", default=str(ROOT / "bench/out/weight_sync.json"))
    p.add_argument("--report", metavar="JSON", help="only print the tables of an earlier --out file")
    p.add_argument("--resume", action="store_true",
                   help="reuse a size's complete probe result under --work when its spec is the same")
    p.add_argument("--staged-compare", action="store_true",
                   help="weight_sync.staged on vs off into 2 local vLLM servers with requests in flight, at "
                        "--sizes (default medium), bucket max(--bucket-mb) (default 512, weight_sync.bucket_mb's), "
                        "--repeats (default 3) pushes per route; written to bench/out/weight_sync_staged.json")
    p.add_argument("--in-flight", type=int, default=4, help="--staged-compare: requests generating per engine")
    p.add_argument("--bounds", action="store_true",
                   help="no engines: only the per-byte steps alone (memcpy, packing, gloo broadcast over loopback "
                        "to 1 / 2 receivers, staging-folder write / read), median of 3, at --sizes (default "
                        "large), bucket max(--bucket-mb); written to bench/out/weight_sync_bounds.json")
    a = p.parse_args()
    if a.report:
        d = json.loads(Path(a.report).read_text())
        if d.get("staged_compare"):
            print(staged_report(d))
        elif d.get("rows"):
            report(d["rows"], d["probes"], d["sizes"], d["runtime_s"], a.report)
        else:
            print(bounds_table(d["probes"]))
        return
    if a.bounds:
        bounds(a)
        return
    if a.staged_compare:
        staged_compare(a)
        return
    sizes = a.sizes or (["small", "large"] if a.quick else list(SIZES))
    sizes = [s for s in SIZES if s in sizes]
    buckets = a.bucket_mb or ([256] if a.quick else [64, 256])
    repeats = a.repeats or (1 if a.quick else 2)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rows, probes = [], {}
    torch.set_num_threads(1)
    for size in sizes:
        t = time.perf_counter()
        model_dir = work / f"model_{size}"
        nbytes = make_model(model_dir, SIZES[size])
        print(f"{size}: {nbytes / 4 / 1e6:.0f}M params, {human(nbytes)} fp32 ({time.perf_counter() - t:.1f} s)",
              flush=True)
        spec = {"model_dir": str(model_dir), "model_bytes": nbytes, "layouts": a.layouts,
                "engines": a.engines, "transports": a.transports, "bucket_mb": buckets, "repeats": repeats,
                "staging": a.staging, "logs": str(work / f"logs_{size}"), "baseline": not a.no_baseline}
        res = run_probe(spec, work, size, a.resume)
        for r in res.pop("rows"):
            rows.append({"size": size, "params": nbytes // 4, **r})
        probes[size] = res
        print(f"  {size}: {res['launch_s']:.0f} s (pool start {res.get('pool_start_s', 0):.0f} s)", flush=True)
    runtime = time.perf_counter() - t_all
    b = best(rows)
    _, proj = projection(b)
    _, tg = targets(rows, b, sizes)
    result = {"rows": rows, "probes": probes, "sizes": sizes, "projection": proj, "targets": tg,
              "runtime_s": runtime, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "loadavg": os.getloadavg()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    report(rows, probes, sizes, runtime, a.out)


def bounds(a) -> None:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    default = str(ROOT / "bench/out/weight_sync.json")
    out = a.out if a.out != default else str(ROOT / "bench/out/weight_sync_bounds.json")
    t_all, probes = time.perf_counter(), {}
    sizes = [s for s in SIZES if s in (a.sizes or ["large"])]
    for size in sizes:
        model_dir = work / f"model_{size}"
        nbytes = make_model(model_dir, SIZES[size])
        spec = {"model_dir": str(model_dir), "model_bytes": nbytes, "layouts": [], "engines": [],
                "transports": a.transports, "bucket_mb": [max(a.bucket_mb or [256])], "repeats": 1,
                "staging": a.staging, "logs": str(work / f"logs_{size}"), "baseline": True,
                "baseline_repeats": 3, "bounds": True}
        probes[size] = run_probe(spec, work, f"bounds_{size}")
    result = {"rows": [], "probes": probes, "sizes": sizes, "runtime_s": time.perf_counter() - t_all,
              "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "loadavg": os.getloadavg()}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print("\nper-byte steps alone, GB/s (median of 3; gloo: rank 0 -> receiver threads in rank 1, loopback):")
    print(bounds_table(probes))
    print(f"\nruntime {result['runtime_s']:.0f} s; in {out}")


def report(rows: list[dict], probes: dict, sizes: list[str], runtime: float, where: str) -> None:
    b = best(rows)
    print("\nevery push:")
    print(table(rows))
    print("\ncollective vs files (fastest bucket per row, median over repeats; trainer-side = sync - engine load):")
    print(side_by_side(b, sizes))
    print("\ntargets (issue 17):")
    print(targets(rows, b, sizes)[0])
    base = baselines(probes)
    if base.count("\n") > 1:
        print("\nbounds on this machine (rank 0 -> receivers in rank 1's threads, stateless gloo group over loopback):")
        print(base)
    warm = [(s, w) for s, p in probes.items() for w in p.get("warm", [])]
    if warm:
        print("\nfirst push per transport / layout / engines (collective: forms the weight group), s:")
        print("  " + "; ".join(f"{s} {w['layout']} n={w['engines']} {w['transport']} {w['warm_s']:.2f}"
                               for s, w in warm))
    print("\nper-byte fit and projection (bf16 bytes: " + ", ".join(f"{m} {v / 1e9:.1f} GB" for m, v in PROJECT.items())
          + "; engine load = the engines' own load, apart from the rest):")
    print(projection(b)[0])
    starts = ", ".join(f"{s} {p.get('pool_start_s', 0):.0f} s" for s, p in probes.items())
    print(f"\nruntime {runtime:.0f} s (pool starts: {starts}); rows in {where}")


STAGED_PARTS = (("begin_update_s", "begin_update (pause, hold)"),
                ("finish_http_s", "/finish_weight_update (slowest engine)"),
                ("worker_take_s", "  worker: wait for the last staged receive"),
                ("worker_prepared_s", "  worker: wait for the version prepared beside the model"),
                ("worker_swap_s", "  worker: swap the prepared tensors in"),
                ("worker_init_s", "  worker: layerwise reload set-up"),
                ("worker_load_s", "  worker: load_weights"),
                ("worker_finalize_s", "  worker: layerwise reload finalisation"),
                ("reset_prefix_s", "/reset_prefix_cache"), ("version_http_s", "/update_weight_version"),
                ("end_update_s", "end_update (resume)"))


def staged_compare(a) -> None:
    """weight_sync.staged on vs off (see the module doc): one probe world, both routes."""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    default = str(ROOT / "bench/out/weight_sync.json")
    out = a.out if a.out != default else str(ROOT / "bench/out/weight_sync_staged.json")
    t_all, probes = time.perf_counter(), {}
    sizes = [s for s in SIZES if s in (a.sizes or ["medium"])]
    for size in sizes:
        model_dir = work / f"model_{size}"
        nbytes = make_model(model_dir, SIZES[size])
        spec = {"model_dir": str(model_dir), "model_bytes": nbytes, "engines": 2,
                "bucket_mb": max(a.bucket_mb or [512]), "repeats": a.repeats or 3, "in_flight": a.in_flight,
                "max_tokens": 448, "kv_cache_mb": 128, "gap_s": 2.0, "logs": str(work / f"logs_staged_{size}"),
                "swap_log": str(work / f"swap_{size}.jsonl")}
        probes[size] = run_probe(spec, work, f"staged_{size}", script="bench/staged_push_probe.py", nproc=1)
        probes[size]["summary"] = staged_summary(probes[size]["rows"])
    result = {"staged_compare": True, "probes": probes, "sizes": sizes, "runtime_s": time.perf_counter() - t_all,
              "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "loadavg": os.getloadavg()}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print(staged_report(result))
    print(f"\nruntime {result['runtime_s']:.0f} s; in {out}")


def staged_summary(rows: list[dict]) -> dict:
    """Per route the medians over its timed pushes, and the two ratios with their targets."""
    out: dict = {}
    for route in ("unstaged", "staged"):
        rs = [r for r in rows if r["route"] == route]
        keys = ["sync_paused_s", "sync_time_s", "sync_wire_s", "tokens_in_push", "tokens_rate_in_push",
                "tokens_before_rate"] + [k for k, _ in STAGED_PARTS]
        out[route] = {k: med([r[k] for r in rs if r.get(k) is not None]) for k in keys}
        out[route]["pushes"] = len(rs)
        out[route]["paused_each"] = [round(r["sync_paused_s"], 3) for r in rs]
        out[route]["total_each"] = [round(r["sync_time_s"], 3) for r in rs]
    u, s = out["unstaged"], out["staged"]
    if u["pushes"] and s["pushes"]:
        out["paused_ratio"] = s["sync_paused_s"] / u["sync_paused_s"]
        out["total_ratio"] = s["sync_time_s"] / u["sync_time_s"]
        out["paused_met"] = out["paused_ratio"] <= STAGED_PAUSE_MAX
        out["total_met"] = out["total_ratio"] <= STAGED_TOTAL_MAX
    return out


def staged_report(d: dict) -> str:
    lines = []
    for size, p in d["probes"].items():
        sm = p.get("summary") or staged_summary(p["rows"])
        spec = p["spec"]
        lines += [f"\n{size} ({human(spec['model_bytes'])}), {spec['engines']} local servers, bucket "
                  f"{spec['bucket_mb']} MB, {spec['in_flight']} requests in flight per engine; medians of "
                  f"{sm['unstaged']['pushes']} / {sm['staged']['pushes']} pushes:",
                  "| route | paused s | total s | wire s | tokens in push | tok/s in push | tok/s before |",
                  "|---|---|---|---|---|---|---|"]
        for route in ("unstaged", "staged"):
            r = sm[route]
            lines.append(f"| {route} | {r['sync_paused_s']:.2f} | {r['sync_time_s']:.2f} | {r['sync_wire_s']:.2f} | "
                         f"{r['tokens_in_push']:.0f} | {r['tokens_rate_in_push']:.0f} | "
                         f"{r['tokens_before_rate']:.0f} |")
        if "paused_ratio" in sm:
            lines.append(f"- paused staged / unstaged = {sm['paused_ratio']:.2f} (target <= {STAGED_PAUSE_MAX}) -> "
                         f"{'MET' if sm['paused_met'] else 'MISSED'}; total staged / unstaged = "
                         f"{sm['total_ratio']:.2f} (target <= {STAGED_TOTAL_MAX}) -> "
                         f"{'MET' if sm['total_met'] else 'MISSED'}")
            lines.append(f"- every push: paused unstaged {sm['unstaged']['paused_each']}, staged "
                         f"{sm['staged']['paused_each']}; total unstaged {sm['unstaged']['total_each']}, staged "
                         f"{sm['staged']['total_each']}")
        lines += ["", "the pause by parts (s, medians; per engine call the slowest engine):",
                  "| part | unstaged | staged |", "|---|---|---|"]
        for k, name in STAGED_PARTS:
            lines.append(f"| {name} | {sm['unstaged'][k]:.3f} | {sm['staged'][k]:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
