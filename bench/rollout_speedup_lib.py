"""Helpers of bench/rollout_speedup.py: length distributions, the in-flight recorder (an engine
wrapper), the decode-curve interpolation and the timeline plot. No vLLM import here."""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Optional

import numpy as np

from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.controller.slots import Group
from megarl.rollout.engines.engine import Engine, GenRequest, GenResult
from megarl.sim.costs import interp  # noqa: F401  (t(b) of the decode curve; re-exported)


class Measured(PartialRolloutController):
    """The stock controller, unchanged, plus two measurements: when the round's target was
    reached (`t_target`), and how many requests it admitted after that (`late_admissions`)."""

    t_target: Optional[float] = None
    late_admissions: int = 0
    fill_s: float = 0.0          # time in _fill (admission: choosing slots, creating tasks)
    emit_s: float = 0.0          # time in _emit (scoring complete groups)

    async def run_round(self, target: int, version: int, wanted=None):
        self.t_target, self.late_admissions, self.fill_s, self.emit_s = None, 0, 0.0, 0.0
        return await super().run_round(target, version, wanted)

    def _emit(self, group: Group) -> None:
        t = time.perf_counter()
        super()._emit(group)
        self.emit_s += time.perf_counter() - t
        if self.t_target is None and self._round_done is not None and self._round_done.is_set():
            self.t_target = time.perf_counter()

    def _fill(self) -> None:
        before, t = len(self._inflight), time.perf_counter()
        super()._fill()
        self.fill_s += time.perf_counter() - t
        if self.t_target is not None:
            self.late_admissions += max(0, len(self._inflight) - before)


class EndOnTarget(Measured):
    """Once the round's target is reached, admit nothing more. Before commit 2fff5a0 the
    controller set `_ending` only when run_round woke up, so `_serve`s resolving in between
    still called `_fill()` and started requests the round then had to abort (and which, with
    the engine race below, ran to their full budget). The controller does this itself now;
    kept so the bench measures the same thing against older checkouts."""

    def _emit(self, group: Group) -> None:
        super()._emit(group)
        if self._round_done is not None and self._round_done.is_set():
            self._ending = True


# -- length distributions: megarl.sim.workload (shared with the simulator) -------------------
def parse_dist(spec: str):
    """lognormal:mu=M,sigma=S | pareto:alpha=A,xmin=X | fixed:len=L"""
    from megarl.sim.workload import parse_dist as parse
    try:
        return parse(spec)
    except ValueError as err:
        raise SystemExit(f"--length-dist: {err}") from None


def summarize_lengths(length_of: Callable[[int, int], int], groups: int, n: int) -> dict:
    x = np.array([length_of(g, j) for g in range(groups) for j in range(n)])
    med = float(np.median(x))
    return {"draws": int(x.size), "mean": float(x.mean()), "median": med,
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)), "max": int(x.max()),
            "p99_over_median": float(np.percentile(x, 99)) / med}


# -- decode curve --------------------------------------------------------------------------
def active_profile(lengths: list[int]) -> list[int]:
    """Requests still generating at decode step s = 1 .. max(lengths)."""
    ls = sorted(lengths)
    m = len(ls)
    out, i = [], 0
    for s in range(1, (ls[-1] if ls else 0) + 1):
        while i < m and ls[i] < s:
            i += 1
        out.append(m - i)
    return out


# -- recording -----------------------------------------------------------------------------
class Recorder:
    """Phases of each mode (rollout / train / weights) and request start/end events."""

    def __init__(self):
        self.mode: Optional[str] = None
        self.kind: Optional[str] = None
        self.phases: list[tuple[str, str, float, float]] = []
        self._t0 = 0.0
        self.events: list[tuple[float, str, int, str]] = []     # (t, engine, +1/-1, mode)
        self.tokens: dict[str, int] = defaultdict(int)
        self.requests: dict[str, int] = defaultdict(int)
        self.reprefill_tokens: dict[str, int] = defaultdict(int)
        self.prompt_len: Callable[[int], int] = lambda gid: 0
        self.last_emit: Optional[float] = None
        self.aborts: list[tuple[str, float, float]] = []          # (mode, start, end) per engine abort
        # modes whose rounds also run through their train and push phases (rollout.partial.async):
        # all of their phases count as rollout time in the in-flight figures
        self.background: set[str] = set()

    def begin(self, mode: str, kind: str) -> None:
        self.mode, self.kind, self._t0 = mode, kind, time.perf_counter()

    def end(self) -> None:
        self.phases.append((self.mode, self.kind, self._t0, time.perf_counter()))
        self.mode = self.kind = None

    def last_phase_s(self) -> float:
        _, _, a, b = self.phases[-1]
        return b - a

    def _generating(self, mode: str, kind: str) -> bool:
        return kind == "rollout" or mode in self.background

    def started(self, engine: str, req: GenRequest, own: Optional[str] = None) -> Optional[str]:
        """`own`: the mode of an engine pool that only one mode uses (its requests are that mode's
        whatever phase runs when they start)."""
        mode = own or (self.mode if self.kind == "rollout" else None)
        if mode is None:
            return None
        self.events.append((time.perf_counter(), engine, +1, mode))
        self.requests[mode] += 1
        if req.key.startswith("g") and "s" in req.key:   # controller keys: g{gid}s{index}a{attempt}
            gid = int(req.key[1:].split("s", 1)[0])
            self.reprefill_tokens[mode] += max(0, len(req.prompt_ids) - self.prompt_len(gid))
        return mode

    def finished(self, engine: str, mode: Optional[str], result: Optional[GenResult]) -> None:
        if mode is None:
            return
        self.events.append((time.perf_counter(), engine, -1, mode))
        if result is not None:
            self.tokens[mode] += len(result.token_ids)

    # -- derived -------------------------------------------------------------------------
    def _segments(self, mode: str, engine: Optional[str] = None):
        """(t0, t1, in-flight) pieces over the mode's rollout phases (one engine or all)."""
        ev = sorted((t, d) for t, e, d, m in self.events if m == mode and (engine is None or e == engine))
        for _, _kind, a, b in [p for p in self.phases if p[0] == mode and self._generating(mode, p[1])]:
            # requests held over a weight update (rollout.update_mode=keep) span phases: a
            # phase starts with those still in flight (abort modes: none)
            count = sum(d for t, d in ev if t < a)
            pts = [(t, d) for t, d in ev if a <= t <= b]
            last = a
            for t, d in pts:
                if t > last:
                    yield last, t, count
                count += d
                last = t
            if b > last:
                yield last, b, count

    def busy(self, mode: str, engines: int) -> dict:
        names = sorted({e for _, e, _, m in self.events if m == mode}) or ["engine0"]
        busy_t = sum(t1 - t0 for name in names for t0, t1, c in self._segments(mode, name) if c > 0)
        area = sum((t1 - t0) * c for t0, t1, c in self._segments(mode))
        roll = sum(b - a for m, k, a, b in self.phases if m == mode and self._generating(m, k))
        wall = sum(b - a for m, k, a, b in self.phases if m == mode)
        return {"wall": busy_t / engines / max(wall, 1e-9), "rollout": busy_t / engines / max(roll, 1e-9),
                "inflight_mean": area / max(roll, 1e-9)}

    def underfill_s(self, mode: str, curve: dict, conc: int, engines: int) -> float:
        """Rollout time lost to fewer than conc/engines requests in flight per engine, valued
        with the decode curve: integral of (1 - rate(b) / rate(full)) dt, rate(b) = b / t(b)."""
        full = conc / engines
        rate_full = full / interp(curve, full)
        names = sorted({e for _, e, _, m in self.events if m == mode})
        lost = 0.0
        for name in names:
            for t0, t1, c in self._segments(mode, name):
                rate = c / interp(curve, c) if c > 0 else 0.0
                lost += (t1 - t0) * max(0.0, 1.0 - rate / rate_full)
        return lost / max(1, len(names))

    def rollout_timeline(self, mode: str) -> dict:
        """The mode's in-flight count on its own rollout clock (train, weight pushes and the
        other modes cut out): step-function points (t, count) rounded to 1 ms, plus the
        clock time at which each of its rounds starts."""
        offset, ts, ys, starts = 0.0, [], [], []
        segs = list(self._segments(mode))
        for m, kind, a, b in self.phases:
            if m != mode or not self._generating(m, kind):
                continue
            starts.append(round(offset, 3))
            for t0, t1, c in segs:
                if a <= t0 <= b:
                    ts += [round(offset + t0 - a, 3), round(offset + t1 - a, 3)]
                    ys += [c, c]
            offset += b - a
        return {"t": ts, "inflight": ys, "round_starts": starts, "total_s": round(offset, 3)}


class Tracked(Engine):
    """An engine of the pool that tells the Recorder when each request starts and resolves."""

    def __init__(self, inner: Engine, rec: Recorder, mode: Optional[str] = None):
        self.inner, self.rec, self.name, self.mode = inner, rec, inner.name, mode

    @property
    def version(self) -> int:   # type: ignore[override]
        return self.inner.version

    async def start(self) -> None:
        await self.inner.start()

    async def generate(self, req: GenRequest) -> GenResult:
        mode = self.rec.started(self.name, req, self.mode)
        result = None
        try:
            result = await self.inner.generate(req)
            return result
        finally:
            self.rec.finished(self.name, mode, result)

    async def abort(self, keys=None) -> None:
        t = time.perf_counter()
        try:
            await self.inner.abort(keys)
        finally:
            if self.rec.mode is not None:
                self.rec.aborts.append((self.rec.mode, t, time.perf_counter()))

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def reload_weights(self, path: str, version: int) -> None:
        await self.inner.reload_weights(path, version)

    def partial(self, key: str):
        return self.inner.partial(key)

    async def clear_kv(self) -> None:
        await self.inner.clear_kv()

    async def health(self):
        return await self.inner.health()

    @property
    def running(self) -> int:
        return self.inner.running

    async def close(self) -> None:
        await self.inner.close()


# -- plot ----------------------------------------------------------------------------------
def plot_timeline(result: dict, path: str) -> None:
    """In-flight requests over each mode's rollout clock (from result["timeline"]), and each
    mode's end-to-end wall split; everything it needs is in the JSON the bench writes."""
    try:
        import matplotlib
    except ImportError:   # not a megarl dependency: the JSON has everything, --replot draws it later
        print(f"matplotlib is not installed: {path} not drawn (pip install matplotlib; then --replot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(result["timeline"])
    conc = result["concurrency"]
    fig, axes = plt.subplots(len(modes) + 1, 1, figsize=(10, 1.4 + 1.8 * (len(modes) + 1)),
                             gridspec_kw={"height_ratios": [2] * len(modes) + [1.3]})
    fill = {"sync": "#3b75af", "partial": "#4c9a52", "partial_fix": "#8a5fb0", "partial_s2": "#c0713a"}
    xmax = max(result["timeline"][m]["total_s"] for m in modes) * 1.01
    for ax, mode in zip(axes, modes):
        tl = result["timeline"][mode]
        f = result["sync_figures"] if mode == "sync" else result[mode]
        ax.fill_between(tl["t"], tl["inflight"], color=fill.get(mode, "#666"), lw=0.4)
        for x in tl["round_starts"][1:]:
            ax.axvline(x, color="#888", lw=0.4)
        ax.axhline(conc, color="k", ls="--", lw=0.7)
        extra = "" if mode == "sync" else (f"; rollout speedup {f['rollout_speedup']:.2f}x, "
                                           f"efficiency vs ideal {f['efficiency_vs_ideal']:.2f}")
        ax.set_title(f"{mode}: rollout {f['rollout_s']:.1f} s (ideal {f['ideal_rollout_s']:.1f} s), "
                     f"slot use {f['slot_utilization']:.2f}{extra}", fontsize=8, loc="left")
        ax.set_ylabel("in flight", fontsize=8)
        ax.set_xlim(0, xmax)
        ax.set_ylim(0, conc * 1.1)
        ax.tick_params(labelsize=7)
    axes[len(modes) - 1].set_xlabel("seconds of rollout on each mode's own clock (grey lines: round "
                                    "starts; dashed: concurrency)", fontsize=8)
    ax = axes[-1]
    for y, mode in enumerate(modes):
        f = result["sync_figures"] if mode == "sync" else result[mode]
        left = 0.0
        for key, color, label in (("rollout_s", fill.get(mode, "#666"), "rollout"), ("train_s", "#f4c27a", "train"),
                                  ("push_s", "#999", "weight push")):
            ax.barh(y, f[key], left=left, color=color, label=label if y == 0 or key == "rollout_s" else None)
            left += f[key]
        ax.text(left, y, f" {left:.0f} s" + ("" if mode == "sync" else f"  (e2e speedup {f['speedup']:.2f}x)"),
                va="center", fontsize=7)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="#f4c27a", label="train"), Patch(color="#999", label="weight push")],
              fontsize=7, loc="lower right")
    ax.set_yticks(range(len(modes)), modes, fontsize=7)
    ax.invert_yaxis()
    ax.tick_params(labelsize=7)
    ax.set_xlim(0, max((result["sync_figures"] if m == "sync" else result[m])["wall_s"] for m in modes) * 1.3)
    ax.set_xlabel("end-to-end seconds (rollout + train + weight push)", fontsize=8)
    fig.suptitle(f"{result['length_dist']} (cap {result['max_len']}), {result['groups_per_step']}x{result['n']} "
                 f"samples/step, concurrency {conc}, {result['steps']} steps, train={result['train']}; "
                 f"ideal rollout speedup {result['ideal_rollout_speedup']:.2f}x", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# -- a scripted reward (the group filter's workload) ------------------------------------------
def scripted_reward(seed: int, flat_share: float) -> Callable:
    """reward(sample): group g (Sample.uid) is flat with probability `flat_share`, drawn once
    per group (numpy seeded with (seed, g)): every sample of it scores the group's 0 or 1;
    another group's samples score uniform draws (all equal with probability 0)."""
    flat: dict[int, Optional[float]] = {}
    rng = np.random.default_rng([seed, 10**6])

    def reward(sample) -> float:
        if sample.uid not in flat:
            r = np.random.default_rng([seed, sample.uid])
            flat[sample.uid] = float(r.integers(0, 2)) if r.random() < flat_share else None
        value = flat[sample.uid]
        return value if value is not None else float(rng.random())
    return reward


# -- a simulated engine (checks the bench's arithmetic without vLLM) -------------------------
class FakeEngine(Engine):
    """Decode loop with a known step time t(b) = a + c * b seconds for b active requests;
    one token per active request per step, prefill free. `--fake-engine A_MS,C_MS`."""

    def __init__(self, name: str, a: float, c: float):
        import asyncio
        self.name, self.a, self.c, self.version = name, a, c, 0
        self._active: dict[str, tuple] = {}
        self._wake = asyncio.Event()
        self._loop_task = None
        self._paused = False

    async def start(self) -> None:
        import asyncio
        self._loop_task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        import asyncio
        while True:
            if not self._active or self._paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            b = len(self._active)
            await asyncio.sleep(self.a + self.c * b)
            for key, (req, res, fut) in list(self._active.items()):
                res.extend([3], [-1.0], self.version)
                if len(res.token_ids) >= req.max_tokens:
                    res.finish_reason = "length"
                    del self._active[key]
                    fut.set_result(res)

    async def generate(self, req: GenRequest) -> GenResult:
        import asyncio
        fut = asyncio.get_running_loop().create_future()
        self._active[req.key] = (req, GenResult(req.key, engine=self.name), fut)
        self._wake.set()
        return await fut

    async def abort(self, keys=None) -> None:
        for key in list(self._active if keys is None else keys):
            if key in self._active:
                _, res, fut = self._active.pop(key)
                fut.set_result(res)

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def reload_weights(self, path: str, version: int) -> None:
        self.version = version

    async def health(self):
        from megarl.rollout.engines.engine import EngineHealth
        return EngineHealth(self.name, True, self._paused, self.running, self.version, "fake")

    @property
    def running(self) -> int:
        return len(self._active)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
