"""The gloo weight group's broadcast is a pipelined chain (group.start_broadcast): the sender's
bytes leave it once whatever the number of engine workers, every member gets them exactly, and
a member that dies ends everyone's wait within the group's timeout. Also the engine workers'
receive buffers (packing.ReceiveBuffers), reused only when no view of them is alive.
Real gloo groups (members are threads), no vLLM."""
import threading
import time

import pytest
import torch

from megarl.distributed.env import free_port
from megarl.rollout.weights import group, packing


class Counting:
    """A member's group that records what it sends (peer, bytes); everything else is the group's."""

    def __init__(self, g):
        self.g, self.sent = g, []

    def send(self, tensors, dst, tag):
        self.sent.append((dst, sum(t.numel() * t.element_size() for t in tensors)))
        return self.g.send(tensors, dst, tag)

    def __getattr__(self, name):
        return getattr(self.g, name)


def run_group(world, body, timeout_s=30.0):
    """Each member r in a thread: body(r, its group) -> result; returns the results by rank and
    the errors by rank."""
    port, token = free_port(), group.new_token()
    store = group.store("127.0.0.1", port, world, timeout_s, sender=True)
    results, errors = {}, {}

    def member(r):
        try:
            s = store if r == 0 else group.store("127.0.0.1", port, world, timeout_s, sender=False)
            results[r] = body(r, Counting(group.join(s, r, world, token, timeout_s)))
        except Exception as err:  # noqa: BLE001 - the test reads it
            errors[r] = err
    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    assert not any(t.is_alive() for t in threads), "a member hung past the group's timeout"
    return results, errors


NBYTES = 5 * 1024 + 37            # not a multiple of the chunk: the last chunk is short


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_sender_sends_each_byte_once_and_every_member_gets_all_of_them(monkeypatch, world):
    monkeypatch.setattr(group, "CHUNK_BYTES", 1024)
    payload = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)

    def body(r, g):
        buf = payload.clone() if r == 0 else torch.zeros(NBYTES, dtype=torch.uint8)
        group.broadcast(g, buf)
        return buf, g.sent
    results, errors = run_group(world, body)
    assert not errors
    for r in range(world):
        buf, sent = results[r]
        assert torch.equal(buf, payload)
        want = [] if r == world - 1 else [r + 1]            # each passes the bytes on once, to the next
        assert sorted({dst for dst, _ in sent}) == want
        assert sum(n for _, n in sent) == (0 if r == world - 1 else NBYTES)
        assert len(sent) == (0 if r == world - 1 else len(group.chunk_spans(NBYTES, 1024)))   # chunk by chunk


def test_gloos_tree_broadcast_stays_available_and_equal():
    payload = torch.arange(4096, dtype=torch.float32)

    def body(r, g):
        buf = payload.clone() if r == 0 else torch.zeros(4096)
        group.broadcast(g, buf, chain=False)
        return buf
    results, errors = run_group(4, body)
    assert not errors and all(torch.equal(results[r], payload) for r in range(4))


def test_a_member_that_leaves_mid_chain_ends_the_wait_of_those_after_it(monkeypatch):
    """Member 1 takes its first chunk and drops its group (an engine dying mid-broadcast):
    members 2 and 3 depend on it and must fail within the group's timeout, not hang."""
    monkeypatch.setattr(group, "CHUNK_BYTES", 1024)
    timeout_s = 5.0

    def body(r, g):
        buf = torch.zeros(NBYTES, dtype=torch.uint8)
        if r == 1:
            g.recv([buf[:1024]], 0, 0).wait()
            g.abort() if hasattr(g.g, "abort") else None
            return "left"
        t = time.monotonic()
        try:
            group.broadcast(g, buf)
        except RuntimeError:
            return ("failed", time.monotonic() - t)
        return ("done", time.monotonic() - t)
    results, errors = run_group(4, body, timeout_s)
    assert not errors
    assert results[2][0] == "failed" and results[3][0] == "failed"
    assert results[0][0] in ("done", "failed")     # the sender may have handed everything to its socket


def test_receive_buffers_are_reused_only_when_no_view_is_alive():
    pool = packing.ReceiveBuffers(keep=2)
    a = pool.take(1000)
    base = a.data_ptr()
    view = a[10:20].view(torch.uint8)            # what vLLM's layerwise reload may hold
    del a
    b = pool.take(1000)
    assert b.data_ptr() != base                 # a view of the first is alive: a new buffer
    del view
    c = pool.take(900)                          # nothing uses the first any more: reused (b is held)
    assert c.data_ptr() == base and c.numel() == 900
    held = [c, b, pool.take(1000), pool.take(1000)]
    assert len({t.data_ptr() for t in held}) == 4    # none handed out twice while in use
    assert len(pool._bufs) <= 2
    del held, b, c
    assert pool.take(1000).data_ptr() in {t.data_ptr() for t in pool._bufs}


def test_unshared_says_no_when_a_view_lives():
    t = torch.empty(64, dtype=torch.uint8)
    assert packing.unshared(t)
    v = t[:8]
    assert not packing.unshared(t) and not packing.unshared(v)
    del v
    assert packing.unshared(t)
