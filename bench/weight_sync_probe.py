"""torchrun body of bench/weight_sync.py: time `weight_sync.push` into in-process vLLM engines.

    python -m torch.distributed.run --standalone --nproc_per_node=N bench/weight_sync_probe.py SPEC.json

SPEC (written by bench/weight_sync.py): model_dir, layouts (of "1x1", "tp2", "pp2"; TP=2 and PP=2
use both ranks of a 2-rank world, 1x1 runs on rank 0 alone while the other rank waits in a
barrier, see OneRank), engines (e.g. [1, 2]), bucket_mb, repeats, staging, out, logs,
anatomy (bool). Rank 0 opens ONE pool with max(engines) in-process engines (vLLM AsyncLLM,
rollout.engine_mode=inprocess) and keeps it for every layout; a push into fewer engines goes to
the first n of them (the others keep the older version). For each layout every rank builds the
actor at that layout (megatron random init: the values do not matter to the timing), pushes once
untimed (first-touch effects in the engines), then for each engine count and bucket size pushes
`repeats` times. Right before each push rank 0 times a plain copy of the same number of bytes
(tensor.copy_ between two preallocated buffers of model_bytes, 1 thread, median of 3) in this
same process, so `efficiency = memcpy_s / sync_s` compares against the machine's state at that
moment. With anatomy=true (after the 1x1 layout) rank 0 also measures, on the same bytes, what the CPU route
is made of: a raw write + read of one file in the staging folder, safetensors save_file of the
converted buckets, and safetensors read-back (the re-reading every engine does).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def memcpy_seconds(nbytes: int, reps: int = 3) -> float:
    """Median time of dst.copy_(src) for two preallocated (and already touched) buffers."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not part of a copy
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    del src, dst
    return statistics.median(times)


class SubPool:
    """The first `n` engines of a started SyncPool, as something `weight_sync.push` can load into."""

    def __init__(self, sync_pool, n: int):
        from megarl.rollout.pool import EnginePool
        self.sync_pool = sync_pool
        self.pool = EnginePool(sync_pool.engines[:n], sync_pool.pool.timeout_s)

    def reload_weights(self, path: str, version: int) -> None:
        self.sync_pool.call(self.pool.reload_weights(path, version), f"loading weight version {version}")


class OneRank:
    """torch.distributed as a 1-rank world sees it, for `weight_sync` on rank 0 of a bigger world
    while the other ranks are parked: in a 1-rank world push's collectives (the staging-size
    all_reduce, the folder-name broadcast, the barriers) are skipped or return at once; with
    TP=1 there is no all-gather. Everything else is the real module."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get_world_size(self, group=None):
        return 1

    def get_rank(self, group=None):
        return 0

    def barrier(self, *a, **k):
        pass

    def all_reduce(self, *a, **k):
        pass

    def broadcast_object_list(self, *a, **k):
        pass

    def all_gather(self, *a, **k):
        raise RuntimeError("OneRank: no all-gather in a 1-rank world (TP=1 only)")


def row_of(layout, ranks, n, bucket_mb, rep, model_bytes, memcpy_s, res, everyone) -> dict:
    staged = sum(r["sync_bytes"] for r in everyone)
    assert staged == model_bytes, (staged, model_bytes)
    # the split is rank 0's own timeline, so it adds up to sync_s: other_s is staging-folder
    # setup, waiting at the barriers for the other ranks (PP: the other stage's writes) and
    # removing the folder. Under TP, a rank's gather_s includes waiting in the all-gather for
    # its peer (e.g. while rank 0 writes a bucket). The slowest rank's figures are kept too.
    split = {k: res[f"sync_{k}_s"] for k in ("gather", "convert", "stage", "load")}
    sync_s = res["sync_time_s"]
    print(f"[probe] {layout} engines={n} bucket={bucket_mb} MB: sync {sync_s:.2f} s "
          f"(gather {split['gather']:.2f} convert {split['convert']:.2f} stage {split['stage']:.2f} "
          f"load {split['load']:.2f}) memcpy {memcpy_s:.3f} s -> eff {memcpy_s / sync_s:.3f}", flush=True)
    return {"layout": layout, "trainer_ranks": ranks, "engines": n, "bucket_mb": bucket_mb, "repeat": rep,
            "model_bytes": model_bytes, "sync_s": sync_s, "memcpy_s": memcpy_s, "efficiency": memcpy_s / sync_s,
            **{f"{k}_s": v for k, v in split.items()}, "other_s": sync_s - sum(split.values()),
            **{f"{k}_max_s": max(r[f"sync_{k}_s"] for r in everyone) for k in ("gather", "convert", "stage")},
            "per_rank": [{k: r[k] for k in ("sync_time_s", "sync_gather_s", "sync_convert_s", "sync_stage_s",
                                            "sync_load_s", "sync_bytes")} for r in everyone]}

def anatomy(model, info, model_bytes: int, staging: str) -> dict:
    """Rank 0 of a 1-rank world: the per-byte pieces of the CPU route on the same bytes."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megarl.rollout import weight_sync
    out = {}
    folder = tempfile.mkdtemp(prefix=f"{weight_sync.PREFIX}{os.getpid()}-anatomy-", dir=staging)
    try:
        # 1. raw file write + read of model_bytes through the staging file system (median of 3;
        # every write goes to a new file, as every sync does)
        src = torch.empty(model_bytes, dtype=torch.uint8)
        src.fill_(1)
        dst = torch.empty_like(src)
        dst.fill_(0)
        path = os.path.join(folder, "raw.bin")
        writes, reads = [], []
        for _ in range(3):
            t = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(src.numpy()))
            writes.append(time.perf_counter() - t)
            t = time.perf_counter()
            with open(path, "rb") as f:
                f.readinto(memoryview(dst.numpy()))
            reads.append(time.perf_counter() - t)
            os.remove(path)
        out["shm_write_s"], out["shm_read_s"] = statistics.median(writes), statistics.median(reads)
        del src, dst
        # 2. gather/convert alone (no write), then the same plus safetensors save_file
        timers: dict = {}
        t = time.perf_counter()
        n = 0
        for bucket in weight_sync.buckets(weight_sync.hf_tensors(model, info, timers), 1024 << 20):
            n += sum(v.numel() * v.element_size() for v in bucket.values())
        out["convert_only_s"] = time.perf_counter() - t
        t_save = 0.0
        for k, bucket in enumerate(weight_sync.buckets(weight_sync.hf_tensors(model, info), 1024 << 20)):
            t = time.perf_counter()
            save_file(bucket, os.path.join(folder, f"b{k:03d}.safetensors"))
            t_save += time.perf_counter() - t
        out["st_save_s"] = t_save
        # 3. the least an engine must do: open each staged file and copy every tensor into its
        # (preallocated) parameter; vLLM's reload does this plus its layer-wise re-processing
        params = {}
        for fname in sorted(os.listdir(folder)):
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                for key in f.keys():
                    params[key] = torch.zeros(f.get_slice(key).get_shape())
        t = time.perf_counter()
        for fname in sorted(os.listdir(folder)):
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                for key in f.keys():
                    params[key].copy_(f.get_tensor(key))
        out["st_read_copy_s"] = time.perf_counter() - t
        del params
        out["anatomy_bytes"] = n
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import torch.distributed as dist

    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    env = init_distributed("gloo", timeout_s=1800)
    cpu.apply()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from megarl.config.schema import RolloutConfig
    from megarl.models.builders import build_model
    from megarl.models.config import transformer_config
    from megarl.rollout import weight_sync
    from megarl.rollout.pool import open_pool

    model_dir, staging = spec["model_dir"], spec["staging"]
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_bytes = spec["model_bytes"]
    rows, extra = [], {}
    pool = None
    t0 = time.perf_counter()
    if env.rank == 0:
        cfg = RolloutConfig(engines=max(spec["engines"]), engine_mode="inprocess", engine_timeout_s=1200,
                            max_model_len=256, kv_cache_mb=64)
        pool = open_pool(cfg, model_dir, 0, spec["logs"])
        extra["pool_start_s"] = time.perf_counter() - t0
        print(f"[probe] {cfg.engines} engine(s) up in {extra['pool_start_s']:.1f} s", flush=True)
    version = 0
    try:
        for layout in spec["layouts"]:
            tp, pp = {"1x1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
            # 1x1 in a bigger world: rank 0 alone, the others parked in a barrier (see OneRank)
            alone = tp * pp == 1 and env.world_size > 1
            assert alone or tp * pp == env.world_size, (layout, env.world_size)
            parallel.initialize(tp, pp, 0)  # collective (group creation), every rank
            if alone and env.rank != 0:
                dist.barrier()
                parallel.destroy()
                continue
            real_dist = weight_sync.dist
            if alone:
                weight_sync.dist = OneRank(dist)
            try:
                t = time.perf_counter()
                tcfg = transformer_config(hf_config, tp, pp, torch.float32, False, "none", False)
                model, info = build_model(hf_config, tcfg, 128, "actor")
                if env.rank == 0:
                    print(f"[probe] {layout}: actor built in {time.perf_counter() - t:.1f} s", flush=True)
                version += 1
                weight_sync.push(model, info, pool, version, staging, bucket_mb=max(spec["bucket_mb"]), tag="warm")
                for n in spec["engines"]:
                    target = SubPool(pool, n) if pool is not None else None
                    for bucket_mb in spec["bucket_mb"]:
                        for rep in range(spec["repeats"]):
                            memcpy_s = memcpy_seconds(model_bytes) if env.rank == 0 else 0.0
                            if not alone:
                                dist.barrier()
                            version += 1
                            res = weight_sync.push(model, info, target, version, staging, bucket_mb=bucket_mb)
                            everyone = [res]
                            if not alone:
                                everyone = [None] * env.world_size
                                dist.all_gather_object(everyone, res)
                            if env.rank != 0:
                                continue
                            rows.append(row_of(layout, 1 if alone else env.world_size, n, bucket_mb, rep,
                                               model_bytes, memcpy_s, res, everyone))
                if spec.get("anatomy") and tp * pp == 1:
                    extra["anatomy"] = anatomy(model, info, model_bytes, staging)
                    print(f"[probe] anatomy: {json.dumps({k: round(v, 4) for k, v in extra['anatomy'].items()})}",
                          flush=True)
                del model
            finally:
                weight_sync.dist = real_dist
            if alone:
                dist.barrier()  # release the parked ranks
            parallel.destroy()
    finally:
        if pool is not None:
            pool.close()
    if env.rank == 0:
        extra["probe_s"] = time.perf_counter() - t0
        with open(spec["out"], "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
