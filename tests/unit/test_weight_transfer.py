"""The collective weight transport's parts, without vLLM: packing maths, the token-guarded gloo
rendezvous, the key middleware, and `CollectiveTransport`'s session against engines that
receive over a real gloo group in threads (engine failures, absent members, new members).

The end-to-end route through vLLM (in-process engines and servers, every trainer layout) is
tests/e2e/test_pool_sync.py; this file pins the scheduling and failure rules."""
import asyncio
import threading
import time

import pytest
import torch
from scripted_engine import Clock, ScriptedEngine

from megarl.config.schema import WeightSyncConfig
from megarl.distributed.env import free_port
from megarl.rollout.engines import auth
from megarl.rollout.engines.engine import EngineError, EngineHealth
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
from megarl.rollout.weights import collective, group, packing, source, wires


# -- packing ---------------------------------------------------------------------------------
def named_tensors():
    """Every element unique (arange), several dtypes and shapes, a scalar and an odd size."""
    return [("a.weight", torch.arange(12, dtype=torch.float32).view(3, 4)),
            ("b.bias", torch.arange(5, dtype=torch.bfloat16)),
            ("c.ids", torch.arange(7, dtype=torch.int64) - 3),
            ("d.half", torch.arange(3, dtype=torch.float16).view(1, 3, 1)),
            ("e.scalar", torch.tensor(2.5))]


def test_pack_unpack_round_trips_every_dtype_and_shape_exactly():
    named = named_tensors()
    meta, buf = packing.pack(named)
    assert buf.dtype == torch.uint8 and buf.numel() == meta.nbytes
    assert all(off % packing.ALIGN == 0 for off in meta.offsets)
    back = packing.unpack(packing.BucketMeta(**meta.to_dict()), buf.clone())
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_pack_into_a_reused_buffer_and_non_contiguous_input():
    t = torch.arange(20, dtype=torch.float32).view(4, 5).t()     # a transposed view
    out = torch.zeros(1024, dtype=torch.uint8)
    meta, buf = packing.pack([("t", t)], out=out)
    assert buf.data_ptr() == out.data_ptr()
    assert torch.equal(packing.unpack(meta, buf)[0][1], t)


def test_buffer_pool_reuses_what_is_given_back():
    pool = packing.BufferPool()
    a = pool.take(1000, "cpu")
    meta, view = packing.pack([("x", torch.ones(10))], out=a)
    pool.give(view)                                   # a view gives back its whole buffer
    assert pool.take(900, "cpu").data_ptr() == a.data_ptr()
    assert pool.take(900, "cpu").data_ptr() != a.data_ptr()   # taken: a new one
    # buffers of different sizes (tensors compare elementwise: choosing must not compare them)
    small, big = pool.take(64, "cpu"), pool.take(4096, "cpu")
    pool.give(small)
    pool.give(big)
    assert pool.take(1000, "cpu").data_ptr() == big.data_ptr()
    held = [pool.take(n, "cpu") for n in (10, 2000, 3000)]
    for b in held:
        pool.give(b)
    assert sorted(b.numel() for b in pool._free) == [2000, 3000]   # keep=2: the smallest goes


def test_bucket_meta_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        packing.BucketMeta(["x"], ["float32"], [[4]], [0], 8)        # 16 bytes in an 8-byte buffer
    with pytest.raises(ValueError, match="unknown dtype"):
        packing.BucketMeta(["x"], ["float99"], [[1]], [0], 64)
    meta, buf = packing.pack([("x", torch.ones(4))])
    with pytest.raises(ValueError, match="uint8 buffer"):
        packing.unpack(meta, buf[:8])


# -- the rendezvous --------------------------------------------------------------------------
def test_group_broadcasts_and_names_members_that_never_arrive():
    port, token = free_port(), group.new_token()
    store = group.store("127.0.0.1", port, 3, 5, sender=True)
    got = {}

    def member(rank, tok):
        s = group.store("127.0.0.1", port, 3, 5, sender=False)
        try:
            g = group.join(s, rank, 3, tok, 5)
        except RuntimeError as err:
            got[rank] = err
            return
        t = torch.zeros(4)
        group.broadcast(g, t)
        got[rank] = t

    # rank 2 knows the address but not the token: it cannot take part
    threads = [threading.Thread(target=member, args=(1, token)),
               threading.Thread(target=member, args=(2, "not-the-token"))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        group.join(store, 0, 3, token, 3)
    assert time.monotonic() - t0 < 30
    assert group.missing_ranks(store, token, 3) == [2]
    for t in threads:
        t.join(30)


# -- the key middleware ----------------------------------------------------------------------
def test_require_key_guards_every_route_but_health(monkeypatch):
    monkeypatch.setenv(auth.KEY_ENV, "s3cret")
    mw = auth.RequireKey(app=None)
    for method, path in [("POST", "/pause"), ("POST", "/update_weights"), ("POST", "/collective_rpc"),
                         ("GET", "/metrics"), ("POST", "/v1/completions"), ("GET", "/is_paused")]:
        assert not mw.allowed(method, path, ""), path
        assert not mw.allowed(method, path, "Bearer wrong"), path
        assert mw.allowed(method, path, "Bearer s3cret"), path
    assert mw.allowed("GET", "/health", "")
    assert not mw.allowed("POST", "/health", "")
    monkeypatch.setenv(auth.KEY_ENV, "")
    with pytest.raises(RuntimeError, match="API key"):
        auth.RequireKey(app=None)


# -- the transport's session -----------------------------------------------------------------
class WireEngine(ScriptedEngine):
    """Receives over the real weight group in a thread, as a vLLM worker would, and keeps the
    unpacked tensors as its weights. `die_at`: the bucket index at which it dies (its group
    goes away, as with a killed process); `absent`: its join never reaches the group."""

    def __init__(self, name, clock, tp=1, die_at=None, absent=False, dies_at_swap=False):
        super().__init__(name, clock)
        self.tp, self.die_at, self.absent, self.dies_at_swap = tp, die_at, absent, dies_at_swap
        self.paused_at_receive: list[bool] = []      # per bucket: was the engine paused?
        self.groups, self.staged, self.weights = [], {}, {}
        self.buckets_seen, self.alive, self.joins = 0, True, 0

    async def transfer_world_size(self):
        return self.tp

    async def init_weight_transfer(self, info):
        self.joins += 1
        if self.absent:
            await asyncio.sleep(3600)

        def join(rank):
            s = group.store(info["master_address"], info["master_port"], info["world_size"],
                            info["timeout_s"], sender=False)
            return group.join(s, rank, info["world_size"], info["token"], info["timeout_s"])
        first = info["rank_offset"]
        self.groups = list(await asyncio.gather(*(asyncio.to_thread(join, first + r) for r in range(self.tp))))

    async def start_weight_update(self, staged=False):
        # staged (weight_sync.staged): the engine generates while the buckets arrive, and is
        # paused only for the finish (the swap)
        assert staged or (self.paused and not self._running)
        self.staged, self.staging = {}, staged

    async def update_weights(self, info):
        meta = packing.BucketMeta(**info)
        self.paused_at_receive.append(self.paused)
        self.buckets_seen += 1
        if self.die_at is not None and self.buckets_seen > self.die_at:
            self.alive, self.groups = False, []
            raise EngineError(f"engine {self.name}: connection lost (killed)")

        def receive(g):
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            group.broadcast(g, buf)
            return buf
        try:
            bufs = await asyncio.gather(*(asyncio.to_thread(receive, g) for g in self.groups))
        except RuntimeError as err:
            raise EngineError(f"engine {self.name}: receive failed: {err}") from err
        assert all(torch.equal(b, bufs[0]) for b in bufs)   # every worker got the same bytes
        self.staged.update({n: t.clone() for n, t in packing.unpack(meta, bufs[0])})

    async def finish_weight_update(self, version):
        assert self.paused and not self._running
        if self.dies_at_swap:
            self.alive = False
            raise EngineError(f"engine {self.name}: died loading the staged weights")
        self.weights, self.version = self.staged, version

    async def health(self):
        return EngineHealth(self.name, self.alive, self.paused, self.running, self.version)


MODEL = {f"layers.{i}.w": torch.arange(i * 1000, i * 1000 + 300, dtype=torch.float32).view(30, 10)
         for i in range(6)}


@pytest.fixture
def fake_source(monkeypatch):
    """The trainer-side source replaced by MODEL in buckets of ~2 tensors (the transport's
    scheduling is under test here; the real source is tested end to end)."""
    def sender_buckets(model, info, bucket_bytes, timers=None, buffers=None):
        items = list(MODEL.items())
        for k in range(0, len(items), 2):
            named = items[k:k + 2]
            yield packing.pack(named, out=buffers.take(packing.layout(named).nbytes, "cpu"))
    monkeypatch.setattr(source, "sender_buckets", sender_buckets)


def open_sync_pool(engines, timeout_s=20.0, failures_max=3):
    loop = LoopThread()
    clock = engines[0].clock
    loop.run(_start_clock(clock), 5)
    return SyncPool(EnginePool(engines, timeout_s, failures_max), loop, 30), loop


async def _start_clock(clock):
    clock.start()


def transport(sp, num_buffers=2, staged=True):
    return collective.CollectiveTransport(
        WeightSyncConfig(bucket_mb=1, num_buffers=num_buffers, backend="gloo", staged=staged), sp)


def same_weights(engine):
    return set(engine.weights) == set(MODEL) and all(torch.equal(engine.weights[k], v) for k, v in MODEL.items())


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_one_broadcast_reaches_every_worker_of_every_engine(fake_source, num_buffers):
    """Contract: one push sends each bucket once (sync_bytes is the model once, not per
    engine) to every worker of every engine (an engine of TP=2 included); each ends with
    exactly the trainer's tensors as the pushed version and is resumed; a second push reuses
    the group (no new join)."""
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("e1", clock, tp=2)]
    sp, loop = open_sync_pool(engines)
    t = transport(sp, num_buffers)
    try:
        stats = t.push(None, None, 1)
        assert all(same_weights(e) and e.version == 1 and not e.paused for e in engines)
        assert len(t.buffers._free) <= num_buffers       # at most num_buffers packed buckets made
        assert stats["sync_buckets"] == 3
        assert stats["sync_bytes"] == sum(packing.layout(list(MODEL.items())[k:k + 2]).nbytes for k in (0, 2, 4))
        t.push(None, None, 2)
        assert [e.joins for e in engines] == [1, 1] and all(e.version == 2 for e in engines)
    finally:
        t.close()
        loop.stop()


def test_an_engine_that_never_joins_is_named_and_retired_within_the_timeout(fake_source):
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("ghost", clock, absent=True)]
    sp, loop = open_sync_pool(engines, timeout_s=3.0)
    t = transport(sp)
    try:
        t0 = time.monotonic()
        t.push(None, None, 1)
        assert time.monotonic() - t0 < 3.0 + 20
        assert [e.name for e in sp.pool.engines] == ["e0"] and same_weights(engines[0])
        failure = sp.pool.failures[0]
        assert failure["engine"] == "ghost" and "did not join the weight group" in failure["error"]
        assert "never arrived" in failure["error"] and "weight_sync.master_addr" in failure["error"]
    finally:
        t.close()
        loop.stop()


def test_an_engine_without_the_session_is_refused_at_once_naming_it(fake_source):
    clock = Clock()
    engines = [WireEngine("e0", clock), ScriptedEngine("plain", clock)]
    sp, loop = open_sync_pool(engines, timeout_s=60.0)
    t = transport(sp)
    try:
        t0 = time.monotonic()
        t.push(None, None, 1)
        assert time.monotonic() - t0 < 30        # not the 60 s join timeout
        assert [e.name for e in sp.pool.engines] == ["e0"]
        assert "weight_sync.transport=files" in sp.pool.failures[0]["error"]
    finally:
        t.close()
        loop.stop()


def test_an_engine_dying_mid_broadcast_is_retired_and_the_others_hold_the_new_version(fake_source):
    """Contract: an engine that dies at the second bucket is retired; the push is redone for
    the survivors, who end with exactly the new weights and version; nobody is left paused."""
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("dies", clock, die_at=1), WireEngine("e2", clock)]
    sp, loop = open_sync_pool(engines, timeout_s=4.0)
    t = transport(sp)
    try:
        t.push(None, None, 5)
        assert [e.name for e in sp.pool.engines] == ["e0", "e2"]
        assert all(same_weights(e) and e.version == 5 and not e.paused for e in sp.pool.engines)
        assert sp.pool.failures[0]["engine"] == "dies" and not engines[1].paused
    finally:
        t.close()
        loop.stop()


def test_the_last_engine_dying_mid_broadcast_is_a_named_error(fake_source):
    clock = Clock()
    engines = [WireEngine("only", clock, die_at=0)]
    sp, loop = open_sync_pool(engines, timeout_s=4.0)
    t = transport(sp)
    try:
        with pytest.raises(EngineError, match="only"):
            t.push(None, None, 1)
    finally:
        t.close()
        loop.stop()


def test_a_replacement_engine_joins_a_new_group_at_the_next_push(fake_source):
    """Contract: membership changes (an engine retired, a replacement waiting in
    pool.joining) re-form the group; the replacement receives the next version in full."""
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("e1", clock)]
    sp, loop = open_sync_pool(engines)
    t = transport(sp)
    try:
        t.push(None, None, 1)
        fresh = WireEngine("e1-new", clock)
        sp.pool.engines.remove(engines[1])
        sp.pool.joining.append(fresh)
        t.push(None, None, 2)
        assert [e.name for e in sp.pool.engines] == ["e0", "e1-new"]
        assert engines[0].joins == 2 and fresh.joins == 1
        assert all(same_weights(e) and e.version == 2 for e in sp.pool.engines)
    finally:
        t.close()
        loop.stop()


# -- staged pushes (weight_sync.staged) -------------------------------------------------------
@pytest.mark.parametrize("staged", [True, False])
def test_a_staged_push_pauses_the_engines_only_for_the_swap(fake_source, staged):
    """Contract: staged, every bucket reaches the engines while they are not paused (they
    generate meanwhile) and only the finish runs paused; unstaged, every bucket arrives
    paused. Either way each engine ends with exactly the new weights, resumed, and the
    push reports its paused seconds (sync_paused_s) within its total."""
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("e1", clock, tp=2)]
    sp, loop = open_sync_pool(engines)
    t = transport(sp, staged=staged)
    try:
        for version in (1, 2):
            stats = t.push(None, None, version)
            assert all(same_weights(e) and e.version == version and not e.paused for e in engines)
            assert 0 < stats["sync_paused_s"] <= stats["sync_time_s"] and stats["sync_staged"] == float(staged)
        assert all(e.paused_at_receive == [not staged] * 6 for e in engines)
    finally:
        t.close()
        loop.stop()


def test_an_engine_dying_at_the_swap_is_retired_and_the_others_take_the_version(fake_source):
    clock = Clock()
    engines = [WireEngine("e0", clock), WireEngine("dies", clock, dies_at_swap=True), WireEngine("e2", clock)]
    sp, loop = open_sync_pool(engines, timeout_s=4.0)
    t = transport(sp)
    try:
        t.push(None, None, 3)
        assert [e.name for e in sp.pool.engines] == ["e0", "e2"]
        assert all(same_weights(e) and e.version == 3 and not e.paused for e in sp.pool.engines)
        assert sp.pool.failures[0]["engine"] == "dies" and engines[1].version == 0
    finally:
        t.close()
        loop.stop()


class Preparing(WireEngine):
    """A staged engine whose version is prepared only after `polls` asks of `staged_ready`
    (what megarl's workers answer while they process the shadow: rollout/weights/shadow.py);
    `broken`: its answer is an error (an engine that cannot tell)."""

    def __init__(self, name, clock, polls, broken=False, **kw):
        super().__init__(name, clock, **kw)
        self.polls, self.broken, self.asked, self.paused_when_asked = polls, broken, 0, []

    async def staged_ready(self):
        self.asked += 1
        self.paused_when_asked.append(self.paused)
        if self.broken:
            raise EngineError(f"engine {self.name}: /collective_rpc answered HTTP 500")
        return self.asked > self.polls

    async def finish_weight_update(self, version):
        self.ready_at_finish = self.broken or self.asked > self.polls
        await super().finish_weight_update(version)


def test_a_staged_swap_pauses_only_once_every_engine_prepared_its_version(fake_source):
    """Contract (swap.await_prepared): after the last bucket, rank 0 asks every engine whether
    its staged version is prepared, while they generate, and pauses for the swap only once each
    said yes; an engine whose answer fails is left to the swap. Unstaged, nobody is asked."""
    clock = Clock()
    engines = [Preparing("slow", clock, polls=3), Preparing("quick", clock, polls=0),
               Preparing("mute", clock, polls=0, broken=True)]
    sp, loop = open_sync_pool(engines)
    t = transport(sp)
    try:
        t.push(None, None, 1)
        assert all(same_weights(e) and e.version == 1 for e in engines)
        assert [e.asked for e in engines] == [4, 1, 1]            # asked again only while not ready
        assert all(e.ready_at_finish for e in engines)
        assert not any(p for e in engines for p in e.paused_when_asked)   # asked while generating
        t2 = transport(sp, staged=False)
        before = [e.asked for e in engines]
        t2.push(None, None, 2)
        assert [e.asked for e in engines] == before and all(e.version == 2 for e in engines)
        t2.close()
    finally:
        t.close()
        loop.stop()


def test_a_replacement_waiting_to_join_gets_an_unstaged_push_and_a_staged_swap_leaves_it_waiting(fake_source):
    """A replacement needs the whole version while paused: a push that finds one waiting is
    not staged (it admits it); one arriving during a staged push's wire waits for the next."""
    clock = Clock()
    engines = [WireEngine("e0", clock)]
    sp, loop = open_sync_pool(engines)
    t = transport(sp)
    try:
        fresh = WireEngine("fresh", clock)
        sp.pool.joining.append(fresh)
        assert t.push(None, None, 1)["sync_staged"] == 0.0
        assert [e.name for e in sp.pool.engines] == ["e0", "fresh"] and same_weights(fresh)
        late = WireEngine("late", clock)
        receive = engines[0].update_weights

        async def arrives_during_the_wire(info):  # the pool's loop, as failover.py appends
            if late not in sp.pool.joining and late not in sp.pool.engines:
                sp.pool.joining.append(late)
            await receive(info)
        engines[0].update_weights = arrives_during_the_wire
        assert t.push(None, None, 2)["sync_staged"] == 1.0
        assert sp.pool.joining == [late] and late.version == 0
        assert all(same_weights(e) and e.version == 2 for e in sp.pool.engines)
        assert t.push(None, None, 3)["sync_staged"] == 0.0
        assert late in sp.pool.engines and same_weights(late) and late.version == 3
    finally:
        t.close()
        loop.stop()


# -- a wire that holds its buffers until the finish (ipc: the engine reads them in place) ------
class HoldingGlooWire(wires.GlooWire):
    """gloo's wire with ipc's buffer rule (`holds_buffers`), so the rule runs over real groups."""
    holds_buffers = True


class FinishLogged(WireEngine):
    def __init__(self, name, clock, events, **kw):
        super().__init__(name, clock, **kw)
        self.events = events

    async def finish_weight_update(self, version):
        self.events.append(("finish", self.name, version))
        await super().finish_weight_update(version)


def logged_transport(sp, events, wire, num_buffers=1):
    t = transport(sp, num_buffers)
    t.wire = wire
    give = t.buffers.give

    def logged_give(buf):
        events.append(("give", buf.data_ptr()))
        give(buf)
    t.buffers.give = logged_give
    return t


@pytest.mark.parametrize("wire", [HoldingGlooWire, wires.GlooWire])
def test_a_holding_wire_gets_its_buffers_back_only_after_every_finish(fake_source, wire):
    """Contract (ipc): no packed buffer goes back to the pool (to be overwritten by the next
    bucket) before every engine's finish_weight_update returned, so each bucket of a push has
    a buffer of its own; then all come back, and the next push reuses them. A wire that does
    not hold (gloo, nccl) gives each back as soon as its bucket is sent."""
    clock, events = Clock(), []
    engines = [FinishLogged("e0", clock, events), FinishLogged("e1", clock, events)]
    sp, loop = open_sync_pool(engines)
    t = logged_transport(sp, events, wire)
    try:
        for version in (1, 2):
            del events[:]
            t.push(None, None, version)
            assert all(same_weights(e) and e.version == version for e in engines)
            kinds = [k for k, *_ in events]
            gives = [ptr for k, ptr, *_ in events if k == "give"]
            assert len(gives) == 3 and t._held == []
            if wire.holds_buffers:
                assert kinds == ["finish", "finish", "give", "give", "give"]
                assert len(set(gives)) == 3            # three buffers alive at once, none reused mid-push
            else:
                assert kinds.index("give") < kinds.index("finish")
        assert len(t.buffers._free) <= 1
    finally:
        t.close()
        loop.stop()


def test_a_holding_wire_drops_the_buffers_of_a_failed_attempt_instead_of_reusing_them(fake_source):
    """An engine dies at the second bucket: the first attempt's buffers may still be mapped by
    the survivors, so they never go back to the pool; the redo's come back after its finish."""
    clock, events = Clock(), []
    engines = [FinishLogged("e0", clock, events), FinishLogged("dies", clock, events, die_at=1)]
    sp, loop = open_sync_pool(engines, timeout_s=4.0)
    t = logged_transport(sp, events, HoldingGlooWire)
    try:
        t.push(None, None, 1)
        assert [e.name for e in sp.pool.engines] == ["e0"] and same_weights(engines[0])
        kinds = [k for k, *_ in events]
        assert kinds == ["finish", "give", "give", "give"] and t._held == []
    finally:
        t.close()
        loop.stop()


@pytest.mark.parametrize("what", ["port", "addr"])
def test_a_rendezvous_that_cannot_listen_is_a_named_error_and_the_engines_keep_theirs(fake_source, what):
    """weight_sync.master_port held by another process, or weight_sync.master_addr not an
    address of this machine: one EngineError naming the setting and the fix; no engine is
    retired (it is the trainer's setting, not the engines' fault) and all are resumed."""
    import socket
    clock = Clock()
    engines = [WireEngine("e0", clock)]
    sp, loop = open_sync_pool(engines)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    ws = (WeightSyncConfig(bucket_mb=1, backend="gloo", master_port=holder.getsockname()[1]) if what == "port"
          else WeightSyncConfig(bucket_mb=1, backend="gloo", master_addr="192.0.2.1"))   # TEST-NET-1
    t = collective.CollectiveTransport(ws, sp)
    try:
        with pytest.raises(EngineError, match=f"weight_sync.master_{what}.*Fix"):
            t.push(None, None, 1)
        assert [e.name for e in sp.pool.engines] == ["e0"] and not engines[0].paused
        assert engines[0].version == 0
    finally:
        holder.close()
        t.close()
        loop.stop()


def test_waiting_on_an_engine_s_join_passes_a_stop_through():
    """collective._result turns an engine's failure (its exception, a timeout) into a value the
    caller names; a stop of this process (a SIGTERM's Stopped, Ctrl-C) raised while waiting is
    not an engine's failure and must go on up instead of being reported as one."""
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    from megarl.distributed.stop import Stopped
    failed, stopped, slow = Future(), Future(), Future()
    failed.set_exception(EngineError("engine0 died"))
    stopped.set_exception(Stopped("SIGTERM"))
    assert isinstance(collective._result(failed, 1), EngineError)
    assert isinstance(collective._result(slow, 0.01), FutureTimeout)
    with pytest.raises(Stopped):
        collective._result(stopped, 1)
