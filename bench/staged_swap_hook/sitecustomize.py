"""Bench-only timing hook inside the vLLM servers of bench/staged_push_probe.py (never used by
megarl itself): the probe puts this folder on the servers' PYTHONPATH and names a log file in
$MEGARL_BENCH_SWAP_LOG. When a server process imports megarl's gloo weight-transfer backend,
its worker's `finish_weight_update` (the swap) is timed by parts and one JSON line per call is
appended to the log: the wait for the staging area's last receive (`take_s`), vLLM's layerwise
reload set-up / finalisation (`init_s` / `finalize_s`), the wait for the version prepared beside
the model (`prepared_s`) and its swap (`swap_s`), the loads (`load_s`: the rest; unstaged: the
last bucket's load), and the staging receives of the session (wall-clock spans). Nothing
is changed in what the calls do."""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

LOG = os.environ.get("MEGARL_BENCH_SWAP_LOG", "")
TARGET = "megarl.rollout.weights.gloo_backend"
_now: dict = {}                  # the finish being timed (one per worker process at a time)
_recv: list = []                 # staging receives since the last finish: (t0, t1, bytes)
_prep: list = []                 # the shadow's loads / finish and the readiness asks: (what, t0, t1)
_lock = threading.Lock()


def _timed(fn, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if _now:
                _now[key] = _now.get(key, 0.0) + time.perf_counter() - t
    return wrapper


def _patch(mod) -> None:
    from vllm.model_executor.model_loader import reload

    from megarl.rollout.weights import group, shadow, staging
    reload.initialize_layerwise_reload = _timed(reload.initialize_layerwise_reload, "init_s")
    reload.finalize_layerwise_reload = _timed(reload.finalize_layerwise_reload, "finalize_s")
    staging.StagingArea.take = _timed(staging.StagingArea.take, "take_s")
    for area in (staging.StagingArea, staging.ShardedStaging):
        area.wait_prepared = _timed(area.wait_prepared, "prepared_s")
    shadow.Shadow.swap = _timed(shadow.Shadow.swap, "swap_s")

    def spanned(fn, what):
        def wrapper(*a, **k):
            t = time.time()
            out = None
            try:
                out = fn(*a, **k)
                return out
            finally:
                with _lock:
                    _prep.append((what if out is None else f"{what}={out}", t, time.time()))
        return wrapper
    shadow.Shadow.load = spanned(shadow.Shadow.load, "load")
    shadow.Shadow.finish = spanned(shadow.Shadow.finish, "finish")
    mod.GlooWeightTransferEngine.staged_ready = spanned(mod.GlooWeightTransferEngine.staged_ready, "ready")
    real_pass = group.chain_pass

    def chain_pass(g, tensor, *args, **kwargs):   # every signature of group.chain_pass
        t = time.time()
        try:
            return real_pass(g, tensor, *args, **kwargs)
        finally:
            if threading.current_thread().name == "megarl-weight-staging":
                with _lock:
                    _recv.append((t, time.time(), int(tensor.numel() * tensor.element_size())))
    group.chain_pass = chain_pass
    cls = mod.GlooWeightTransferEngine
    real_finish = cls.finish_weight_update

    def finish_weight_update(self):
        _now.clear()
        _now.update(t0=time.time(), pid=os.getpid(), rank=self.rank, staged=bool(self.staged))
        t = time.perf_counter()
        err = None
        try:
            return real_finish(self)
        except BaseException as e:
            err = f"{type(e).__name__}: {e}"
            raise
        finally:
            rec = dict(_now, total_s=time.perf_counter() - t, t1=time.time(), error=err)
            _now.clear()
            rec["load_s"] = rec["total_s"] - sum(rec.get(k, 0.0) for k in ("take_s", "init_s", "finalize_s",
                                                                             "prepared_s", "swap_s"))
            with _lock:
                rec["recv"], _recv[:] = list(_recv), []
                rec["prep"], _prep[:] = list(_prep), []
            if LOG:
                with open(LOG, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    cls.finish_weight_update = finish_weight_update


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the backend module right after it is executed, once."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


if LOG and TARGET not in sys.modules:
    sys.meta_path.insert(0, _Finder())
