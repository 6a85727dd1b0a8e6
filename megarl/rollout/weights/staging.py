"""The engine side of a staged update (weight_sync.staged): a staging area beside each engine
worker that receives the next version while the engine keeps generating with the one it holds.

Inside a vLLM worker every weight-transfer call runs on the engine core's thread, between
model steps: a receive there stops generation for the bucket's wire time. Staged, the worker's
`update_weights` only queues the bucket's description and returns; a receiver thread of the
staging area takes its part of the chain broadcast (group.chain_pass: receive each chunk,
forward it to the next member) into a buffer of its own, while the engine core goes on
stepping. The swap (`finish_weight_update`, with the engine paused) waits for the last
receive, then loads every staged bucket from local memory: the only part of the push that
pauses the engine.

A staging area belongs to one session. It is never loaded half: a receive that failed
(a member died, the group was dropped) fails the swap, which loads nothing; a session that
was given up on (the sender formed a new group, `abandon`) is discarded by the swap instead,
which is how vLLM's still-open session is closed before the next one starts (engine.py
STALE_SESSION). Memory: one more copy of the model's HF tensors per worker until the next swap
(its buffers are reused push after push once vLLM holds no view of them: packing.ReceiveBuffers).

Prepared (the gloo backend with a shadow.Shadow, unquantized models): each bucket is queued
for the shadow as it arrives (the engine's thread loads it: shadow.py), and `prepare(then)`,
asked for by the sender once every bucket is on the wire (the worker method
engines/staged_swap.READY), runs `then` on the receiver thread after the last receive (the
shadow learns that nothing more comes). `prepared()` answers whether that ended.
"""
from __future__ import annotations

import queue
import threading
import time

from megarl.rollout.weights import group as wgroup
from megarl.rollout.weights import packing


class StagingError(RuntimeError):
    """The staged version cannot be swapped in (a receive failed or did not end in time)."""


class _Prepared:
    """`prepare`'s end, shared by both kinds of staging (`_prepared`: an Event; `error`)."""

    def prepared(self) -> bool:
        return self._prepared.is_set()

    def wait_prepared(self, timeout_s: float) -> None:
        """Wait for `prepare`'s step (asked for here if the sender did not); StagingError if it
        failed, did not end in time, or a receive before it failed."""
        self.prepare()
        if not self._prepared.wait(timeout_s):
            raise StagingError(f"the staged weight version was not prepared within {timeout_s:g} s")
        if self.error is not None:
            raise StagingError(f"the staged weight version failed: {type(self.error).__name__}: "
                               f"{self.error}") from self.error


class StagingArea(_Prepared):
    """One session's staged buckets on one worker. `receive(meta)` queues a bucket (the
    receiver thread takes its part of the chain broadcast); `take(timeout_s)` waits for every
    queued receive and returns the buckets in order, or raises StagingError."""

    def __init__(self, group, buffers: packing.ReceiveBuffers, order: list[int] | None = None,
                 tag_base: int = 0, on_bucket=None):
        # order / tag_base: this area's chain in a sharded push (one sender of several: group.py);
        # on_bucket(meta, buf): a sharded push's pieces are placed as they arrive, not kept
        self.group = group
        self.buffers = buffers
        self.order, self.tag_base, self.on_bucket = order, tag_base, on_bucket
        self.buckets: list[tuple[packing.BucketMeta, object]] = []
        self.error: BaseException | None = None
        self.abandoned = False
        self._queue: queue.Queue = queue.Queue()
        self._prepare_asked = False
        self._prepared = threading.Event()   # every receive queued before prepare() ended, and its `then`
        self._thread = threading.Thread(target=self._run, name="megarl-weight-staging", daemon=True)
        self._thread.start()

    def receive(self, meta: packing.BucketMeta) -> None:
        """Queue the next bucket; returns at once (the sender's broadcast of it may start now:
        the chain's receives are ordered by the queue, one bucket after the other)."""
        if self.error is not None:
            raise StagingError(f"the staged weight update already failed: {self.error}")
        self._queue.put(meta)

    def prepare(self, then=None) -> None:
        """Once: after every receive queued so far, run `then(buckets)` on the receiver thread
        (a failure is this area's error); `prepared()` is true after it."""
        if self._prepare_asked:
            return
        self._prepare_asked = True
        self._queue.put(_Prepare(then))


    def _run(self) -> None:
        try:
            self._receive_all()
        finally:
            self._prepared.set()         # the thread ended (a take, an abandon): nothing is pending

    def _receive_all(self) -> None:
        while True:
            meta = self._queue.get()
            if meta is None:
                return
            if isinstance(meta, _Prepare):
                if self.error is None and self.group is not None and meta.then is not None:
                    try:
                        meta.then(self.buckets)
                    except BaseException as err:  # noqa: BLE001 - the swap raises it
                        self.error = err
                self._prepared.set()
                continue
            group = self.group
            if self.error is not None or group is None:
                continue                 # drain: nothing more is received after a failure
            try:
                buf = self.buffers.take(meta.nbytes)
                wgroup.chain_pass(group, buf, self.order, self.tag_base)
                if self.on_bucket is not None:
                    self.on_bucket(meta, buf)
                    del buf              # placed: the buffer is free for the next bucket
                else:
                    self.buckets.append((meta, buf))
            except BaseException as err:  # noqa: BLE001 - raised by take()
                self.error = err
                # let go of the group: gloo closes its pairs only once it is collected, and the
                # next member of the chain waits on ours until then
                self.group = None
            del group

    def take(self, timeout_s: float) -> list[tuple[packing.BucketMeta, object]]:
        """Every staged bucket, once each queued receive has ended (bounded: each receive is
        bounded by the group's timeout, this wait by `timeout_s` on top)."""
        self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise StagingError(f"the staged receive did not end within {timeout_s:g} s")
        if self.error is not None:
            raise StagingError(f"a staged weight bucket was not received: {type(self.error).__name__}: "
                               f"{self.error}") from self.error
        buckets, self.buckets = self.buckets, []
        return buckets

    def abandon(self) -> None:
        """The sender gave this session up (a new group): what arrives is never loaded."""
        self.abandoned = True
        self.group = None
        self.buckets = []
        self._queue.put(None)


class _Prepare:
    """The receiver queue's marker for `StagingArea.prepare`."""

    def __init__(self, then):
        self.then = then


class ShardedStaging(_Prepared):
    """A sharded push's staging on one worker: one StagingArea per trainer sender (weight-group
    ranks 0 .. senders-1, each with its chain through every worker: order [s, senders, ...,
    world-1], its own tags), all placing their pieces into one Assembler of full HF tensors."""

    TAG_STRIDE = 1 << 20                 # chunks per bucket below this: 8 TiB at 8 MiB chunks

    def __init__(self, group, senders: int, kept: dict, buffers: list[packing.ReceiveBuffers]):
        from megarl.rollout.weights import pieces

        self.assembler = pieces.Assembler(kept)
        workers = list(range(senders, group.size()))

        def place(meta, buf):
            self.assembler.add(pieces.unpack(meta, buf))
        self.areas = [StagingArea(group, buffers[s], [s] + workers, s * self.TAG_STRIDE, place)
                      for s in range(senders)]
        self.error: BaseException | None = None
        self._prepare: threading.Thread | None = None
        self._prepared = threading.Event()

    def prepare(self, then=None) -> None:
        """Once: after every sender's receives queued so far, `then(full HF tensors)` on a thread
        of its own; `prepared()` is true after it."""
        if self._prepare is not None:
            return
        for area in self.areas:
            area.prepare()

        def run():
            try:
                for area in self.areas:
                    area._prepared.wait()
                errors = [a.error for a in self.areas if a.error is not None]
                if errors:
                    self.error = errors[0]
                elif then is not None and not self.abandoned:
                    then(self.assembler.tensors())
            except BaseException as err:  # noqa: BLE001 - the swap raises it
                self.error = err
            finally:
                self._prepared.set()
        self._prepare = threading.Thread(target=run, name="megarl-weight-prepare", daemon=True)
        self._prepare.start()


    def receive(self, sender: int, metas: list) -> None:
        if not 0 <= sender < len(self.areas):
            raise StagingError(f"a piece bucket from sender {sender} of a group with {len(self.areas)} senders")
        for meta in metas:
            self.areas[sender].receive(meta)

    def take(self, timeout_s: float) -> dict:
        """The full HF tensors, once every sender's receives ended and every tensor is covered."""
        deadline = time.monotonic() + timeout_s
        for area in self.areas:
            area.take(max(0.0, deadline - time.monotonic()))
        try:
            return self.assembler.tensors()
        except ValueError as err:
            raise StagingError(f"the staged pieces do not cover the model: {err}") from err

    @property
    def abandoned(self) -> bool:
        return any(a.abandoned for a in self.areas)

    def abandon(self) -> None:
        for area in self.areas:
            area.abandon()
