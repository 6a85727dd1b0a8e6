"""Every wait of the weight push has a deadline (rollout.engines.timeout_s, the one the gloo
group's broadcasts and joins are bounded by): a wire whose send never returns (an NCCL
broadcast to a peer that died: the kernel waits forever), or a sender's join that never
returns (NCCL's communicator init), ends the push with a named EngineError instead of hanging
rank 0. The NCCL wire's own wait on its broadcasts is `wires.wait_until` on a CUDA event
(tests/gpu/test_nccl_deadline.py runs it on a GPU); here, on CPU, the same helper on a
condition that never comes, and the transport's session and group forming against wires that
never finish."""
import asyncio
import threading

import pytest
from scripted_engine import Clock, ScriptedEngine

from megarl.config.schema import WeightSyncConfig
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
from megarl.rollout.weights import collective, packing, source, wires

TIMEOUT_S = 1.0
BOUND_S = 120            # far above every deadline under test; only a hang reaches it


class QuietEngine(ScriptedEngine):
    """Takes part in the weight session without a real group (the wire under test is fake)."""

    async def transfer_world_size(self):
        return 1

    async def init_weight_transfer(self, info):
        pass

    async def start_weight_update(self, staged=False):
        pass

    async def update_weights(self, info):
        pass

    async def finish_weight_update(self, version):
        self.version = version


class StuckRendezvous:
    """A rendezvous with no store; `join` returns a group, or never (`hang_join`)."""
    hang_join = False

    def __init__(self, host, port, world, timeout_s):
        self.released = threading.Event()

    def engine_info(self, rank_offset):
        return {}

    def join(self):
        if self.hang_join:
            self.released.wait(BOUND_S)
        return object()

    def missing(self):
        return None


class StuckWire:
    """A wire whose send never returns until the group is dropped (NCCL's abort ends a pending
    broadcast; without one it would wait for ever)."""
    name = "stuck"
    Rendezvous = StuckRendezvous
    holds_buffers = False
    stages = False                 # as NCCL's: the engines are paused for the whole push
    released = threading.Event()
    sends = 0

    @staticmethod
    def update_info(meta, buf):
        return {}

    @classmethod
    def send(cls, group, meta, buf, timeout_s):
        cls.sends += 1
        cls.released.wait(BOUND_S)

    @classmethod
    def drop(cls, group):
        cls.released.set()


@pytest.fixture
def pushing(monkeypatch):
    """A transport over two quiet engines and the stuck wire; buckets of a small fake model."""
    def sender_buckets(model, info, bucket_bytes, timers=None, buffers=None):
        import torch
        for k in range(3):
            named = [(f"w{k}", torch.ones(16))]
            yield packing.pack(named, out=buffers.take(packing.layout(named).nbytes, "cpu"))
    monkeypatch.setattr(source, "sender_buckets", sender_buckets)
    StuckWire.released, StuckWire.sends = threading.Event(), 0
    made = []

    def make():
        clock = Clock()
        loop = LoopThread()

        async def start():
            clock.start()
        loop.run(start(), 5)
        sp = SyncPool(EnginePool([QuietEngine("e0", clock), QuietEngine("e1", clock)], TIMEOUT_S, 3), loop, 30)
        t = collective.CollectiveTransport(WeightSyncConfig(bucket_mb=1, num_buffers=1, backend="gloo"), sp)
        t.wire = StuckWire
        made.append((t, sp, clock))
        return t, sp
    yield make
    for t, sp, clock in made:
        StuckWire.released.set()
        t.close()
        sp.loop.run(asyncio.sleep(0), 5)
        clock.stop()
        sp.close()


def _bounded(fn):
    """fn() on a thread; what it raised, or a failure if it was still waiting after BOUND_S."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(BOUND_S)
    assert not th.is_alive(), "the push hung: no deadline on this wait"
    return out


def test_wait_until_gives_up_at_its_deadline_naming_the_setting():
    with pytest.raises(EngineError, match=r"did not complete within 0.2 s \(rollout.engines.timeout_s\)"):
        wires.wait_until(lambda: False, 0.2, "the NCCL broadcast of a weight bucket")
    seen = []
    wires.wait_until(lambda: seen.append(1) or len(seen) > 3, 30, "x")
    assert len(seen) == 4


def test_a_send_that_never_returns_ends_the_push_with_a_named_error(pushing):
    t, sp = pushing()
    out = _bounded(lambda: t.push(None, None, 1))
    err = out.get("error")
    assert isinstance(err, EngineError), out
    assert "rollout.engines.timeout_s" in str(err) and "weight" in str(err)
    assert StuckWire.sends == 1, "a bucket went on the wire after the stuck one"
    assert all(not e.paused for e in sp.pool.engines), "an engine was left paused"


def test_a_sender_join_that_never_returns_ends_the_push_with_a_named_error(pushing, monkeypatch):
    monkeypatch.setattr(StuckRendezvous, "hang_join", True)
    t, sp = pushing()
    out = _bounded(lambda: t.push(None, None, 1))
    err = out.get("error")
    assert isinstance(err, EngineError), out
    assert "did not form" in str(err) and "rollout.engines.timeout_s" in str(err)
    assert StuckWire.sends == 0
