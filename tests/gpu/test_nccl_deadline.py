"""The NCCL wire's send has a deadline on a real CUDA stream (rollout/weights/wires.py).

An NCCL broadcast to a peer that died never completes: the kernel spins on the stream, and a
`stream.synchronize()` would wait for ever. The wire records an event after its broadcasts and
polls it until rollout.engines.timeout_s. Here a group stands in for the communicator: its
broadcast enqueues a kernel that spins on the stream for seconds (as a broadcast waiting for a
dead peer does), or nothing (a healthy, finished broadcast). Needs CUDA only (no vLLM, no
second GPU)."""
import time

import pytest
import torch

from megarl.rollout.weights import packing, wires

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPIN_CYCLES = 20_000_000_000       # ~10 s at 2 GHz: far longer than the deadline under test


class SpinningGroup:
    """`broadcast` enqueues a kernel that keeps the stream busy (spin=True), or nothing."""

    def __init__(self, spin: bool):
        self.spin, self.calls = spin, 0

    def broadcast(self, tensor, src, stream):
        assert tensor.is_cuda and src == 0
        self.calls += 1
        if self.spin and self.calls == 1:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SPIN_CYCLES)


def _bucket():
    named = [("a", torch.ones(64, device="cuda")), ("b", torch.arange(8, device="cuda", dtype=torch.float32))]
    return packing.pack(named)


def test_a_broadcast_that_never_completes_is_a_named_error_at_the_deadline():
    meta, buf = _bucket()
    group = SpinningGroup(spin=True)
    start = time.monotonic()
    with pytest.raises(wires.WireTimeout, match=r"did not complete within 0.5 s \(rollout.engines.timeout_s\)"):
        wires.NcclWire.send(group, meta, buf, 0.5)
    waited = time.monotonic() - start
    assert group.calls == 2 and waited < 0.5 + 5, waited   # one broadcast per tensor, then given up
    torch.cuda.synchronize()                                  # let the spinning kernel end


def test_a_completed_broadcast_returns():
    meta, buf = _bucket()
    group = SpinningGroup(spin=False)
    wires.NcclWire.send(group, meta, buf, 30)
    assert group.calls == 2
