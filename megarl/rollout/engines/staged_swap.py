"""The sender's wait for a staged version to be ready before it pauses the engines (the engine
side of weight_sync.staged: rollout/weights/gloo_backend.py, shadow.py).

A staged push's buckets are queued beside each worker's model as they arrive, to be loaded into
a shadow of it. Pausing the engines at once would put that load in the pause; so the sender
asks every engine's workers (`READY`, a worker method called through collective_rpc: it runs on
the engine's thread between model steps) until each says its version is ready. Each call loads
a slice of the queue into the shadow (gloo_backend.PREPARE_SLICE_S) before it answers, so the
engine generates between the slices; where the wait runs out, the swap loads the rest, paused.
"""
from __future__ import annotations

#: the worker method (collective_rpc): "1" when the staged version is ready to swap in, else "0"
READY = "megarl_staged_ready"


def worker_ready(worker) -> str:
    """Worker method `READY`. A worker whose transfer engine does not stage is always ready."""
    transfer = getattr(worker, "weight_transfer_engine", None)
    ask = getattr(transfer, "staged_ready", None)
    return "1" if ask is None or ask() else "0"


def all_ready(answers) -> bool:
    """`READY`'s answers, one per worker (strings over HTTP's /collective_rpc)."""
    return all(str(a) == "1" for a in answers or [])


def install_worker_method() -> None:
    """Add `READY` to vLLM's worker class (collective_rpc calls it by name)."""
    from vllm.v1.worker.worker_base import WorkerBase
    if not hasattr(WorkerBase, READY):
        setattr(WorkerBase, READY, worker_ready)
