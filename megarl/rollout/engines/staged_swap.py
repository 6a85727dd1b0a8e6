"""The sender's wait for a staged version to be ready before it pauses the engines (the engine
side of weight_sync.staged: rollout/weights/gloo_backend.py, shadow.py).

A staged push's buckets are loaded into a shadow of the model while the engine generates, and
the last layers are processed after the last bucket arrives. Pausing the engines at once would
put that processing in the pause; so the sender asks every engine's workers (`READY`, a worker
method called through collective_rpc: between model steps, returning at once) whether their
staged version is ready, and pauses only when every one is, or when its wait runs out (the
swap then waits for the rest, paused). The first call also starts the preparation.
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
