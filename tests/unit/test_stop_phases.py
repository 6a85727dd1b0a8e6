"""A SIGTERM during the first weight push or an evaluation stops the run at its next safe point
(megarl/train.py `Trainer.run`, megarl/distributed/stop.py), instead of after a whole step:

- the evaluation's generation runs inside `StopSignal.interruptible()`: a SIGTERM raises
  Stopped there and its requests are cancelled; what it scores, dumps and logs is never cut
  short, and the final evaluation (after the last step, its checkpoint saved) is not cut;
- the first push is cut short on a single trainer rank; with several, rank 0 leaving it would
  leave the others in its collectives, so the stop waits for its end;
- every rank votes after the first push and after each evaluation: all of them stop before
  the step with the line the cluster scripts requeue on ('stopping before step N'), the last
  step trained is saved, nothing else.

Trainer-level cases run the real `run()` on fakes of the phases (a push, an evaluation, a
step); the evaluation's own cut runs the real Evaluator on a scripted pool; two gloo ranks
check that they agree. The engine start's stop: test_engine_pool.py, tests/e2e/test_train_cli.py."""
from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp
from scripted_engine import ScriptedEngine
from test_eval_runner import Tokenizer, pool  # noqa: F401  (the scripted pool)

from megarl.bootstrap import bootstrap

HANG_S = 20   # a phase a SIGTERM does not cut would last this long


@pytest.fixture(autouse=True)
def sigterm_handler():
    """StopSignal installs its SIGTERM handler: the test process gets its own back after."""
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.fixture(scope="module")
def train():
    bootstrap()   # before anything imports megatron
    import megarl.train
    return megarl.train


def term_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def hang() -> None:
    """A long phase: returns after HANG_S unless a Stopped cuts it short."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        time.sleep(0.05)


class Transport:
    def __init__(self, term_at: set, cut: bool):
        self.term_at, self.cut, self.pushed = term_at, cut, []

    def push(self, model, info, version):
        if version in self.term_at:
            term_self()
            if self.cut:
                hang()
        self.pushed.append(version)
        return {}


class Evaluation:
    """What eval/runner.Evaluator does with a SIGTERM during its generation (its own test below)."""

    def __init__(self, stop, term_at: set, steps: int):
        self.stop, self.term_at, self.steps, self.at_calls, self.end_calls = stop, term_at, steps, [], []

    def at(self, step):
        self.at_calls.append(step)
        if step in self.term_at:
            with self.stop.interruptible():
                term_self()
                hang()

    def at_end(self, last, start):
        if last == self.steps - 1 and last >= start:   # as the Evaluator's: after the last step only
            self.end_calls.append(last)


def fake_trainer(train, tmp_path, *, world=1, rank=0, push_term=(), eval_term=(), every=0, steps=4):
    """A Trainer past setup: its push, evaluation and steps are fakes; what run() does with
    them is megarl's. eval.every=2 (and at the start)."""
    from megarl.config.loader import load_config
    from megarl.distributed.stop import StopSignal
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "1 2 3", "answer": "x"}\n')
    cfg = load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path / 'run'}", f"train.steps={steps}",
                                                f"eval.datasets=[{held}]", "eval.every=2", f"checkpoint.every={every}"])
    t = train.Trainer(cfg)
    t.env, t.is_driver, t.start = SimpleNamespace(world_size=world, rank=rank), rank == 0, 0
    t.stop = StopSignal()
    t.eval_sets = ["held"]
    t.models = SimpleNamespace(actor=SimpleNamespace(model=None, info=None))
    t.transport = Transport(set(push_term) if rank == 0 else set(), cut=world == 1)
    if t.is_driver:
        t.evaluator = Evaluation(t.stop, set(eval_term), steps)
        t.logger = SimpleNamespace(bar=SimpleNamespace(lines=[]))
        t.logger.bar.write = t.logger.bar.lines.append
    t.trained, t.saved = [], []
    t.step = t.trained.append
    t.save = t.saved.append
    return t


def run_timed(t) -> float:
    t0 = time.monotonic()
    t.run()
    return time.monotonic() - t0


def test_a_sigterm_during_the_first_push_stops_before_step_0(train, tmp_path):
    t = fake_trainer(train, tmp_path, push_term={0})
    assert run_timed(t) < HANG_S / 2, "the push was not cut short"
    assert t.trained == [] and t.saved == [] and t.transport.pushed == []
    assert t.evaluator.at_calls == [] and t.evaluator.end_calls == []
    assert t.logger.bar.lines == ["stopping before step 0 (SIGTERM): nothing new to save"]


def test_a_sigterm_during_the_first_evaluation_stops_before_step_0(train, tmp_path):
    t = fake_trainer(train, tmp_path, eval_term={0})
    assert run_timed(t) < HANG_S / 2, "the evaluation was not cut short"
    assert t.transport.pushed == [0] and t.evaluator.at_calls == [0]
    assert t.trained == [] and t.saved == [] and t.evaluator.end_calls == []
    assert t.logger.bar.lines == ["stopping before step 0 (SIGTERM): nothing new to save"]


@pytest.mark.parametrize("every,saved", [(0, [1]), (2, [])])
def test_a_sigterm_during_a_later_evaluation_saves_the_last_step_and_stops_before_the_next(train, tmp_path,
                                                                                          every, saved):
    """The evaluation at the top of step 2 (version 2): steps 0 and 1 are trained, step 1 is
    saved unless its checkpoint is on schedule (then saved by the step already), step 2 is not
    trained, and the final evaluation does not run."""
    t = fake_trainer(train, tmp_path, eval_term={2}, every=every)
    assert run_timed(t) < HANG_S / 2, "the evaluation was not cut short"
    assert t.trained == [0, 1] and t.saved == saved and t.evaluator.at_calls == [0, 2]
    assert t.evaluator.end_calls == []
    what = "saving a checkpoint" if saved else "nothing new to save"
    assert t.logger.bar.lines == [f"stopping before step 2 (SIGTERM): {what}"]


def test_without_a_stop_every_step_runs_and_the_final_evaluation_too(train, tmp_path):
    t = fake_trainer(train, tmp_path)
    t.run()
    assert t.trained == [0, 1, 2, 3] and t.saved == [3] and t.evaluator.at_calls == [0, 2]
    assert t.evaluator.end_calls == [3] and t.logger.bar.lines == []


class TermOnRequest(ScriptedEngine):
    """Sends this process a SIGTERM when an evaluation request arrives: it is in flight then."""

    async def generate(self, req):
        term_self()
        return await super().generate(req)


@pytest.fixture
def hung_pool():
    """A pool of one scripted engine whose requests hang after their first token (for good:
    its own timeout is 10**9 ticks), sending a SIGTERM as each arrives."""
    from scripted_engine import Clock

    from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
    loop = LoopThread()

    async def start_clock():
        clock = Clock()
        clock.start()
        return clock
    clock = loop.run(start_clock(), 10)
    engine = TermOnRequest("hung", clock, stall_after=1, timeout_ticks=10**9)
    sync = SyncPool(EnginePool([engine], 30), loop, 10)
    yield sync, engine
    loop.run(_stop(clock), 10)
    sync.close()


async def _stop(clock):
    clock.stop()


def evaluator(cfg, tmp_path, sync, stop):
    from megarl.eval.datasets import load_eval_sets
    from megarl.eval.runner import Evaluator
    from megarl.metrics.logger import MetricsLogger
    logger = MetricsLogger(cfg.run.dir, cfg.train.steps, tensorboard=False, progress=False)
    return Evaluator(cfg, load_eval_sets(cfg), sync, Tokenizer(), logger, stop), logger


def eval_config(tmp_path):
    from megarl.config.loader import load_config
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"0 {i} 3", "answer": "x"}) + "\n" for i in range(4)))
    return load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path / 'run'}", "rollout.mode=sync", "train.steps=2",
                                                 f"eval.datasets=[{held}]", "eval.verifiers=[exact]"])


def evaluate_until_stopped(sync, tmp_path):
    """The real Evaluator's `at(0)` on `sync`, which must raise Stopped; its StopSignal."""
    from megarl.distributed.stop import Stopped, StopSignal
    stop = StopSignal()
    ev, logger = evaluator(eval_config(tmp_path), tmp_path, sync, stop)
    try:
        with pytest.raises(Stopped):
            ev.at(0)
    finally:
        ev.close()
        logger.close()
    return stop


def wait_until(done, within_s: float = 30) -> None:
    """Poll `done()` until it holds or `within_s` passed (the caller asserts what it needs)."""
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_evaluation_s_generation_is_cut_by_a_sigterm_and_its_requests_cancelled(hung_pool, tmp_path):
    """The real Evaluator, its requests hanging on a scripted engine: the SIGTERM raises
    Stopped out of `at`, the requests are cancelled (none left running on the engine), and
    nothing is logged or dumped."""
    sync, engine = hung_pool
    stop = evaluate_until_stopped(sync, tmp_path)
    assert stop.signalled and engine.served > 0
    wait_until(lambda: engine.running == 0)
    assert engine.running == 0, "the evaluation's requests were left running"
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    assert not (tmp_path / "run" / "eval").exists()


def test_a_sigterm_landing_as_the_requests_are_submitted_still_cancels_them(hung_pool, tmp_path, monkeypatch):
    """The SIGTERM's handler runs in the main thread at whatever line it is on: here just
    after the evaluation's requests were handed to the pool's loop and before the driver waits
    for them (where a loaded machine's main thread often is when the first request reaches the
    engine). The run still stops with Stopped and no request is left running on the engine."""
    sync, engine = hung_pool
    submit, generation = sync.loop.submit, []

    def submit_then_term(coro):
        future = submit(coro)
        if coro.__qualname__ == "generate_limited":   # the evaluation's requests
            generation.append(future)
            term_self()        # the handler runs before this function returns
        return future
    monkeypatch.setattr(sync.loop, "submit", submit_then_term)
    evaluate_until_stopped(sync, tmp_path)
    wait_until(lambda: generation[0].done() and engine.running == 0)
    assert generation[0].cancelled(), "the evaluation's generation was left running"
    assert engine.running == 0, "the evaluation's requests were left running"


def test_the_final_evaluation_is_not_cut_by_a_sigterm(pool, tmp_path):  # noqa: F811
    """After the last step (its checkpoint saved) the final evaluation runs to its end
    whatever was signalled; at the top of a step a SIGTERM already received stops the
    evaluation before any request."""
    from megarl.distributed.stop import Stopped, StopSignal
    cfg = eval_config(tmp_path)
    stop = StopSignal()
    stop.signalled = True
    ev, logger = evaluator(cfg, tmp_path, pool, stop)
    try:
        with pytest.raises(Stopped):
            ev.at(0)
        assert sum(e.served for e in pool.engines) == 0
        ev.at_end(cfg.train.steps - 1, start=0)
    finally:
        ev.close()
        logger.close()
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [2] and logged[0]["eval/held/prompts"] == 4


def _rank(rank: int, store: str, root: str) -> None:
    """One of two gloo ranks: each case's run() on fakes; rank 0 alone gets the SIGTERM."""
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    bootstrap()
    import megarl.train as train
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))   # a rank left waiting fails, not hangs
    out = {}
    for name, kw in (("push", {"push_term": {0}}), ("eval", {"eval_term": {2}}), ("none", {})):
        folder = Path(root) / f"{name}{rank}"
        folder.mkdir()
        t = fake_trainer(train, folder, world=2, rank=rank, **kw)
        t.run()
        out[name] = {"trained": t.trained, "saved": t.saved, "pushed": t.transport.pushed,
                     "lines": t.logger.bar.lines if t.is_driver else None}
    Path(root, f"out{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_two_ranks_agree_on_a_stop_only_rank_0_was_signalled_for(tmp_path):
    """With two trainer ranks the first push is not cut (rank 1 would be left in its
    collectives): it ends, and both ranks stop before step 0; at an evaluation (rank 0's
    alone) both stop before step 2 and save step 1; without a stop both train every step."""
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert got[r]["push"] | {"lines": None} == {"trained": [], "saved": [], "pushed": [0], "lines": None}
        assert got[r]["eval"] | {"lines": None} == {"trained": [0, 1], "saved": [1], "pushed": [0], "lines": None}
        assert got[r]["none"] | {"lines": None} == {"trained": [0, 1, 2, 3], "saved": [3], "pushed": [0],
                                                    "lines": None}
    assert got[0]["push"]["lines"] == ["stopping before step 0 (SIGTERM): nothing new to save"]
    assert got[0]["eval"]["lines"] == ["stopping before step 2 (SIGTERM): saving a checkpoint"]
