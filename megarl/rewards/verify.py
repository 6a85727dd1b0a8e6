"""Scoring one sample never stops the run: a verifier that raises, or takes longer than
`reward.timeout_s`, scores 0 and is counted (`reward_errors`, `reward_timeouts` per step).

Verifiers that can hang (sympy / LaTeX parsing in `math`) run in a worker process that is killed
and replaced when a call times out: a thread cannot be stopped, and the trainer process runs
torch (and vLLM's event loop), so forking it is unsafe. The worker is a fresh interpreter started
on first use and kept for later calls; its start-up (importing sympy takes seconds) does not count
against the timeout, and a worker that cannot start at all stops the run (no sample could be
scored). Functions travel pickled by reference (module + name), so a verifier must be a
module-level function; the worker loads its module first, by name or, for a verifier named by
file path (reward.fn=path/to/file.py:fn), from the same file (megarl.config.extension).

Pure-string verifiers run in this process; their time is measured afterwards and a call over the
limit scores 0 as well (they cannot hang: no backtracking regex).
"""
from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable

from megarl.config.extension import load_source, module_source

log = logging.getLogger("megarl.rewards")

#: start-up allowance of the worker process (interpreter + verifier imports), seconds
WORKER_START_TIMEOUT_S = 120.0
#: errors whose message is logged (one line each); later ones are only counted
LOGGED_ERRORS = 5


def _serve(conn, warm: list[str]) -> None:
    """Worker loop: import the verifier modules once (names or file paths), say ready, then
    answer (fn, args, kwargs) with ("ok", value) or ("err", text); an unpicklable value is an "err"."""
    for source in warm:
        load_source(source)
    conn.send(("ready", None))
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):   # the trainer is gone or closed the socket
            return
        try:
            conn.send(("ok", fn(*args, **kwargs)))   # the caller converts (one float, or a batch's list)
        except BaseException as err:   # noqa: BLE001 - everything goes back as text, the loop lives on
            conn.send(("err", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"))


def _main() -> None:
    """Entry point of the worker process: argv = [socket fd, modules to import first]."""
    _serve(Connection(int(sys.argv[1])), sys.argv[2:])


class WorkerTimeout(TimeoutError):
    """A call ran past its deadline (the worker was killed)."""


class WorkerError(RuntimeError):
    """A call raised in the worker, or the worker died during it."""


class WorkerStartError(RuntimeError):
    """The worker process could not start: no sample can be scored, so the run stops."""


class Worker:
    """One persistent worker process running calls with a deadline each; `call` kills and
    forgets the process on a timeout (the next call starts a new one).

    A plain `python -c` subprocess and not multiprocessing's `spawn`: spawn re-imports the
    parent's __main__ in the child (torchrun's, pytest's, or a script that is not a file),
    which is slow at best and fails at worst. The parent's sys.path goes along as PYTHONPATH,
    so a verifier importable here is importable there.
    """

    def __init__(self, warm: tuple[str, ...] = ()):
        self.warm = list(warm)
        self._proc = None
        self._conn = None
        self.starts = 0

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from megarl.rewards.verify import _main; _main()",
                 str(theirs.fileno()), *self.warm],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        try:
            if not conn.poll(WORKER_START_TIMEOUT_S):
                raise WorkerStartError(f"the verifier worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
            conn.recv()
        except (EOFError, OSError, WorkerStartError) as err:
            self._kill(proc)
            conn.close()
            raise WorkerStartError(f"the verifier worker (importing {', '.join(self.warm) or 'nothing'}) did "
                                   f"not start ({err or 'it exited'}); its error is above") from None
        self._proc, self._conn = proc, conn
        self.starts += 1

    @staticmethod
    def _kill(proc) -> None:
        proc.kill()
        proc.wait(5)

    def _drop(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._conn.close()
        self._proc = self._conn = None

    def call(self, fn: Callable, args: tuple, kwargs: dict, timeout_s: float):
        if self._proc is None or self._proc.poll() is not None:
            self._drop()
            self._start()
        try:
            self._conn.send((fn, args, kwargs))
            ready = self._conn.poll(timeout_s)
        except (OSError, EOFError) as err:
            self._drop()
            raise WorkerError(f"the verifier worker is gone ({err})") from None
        if not ready:
            self._drop()    # it may be stuck in C code: only killing it frees it
            raise WorkerTimeout(f"no result within {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except (OSError, EOFError):
            self._drop()
            raise WorkerError("the verifier worker died during the call (crash or killed)") from None
        if status == "err":
            raise WorkerError(value)
        return value

    def close(self) -> None:
        self._drop()


class Failures:
    """A verifier's errors and timeouts, counted (thread-safe: `take` never waits for a call),
    the first LOGGED_ERRORS logged with their message, one line each."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self.errors = self.timeouts = 0
        self._taken = (0, 0)

    def note(self, what: str, err: BaseException, timeout: bool, samples: int = 1) -> None:
        """`samples` scored 0 because the call `what` (timed out / failed) with `err`."""
        with self._lock:
            if timeout:
                self.timeouts += samples
            else:
                self.errors += samples
            n = self.errors + self.timeouts
        if n - samples < LOGGED_ERRORS:
            more = "" if n < LOGGED_ERRORS else " (further failures are only counted)"
            on = "a sample" if samples == 1 else f"a batch of {samples} samples"
            text = str(err).strip()
            log.warning("reward.fn=%s %s on %s, scored 0: %s%s", self.name, what, on,
                        text.splitlines()[0] if text else type(err).__name__, more)

    def take(self) -> dict:
        """Errors and timeouts since the previous call (the step's metrics)."""
        with self._lock:
            now = (self.errors, self.timeouts)
            errors, timeouts = now[0] - self._taken[0], now[1] - self._taken[1]
            self._taken = now
        return {"reward_errors": errors, "reward_timeouts": timeouts}


class Verifier:
    """`verifier(response_text, record, finished=...) -> float`, the reward_fn signature the
    rollout calls, with the errors and timeouts of that call counted instead of raised.
    Thread-safe: the partial rollout scores in a thread of its own (never on the engines' event
    loop: a call may block up to timeout_s, a worker start up to WORKER_START_TIMEOUT_S), the
    synchronous rollout on the driver thread. A WorkerStartError is raised, not counted: the
    controller ends the round with it at once."""

    def __init__(self, fn: Callable, *, timeout_s: float, isolate: bool, name: str = "",
                 kwargs: dict | None = None):
        self.fn, self.timeout_s, self.isolate = fn, timeout_s, isolate
        self.name = name or getattr(fn, "__name__", "verifier")
        self.kwargs = dict(kwargs or {})
        self._worker = Worker((module_source(fn.__module__),)) if isolate else None
        self._lock = threading.Lock()         # one call at a time (one worker)
        self.counts = Failures(self.name)

    def __call__(self, response_text: str, record: dict, *, finished: bool) -> float:
        kwargs = {**self.kwargs, "finished": finished}
        with self._lock:
            try:
                if self._worker is not None:
                    value = float(self._worker.call(self.fn, (response_text, record), kwargs, self.timeout_s))
                else:
                    t0 = time.monotonic()
                    value = float(self.fn(response_text, record, **kwargs))
                    if time.monotonic() - t0 > self.timeout_s:
                        raise WorkerTimeout(f"took {time.monotonic() - t0:.1f} s")
                if not math.isfinite(value):   # a NaN reward would stop the run (train.on_nonfinite)
                    raise ValueError(f"returned {value}")
                return value
            except WorkerTimeout as err:
                self.counts.note("timed out", err, timeout=True)
            except WorkerStartError:
                raise
            except Exception as err:   # noqa: BLE001 - a verifier's failure is one sample's 0, never the run's end
                self.counts.note("failed", err, timeout=False)
            return 0.0

    def take_counts(self) -> dict:
        """Errors and timeouts since the previous call (the step's metrics)."""
        return self.counts.take()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
