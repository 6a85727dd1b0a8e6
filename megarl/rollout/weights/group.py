"""The weight group's rendezvous: a stateless gloo group of the trainer's sender (rank 0) and
every engine worker, apart from the trainer's own torch.distributed world.

Members meet at a TCPStore that the sender hosts (`master_address:master_port`). Every key of
the group lives under a per-group random token that only the job's members learn (the sender
hands it to each engine over the engine's authenticated control API), so a process that
reaches the port cannot join the group or feed it data. Both sides take the same `timeout_s`:
a member that never arrives, or a broadcast whose peer died, fails after it instead of hanging.
"""
from __future__ import annotations

import datetime
import secrets
import threading

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

PREFIX = "megarl-weights"


def new_token() -> str:
    return secrets.token_hex(16)


def store(host: str, port: int, world_size: int, timeout_s: float, sender: bool):
    """The group's TCPStore: the sender hosts it (listening before any member arrives)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if sender:
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    return TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def keys(tcp_store, token: str):
    """The group's own key space in the store (unguessable without the token)."""
    return PrefixStore(f"{PREFIX}/{token}/", tcp_store)


def join(tcp_store, rank: int, world_size: int, token: str, timeout_s: float):
    """Join the group as `rank` (0: the sender). Blocks until every member has joined or
    `timeout_s` passes. Members first record `joined/<rank>`, so the sender can name the ones
    that never arrived. Returns a torch ProcessGroupGloo (collectives on CPU tensors)."""
    space = keys(tcp_store, token)
    space.set(f"joined/{rank}", "1")
    return ProcessGroupGloo(space, rank, world_size, datetime.timedelta(seconds=timeout_s))


def missing_ranks(tcp_store, token: str, world_size: int) -> list[int]:
    """Ranks that have not recorded their arrival (see `join`)."""
    space = keys(tcp_store, token)
    return [r for r in range(world_size) if not space.check([f"joined/{r}"])]


# the unit of the chain: small enough that every member forwards while it still receives, large
# enough that per-message costs vanish (bench/weight_sync.py --bounds measures chain vs tree)
CHUNK_BYTES = 8 << 20


def broadcast(group, tensor, chain: bool = True) -> None:
    """Broadcast `tensor` (CPU) from the group's rank 0 to every member; blocks until done
    (the chain runs on the calling thread: the sender's is already a thread of its own)."""
    if chain:
        chain_pass(group, tensor)
    else:
        start_broadcast(group, tensor, chain=False).wait()


def start_broadcast(group, tensor, chain: bool = True):
    """The same, asynchronous: returns the work; `.wait()` blocks until `tensor` is complete on
    this member (and, on a member that forwards, until it has passed every chunk on).

    `chain` (the default): a pipelined chain 0 -> 1 -> ... -> world-1. Each member receives
    chunk c from the rank before it and forwards it to the next while chunk c+1 arrives, so
    the sender's bytes leave it once whatever the number of engines, and the last member is
    done one chunk after the first. gloo's own broadcast (`chain=False`) is a binomial tree of
    whole messages: the root sends the whole tensor ceil(log2(world)) times and each level
    waits for the level above to have everything."""
    if not chain:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return group.broadcast([tensor], opts)
    return _ChainWork(group, tensor)


def chunk_spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of the chunks a buffer of `nbytes` travels in."""
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


class _ChainWork:
    """One member's part of a chain broadcast, on a thread of its own (an engine loads the
    previous bucket meanwhile); `wait()` joins it and raises what it raised."""

    def __init__(self, group, tensor):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(group, tensor), daemon=True,
                                        name="megarl-weight-chain")
        self._thread.start()

    def _run(self, group, tensor) -> None:
        try:
            chain_pass(group, tensor)
        except BaseException as err:  # noqa: BLE001 - raised again by wait()
            self._error = err

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def chain_pass(group, tensor, order: list[int] | None = None, tag_base: int = 0) -> None:
    """This member's part of the chain: rank 0 sends every chunk to rank 1; rank r receives
    each chunk from r-1 (every receive posted at once) and forwards it to r+1 as soon as it is
    in. Each send and receive is bounded by the group's timeout; a dropped group ends them.

    `order` (a sharded push: several senders, each with a chain of its own through the same
    receivers): the members of this chain, its root first; `tag_base` keeps the chains'
    messages apart where two of them pass between the same pair of members."""
    me = group.rank()
    order = list(range(group.size())) if order is None else order
    pos = order.index(me)
    flat = tensor.view(-1).view(torch.uint8)
    spans = chunk_spans(flat.numel(), CHUNK_BYTES)
    after = order[pos + 1] if pos + 1 < len(order) else None
    sends = []
    if pos == 0:
        if after is not None:
            sends = [group.send([flat[a:b]], after, tag_base + tag) for tag, (a, b) in enumerate(spans)]
    else:
        before = order[pos - 1]
        recvs = [group.recv([flat[a:b]], before, tag_base + tag) for tag, (a, b) in enumerate(spans)]
        for tag, (work, (a, b)) in enumerate(zip(recvs, spans)):
            work.wait()
            if after is not None:
                sends.append(group.send([flat[a:b]], after, tag_base + tag))
    for work in sends:
        work.wait()
