"""The engine pool and protocol plumbing, against a scripted engine (no vLLM here: the real
engines are tested in tests/e2e). Pins load balancing, abort semantics, the update sequence
(abort -> pause -> load -> resume, also when the load fails) and hang protection."""
import asyncio
import os
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import engine_contract
import pytest
import scripted_engine
from scripted_engine import Clock
from scripted_engine import ScriptedEngine as ClockedEngine

from megarl.config.errors import ConfigError
from megarl.config.registry import ENGINE_KINDS
from megarl.config.schema import EnginesConfig, RolloutConfig
from megarl.rollout.engines import vllm_async
from megarl.rollout.engines.build import build_engine
from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth, GenRequest, GenResult
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
from megarl.rollout.engines.servers import LocalServerEngine
from megarl.rollout.engines.vllm_async import AsyncVLLMEngine
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine
from megarl.sim.engine import SimEngine


class ScriptedEngine(Engine):
    """Emits token `i` every `tick` seconds up to max_tokens; logprob -0.1 * i."""

    def __init__(self, name, tick=0.01, fail_load=False):
        self.name, self.tick, self.fail_load = name, tick, fail_load
        self.version, self.paused, self.log = 0, False, []
        self._tasks: dict[str, asyncio.Future] = {}
        self._abort: set[str] = set()

    async def start(self):
        self.log.append("start")

    @property
    def running(self):
        return len(self._tasks)

    async def generate(self, req):
        res = GenResult(req.key, engine=self.name)
        done = asyncio.get_running_loop().create_future()
        self._tasks[req.key] = done
        try:
            for i in range(req.max_tokens):
                while self.paused and req.key not in self._abort:
                    await asyncio.sleep(self.tick)
                if req.key in self._abort:
                    res.finish_reason = "abort"
                    return res
                await asyncio.sleep(self.tick)
                res.extend([i], [-0.1 * i], self.version)
            res.finish_reason = "length"
            return res
        finally:
            self._tasks.pop(req.key)
            self._abort.discard(req.key)
            done.set_result(None)

    async def abort(self, keys=None):
        keys = list(self._tasks) if keys is None else [k for k in keys if k in self._tasks]
        futs = [self._tasks[k] for k in keys]
        self._abort.update(keys)
        await asyncio.gather(*futs)

    async def pause(self):
        self.paused = True
        self.log.append("pause")

    async def resume(self):
        self.paused = False
        self.log.append("resume")

    async def reload_weights(self, path, version):
        assert self.paused and not self._tasks, "update while running"
        self.log.append(f"load {path} v{version}")
        if self.fail_load:
            raise EngineError(f"engine {self.name}: load failed")
        self.version = version

    async def health(self):
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self):
        self.log.append("close")


def run(coro):
    return asyncio.run(coro)


def test_requests_go_to_the_least_loaded_engine():
    """With 3 engines and 9 concurrent requests, each engine serves 3."""
    async def main():
        engines = [ScriptedEngine(f"e{i}") for i in range(3)]
        pool = EnginePool(engines, 10)
        results = await asyncio.gather(*(pool.generate(GenRequest(f"r{i}", [1], 5)) for i in range(9)))
        return [r.engine for r in results]
    served = run(main())
    assert sorted(served.count(f"e{i}") for i in range(3)) == [3, 3, 3]


def test_abort_resolves_every_request_with_its_partial_tokens():
    """abort() returns only after each aborted request resolved; tokens so far are kept."""
    async def main():
        pool = EnginePool([ScriptedEngine("e0"), ScriptedEngine("e1")], 10)
        tasks = [asyncio.ensure_future(pool.generate(GenRequest(f"r{i}", [1], 1000))) for i in range(4)]
        await asyncio.sleep(0.1)
        await pool.abort(["r0", "r3"])
        assert tasks[0].done() and tasks[3].done() and not tasks[1].done()
        await pool.abort()
        assert all(t.done() for t in tasks) and pool.running == 0
        return [t.result() for t in tasks]
    for r in run(main()):
        assert r.finish_reason == "abort"
        assert 0 < len(r.token_ids) < 1000
        assert r.token_ids == list(range(len(r.token_ids)))
        assert len(r.logprobs) == len(r.versions) == len(r.token_ids)


def test_update_aborts_pauses_loads_and_resumes_every_engine_and_versions_follow():
    async def main():
        engines = [ScriptedEngine("e0"), ScriptedEngine("e1")]
        pool = EnginePool(engines, 10)
        before = asyncio.ensure_future(pool.generate(GenRequest("old", [1], 1000)))
        await asyncio.sleep(0.05)
        await pool.reload_weights("/w", 7)
        old = await before
        new = await pool.generate(GenRequest("new", [1], 4))
        return engines, old, new, pool.version
    engines, old, new, version = run(main())
    assert old.finish_reason == "abort" and set(old.versions) == {0}
    assert new.versions == [7] * 4 and version == 7
    for e in engines:
        assert e.log[-3:] == ["pause", "load /w v7", "resume"]


def test_failed_load_still_resumes_and_names_the_engine():
    """An engine is never left paused after an update, even a failed one (AReaL #1160); with
    rollout.engines.failures_max=0 the failure stops the run, naming the engine."""
    engines = [ScriptedEngine("e0"), ScriptedEngine("e1", fail_load=True)]
    pool = EnginePool(engines, 10, failures_max=0)
    with pytest.raises(EngineError, match="e1.*load failed"):
        run(pool.reload_weights("/w", 3))
    assert all(not e.paused for e in engines)


def test_engine_that_cannot_load_is_retired_and_the_rest_move_on():
    engines = [ScriptedEngine("e0"), ScriptedEngine("e1", fail_load=True), ScriptedEngine("e2")]
    pool = EnginePool(engines, 10, failures_max=1)
    run(pool.reload_weights("/w", 3))
    assert [e.name for e in pool.engines] == ["e0", "e2"] and pool.version == 3
    assert [f["engine"] for f in pool.failures] == ["e1"] and "close" in engines[1].log
    assert all(not e.paused for e in engines)


class DyingEngine(ScriptedEngine):
    """Serves `after` tokens of each request, then fails as a dead server does, handing back
    the tokens it streamed."""

    def __init__(self, name, after):
        super().__init__(name)
        self.after = after

    async def generate(self, req):
        partial = await super().generate(type(req)(req.key, req.prompt_ids, min(self.after, req.max_tokens)))
        if req.max_tokens <= self.after:
            return partial
        raise EngineError(f"engine {self.name} at 127.0.0.1:1: connection lost", partial=partial)


def test_request_continues_on_another_engine_from_the_streamed_tokens():
    async def main():
        pool = EnginePool([DyingEngine("e0", after=3), ScriptedEngine("e1")], 10, failures_max=1)
        res = await pool.generate(GenRequest("r", [1, 2], 8), pool.engines[0])
        return pool, res
    pool, res = run(main())
    # e0 streamed tokens 0..2, then e1 generated the remaining 5 (its script restarts at 0)
    assert res.token_ids == [0, 1, 2, 0, 1, 2, 3, 4] and len(res.logprobs) == len(res.versions) == 8
    assert res.engine == "e1" and res.finish_reason == "length"
    assert [e.name for e in pool.engines] == ["e1"] and len(pool.failures) == 1


class StartFails(ScriptedEngine):
    async def start(self):
        raise EngineError(f"engine {self.name}: port in use")


@pytest.mark.parametrize("replacement_starts", [True, False])
def test_a_failed_engine_is_replaced_and_the_replacement_loads_before_it_serves(replacement_starts):
    """rollout.engines.restart: the failed engine is closed, a fresh one is started in its
    place, and it joins only at the next weight update, after loading that version: the first
    thing it does after starting is pause + load, and the requests after the update are spread
    over both engines again. A replacement that cannot start is logged and left out."""
    made = []

    def replace(slot):
        made.append((ScriptedEngine if replacement_starts else StartFails)(f"e{slot}'"))
        return made[-1]

    async def main():
        dying, other = DyingEngine("e0", after=3), ScriptedEngine("e1")
        pool = EnginePool([dying, other], 10, failures_max=2, replace=replace)
        first = await pool.generate(GenRequest("r", [1], 8), dying)
        for _ in range(100):             # the replacement starts in the background
            if pool.joining or (made and not replacement_starts and pool._starting[0].done()):
                break
            await asyncio.sleep(0.01)
        assert [e.name for e in pool.engines] == ["e1"]        # not serving before the update
        await pool.reload_weights("/w/v1", 1)
        after = await asyncio.gather(*(pool.generate(GenRequest(f"q{i}", [1], 4)) for i in range(4)))
        await pool.close()
        return dying, pool, first, after

    dying, pool, first, after = run(main())
    assert first.engine == "e1" and len(first.token_ids) == 8
    assert "close" in dying.log and len(pool.failures) == 1
    if replacement_starts:
        fresh = made[0]
        assert fresh.log[:4] == ["start", "pause", "load /w/v1 v1", "resume"], fresh.log
        assert fresh.version == 1 and pool.version == 1 and pool.restarts == 1
        assert {r.engine for r in after} == {"e0'", "e1"}
    else:
        assert [e.name for e in pool.engines] == ["e1"] and pool.restarts == 0
        assert {r.engine for r in after} == {"e1"}


def test_injected_engine_failure_retires_that_engine_and_every_request_completes(monkeypatch):
    """MEGARL_FAULT=engine_fail@4 (the fault harness): the pool's 4th request fails its engine;
    the engine is retired and closed, and all 9 requests finish on the other two."""
    from megarl.distributed import faults
    monkeypatch.setenv("MEGARL_FAULT", "engine_fail@4")
    faults.reset()
    try:
        async def main():
            engines = [ScriptedEngine(f"e{i}") for i in range(3)]
            pool = EnginePool(engines, 10, failures_max=1)
            results = await asyncio.gather(*(pool.generate(GenRequest(f"r{i}", [1], 5)) for i in range(9)))
            await pool.close()
            return engines, pool, results
        engines, pool, results = run(main())
    finally:
        faults.reset()
    assert len(pool.failures) == 1 and "on purpose" in pool.failures[0]["error"]
    dead = pool.retired[0]
    assert dead not in pool.engines and "close" in dead.log and len(pool.engines) == 2
    assert all(r.finish_reason == "length" and len(r.token_ids) == 5 for r in results)
    # only requests admitted before the failure (3) may have finished on the failed engine
    assert sum(r.engine == dead.name for r in results) <= 3


@pytest.mark.parametrize("engines,failures_max,message", [
    (1, 5, "no rollout engine left"),
    (2, 0, r"engines\.failures_max=0"),
])
def test_pool_gives_up_when_no_engine_is_left_or_too_many_failed(engines, failures_max, message):
    async def main():
        pool = EnginePool([DyingEngine(f"e{i}", after=2) for i in range(engines)], 10, failures_max=failures_max)
        await pool.generate(GenRequest("r", [1], 8))
    with pytest.raises(EngineError, match=message):
        run(main())


def test_duplicate_keys_in_flight_are_refused():
    async def main():
        pool = EnginePool([ScriptedEngine("e0")], 10)
        t = asyncio.ensure_future(pool.generate(GenRequest("same", [1], 100)))
        await asyncio.sleep(0.02)
        with pytest.raises(ValueError, match="already in flight"):
            await pool.generate(GenRequest("same", [1], 100))
        await pool.abort()
        await t
    run(main())


def test_sync_pool_times_out_instead_of_hanging():
    """A call that exceeds rollout.engines.timeout_s raises EngineError; it never blocks forever."""
    loop = LoopThread()
    try:
        sync = SyncPool(EnginePool([ScriptedEngine("e0")], timeout_s=0.3), loop, 5)
        with pytest.raises(EngineError, match="engines.timeout_s"):
            sync.call(asyncio.sleep(5), "sleeping", timeout=0.3)
        out = sync.generate_many([GenRequest("a", [1], 1)])
        assert out[0].token_ids == [0]
    finally:
        loop.stop()


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        GenRequest("k", [1], 0)
    with pytest.raises(ValueError, match="empty prompt"):
        GenRequest("k", [], 4)
    with pytest.raises(EngineError, match="2 tokens but 1 logprobs"):
        GenResult("k").extend([1, 2], [0.0], 0)


def test_stale_staging_folders_of_dead_runs_are_removed(tmp_path):
    """Weights staged by a crashed run (its pid is gone) are removed; a live run's are kept."""
    from megarl.rollout.weights import files
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"{files.PREFIX}{dead}-run-abc"
    live = tmp_path / f"{files.PREFIX}{os.getpid()}-run-def"
    other = tmp_path / "unrelated"
    for d in (stale, live, other):
        d.mkdir()
    assert files.clean_stale(str(tmp_path)) == [str(stale)]
    assert live.exists() and other.exists() and not stale.exists()


def test_staging_problems_are_named(tmp_path):
    from megarl.rollout.weights import files
    assert "not a writable folder" in files._staging_problem(str(tmp_path / "missing"), 0)
    msg = files._staging_problem(str(tmp_path), 1 << 60)
    assert "weight_sync.staging_dir" in msg and "MiB free" in msg
    assert files._staging_problem(str(tmp_path), 1024) is None


def test_an_engine_start_past_its_deadline_names_the_start_setting():
    """The start deadline is rollout.engines.start_timeout_s, and its error says so (it named
    rollout.engines.timeout_s, which does not govern the start)."""
    from megarl.rollout.engines.pool import LoopThread, SyncPool

    class SlowStart(ScriptedEngine):
        async def start(self):
            await asyncio.sleep(30)
    loop = LoopThread()
    try:
        with pytest.raises(EngineError, match="rollout.engines.start_timeout_s"):
            SyncPool(EnginePool([SlowStart("slow")], 10), loop, 0.3)
    finally:
        loop.stop()


@pytest.mark.parametrize("cut", ["deadline", "stop"])
def test_a_start_cut_short_closes_the_engines_it_began(cut):
    """A start that ends before every engine is up (its deadline, or a SIGTERM raising
    distributed.stop.Stopped in the waiting thread) closes every engine, the one still starting
    and the one already up, before the error leaves: a local server it had launched is not left
    running."""
    from megarl.distributed.stop import Stopped
    from megarl.rollout.engines.pool import LoopThread, SyncPool

    closed = []

    class Tracked(ScriptedEngine):
        async def close(self):
            closed.append(self.name)
            await super().close()

    class SlowStart(Tracked):
        async def start(self):
            await asyncio.sleep(30)
    loop = LoopThread()
    try:
        pool = EnginePool([Tracked("up"), SlowStart("slow")], 10)
        if cut == "deadline":
            with pytest.raises(EngineError, match="start_timeout_s"):
                SyncPool(pool, loop, 0.3)
        else:
            timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1))
            old = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(Stopped("SIGTERM")))
            try:
                timer.start()
                with pytest.raises(Stopped):
                    SyncPool(pool, loop, 30)
            finally:
                timer.cancel()
                signal.signal(signal.SIGUSR1, old)
        assert sorted(closed) == ["slow", "up"]
    finally:
        loop.stop()


def test_engine_kinds_are_the_builders_registered_next_to_them(monkeypatch):
    """rollout.engines.mode names an ENGINE_KINDS entry, registered in megarl/rollout/engines/build.py:
    the three built-in kinds build their engine classes (unstarted: nothing runs), a kind
    registered elsewhere is validated and built like them, and an unknown one is a ConfigError
    naming the setting, the value and the known kinds."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")     # engine_args' setdefault stays local
    assert ENGINE_KINDS.names() == ["inprocess", "local_servers", "remote"]
    made = {mode: build_engine(RolloutConfig(engines=EnginesConfig(mode=mode, **extra)), "/m", 3, "/logs", 1, "gloo")
            for mode, extra in [("inprocess", {}), ("local_servers", {}),
                                ("remote", {"urls": ["http://h:1", "http://h:2"]})]}
    assert type(made["inprocess"]) is AsyncVLLMEngine and made["inprocess"].engine_args["seed"] == 4
    assert made["inprocess"].engine_args["weight_transfer_config"] == {"backend": "gloo"}
    assert type(made["local_servers"]) is LocalServerEngine
    assert made["local_servers"].server.log_path == "/logs/engine_1.log" and made["local_servers"].server.proc is None
    assert type(made["remote"]) is HTTPVLLMEngine and made["remote"].url == "http://h:2"
    assert all(e.name == "engine1" for e in made.values())

    def fake(cfg, model_path, seed, log_dir, i, weight_backend, lora_rank=0):
        return ("fake", model_path, seed, i)
    ENGINE_KINDS.register("test_fake", fake)
    try:
        ENGINE_KINDS.check("test_fake")
        fake = SimpleNamespace(engines=SimpleNamespace(mode="test_fake"))
        assert build_engine(fake, "/m", 3, "/logs", 2) == ("fake", "/m", 3, 2)
    finally:
        ENGINE_KINDS._entries.pop("test_fake")
    with pytest.raises(ConfigError, match=r"rollout\.engines\.mode='cloud'.*inprocess, local_servers, remote"):
        build_engine(SimpleNamespace(engines=SimpleNamespace(mode="cloud")), "/m", 3, "/logs", 0)


# -- the engine contract (tests/engine_contract.py) on the two fakes ------------------------
class _Costs:
    load_weights_s = 0.0

    def step_s(self, batch, context_tokens, prefill_tokens, new_requests):
        return 0.001


def _scripted_subject():
    """tests/unit/scripted_engine.py's engine: prompts [gid, index, L] with L beyond any
    budget; its model gives token p the logprob behaviour_logprob(p) at any temperature."""
    clock = Clock()
    clock.start()
    e = ClockedEngine("scripted", clock)
    return clock.stop, engine_contract.Subject(
        e, prompt=lambda i: [i, 0, 10 ** 9], weights="/unused", long=10 ** 6, tempered=False,
        progress=lambda key: len((e.partial(key) or GenResult(key)).token_ids),
        reference=lambda p, toks, t: [scripted_engine.behaviour_logprob(len(p) - 3 + j) for j in range(len(toks))])


def _sim_subject():
    """megarl/sim/engine.py's SimEngine: every token TOKEN with logprob -1 (its model)."""
    e = SimEngine("sim", _Costs())
    return (lambda: None), engine_contract.Subject(
        e, prompt=lambda i: [1, 2, 3 + i], weights="/unused", long=10 ** 6, tempered=False,
        reference=lambda p, toks, t: [-1.0] * len(toks))


@pytest.mark.parametrize("check", engine_contract.CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("make", [_scripted_subject, _sim_subject], ids=["scripted", "sim"])
def test_fake_engines_keep_the_engine_contract(make, check):
    async def main():
        stop, subject = make()
        await subject.engine.start()
        try:
            await asyncio.wait_for(check(subject), 60)
        finally:
            await subject.engine.close()
            stop()
    run(main())


def test_the_contract_catches_logprobs_of_another_distribution():
    """The logprob check fails an engine whose reported logprobs are not its model's (here: a
    reference off by 0.01, as raw logprobs at T != 1 would be)."""
    async def main():
        stop, subject = _scripted_subject()
        model = subject.reference
        subject.reference = lambda p, toks, t: [x + 0.01 for x in model(p, toks, t)]
        try:
            with pytest.raises(AssertionError):
                await engine_contract.logprobs_are_of_the_sampled_distribution(subject)
        finally:
            await subject.engine.abort()
            stop()
    run(main())


class _FakeAsyncLLM:
    """Just enough of vLLM's AsyncLLM for AsyncVLLMEngine's generate/abort: one token per
    10 ms, streamed as deltas; an aborted request ends with finish_reason "abort"."""

    def __init__(self):
        self.aborted = set()

    async def generate(self, prompt, params, request_id, lora_request=None):
        for i in range(10 ** 6):
            await asyncio.sleep(0.01)
            done = request_id in self.aborted
            out = SimpleNamespace(token_ids=[] if done else [i], finish_reason="abort" if done else None,
                                  logprobs=[] if done else [{i: SimpleNamespace(logprob=-0.5)}])
            yield SimpleNamespace(outputs=[out], finished=done)
            if done:
                return

    async def abort(self, rids):
        self.aborted.update([rids] if isinstance(rids, str) else rids)


def test_in_process_abort_returns_after_the_aborted_generate_calls(monkeypatch):
    """AsyncVLLMEngine.abort returns only once the aborted generate() calls have returned (the
    protocol), not merely their stream readers: the pool may load weights right after it."""
    monkeypatch.setattr(vllm_async, "sampling_params", lambda req: None)   # no vLLM import here
    engine = AsyncVLLMEngine("e", "/m", {}, timeout_s=30)
    engine.llm = _FakeAsyncLLM()

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(GenRequest(f"k{i}", [1, 2], 10 ** 6))) for i in range(2)]
        deadline = asyncio.get_running_loop().time() + 30
        while not all(engine.progress(f"k{i}") for i in range(2)):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await engine.abort(["k0"])
        first = (tasks[0].done(), tasks[1].done(), engine.running)
        await engine.abort()
        return first, [t.done() for t in tasks], engine.running, [t.result() for t in tasks]

    first, done, running, results = run(main())
    assert first == (True, False, 1) and done == [True, True] and running == 0
    assert all(r.finish_reason == "abort" and r.token_ids and len(r.logprobs) == len(r.token_ids) for r in results)
