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


def broadcast(group, tensor) -> None:
    """Broadcast `tensor` (CPU) from the group's rank 0 to every member; blocks until done."""
    start_broadcast(group, tensor).wait()


def start_broadcast(group, tensor):
    """The same, asynchronous: returns the work; `.wait()` blocks until `tensor` is complete."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)
