"""Start the conversion's gloo ranks as child processes of the CLI (CPU only, no torchrun)."""
from __future__ import annotations

import os
import sys

import torch

from megarl.bootstrap import bootstrap
from megarl.distributed.env import free_port, init_distributed
from megarl.formats.hf_reader import ConversionError


def init_world(rank: int, world: int, port: int, threads: int) -> None:
    """This process as gloo rank `rank` of `world` with megarl's CPU shim applied."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    init_distributed(backend="gloo")
    bootstrap()   # a no-op in a forked rank (the CLI applied it); a spawned one applies it here


def _rank_main(rank: int, world: int, port: int, threads: int, target, prog: str, *args) -> None:
    """Entry of a forked rank: user errors exit 2 with one line, not a traceback per rank."""
    try:
        target(rank, world, port, threads, *args)
    except (ConversionError, ValueError) as e:
        print(f"{prog}: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        os._exit(2)


def launch(target, world: int, threads: int, args: tuple, prog: str) -> None:
    """`world` ranks (1 included) as child processes, each running
    target(rank, world, port, threads, *args); a rank that fails ends the others.

    Forked, so torch and megatron are not imported again (seconds each on a small machine),
    unless this process has touched CUDA (then spawned). This process itself never creates a
    process group: a child forked from a process holding gloo groups can hang in their
    destructors (threads do not survive a fork), so every conversion gets fresh ranks.
    """
    import torch.multiprocessing as mp
    port = free_port()
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    try:
        mp.start_processes(_rank_main, args=(world, port, threads, target, prog, *args), nprocs=world,
                           join=True, start_method=method)
    except mp.ProcessExitedException as e:
        what = "stopped on the error above" if e.exit_code == 2 else f"died (exit code {e.exit_code})"
        raise ConversionError(f"conversion rank {e.error_index} {what}; nothing usable was "
                              f"written") from None
    except mp.ProcessRaisedException as e:  # spawn: the traceback comes back as text
        raise ConversionError(f"a conversion rank failed:\n{e}") from None
