"""The adapters-only push, engine side (inside each vLLM worker; docs/lora.md "What travels"):
the PEFT tensors an adapters push received (rollout/weights/gloo_backend.py keeps them) become
vLLM's `LoRAModel` in memory (no file) and replace the one adapter the engine serves, under the
same id (vllm_settings.ADAPTER_ID), so every request that names it samples from the base + the
new adapters from its next step on.

Why a worker method of its own (`SWAP`, called by the engine client right after
finish_weight_update, the engine still paused): vLLM's worker ends every weight-update session
by dropping every registered adapter (`reset_lora_state`: base weights changed), so an adapter
swapped inside the session would be gone before the next step. vLLM's worker LoRA manager loads
an adapter from its `lora_path` only when the id is not registered; the swap registers it, so
requests never read a path. A request held across the update (rollout.update_mode=keep) goes on
under the new adapter, as a held request goes on under new merged weights.

A server names adapters by the OpenAI `model` field; `AdapterRoute` (a middleware of the servers
megarl starts) registers the swapped adapter's name there, with no load (vLLM's own
/v1/load_lora_adapter loads from a path), so the HTTP engine's requests name it after a push.
"""
from __future__ import annotations

import json

import torch

from megarl.formats import lora_peft
from megarl.rollout.engines import asgi
from megarl.rollout.engines.engine import EngineError


def manager_of(model):
    """vLLM's LoRA model manager of a worker's model (it sets `model.lora_manager`), or a
    one-line error: the engine was started without LoRA."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError("megarl adapters push: this engine was started without LoRA (vLLM's enable_lora): "
                           "megarl starts its engines with it when model.lora.rank > 0 and "
                           "weight_sync.lora=adapters; a server started by hand needs --enable-lora "
                           "--max-lora-rank R --max-loras 1")
    return manager


def build(manager, model, tensors: dict[str, torch.Tensor], spec: dict):
    """vLLM's LoRAModel from PEFT tensors {name: tensor} and `spec` (adapters.spec: id, r, alpha),
    checked against the engine's LoRA config (its max_lora_rank) as a loaded folder would be."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    config = lora_peft.adapter_config(spec["r"], spec["alpha"], lora_peft.target_modules(tensors), "")
    peft = PEFTHelper.from_dict(config)
    peft.validate_legal(manager.lora_config)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # owned copies: the received buffers are reused by the next push, and vLLM scales B in place
    owned = {k: v.detach().clone() for k, v in tensors.items()}
    return LoRAModel.from_lora_tensors(
        int(spec["id"]), owned, peft, device="cpu", dtype=manager.lora_config.lora_dtype,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))


def lora_request(name: str, lora_id: int):
    """vLLM's LoRARequest naming the adapter a push swapped in. Its path is never read (the
    workers have the id registered); vLLM only requires one."""
    from vllm.lora.request import LoRARequest
    return LoRARequest(name, int(lora_id), lora_path=f"megarl-pushed:{name}")


#: the worker method (collective_rpc) that swaps the pushed adapter in
SWAP = "megarl_lora_swap"


def worker_swap(worker) -> int:
    """Worker method `SWAP`: the adapter the last weight-update session received, swapped in
    (1), or nothing to swap (0: that session carried none)."""
    transfer = getattr(worker, "weight_transfer_engine", None)
    taken = transfer.take_adapter() if transfer is not None and hasattr(transfer, "take_adapter") else None
    if taken is None:
        return 0
    tensors, spec = taken
    swap(worker.get_model(), tensors, spec)
    return 1


def check_swapped(answers, engine: str) -> None:
    """`SWAP`'s answers, one per worker (numbers; strings over HTTP's /collective_rpc): every
    worker must have swapped an adapter in."""
    if not answers or any(str(a) != "1" for a in answers):
        raise EngineError(f"engine {engine}: the adapters push reached the workers as {answers} (1: swapped in, "
                           f"0: no adapter received): the engine keeps serving its previous adapter")


def install_worker_method() -> None:
    """Add `SWAP` to vLLM's worker class (collective_rpc calls it by name)."""
    from vllm.v1.worker.worker_base import WorkerBase
    if not hasattr(WorkerBase, SWAP):
        setattr(WorkerBase, SWAP, worker_swap)


def swap(model, tensors: dict[str, torch.Tensor], spec: dict) -> None:
    """Replace the engine's adapter `spec["id"]` by these tensors and make it the active one."""
    manager = manager_of(model)
    lora = build(manager, model, tensors, spec)
    manager.remove_adapter(lora.id)
    manager.add_adapter(lora)
    manager.activate_adapter(lora.id)



ROUTE = "/megarl/lora_adapter"


class AdapterRoute:
    """Pure ASGI middleware of servers megarl starts: `POST /megarl/lora_adapter` {"name", "id"}
    makes the OpenAI `model` name `name` the adapter the workers hold under `id` (swapped in by
    `SWAP` first: the LoRARequest's path is never read). Every other request passes through.
    Listed before `auth.RequireKey`, which wraps it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = (scope.get("path") or "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path != ROUTE or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        status, answer = 200, {}
        try:
            ask = json.loads(await asgi.read_body(receive) or b"{}")
            models = scope["app"].state.openai_serving_models
            name, lora_id = str(ask["name"]), int(ask["id"])
            models.lora_requests[name] = lora_request(name, lora_id)
            answer = {"name": name, "id": lora_id}
        except Exception as err:   # the answer names it; the server stays up
            status, answer = 500, {"error": f"{type(err).__name__}: {err}"}
        await asgi.send_json(send, status, answer)
