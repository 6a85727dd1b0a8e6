"""collective transport: the trainer's global rank 0 broadcasts packed buckets to every worker
of every engine at once, through vLLM's weight-transfer session. Nothing is written to disk.

One push (every trainer rank calls `CollectiveTransport.push`):
1. the pool pauses every engine (`begin_update`); if the engines changed since the last push
   (first push, a retired engine, a replacement joining) the weight group is formed anew: a
   stateless group (group.py) of the sender (rank 0) and every engine worker, each engine's
   workers at `rank_offset` = 1 + the workers of the engines before it;
2. `start_weight_update` on every engine;
3. per bucket: every engine's `update_weights(meta)` is sent (it blocks in the receive), then
   rank 0 broadcasts the packed bytes once, whatever the number of engines. The buckets come
   from `source.sender_buckets` (TP all-gather, HF conversion, PP stages relayed to rank 0
   one after another); with `num_buffers` >= 2 the next bucket is gathered and packed on the
   main thread while a sender thread has the current one on the wire;
4. `finish_weight_update(version)` (vLLM finalizes the layerwise reload), prefix-cache reset;
   the engines resume (`end_update`, also after a failure).

Failures: every engine call is bounded by rollout.engines.timeout_s and so is every broadcast
(the group's timeout; the nccl wire's own wait, wires.py), so nothing hangs; the session also
bounds the sender thread's time on the wire and the sender's join, whatever the wire does
(`send_limit_s`): past it the group is dropped and the push fails with a WeightGroupError. A
member that never joins is named and retired. If a bucket fails (an engine died mid-broadcast),
the group is dropped, which ends the others' pending receives at once; engines that are not
alive are retired, and the push is redone once (every trainer rank iterates the source again:
rank 0 broadcasts its decision) with a group of the survivors, so they end on the new version.
Nothing is kept for the redo: at most `num_buffers` packed buckets exist at any time.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import traceback
from urllib.parse import urlparse

import torch
from torch.distributed import DistNetworkError

from megarl.distributed import faults, parallel
from megarl.distributed.env import free_port, from_rank0
from megarl.rollout.engines.engine import Engine, EngineError
from megarl.rollout.weights import adapters, packing, sharded, source
from megarl.rollout.weights.swap import Pause, await_prepared, settled
from megarl.rollout.weights.wires import MEMBER_GRACE_S, WIRES

LOOPBACK = ("127.0.0.1", "localhost", "::1")
log = logging.getLogger("megarl.engines")


class WeightGroupError(EngineError):
    """A broadcast of the weight group failed (a member died or timed out)."""


def send_limit_s(timeout_s: float) -> float:
    """How long the sender may stay on one bucket's wire send, or in its join, before the
    session gives up on it: the wire's own bound (timeout_s) and a grace, as the members get."""
    return timeout_s + min(MEMBER_GRACE_S, timeout_s)


class _OnWire:
    """When the sender thread went on the wire with its current bucket (None: not on it), read
    by the main thread's watch; `abandoned`: the session gave up on the thread."""

    def __init__(self):
        self.since: float | None = None
        self.abandoned = False

    def stuck(self, limit_s: float) -> bool:
        since = self.since
        return since is not None and time.monotonic() - since > limit_s


class CollectiveTransport:
    """One per run, on every trainer rank; `pool` (a SyncPool) only on global rank 0."""

    def __init__(self, ws, pool, engine_mode: str = "remote", own_gpus: bool = False):
        self.ws = ws
        self.pool = pool
        # engine_mode: rollout.engines.mode, and own_gpus (engines megarl starts on GPUs of their
        # own: rollout/engines/gpus.py), which weight_sync.backend=auto resolves with
        self.wire_name = ws.resolved_backend(torch.cuda.is_available(), engine_mode, own_gpus)
        self.wire = WIRES[self.wire_name]
        self._adapter: dict | None = None       # this push's adapter spec (weight_sync.lora=adapters)
        self.buffers = packing.BufferPool(ws.num_buffers)   # packed buckets' buffers, reused push after push
        self._held: list = []   # wire.holds_buffers: this session's sent buffers, until its finish
        self.group = None
        self._store = None                       # the group's TCPStore (hosted here while the group lives)
        self.members: tuple = ()                 # ids of the engines in self.group, in rank order
        self._staged_group = False               # whether self.group's engines stage (init info)
        self._pause = Pause(None)               # this push's pause of the engines
        self._sharded = None                     # sharded.ShardedPush, made at the first sharded push
        self._senders: list[int] | None = None   # global ranks that send in a sharded push
        self._layout: tuple = ()                 # the trainer layout self._senders was learnt for

    # -- the push --------------------------------------------------------------------------
    def push(self, model, info, version: int) -> dict:
        """Collective over every trainer rank. If an engine dies mid-push, the push is redone
        once for the survivors; rank 0 decides, and every rank iterates the source again.
        If the source fails on some stage (a mapping error: the same on its TP ranks), every
        rank raises the same EngineError naming it (source.StageError, via rank 0)."""
        t0 = time.perf_counter()
        timers: dict[str, float] = {}
        stats = {"sync_wire_s": 0.0, "sync_bytes": 0, "sync_buckets": 0}
        sp = self.pool
        # staged: the engines pause only at the swap (_session); replacements waiting to join
        # need the whole version in a pause, so a push that admits them is not staged
        staged = self.stages and sp is not None and not sp.pool.joining
        if self.ws.sharded and self.stages:
            # the senders, learnt collectively once per trainer layout (every rank sees the same
            # layout, so all of them gather again together; only tests change it mid-run)
            layout = parallel.layout()
            if self._senders is None or self._layout != layout:
                self._senders, self._layout = sharded.sender_ranks(), layout
            if self.shards:                  # every rank follows rank 0's staged or not
                staged = from_rank0(staged)
        # weight_sync.lora=adapters: only the LoRA adapters travel (adapters.py), unstaged and
        # unsharded (megabytes: the pause is the receive and the swap)
        self._adapter = adapters.spec(model) if adapters.wanted(self.ws, model) else None
        if self._adapter is not None:
            adapters.check_route(self.ws, self.wire_name)
            staged = False
        self._pause = Pause(sp)
        if staged and self.shards:
            return self._push_sharded(model, info, version, t0)
        engines = self._pause.begin(admit=True) if sp and not staged else (list(sp.pool.engines) if sp else None)
        try:
            for attempt in (0, 1):
                make = adapters.sender_buckets if self._adapter is not None else source.sender_buckets
                buckets = make(model, info, self.ws.bucket_mb << 20, timers, self.buffers)
                outcome = local = None
                try:
                    if sp is None:
                        for _ in buckets:        # gathers and PP relays only; rank 0 sends
                            pass
                    else:
                        outcome = self._attempt(engines, buckets, version, stats, staged, may_redo=attempt == 0)
                except Exception as err:  # noqa: BLE001 - this rank still joins the broadcast below
                    # its stage failed (rank 0 hears it through the relay and names it): leaving
                    # now would keep rank 0 and the other ranks waiting in from_rank0
                    local = err
                    log.error("megarl: weight push failed on this trainer rank:\n%s", traceback.format_exc())
                    outcome = ("error", f"{type(err).__name__}: {err}") if sp is not None else None
                outcome = from_rank0(outcome)    # every rank learns rank 0's outcome
                if outcome is not None and outcome[0] == "error":
                    raise EngineError(outcome[1]) from local
                if local is not None:            # rank 0 saw no error: this rank failed alone
                    raise EngineError(f"weight push failed on trainer rank {torch.distributed.get_rank()} "
                                      f"alone: {type(local).__name__}: {local}") from local
                if outcome is None:
                    break
                engines = [e for e in engines if e in sp.pool.engines] if sp else None
        finally:
            self._pause.end()
        return {"sync_time_s": time.perf_counter() - t0, "sync_gather_s": timers.get("gather", 0.0),
                "sync_convert_s": timers.get("convert", 0.0), "sync_pack_s": timers.get("pack", 0.0),
                "sync_stage_s": 0.0, "sync_paused_s": self._pause.seconds, "sync_staged": float(staged),
                "sync_sharded": 0.0, "sync_link_bytes": stats["sync_bytes"], **stats}

    def _push_sharded(self, model, info, version: int, t0: float) -> dict:
        timers: dict[str, float] = {}
        stats = {"sync_wire_s": 0.0, "sync_bytes": 0, "sync_buckets": 0}
        if self._sharded is None or self._sharded.senders != self._senders:
            if self._sharded is not None:    # the trainer's layout changed: a group of the new senders
                self._drop_group()
            self._sharded = sharded.ShardedPush(self, self._senders)
        try:
            self._sharded.push(model, info, version, stats, timers)
        finally:
            self._pause.end()
        return {"sync_time_s": time.perf_counter() - t0, "sync_gather_s": 0.0,
                "sync_convert_s": timers.get("convert", 0.0), "sync_pack_s": timers.get("pack", 0.0),
                "sync_stage_s": 0.0, "sync_paused_s": self._pause.seconds, "sync_staged": 1.0,
                "sync_sharded": 1.0, **stats}

    @property
    def shards(self) -> bool:
        """Whether staged pushes are sharded (weight_sync.sharded): every trainer rank that owns
        shards sends them (sharded.py), where more than one does (one: rank 0's route is the
        same). The same on every rank: the settings, and the senders learnt collectively
        (`push`)."""
        return bool(self.ws.sharded and self.stages and self._senders and len(self._senders) > 1)

    @property
    def stages(self) -> bool:
        """Whether pushes are staged: weight_sync.staged, on a wire whose engine side has a
        staging area (megarl's gloo; vLLM's nccl and ipc receivers load as they receive)."""
        return bool(self.ws.staged) and self.wire.stages

    def _attempt(self, engines: list[Engine], buckets, version: int, stats: dict, staged: bool, may_redo: bool):
        """One session on rank 0: None when every engine took `version`, ("redo", why) when
        engines died and the survivors must get it again, ("error", message) otherwise. The
        source is always drained: the other trainer ranks iterate it to its end."""
        try:
            self._session(engines, buckets, version, stats, staged)
            return None
        except Exception as first:  # noqa: BLE001 - turned into one outcome every rank shares
            err = first
            try:
                for _ in buckets:
                    pass
            except Exception as late:  # noqa: BLE001 - a stage failed too (StageError): a redo would as well
                err = late
            self._drop_group()
            if not isinstance(err, WeightGroupError):
                log.error("megarl: weight push failed on the sender:\n%s", "".join(traceback.format_exception(err)))
                return ("error", f"{type(err).__name__}: {err}")
            try:
                gone = [e for e in engines if e not in self.pool.pool.engines]   # retired meanwhile
                dead = self._dead([e for e in engines if e not in gone])
                for e in dead:
                    self.pool.call(self.pool.pool.retire(e, EngineError(
                        f"engine {e.name} died during a weight push: {err}")), "retiring a failed engine")
            except EngineError as final:         # none left, or too many failures
                return ("error", str(final))
            if may_redo and (dead or gone):
                return ("redo", str(err))
            return ("error", str(err))

    def _session(self, engines: list[Engine], buckets, version: int, stats: dict, staged: bool) -> None:
        """One session on `engines`. Unstaged they are paused already; staged they generate
        until every bucket is on the wire, then pause for the finish (the swap) only."""
        sp, pool = self.pool, self.pool.pool
        if self.group is None or self.members != tuple(id(e) for e in engines) or self._staged_group != staged:
            self._form(engines, staged)
        sp.call(pool.on_each(lambda e: e.start_weight_update(staged=staged), engines), "starting a weight update")
        if any(e not in pool.engines for e in engines):   # retired: the group would wait for it
            raise WeightGroupError("an engine failed to start the weight update: "
                                   f"{pool.failures[-1]['error'] if pool.failures else '?'}")
        # at most num_buffers packed buckets alive: one on the wire, the rest being made
        slots = threading.Semaphore(self.ws.num_buffers)
        wire: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        on_wire, limit = _OnWire(), send_limit_s(float(pool.timeout_s))
        sender = threading.Thread(target=self._sender, args=(engines, wire, slots, errors, stats, on_wire),
                                  name="megarl-weight-sender", daemon=True)
        sender.start()
        try:
            it = iter(buckets)
            while not errors and not on_wire.stuck(limit):
                while not slots.acquire(timeout=0.5):
                    if errors or on_wire.stuck(limit):
                        break
                else:
                    bucket = next(it, None)
                    if bucket is None:
                        break
                    wire.put(bucket)
        finally:
            wire.put(None)
            while sender.is_alive() and not on_wire.stuck(limit):
                sender.join(0.2)
        if sender.is_alive():           # stuck on the wire: it never returns to us
            on_wire.abandoned = True
            self._drop_group()          # ends a pending broadcast where the wire can (NCCL's abort)
            raise WeightGroupError(f"the weight broadcast of a bucket to {len(engines)} engines did not finish "
                                   f"within {limit:.0f} s (rollout.engines.timeout_s={pool.timeout_s:g}): an engine "
                                   f"died or hung mid-broadcast")
        if errors:
            raise errors[0]
        if staged:       # the swap: every bucket was staged while the engines generated
            await_prepared(self.pool, engines)
            self._pause.begin(admit=False)
            engines = [e for e in engines if e in pool.engines]
        sp.call(pool.on_each(lambda e: e.finish_weight_update(version), engines),
                f"finishing weight version {version}")
        self._give_held(reuse=True)           # the engines are done reading them (ipc)

    def _sender(self, engines, wire: queue.Queue, slots, errors: list, stats: dict, on_wire: _OnWire) -> None:
        """Thread: for each bucket, every engine's receive call, then the one broadcast."""
        while True:
            bucket = wire.get()
            if bucket is None:
                return
            try:
                if not errors:
                    self._send(engines, *bucket, stats, on_wire)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                errors.append(err if isinstance(err, EngineError) else WeightGroupError(str(err)))
            finally:
                if on_wire.abandoned:         # given up on: the wire may still read it, never reused
                    pass
                elif self.wire.holds_buffers:   # the engines read it until the finish (ipc)
                    self._held.append(bucket[1])
                else:
                    self.buffers.give(bucket[1])
                del bucket
                slots.release()

    def _send(self, engines, meta, buf, stats: dict, on_wire: _OnWire) -> None:
        sp = self.pool
        faults.point("sync_bucket")
        update = self.wire.update_info(meta, buf)
        if self._adapter is not None:    # the engines swap these in as adapters (gloo_backend.py)
            update[adapters.ADAPTER_KEY] = self._adapter
        receive = sp.loop.submit(settled([e.update_weights(update) for e in engines]))
        t = time.perf_counter()
        on_wire.since = time.monotonic()
        try:
            self.wire.send(self.group, meta, buf, sp.timeout_s)
        except RuntimeError as err:
            on_wire.since = None          # off the wire: collecting the receives is bounded below
            # the engines' receive calls end with the group (dropped by the caller): collect them
            self._drop_group()
            _result(receive, sp.timeout_s + 30)
            raise WeightGroupError(f"the weight broadcast to {len(engines)} engines failed "
                                   f"({meta.nbytes} bytes): {err}") from err
        finally:
            on_wire.since = None
        stats["sync_wire_s"] += time.perf_counter() - t
        results = sp.loop.wait(receive, sp.timeout_s + 30, "receiving a weight bucket")
        failed = [(e, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
        if failed:
            raise WeightGroupError(f"engine {failed[0][0].name} failed to receive a weight bucket: {failed[0][1]}")
        stats["sync_bytes"] += meta.nbytes
        stats["sync_buckets"] += 1

    # -- the group -------------------------------------------------------------------------
    def _form(self, engines: list[Engine], staged: bool = False, senders: int = 1, announce=None) -> None:
        """A new group of rank 0 and every worker of `engines`. An engine whose join fails, or
        that has not arrived when the timeout passes, is named and retired; the group is then
        formed again without it. A sharded push (sharded.py): `senders` trainer ranks lead the
        group (rank 0 one of them) and `announce` tells the others each round's rendezvous."""
        sp, pool = self.pool, self.pool.pool
        self._drop_group()
        timeout_s = float(pool.timeout_s)
        while True:
            if not engines:
                raise EngineError("no rollout engine left to form the weight group with")
            sizes = sp.call(settled([e.transfer_world_size() for e in engines]), "asking engines their size")
            unable = [(e, r) for e, r in zip(engines, sizes) if isinstance(r, BaseException)]
            for e, err in unable:                # e.g. an engine started without the config
                sp.call(pool.retire(e, err if isinstance(err, EngineError) else EngineError(
                    f"engine {e.name}: {type(err).__name__}: {err}")), "retiring an engine")
            if unable:
                engines[:] = [e for e in engines if e in pool.engines]
                continue
            world, host = senders + sum(sizes), self._address(engines)
            port = self.ws.master_port or free_port()
            meet = box = None                    # a failed round's store frees its port first
            meet = self._rendezvous(host, port, world, timeout_s)
            first = [senders + sum(sizes[:i]) for i in range(len(engines))]
            if announce is not None:     # the other senders join this round's group too
                announce(("join", meet.host, meet.port, meet.token, world, meet.timeout_s))
            joins = [sp.loop.submit(e.init_weight_transfer(self._engine_info(meet, off, staged, senders)))
                     for e, off in zip(engines, first)]
            box: dict = {}

            def sender_join(meet=meet, box=box):   # this round's: a late thread never fills the next one's
                try:
                    box["group"] = meet.join()
                except BaseException as exc:  # noqa: BLE001 - read by the polling thread
                    box["error"] = exc
            joiner = threading.Thread(target=sender_join, name="megarl-weight-join", daemon=True)
            joiner.start()
            failed: list = []
            # the sender's join is bounded by the group (gloo) or not at all (NCCL's init): once more here
            until = time.monotonic() + 2 * send_limit_s(timeout_s)
            while joiner.is_alive() and not failed:   # an engine that fails to join is named at once
                joiner.join(0.2)
                failed = [(e, f.exception()) for e, f in zip(engines, joins) if f.done() and f.exception()]
                if not failed and joiner.is_alive() and time.monotonic() > until:
                    for f in joins:
                        f.cancel()
                    raise EngineError(f"the weight group ({world} members at {host}:{port}) did not form within "
                                      f"{2 * send_limit_s(timeout_s):.0f} s (rollout.engines.timeout_s={timeout_s:g}): "
                                      f"the sender's join never returned; an engine may be hung, see their logs")
            if "group" in box and not failed:
                results = [_result(f, timeout_s + 60) for f in joins]
                failed = [(e, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
                if not failed:
                    self.group, self._store = box["group"], meet
                    self.members, self._staged_group = tuple(id(e) for e in engines), staged
                    return
            if not failed:              # the sender timed out: name who never arrived
                absent = meet.missing()
                failed = [(e, "it never arrived") for e, off, n in zip(engines, first, sizes)
                          if absent is None or absent & set(range(off, off + n))]
                if not failed:
                    raise EngineError(f"the weight group ({world} members at {host}:{port}) did not form "
                                      f"within {timeout_s:.0f} s (rollout.engines.timeout_s): {box.get('error')}")
            for f in joins:
                f.cancel()
            for e, why in failed:
                sp.call(pool.retire(e, EngineError(
                    f"engine {e.name} did not join the weight group at {host}:{port} within "
                    f"{timeout_s:.0f} s (rollout.engines.timeout_s): {why}. Fix: the engine must reach that "
                    f"address (weight_sync.master_addr / weight_sync.master_port, the port open) and run "
                    f"with megarl's weight-transfer config (or set weight_sync.transport=files)")),
                    "retiring an engine")
            engines[:] = [e for e in engines if e in pool.engines]

    def _engine_info(self, meet, rank_offset: int, staged: bool, senders: int = 1) -> dict:
        info = meet.engine_info(rank_offset)
        if staged:                       # only a wire that stages knows the fields
            info["staged"] = True
        if senders > 1:
            info["senders"] = senders
        return info

    def _rendezvous(self, host: str, port: int, world: int, timeout_s: float):
        """The wire's rendezvous, hosted here; a port in use or an address that is not this
        machine's is a named error (the engines keep their weights), not torch's traceback."""
        try:
            return self.wire.Rendezvous(host, port, world, timeout_s)
        except (OSError, DistNetworkError) as err:
            raise EngineError(
                f"the weight group cannot listen at {host}:{port} (weight_sync.master_addr="
                f"{self.ws.master_addr!r}, weight_sync.master_port={self.ws.master_port}): "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Fix: "
                f"weight_sync.master_port=0 (a free port) or a port nothing else holds, and "
                f"weight_sync.master_addr an address of this machine (or empty)") from err

    def _address(self, engines: list[Engine]) -> str:
        """Where the engines reach the sender: weight_sync.master_addr, else this host's address
        on the route to the first remote engine (the interface the engines' traffic uses),
        else loopback for engines on this machine."""
        if self.ws.master_addr:
            return self.ws.master_addr
        for e in engines:
            host = urlparse(getattr(e, "url", "") or "").hostname
            if host and host not in LOOPBACK:
                return route_address(host)
        return "127.0.0.1"

    def _dead(self, engines: list[Engine]) -> list[Engine]:
        healths = self.pool.call(settled([e.health() for e in engines]), "engine health check")
        return [e for e, h in zip(engines, healths) if isinstance(h, BaseException) or not h.alive]

    def _drop_group(self) -> None:
        """Forget the group: its sockets close, so any member still waiting in a receive fails now."""
        group, self.group, self.members = self.group, None, ()
        if group is not None:
            self.wire.drop(group)
        self._store = None
        self._give_held(reuse=False)

    def _give_held(self, reuse: bool) -> None:
        """The buffers a holding wire kept through the session: back to the pool once the
        engines finished (`reuse`); after a failure dropped instead, never reused (an engine may
        still map them: CUDA keeps a block alive until every process that mapped it lets go)."""
        held, self._held = self._held, []
        if reuse:
            for buf in held:
                self.buffers.give(buf)
        if self.wire.holds_buffers and torch.cuda.is_available():
            torch.cuda.ipc_collect()            # frees the shared blocks the engines let go of

    def close(self) -> None:
        self._drop_group()


def _result(future, timeout_s: float):
    """A concurrent future's result, or the exception it ended with (a timeout included). A
    stop of this process (Stopped, KeyboardInterrupt: BaseExceptions) is not the engine's
    failure: it goes on up."""
    try:
        return future.result(timeout_s)
    except Exception as err:  # noqa: BLE001 - the caller names the engine
        return err


def route_address(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket's
    connect only picks the interface)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()
