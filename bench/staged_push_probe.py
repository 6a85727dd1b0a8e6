"""torchrun body of `bench/weight_sync.py --staged-compare`: today's unstaged push against the
staged one (weight_sync.staged), into the same local vLLM servers, with requests in flight.

    python -m torch.distributed.run --standalone --nproc_per_node=1 bench/staged_push_probe.py SPEC.json

SPEC (written by bench/weight_sync.py): model_dir, model_bytes, engines (servers), bucket_mb,
repeats, in_flight (requests kept in flight per engine, 0: idle engines), max_tokens, gap_s,
logs, swap_log, out.

One gloo rank (TP=1, PP=1) builds the actor and opens ONE pool of `engines` local servers
(rollout.engines.mode=local_servers, megarl's gloo weight-transfer backend,
rollout.update_mode=keep: held requests continue after the push) and ONE collective transport.
A load driver on the pool's loop keeps `in_flight` requests per engine generating (ignore_eos,
`max_tokens` each, a new one as each ends), as a training round's stragglers would be.

Per repeat both routes push once, the order alternating (unstaged first on even repeats). A
route's weight group is formed (its engines learn whether they stage) before the push, untimed,
followed by an untimed push on that group, so the timed push finds what a training run's next
push finds: its group formed, its receive / staging buffers allocated. Before every timed push
`gap_s` seconds of generation give the rate before it (tokens / s).

Per timed push: the transport's stats (sync_time_s, sync_paused_s, sync_staged, the split),
tokens the engines generated during the push (the load's count at its start and end) and during
the pause, and the pause by parts from the trainer side (calls wrapped on rank 0):
begin_update (pause + hold: every engine's /pause and its wait for the held tokens), per engine
/finish_weight_update, /reset_prefix_cache, /update_weight_version (the slowest engine's), and
end_update (/resume); from the worker side (bench/staged_swap_hook, in the servers): the
finish's wait for the last staged receive (take_s) and for the prepared version (prepared_s),
the shadow's swap (swap_s), the layerwise reload's set-up, loads and finalisation (unstaged),
and when each staged receive ran (wall clock, against the pause's start); the raw log also
holds the shadow's loads and the readiness polls (`prep`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "staged_swap_hook")
CALLS: list = []      # (what, engine, t0, t1) wall clock (time.time), rank 0


class Load:
    """Keeps `per_engine` requests generating on every engine of the pool; counts tokens."""

    def __init__(self, sp, per_engine: int, max_tokens: int):
        self.sp, self.per_engine, self.max_tokens = sp, per_engine, max_tokens
        self.done_tokens = 0
        self.live: set[str] = set()
        self.stop = threading.Event()
        self.futures = []
        self.errors: list[str] = []

    def start(self) -> None:
        engines = list(self.sp.pool.engines)
        for e in engines:
            for s in range(self.per_engine):
                self.futures.append(self.sp.loop.submit(self._slot(e, s)))

    async def _slot(self, engine, slot: int) -> None:
        from megarl.rollout.engines.engine import GenRequest
        k = 0
        while not self.stop.is_set():
            key = f"load-{engine.name}-{slot}-{k}"
            req = GenRequest(key, [1, 5 + slot, 9, 12 + k % 50, 7], self.max_tokens, 1.0,
                             seed=1000 * slot + k, ignore_eos=True)
            self.live.add(key)
            try:
                r = await self.sp.pool.generate(req, engine)
                self.done_tokens += len(r.token_ids)
            except Exception as err:  # noqa: BLE001 - reported in the result, the slot stops
                self.errors.append(f"{key}: {type(err).__name__}: {err}")
                return
            finally:
                self.live.discard(key)
            k += 1

    def tokens(self) -> int:
        """Tokens generated so far (ended requests and what the live ones have), on the loop."""
        async def count():
            n = self.done_tokens
            for key in list(self.live):
                part = self.sp.pool.partial(key)
                if part is not None:
                    n += len(part.token_ids)
            return n
        return self.sp.call(count(), "counting the load's tokens", 60)

    def close(self) -> None:
        self.stop.set()
        if self.live:
            try:
                self.sp.call(self.sp.pool.abort([k for k in self.live]), "aborting the load", 120)
            except Exception as err:  # noqa: BLE001 - closing anyway
                self.errors.append(f"abort at close: {err}")
        for f in self.futures:
            try:
                f.result(120)
            except Exception as err:  # noqa: BLE001
                self.errors.append(f"at close: {err}")


def instrument(sp) -> None:
    """Time the pool's begin/end_update and every engine's HTTP control call (rank 0)."""
    pool = sp.pool
    for what in ("begin_update", "end_update"):
        real = getattr(pool, what)

        def wrapped(*a, _real=real, _what=what, **k):
            async def run():
                t = time.time()
                try:
                    return await _real(*a, **k)
                finally:
                    CALLS.append((_what, "", t, time.time()))
            return run()
        setattr(pool, what, wrapped)
    for e in pool.engines:
        real_call = e._call

        def call(method, path, *a, _real=real_call, _name=e.name, **k):
            async def run():
                t = time.time()
                try:
                    return await _real(method, path, *a, **k)
                finally:
                    CALLS.append((path.split("?")[0], _name, t, time.time()))
            return run()
        e._call = call


def instrument_wire() -> None:
    """The sender's broadcasts (one per bucket), wall clock."""
    from megarl.rollout.weights import group
    real = group.broadcast

    def timed(g, tensor, chain: bool = True):
        t = time.time()
        try:
            return real(g, tensor, chain)
        finally:
            CALLS.append(("broadcast", "", t, time.time()))
    group.broadcast = timed


def swap_records(path: str, since: float) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("t0", 0) >= since:
                out.append(r)
    return out


def parts(calls: list, swaps: list[dict], t_push: float) -> dict:
    """The pause by parts (seconds; per engine call: the slowest engine)."""
    def span(what):
        v = [(t0, t1) for w, _, t0, t1 in calls if w == what]
        return v[0] if v else None

    def slowest(path):
        per: dict = {}
        for w, name, t0, t1 in calls:
            if w == path:
                per[name] = per.get(name, 0.0) + t1 - t0
        return max(per.values(), default=0.0)
    begin, end = span("begin_update"), span("end_update")
    bc = [(t0, t1) for w, _, t0, t1 in calls if w == "broadcast"]
    out = {"begin_update_s": begin[1] - begin[0] if begin else 0.0,
           "end_update_s": end[1] - end[0] if end else 0.0,
           "pause_http_s": slowest("/pause"), "held_tokens_http_s": slowest("/megarl/held_tokens"),
           "start_http_s": slowest("/start_weight_update"), "update_http_s": slowest("/update_weights"),
           "finish_http_s": slowest("/finish_weight_update"), "reset_prefix_s": slowest("/reset_prefix_cache"),
           "version_http_s": slowest("/update_weight_version"), "resume_http_s": slowest("/resume"),
           "wire_first_start": bc[0][0] - t_push if bc else None,
           "wire_last_end": bc[-1][1] - t_push if bc else None,
           "pause_start": begin[0] - t_push if begin else None, "pause_end": end[1] - t_push if end else None}
    if begin and end:
        finishes = [(t0, t1) for w, _, t0, t1 in calls if w == "/finish_weight_update"]
        # between begin_update's end and the first finish call / after the last one's end
        if finishes:
            out["before_finish_s"] = min(t0 for t0, _ in finishes) - begin[1]
        resets = [t1 for w, _, _, t1 in calls if w == "/update_weight_version"]
        if resets:
            out["before_end_s"] = end[0] - max(resets)
    if swaps:
        for k in ("take_s", "prepared_s", "swap_s", "init_s", "load_s", "finalize_s", "total_s"):
            out[f"worker_{k}"] = max(r.get(k, 0.0) for r in swaps)
        recv = [x for r in swaps for x in r.get("recv", [])]
        out["worker_finishes"] = len(swaps)
        if recv:
            out["staged_recv_first_start"] = min(x[0] for x in recv) - t_push
            out["staged_recv_last_end"] = max(x[1] for x in recv) - t_push
            out["staged_recv_n"] = len(recv)
        out["worker_finish_start"] = min(r["t0"] for r in swaps) - t_push
    return out


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    init_distributed("gloo", timeout_s=1800)
    cpu.apply()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from megarl.config.schema import EnginesConfig, RolloutConfig, WeightSyncConfig
    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.pool import open_pool
    from megarl.rollout.weights import sync as weight_sync

    swap_log = spec["swap_log"]
    open(swap_log, "w").close()
    # only the servers started below see the hook (this process imported what it needs)
    os.environ["PYTHONPATH"] = HOOK + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["MEGARL_BENCH_SWAP_LOG"] = swap_log
    t0 = time.perf_counter()
    cfg = RolloutConfig(engines=EnginesConfig(count=spec["engines"], mode="local_servers",
                                              timeout_s=spec.get("timeout_s", 180),
                                              max_model_len=spec["max_tokens"] + 64, kv_cache_mb=spec["kv_cache_mb"]))
    assert cfg.update_mode == "keep", cfg.update_mode
    sp = open_pool(cfg, spec["model_dir"], 0, spec["logs"], "gloo")
    import megarl
    result = {"megarl": os.path.dirname(megarl.__file__), "spec": spec, "pool_start_s": time.perf_counter() - t0,
              "rows": [], "warm": [], "complete": False}
    print(f"[probe] {spec['engines']} local servers up in {result['pool_start_s']:.1f} s", flush=True)
    load = None
    tr = None
    try:
        instrument(sp)
        instrument_wire()
        parallel.initialize(1, 1, 0)
        hf_config = AutoConfig.from_pretrained(spec["model_dir"])
        tcfg = transformer_config(hf_config, 1, 1, torch.float32, False, "none", False)
        model, info = build_model(hf_config, tcfg, 128, "actor")
        ws = WeightSyncConfig(transport="collective", bucket_mb=spec["bucket_mb"], staged=False)
        tr = weight_sync.open_transport(ws, sp, "local_servers")
        assert tr.wire.stages, "the gloo wire must stage"
        if spec["in_flight"]:
            load = Load(sp, spec["in_flight"], spec["max_tokens"])
            load.start()
            deadline = time.monotonic() + 300
            while load.tokens() < 8 * spec["engines"] * spec["in_flight"]:
                assert time.monotonic() < deadline and not load.errors, f"the load never generated: {load.errors}"
                time.sleep(0.5)
        version = 0
        for rep in range(spec["repeats"]):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for staged in order:
                route = "staged" if staged else "unstaged"
                tr.ws = dataclasses.replace(ws, staged=staged)
                t = time.perf_counter()
                version += 1
                warm = tr.push(model, info, version)     # forms the route's group; buffers allocated
                result["warm"].append({"route": route, "repeat": rep, "s": time.perf_counter() - t,
                                       "sync_time_s": warm["sync_time_s"], "sync_paused_s": warm["sync_paused_s"]})
                tok_gap0 = load.tokens() if load else 0
                time.sleep(spec["gap_s"])
                CALLS.clear()
                version += 1
                tok0 = load.tokens() if load else 0
                t_push = time.time()
                res = tr.push(model, info, version)
                t_end = time.time()
                tok1 = load.tokens() if load else 0
                assert sp.version == version, (sp.version, version)
                calls = list(CALLS)
                time.sleep(0.3)                        # the servers' swap lines reach the log
                row = {"route": route, "repeat": rep, "version": version,
                       **{k: v for k, v in res.items()},
                       "tokens_before_rate": (tok0 - tok_gap0) / spec["gap_s"],
                       "tokens_in_push": tok1 - tok0, "tokens_rate_in_push": (tok1 - tok0) / (t_end - t_push),
                       **parts(calls, swap_records(swap_log, t_push - 1e-3), t_push)}
                result["rows"].append(row)
                print(f"[probe] rep {rep} {route:8s}: total {row['sync_time_s']:.2f} s, paused "
                      f"{row['sync_paused_s']:.2f} s (begin {row['begin_update_s']:.2f}, finish "
                      f"{row['finish_http_s']:.2f} [worker take {row.get('worker_take_s', 0):.2f} load "
                      f"{row.get('worker_load_s', 0):.2f} finalize {row.get('worker_finalize_s', 0):.2f}], "
                      f"prefix {row['reset_prefix_s']:.2f}, end {row['end_update_s']:.2f}); tokens in push "
                      f"{row['tokens_in_push']} ({row['tokens_rate_in_push']:.0f}/s vs "
                      f"{row['tokens_before_rate']:.0f}/s before)", flush=True)
                save(spec, result)
        result["health"] = [h.__dict__ for h in sp.health()]
        result["complete"] = True
    finally:
        if load is not None:
            load.close()
            result["load_errors"] = load.errors[:10]
        if tr is not None:
            tr.close()
        sp.close()
        parallel.destroy()
    result["probe_s"] = time.perf_counter() - t0
    save(spec, result)
    print(f"[probe] done in {result['probe_s']:.0f} s", flush=True)


def save(spec: dict, result: dict) -> None:
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, spec["out"])


if __name__ == "__main__":
    main(sys.argv[1])
