"""A sharded push (weight_sync.sharded, staged, gloo wire): every trainer rank that owns
distinct shards sends the pieces of HF tensors they cover, converted on the rank itself
(`formats/shard_slices.py`); no rank gathers the whole model, and each sender's link carries
its shard only (the model's bytes / TP x PP x EP, where today's route puts the whole model on
rank 0's link).

The senders are the ranks that take part in today's gathers (`source.joins_gathers`: DP replica
0's ranks, and with expert parallelism the expert owners outside it, which send their experts
only). They are ranks 0 .. S-1 of the weight group (in global-rank order, global rank 0 first),
the engine workers S .. world-1. Each sender's buckets travel down a chain of their own, through
every worker (group.chain_pass with the sender as root and a tag range of its own); each worker
receives the S chains at once, one receiver thread per sender (staging.ShardedStaging), and
places the pieces into full HF tensors as they arrive. The swap loads those, so the engines'
weights are bitwise those of today's route.

One push, collective over every trainer rank (rank 0 drives the engines and decides):
1. the group, when rank 0 says it must be formed: rank 0 runs the transport's formation and
   announces each round's rendezvous (`("join", ...)`), the other senders join it, and every
   rank learns the end (`("formed",)` or `("error", why)`);
2. each sender cuts its pieces into buckets; rank 0 gathers every sender's bucket layouts and
   opens a staged session on every engine, one `update_weights` per sender with all its layouts;
3. every sender sends its buckets down its chain while the engines generate;
4. rank 0 gathers the senders' outcomes. All sent: the swap (pause, finish, resume). A failure:
   every sender drops the group (which ends the chains' pending receives), rank 0 retires the
   engines that died and the push is redone once for the survivors, else the push fails naming
   the rank or engine; nothing was loaded (staging.py).
"""
from __future__ import annotations

import logging
import time
import traceback

import torch
import torch.distributed as dist

from megarl.distributed import parallel
from megarl.distributed.env import from_rank0
from megarl.formats.mapping import mapping_for
from megarl.formats.shard_slices import Coverage, HFSlice, rank_to_hf_slices
from megarl.models.builders import ModelInfo, use_te
from megarl.models.lora import merged_parameters
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.weights import group as wgroup
from megarl.rollout.weights import packing, pieces, source, swap
from megarl.rollout.weights.staging import ShardedStaging

log = logging.getLogger("megarl.engines")


def sender_ranks() -> list[int]:
    """Global ranks that send in a sharded push (collective over the world), rank 0 first."""
    mine = source.joins_gathers()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0]
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, mine)
    return [r for r, f in enumerate(flags) if f]


def own_pieces(model, info: ModelInfo, timers: dict) -> list:
    """This rank's pieces of HF tensors: its shards converted here, replicated tensors from TP
    rank 0 only, and outside DP replica 0 the experts only (their dense tensors are replica 0's)."""
    t = time.perf_counter()
    table = mapping_for(info.hf_config, te_names=use_te())
    # with LoRA: each adapted weight's shard merged with its adapters (models/lora.py), no adapters
    state = {name: data for name, _, data in merged_parameters(source.unwrap(model))}
    out = rank_to_hf_slices(table, state, tp_rank=parallel.tp_rank(), tp_size=parallel.tp_size(),
                            layer_offset=info.layer_offset, expert_offset=info.expert_offset,
                            sends_replicated=parallel.tp_rank() == 0, experts_only=parallel.dp_rank() != 0)
    timers["convert"] = timers.get("convert", 0.0) + time.perf_counter() - t
    return out


def gather_to_rank0(obj) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class ShardedPush:
    """The sharded push of a CollectiveTransport (`t`), on every trainer rank."""

    def __init__(self, t, senders: list[int]):
        self.t = t
        self.senders = senders
        me = dist.get_rank() if dist.is_initialized() else 0
        self.index = self.senders.index(me) if me in self.senders else None   # None: not a sender

    # -- the push ---------------------------------------------------------------------------
    def push(self, model, info, version: int, stats: dict, timers: dict) -> None:
        t, sp = self.t, self.t.pool
        engines = list(sp.pool.engines) if sp else None
        for attempt in (0, 1):
            self._group(engines)
            groups, local = [], None
            try:
                if self.index is not None:
                    groups = list(pieces.group_pieces(own_pieces(model, info, timers), t.ws.bucket_mb << 20))
            except Exception as err:  # noqa: BLE001 - this rank still joins the collectives below
                log.error("megarl: preparing this rank's weight pieces failed:\n%s", traceback.format_exc())
                local = f"trainer rank {dist.get_rank() if dist.is_initialized() else 0}: {type(err).__name__}: {err}"
            layouts = [pieces.layout(g) for g in groups]
            gathered = gather_to_rank0((self.index, [m.to_dict() for m in layouts], local))
            every = [(i, metas) for i, metas, _ in gathered] if sp else []
            failed = [why for _, _, why in gathered if why] if sp else []
            opened = from_rank0((("error", failed[0]) if failed else self._missing(info, every)
                                 or self._open(engines, every, version)) if sp else None)
            sent = self._send(groups, layouts, stats, timers) if opened is None and self.index is not None else None
            results = gather_to_rank0(sent)
            outcome = from_rank0(self._decided(engines, opened, results, version, attempt == 0) if sp else None)
            if outcome is not None:
                t._drop_group()          # every sender: its pending chains end with it
            if outcome is None:
                if sp:       # the push's bytes and buckets, every sender's; the largest on one link
                    per_sender = [[pieces.PieceMeta.from_dict(d).nbytes for d in metas] for i, metas in every
                                  if i is not None]
                    stats.update(sync_bytes=sum(map(sum, per_sender)), sync_buckets=sum(map(len, per_sender)),
                                 sync_link_bytes=max(map(sum, per_sender)))
                return
            if outcome[0] == "error":
                raise EngineError(outcome[1])
            engines = [e for e in engines if e in sp.pool.engines] if sp else None

    def _group(self, engines) -> None:
        """Form the weight group of the senders and every engine worker, when rank 0 says so."""
        t = self.t
        need = from_rank0(t.group is None or t.members != tuple(id(e) for e in engines) or not t._staged_group
                          if t.pool else None)
        if not need:
            return
        if t.pool is None:
            self._follow()
            return
        try:
            t._form(engines, staged=True, senders=len(self.senders), announce=from_rank0)
        except BaseException as err:
            from_rank0(("error", f"{type(err).__name__}: {err}"))
            raise
        from_rank0(("formed",))

    def _follow(self) -> None:
        """A rank other than 0: join each round rank 0 announces (as weight-group rank `index`
        when a sender), until the group is formed or the formation failed."""
        group = None
        while True:
            msg = from_rank0(None)
            if msg[0] == "join":
                _, host, port, token, world, timeout_s = msg
                group = None
                if self.index is not None:
                    try:
                        store = wgroup.store(host, port, world, timeout_s, sender=False)
                        group = wgroup.join(store, self.index, world, token, timeout_s)
                    except Exception as err:  # noqa: BLE001 - rank 0 names the round's failure
                        log.warning("megarl: trainer rank %d could not join the weight group: %s",
                                    dist.get_rank(), err)
            elif msg[0] == "formed":
                self.t.group, self.t._staged_group = group, True
                return
            else:
                raise EngineError(msg[1])

    def _missing(self, info: ModelInfo, every: list):
        """Rank 0: ("error", why) when the senders' pieces do not cover every HF tensor of the
        model whole, exactly once (a rank that owns a part but sends none, a layout bug): the
        engines would keep that part's old values. Checked on the layouts alone (no bytes)."""
        coverage = Coverage()
        try:
            for _, metas in every:
                for d in metas:
                    m = pieces.PieceMeta.from_dict(d)
                    for name, dt, shape, full, dim, start in zip(m.bucket.names, m.bucket.dtype_names,
                                                                m.bucket.shapes, m.full_shapes, m.dims, m.starts):
                        t = torch.empty(shape, dtype=getattr(torch, dt), device="meta")
                        coverage.add(HFSlice(name, tuple(full), dim, start, t))
            coverage.check_complete(mapping_for(info.hf_config, te_names=use_te()).hf_names())
        except ValueError as err:
            return ("error", f"the sharded weight push's {len(self.senders)} senders (global ranks "
                             f"{self.senders}) do not cover the model: {err} (weight_sync.sharded=false "
                             f"sends from rank 0)")
        return None

    def _open(self, engines, every: list, version: int):
        """Rank 0: open a staged session on every engine and queue every sender's buckets there.
        None, or ("error", why)."""
        t = self.t
        sp, pool = t.pool, t.pool.pool
        try:
            sp.call(pool.on_each(lambda e: e.start_weight_update(staged=True), engines), "starting a weight update")
            for index, metas in every:
                if index is None:
                    continue
                info = {"sender": index, "pieces": metas}
                sp.call(pool.on_each(lambda e, info=info: e.update_weights(info), engines),
                        f"queueing trainer sender {index}'s weight buckets")
            if any(e not in pool.engines for e in engines):
                return ("error", "an engine failed to open the staged update: "
                                 f"{pool.failures[-1]['error'] if pool.failures else '?'}")
        except Exception as err:  # noqa: BLE001 - one outcome for every rank
            return ("error", f"{type(err).__name__}: {err}")
        return None

    def _send(self, groups, layouts, stats: dict, timers: dict) -> str | None:
        """This sender's buckets, each packed into a reused buffer and sent down its chain.
        None, or why it failed (the group is then dropped here: the chains through it end)."""
        t = self.t
        workers = list(range(len(self.senders), t.group.size())) if t.group is not None else []
        order, tags = [self.index] + workers, self.index * ShardedStaging.TAG_STRIDE
        try:
            for g, meta in zip(groups, layouts):
                t0 = time.perf_counter()
                buf = t.buffers.take(meta.nbytes, "cpu")
                _, packed = packing.pack([(p.name, p.tensor) for p in g], out=buf)   # meta's layout
                t1 = time.perf_counter()
                wgroup.chain_pass(t.group, packed if packed.device.type == "cpu" else packed.cpu(), order, tags)
                t.buffers.give(buf)
                timers["pack"] = timers.get("pack", 0.0) + t1 - t0
                stats["sync_wire_s"] += time.perf_counter() - t1
        except Exception as err:  # noqa: BLE001 - gathered by rank 0, named there
            t._drop_group()
            me = dist.get_rank() if dist.is_initialized() else 0
            return f"trainer rank {me} (weight sender {self.index}): {type(err).__name__}: {err}"
        return None

    def _decided(self, engines, opened, results: list, version: int, may_redo: bool):
        """`_decide`, whatever it raises turned into the outcome every rank shares (the others
        wait for it in from_rank0)."""
        try:
            return self._decide(engines, opened, results, version, may_redo)
        except Exception as err:  # noqa: BLE001 - one outcome for every rank
            return ("error", f"{type(err).__name__}: {err}")

    def _decide(self, engines, opened, results: list, version: int, may_redo: bool):
        """Rank 0: the swap when every sender sent, else what to do: ("redo", why) when engines
        died and the survivors can take it again, ("error", why) otherwise."""
        t = self.t
        sp, pool = t.pool, t.pool.pool
        failed = [r for r in results if r]
        if opened is None and not failed:
            swap.await_prepared(sp, [e for e in engines if e in pool.engines])
            t._pause.begin(admit=False)
            sp.call(pool.on_each(lambda e: e.finish_weight_update(version),
                                 [e for e in engines if e in pool.engines]),
                    f"finishing weight version {version}")
            if not pool.engines:
                return ("error", "no rollout engine took the weight update")
            return None
        why = opened[1] if opened else failed[0]
        try:
            dead = t._dead([e for e in engines if e in pool.engines])
            for e in dead:
                sp.call(pool.retire(e, EngineError(f"engine {e.name} died during a weight push: {why}")),
                        "retiring a failed engine")
        except EngineError as final:
            return ("error", str(final))
        gone = [e for e in engines if e not in pool.engines]
        if may_redo and gone:
            return ("redo", why)
        return ("error", f"the sharded weight push failed: {why}")
