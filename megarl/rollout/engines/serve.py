"""vLLM servers for cluster jobs (`slurm/common.sh`), from the recipe the trainer runs.

    python -m megarl.rollout.engines.serve serve RECIPE [key=value ...] --host ADDR --port P [--index I]
        Replaces itself (exec) with exactly the server `rollout.engines.mode=local_servers` starts
        (`servers.LocalServer.command()` / `.env()`: the flags render `vllm_settings.engine_settings`,
        the settings in-process engines get too), configured
        from the same recipe and overrides as the trainer: model.path, rollout.engines.max_model_len,
        rollout.engines.tp, rollout.engines.enforce_eager, rollout.engines.kv_cache_mb,
        rollout.engines.gpu_memory_utilization, rollout.engines.expert_parallel, and vLLM's LoRA
        when model.lora.rank > 0 with weight_sync.lora=adapters; seed run.seed + I, as
        `build_engines` gives engine I.
        The API key comes from $MEGARL_ENGINE_API_KEY (required) and reaches vLLM as
        $VLLM_API_KEY, so it never shows in the process list. ADDR is the node's
        cluster-internal address, never 0.0.0.0. Every route but /health needs the key
        (`megarl.rollout.engines.auth.RequireKey`), and the server takes weights with the recipe's
        weight_sync.transport (collective: `--weight-transfer-config`).

    python -m megarl.rollout.engines.serve wait --timeout S [--watch-pid PID ...] URL=LOG [URL=LOG ...]
        Polls GET URL/health until every server answers 200. Exits 1, naming the server and
        printing the last lines of its log, when the deadline passes or a watched process (the
        `srun` steps of the servers and of the trainer) has exited first.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from collections import deque

import torch

from megarl.config import ConfigError, load_config
from megarl.rollout.engines.build import lora_rank, weight_backend
from megarl.rollout.engines.reaper import pid_alive
from megarl.rollout.engines.servers import LocalServer
from megarl.rollout.engines.vllm_settings import check_expert_parallel

KEY_ENV = "MEGARL_ENGINE_API_KEY"


def scheduling_group() -> str:
    """Where this process is scheduled: its session, process group and (where the kernel
    groups scheduling by session) its autogroup. A server alone in a session competes with its
    own engine threads as one group (servers.py's docstring); the job log shows it."""
    autogroup = "not grouped by session"
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as fh:
            if fh.read().strip() == "1":
                with open("/proc/self/autogroup") as ag:
                    autogroup = ag.read().strip()
    except OSError:
        pass
    sid, pgid = os.getsid(0), os.getpgid(0)
    return (f"session {sid}{' (its leader)' if sid == os.getpid() else ''}, "
            f"process group {pgid}, {autogroup}")


def _serve(args) -> int:
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"megarl: serve: ${KEY_ENV} is empty: every server needs an API key "
              f"(slurm/common.sh makes one per job)", file=sys.stderr)
        return 2
    if args.host in ("0.0.0.0", "::", ""):
        print(f"megarl: serve: --host {args.host!r}: bind to the node's cluster-internal address, "
              f"not every interface", file=sys.stderr)
        return 2
    try:   # the trainer reaches these servers as rollout.engines.mode=remote: never ipc
        backend = weight_backend(cfg.weight_sync, "remote")
        check_expert_parallel(cfg.rollout.engines.expert_parallel, cfg.model.path, torch.cuda.is_available())
    except ConfigError as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    ro = cfg.rollout
    server = LocalServer(cfg.model.path, log_path=os.devnull, api_key="", seed=cfg.run.seed + args.index,
                         max_model_len=ro.engines.max_model_len, tp=ro.engines.tp,
                         enforce_eager=ro.engines.enforce_eager,
                         kv_cache_mb=ro.engines.kv_cache_mb, gpu_memory_utilization=ro.engines.gpu_memory_utilization,
                         port=args.port, host=args.host, weight_backend=backend,
                         expert_parallel=ro.engines.expert_parallel,
                         lora_rank=lora_rank(cfg.model, cfg.weight_sync))
    # env() names a socket folder after this pid, which the server keeps (exec): once it is
    # gone, the next megarl process on the node removes the folder (reaper.remove_stale)
    cmd, env = server.command(), server.env()
    env["VLLM_API_KEY"] = key       # vLLM's --api-key fallback: the key stays out of argv
    env.pop(KEY_ENV, None)
    print(f"# megarl: engine {args.index} at {server.url}: VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY=*** "
          f"{' '.join(cmd)}", flush=True)
    print(f"# megarl: engine {args.index} scheduling: {scheduling_group()}", flush=True)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)     # the srun task becomes the server: signals reach it directly
    return 1                        # not reached


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as fh:
            return b"".join(deque(fh, maxlen=lines)).decode(errors="replace")
    except OSError as err:
        return f"(no log: {err})\n"


def _wait(args) -> int:
    servers = []
    for item in args.servers:
        url, sep, log = item.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            print(f"megarl: wait: {item!r}: expected URL=LOG", file=sys.stderr)
            return 2
        servers.append((url.rstrip("/"), log))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never via a proxy
    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for url, log in list(pending):
            try:
                with opener.open(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        pending.remove((url, log))
                        print(f"megarl: engine {url} healthy after {time.monotonic() - t0:.0f} s", flush=True)
            except OSError:
                pass
        if not pending:
            break
        gone = [pid for pid in args.watch_pid if not pid_alive(pid)]
        late = time.monotonic() - t0 > args.timeout
        if gone or late:
            why = (f"process {', '.join(map(str, gone))} exited" if gone
                   else f"not healthy after {args.timeout:.0f} s")
            for url, log in pending:
                print(f"megarl: engine {url} (log {log}): {why}. Last lines of its log:\n{_tail(log)}",
                      file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.engines.serve")
    sub = parser.add_subparsers(dest="command", required=True)
    sv = sub.add_parser("serve", help="exec one vLLM server configured from a recipe")
    sv.add_argument("recipe")
    sv.add_argument("overrides", nargs="*")
    sv.add_argument("--host", required=True, help="address to bind: the node's cluster-internal address")
    sv.add_argument("--port", type=int, required=True)
    sv.add_argument("--index", type=int, default=0, help="engine index (seed = run.seed + index)")
    wt = sub.add_parser("wait", help="wait until servers answer /health")
    wt.add_argument("servers", nargs="+", metavar="URL=LOG")
    wt.add_argument("--timeout", type=float, default=1200.0, help="seconds")
    wt.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    wt.add_argument("--watch-pid", type=int, action="append", default=[],
                    help="stop waiting when this process has exited")
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and args.command != "serve"):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if args.command == "serve":
        args.overrides = list(args.overrides) + extra
        return _serve(args)
    return _wait(args)


if __name__ == "__main__":
    sys.exit(main())
