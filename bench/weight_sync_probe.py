"""torchrun body of bench/weight_sync.py: both weight-sync transports into in-process vLLM engines.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/weight_sync_probe.py SPEC.json

SPEC (written by bench/weight_sync.py): model_dir, model_bytes, layouts (of "1x1", "tp2", "pp2"),
engines (e.g. [1, 2]), transports (e.g. ["collective", "files"]), bucket_mb, repeats, staging,
out, logs, baseline (bool). The world has 2 gloo ranks. Rank 0 opens ONE pool of max(engines)
in-process engines with megarl's gloo weight-transfer backend (open_pool(..., "gloo"): such an
engine takes both routes) and keeps it for every layout. Layouts: TP=2 and PP=2 use both ranks;
1x1 is TP=1 x PP=1 with the second rank a data-parallel replica, which sits out of the sync (the
real DP=2 code path: only DP rank 0 gathers, converts, packs or writes; the replica only joins
the collectives), so rank 0 is the one sender as in a 1-rank world.

Per layout every rank builds the actor (megatron random init: values do not matter to the
timing); per engine count n the transports are opened over a view of the pool's first n engines
(`sub_pool`) and pushed once untimed each (the collective one forms its weight group then;
`warm_s` keeps that first push's time), then for each bucket size and repeat both transports
push back to back, in alternating order (so drift on the shared machine hits both alike). Right
before each push rank 0 times tensor.copy_ of model_bytes (`memcpy_s`).

Measured around each push, besides the transport's own timings (sync_time_s, gather, convert,
pack, wire, stage, load, bytes, buckets):
- engine-side calls (rank 0 wraps every engine's methods): start/update/finish_weight_update,
  reload_weights, abort/pause/resume, each call's start and end time; the trainer's weight
  broadcasts (megarl.rollout.weights.group.broadcast, as collective.py calls it) likewise.
  For the collective route the engine loads a bucket inside its `update_weights` (receive, then
  `model.load_weights`) and the trainer waits for every engine's call before the next bucket,
  so per bucket `tail` = last engine's update_weights end - the broadcast's end is the engine's
  own load (plus the RPC's return); engine_load_s = sum of tails + start + finish (vLLM's
  layerwise-reload set-up and finalisation, prefix-cache reset). For files engine_load_s = the
  slowest engine's reload_weights (read the staged files + load).
- bytes on disk: (a) /proc/<pid>/io write_bytes of every trainer rank and every process under
  rank 0 (the engine cores), summed: bytes these processes dirtied on block devices (tmpfs
  writes are not counted there; the nonzero ones are named per process); (b) a 10 ms poller on
  rank 0: bytes of files that appeared under the staging folder, /dev/shm and the temp folder
  during the push (new entries, recursively, at their peak; this run's when named after one of
  its pids or held open / mapped by one of its processes, other users' apart as foreign), and
  the peak growth of those file systems' used space (shared with other users: noise).
With spec.baseline, per size: gloo broadcast throughput over loopback between rank 0 and one or
two receivers (threads in rank 1, each a member of one stateless group like the engines'),
buckets of the largest bucket_mb, into a fresh buffer per bucket (as the engine's backend
receives) and into a reused one.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

EVENTS: list = []           # (what, engine name or "", t0, t1) on rank 0


MEMCPY_MAX = 512 << 20   # larger copies are timed on this many bytes and scaled (memory on a shared box)


def memcpy_seconds(nbytes: int, reps: int = 3) -> float:
    """Median time of dst.copy_(src) for two preallocated (and already touched) buffers of
    `nbytes` (beyond MEMCPY_MAX: of MEMCPY_MAX bytes, scaled linearly)."""
    import torch
    if nbytes > MEMCPY_MAX:
        return memcpy_seconds(MEMCPY_MAX, reps) * nbytes / MEMCPY_MAX
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


def sub_pool(sync_pool, n: int):
    """A SyncPool over the first `n` engines of a started one (same loop thread and timeout):
    what a transport pushes into. The other engines keep their older version."""
    from megarl.rollout.engines.pool import EnginePool, SyncPool
    sub = SyncPool.__new__(SyncPool)         # __init__ would start the (already started) engines
    sub.pool = EnginePool(sync_pool.engines[:n], sync_pool.pool.timeout_s)
    sub.loop = sync_pool.loop
    return sub


def instrument(engines) -> None:
    """Record the start and end of every weight-related call on each engine (rank 0)."""
    for e in engines:
        for what in ("abort", "pause", "resume", "reload_weights", "start_weight_update",
                     "update_weights", "finish_weight_update"):
            real = getattr(e, what)

            def wrapped(*a, _real=real, _what=what, _name=e.name, **k):
                async def run():
                    t = time.perf_counter()
                    try:
                        return await _real(*a, **k)
                    finally:
                        EVENTS.append((_what, _name, t, time.perf_counter()))
                return run()
            setattr(e, what, wrapped)


def instrument_broadcast():
    """Time the trainer's weight broadcasts; returns the original function."""
    from megarl.rollout.weights import group
    real = group.broadcast

    def timed(g, tensor):
        t = time.perf_counter()
        try:
            return real(g, tensor)
        finally:
            EVENTS.append(("broadcast", "", t, time.perf_counter()))
    group.broadcast = timed
    return real


def engine_split(events: list, kind: str) -> dict:
    """The engine side of one push from the recorded calls (see the module doc)."""
    def durs(what):
        per = {}
        for w, name, t0, t1 in events:
            if w == what:
                per.setdefault(name, []).append((t0, t1))
        return per
    out = {}
    for what in ("abort", "pause", "resume", "start_weight_update", "finish_weight_update", "reload_weights"):
        per = durs(what)
        out[f"eng_{what}_s"] = max((sum(t1 - t0 for t0, t1 in v) for v in per.values()), default=0.0)
    upd, bc = durs("update_weights"), [(t0, t1) for w, _, t0, t1 in events if w == "broadcast"]
    out["eng_update_weights_s"] = max((sum(t1 - t0 for t0, t1 in v) for v in upd.values()), default=0.0)
    tail = 0.0
    for k, (_, b1) in enumerate(bc):
        ends = [v[k][1] for v in upd.values() if len(v) > k]
        if ends:
            tail += max(0.0, max(ends) - b1)
    out["eng_tail_s"] = tail
    out["bcast_s"] = sum(t1 - t0 for t0, t1 in bc)
    if kind == "collective":
        out["engine_load_s"] = tail + out["eng_start_weight_update_s"] + out["eng_finish_weight_update_s"]
    else:
        out["engine_load_s"] = out["eng_reload_weights_s"]
    return out


# -- bytes on disk ---------------------------------------------------------------------------
def write_bytes(pids) -> dict:
    """write_bytes of /proc/<pid>/io per pid (None where unreadable)."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                out[pid] = next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))
        except (OSError, StopIteration, ValueError):
            out[pid] = None
    return out


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def descendants(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        try:
            return os.path.getsize(path)
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _opened_by(pids, paths: set[str]) -> set[str]:
    """The paths among `paths` (or files under them) that one of `pids` has open or mapped."""
    hit = set()
    for pid in pids:
        seen = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    seen.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                seen += [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
        except OSError:
            continue
        for target in seen:
            for p in paths:
                if target == p or target.startswith(p + "/"):
                    hit.add(p)
    return hit


class DiskWatch:
    """Rank 0: polls, every `interval` s while a push runs, the entries that are new under the
    watched folders (bytes at their peak, names) and the used space of their file systems.
    A new entry is this run's when its name carries one of `pids` (as the files route's staging
    folder does) or one of `pids` has it (or a file under it) open or mapped when it is seen;
    others (another user's vLLM shared-memory queues, say) are counted apart as foreign."""

    def __init__(self, folders: list[str], pids=(), interval: float = 0.01):
        self.folders = sorted({os.path.realpath(f) for f in folders if os.path.isdir(f)})
        self.pids = list(pids)
        self.interval = interval

    def __enter__(self):
        self.before = {f: set(os.listdir(f)) for f in self.folders}
        self.used0 = {f: _used(f) for f in self.folders}
        self.peak_new = self.peak_foreign = 0
        self.peak_used = {f: 0 for f in self.folders}
        self.names: set[str] = set()
        self.ours: set[str] = set()
        self.tokens = {f"-{p}-" for p in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="bench-diskwatch")
        self._thread.start()
        return self

    def _sample(self):
        new, foreign, unseen = 0, 0, set()
        found = []
        for f in self.folders:
            try:
                entries = set(os.listdir(f)) - self.before[f]
            except OSError:
                entries = set()
            for e in entries:
                path = os.path.join(f, e)
                if path not in self.names:
                    self.names.add(path)
                    if any(t in e for t in self.tokens):
                        self.ours.add(path)
                    else:
                        unseen.add(path)
                found.append(path)
            try:
                self.peak_used[f] = max(self.peak_used[f], _used(f) - self.used0[f])
            except OSError:
                pass
        unknown = {p for p in found if p not in self.ours}
        if unknown and self.pids:
            self.ours |= _opened_by(self.pids, unknown)
        for path in found:
            nbytes = _tree_bytes(path)
            if path in self.ours:
                new += nbytes
            else:
                foreign += nbytes
        self.peak_new = max(self.peak_new, new)
        self.peak_foreign = max(self.peak_foreign, foreign)

    def _poll(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def result(self) -> dict:
        foreign = sorted(self.names - self.ours)
        return {"new_file_bytes_peak": self.peak_new, "new_entries": sorted(self.ours)[:20],
                "new_entries_n": len(self.ours), "foreign_bytes_peak": self.peak_foreign,
                "foreign_entries": foreign[:20], "foreign_entries_n": len(foreign),
                "fs_used_growth_peak": {f: self.peak_used[f] for f in self.folders}}


# -- gloo over loopback ----------------------------------------------------------------------
def gloo_baseline(rank: int, total: int, bucket: int, receivers: int, fresh: bool,
                  chain: bool = True) -> float | None:
    """Both trainer ranks: seconds for rank 0 to broadcast `total` bytes (buckets of `bucket`)
    to `receivers` members (threads of rank 1) of a stateless gloo group; rank 0 returns it.
    `chain`: megarl's chain broadcast (what the transport uses), else gloo's own tree."""
    import torch
    import torch.distributed as dist

    from megarl.distributed.env import free_port
    from megarl.rollout.weights import group
    world, nb = 1 + receivers, max(1, -(-total // bucket))
    box = [(free_port(), group.new_token())] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    port, token = box[0]
    real = BROADCAST or group.broadcast

    def bcast(g, t):
        real(g, t, chain)
    if rank == 0:
        store = group.store("127.0.0.1", port, world, 120, sender=True)
        dist.barrier()
        g = group.join(store, 0, world, token, 120)
        buf = torch.empty(bucket, dtype=torch.uint8)
        buf.fill_(1)
        bcast(g, buf[:1024])                   # warm the pairs
        t = time.perf_counter()
        for _ in range(nb):
            bcast(g, buf)
        secs = time.perf_counter() - t
        dist.barrier()
        del g
        return secs * total / (nb * bucket)
    dist.barrier()

    def receiver(r):
        s = group.store("127.0.0.1", port, world, 120, sender=False)
        g = group.join(s, r, world, token, 120)
        keep = torch.empty(bucket, dtype=torch.uint8)
        keep.fill_(0)
        bcast(g, keep[:1024])
        for _ in range(nb):
            bcast(g, torch.empty(bucket, dtype=torch.uint8) if fresh else keep)
    threads = [threading.Thread(target=receiver, args=(r,)) for r in range(1, world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dist.barrier()
    return None


BROADCAST = None


def copy_bounds(nbytes: int, bucket: int, staging: str, reps: int) -> dict:
    """Rank 0: what each route's per-byte steps cost here, on `nbytes` in buckets of `bucket`:
    packing = a copy into a fresh buffer per bucket (as the collective sender packs) vs into a
    reused one; a write of each bucket into a new file in the staging folder (the files route's
    stage step, without safetensors) and reading it back into a fresh buffer (what an engine
    reads). Medians of `reps`."""
    import torch
    nb = max(1, -(-nbytes // bucket))
    src = torch.empty(bucket, dtype=torch.uint8)
    src.fill_(1)
    keep = torch.empty(bucket, dtype=torch.uint8)
    keep.fill_(0)
    out = {k: [] for k in ("pack_fresh_s", "pack_reused_s", "file_write_s", "file_read_fresh_s")}
    folder = tempfile.mkdtemp(prefix="megarl-bench-bounds-", dir=staging)
    try:
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(nb):
                torch.empty(bucket, dtype=torch.uint8).copy_(src)
            out["pack_fresh_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(nb):
                keep.copy_(src)
            out["pack_reused_s"].append(time.perf_counter() - t)
            paths = [os.path.join(folder, f"b{k}.bin") for k in range(nb)]
            t = time.perf_counter()
            for path in paths:
                with open(path, "wb") as f:
                    f.write(memoryview(src.numpy()))
            out["file_write_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for path in paths:
                with open(path, "rb") as f:
                    f.readinto(memoryview(torch.empty(bucket, dtype=torch.uint8).numpy()))
            out["file_read_fresh_s"].append(time.perf_counter() - t)
            for path in paths:
                os.remove(path)
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    scale = nbytes / (nb * bucket)
    return {k: statistics.median(v) * scale for k, v in out.items()}


def main(spec_path: str) -> None:
    global BROADCAST
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

    from megarl.config.schema import EnginesConfig, RolloutConfig, WeightSyncConfig
    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import sync as weight_sync

    model_dir, staging, model_bytes = spec["model_dir"], spec["staging"], spec["model_bytes"]
    hf_config = AutoConfig.from_pretrained(model_dir)
    rank0 = env.rank == 0
    pids = [None] * env.world_size
    dist.all_gather_object(pids, os.getpid())
    rows, warms, extra = [], [], {}
    pool = None
    t0 = time.perf_counter()
    if rank0 and spec["layouts"] and spec["engines"]:
        BROADCAST = instrument_broadcast()
        cfg = RolloutConfig(engines=EnginesConfig(count=max(spec["engines"]), mode="inprocess", timeout_s=1200,
                                                  max_model_len=256, kv_cache_mb=64))
        pool = open_pool(cfg, model_dir, 0, spec["logs"], "gloo")
        extra["pool_start_s"] = time.perf_counter() - t0
        instrument(pool.engines)
        print(f"[probe] {cfg.engines.count} engine(s) up in {extra['pool_start_s']:.1f} s", flush=True)
    if spec.get("baseline"):
        bucket = max(spec["bucket_mb"]) << 20
        base, reps = {}, int(spec.get("baseline_repeats", 1))
        for receivers, fresh, chain in ((1, True, True), (1, False, True), (2, True, True), (2, False, True),
                                        (2, True, False), (2, False, False)):
            secs = [gloo_baseline(env.rank, model_bytes, bucket, receivers, fresh, chain) for _ in range(reps)]
            if rank0:
                tree = "" if chain else "_tree"
                base[f"recv{receivers}_{'fresh' if fresh else 'reused'}{tree}_s"] = statistics.median(secs)
        if rank0:
            base.update(bytes=model_bytes, bucket_mb=max(spec["bucket_mb"]), memcpy_s=memcpy_seconds(model_bytes),
                        repeats=reps)
            if spec.get("bounds"):
                base.update(copy_bounds(model_bytes, bucket, staging, reps))
            extra["gloo_baseline"] = base
            print(f"[probe] gloo loopback broadcast of {model_bytes / 1e9:.2f} GB: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in base.items() if k.endswith("_s")), flush=True)
    watched = [staging, tempfile.gettempdir(), "/dev/shm"]
    version = 0
    try:
        for layout in spec["layouts"]:
            tp, pp = {"1x1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
            parallel.initialize(tp, pp, 0)   # 1x1: the second rank is a DP replica
            t = time.perf_counter()
            tcfg = transformer_config(hf_config, tp, pp, torch.float32, False, "none", False)
            model, info = build_model(hf_config, tcfg, 128, "actor")
            if rank0:
                print(f"[probe] {layout}: actor built in {time.perf_counter() - t:.1f} s", flush=True)
            for n in spec["engines"]:
                target = sub_pool(pool, n) if rank0 else None
                transports = {}
                for kind in spec["transports"]:
                    ws = WeightSyncConfig(transport=kind, bucket_mb=max(spec["bucket_mb"]), staging_dir=staging)
                    transports[kind] = weight_sync.open_transport(ws, target)
                try:
                    for kind, tr in transports.items():   # untimed: first touch, group formation
                        version += 1
                        dist.barrier()
                        res = tr.push(model, info, version)
                        if rank0:
                            warms.append({"layout": layout, "engines": n, "transport": kind,
                                          "warm_s": res["sync_time_s"]})
                    for bucket_mb in spec["bucket_mb"]:
                        for rep in range(spec["repeats"]):
                            order = list(transports) if rep % 2 == 0 else list(transports)[::-1]
                            for kind in order:
                                tr = transports[kind]
                                tr.ws = dataclasses.replace(tr.ws, bucket_mb=bucket_mb)
                                version += 1
                                rows.extend(timed_push(tr, kind, model, info, layout, n, bucket_mb, rep,
                                                       model_bytes, pids, pool, watched, env.rank, version))
                                if rank0:    # so far: a run that dies later keeps these rows
                                    save(spec, rows, warms, extra, complete=False)
                finally:
                    for tr in transports.values():
                        tr.close()
            del model
            gc.collect()
            parallel.destroy()
        if pool is not None:
            extra["final_version"] = pool.version
            extra["health"] = [h.__dict__ for h in pool.health()]
    finally:
        if pool is not None:
            pool.close()
    if rank0:
        extra["probe_s"] = time.perf_counter() - t0
        save(spec, rows, warms, extra, complete=True)


def save(spec: dict, rows: list, warms: list, extra: dict, complete: bool) -> None:
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": rows, "warm": warms, **extra, "spec": spec, "complete": complete}, f, indent=1)
    os.replace(tmp, spec["out"])


def timed_push(tr, kind, model, info, layout, n, bucket_mb, rep, model_bytes, pids, pool, watched,
               rank, version) -> list[dict]:
    import torch.distributed as dist
    memcpy_s = memcpy_seconds(model_bytes) if rank == 0 else 0.0
    procs = (pids + descendants(os.getpid())) if rank == 0 else []
    dist.barrier()
    if rank == 0:
        wb0 = write_bytes(procs)
        EVENTS.clear()
        watch = DiskWatch(watched, procs).__enter__()
    try:
        res = tr.push(model, info, version)
    finally:
        if rank == 0:
            watch.__exit__(None, None, None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if rank != 0:
        return []
    wb1 = write_bytes(procs)
    trainer_pids = set(pids)
    wb = {"trainer": 0, "engines": 0, "unreadable": 0, "by_process": {}}
    for pid in procs:
        if wb0.get(pid) is None or wb1.get(pid) is None:
            wb["unreadable"] += 1
            continue
        delta = wb1[pid] - wb0[pid]
        wb["trainer" if pid in trainer_pids else "engines"] += delta
        if delta:
            wb["by_process"][str(pid)] = [_proc_name(pid), delta]
    split = engine_split(list(EVENTS), kind)
    disk = watch.result()
    assert pool.engines[0].version == version, (kind, pool.engines[0].version, version)
    row = {"transport": kind, "layout": layout, "engines": n, "bucket_mb": bucket_mb, "repeat": rep,
           "model_bytes": model_bytes, "sync_s": res["sync_time_s"], "memcpy_s": memcpy_s,
           "efficiency": memcpy_s / res["sync_time_s"],
           **{f"{k}_s": res.get(f"sync_{k}_s", 0.0) for k in ("gather", "convert", "pack", "wire", "stage", "load")},
           "sync_bytes": sum(r["sync_bytes"] for r in everyone), "buckets": res.get("sync_buckets"),
           **split, "write_bytes": wb, **disk,
           "per_rank": [{k: v for k, v in r.items()} for r in everyone]}
    row["trainer_only_s"] = row["sync_s"] - row["engine_load_s"]
    print(f"[probe] {kind:10s} {layout} engines={n} bucket={bucket_mb} MB: sync {row['sync_s']:.2f} s "
          f"(gather {row['gather_s']:.2f} convert {row['convert_s']:.2f} pack {row['pack_s']:.2f} "
          f"wire {row['wire_s']:.2f} stage {row['stage_s']:.2f} engine load {row['engine_load_s']:.2f}) "
          f"disk: new files {row['new_file_bytes_peak'] / 2**20:.1f} MiB, write_bytes "
          f"{(wb['trainer'] + wb['engines']) / 2**10:.0f} KiB; memcpy {memcpy_s:.3f} s", flush=True)
    return [row]


if __name__ == "__main__":
    main(sys.argv[1])
