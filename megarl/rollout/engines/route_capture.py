"""Engine side of routing replay on vLLM builds without `enable_return_routed_experts` (vLLM's
own capture needs Model Runner V2, which needs Triton: not on CPU): the experts every MoE layer's
router chose for each token, captured inside the engine's workers, per request.

vLLM batches many requests into one forward, so a router sees the flattened tokens of the whole
batch. Which rows belong to which request is the model runner's own layout of that step: its
persistent batch lists the requests in order, each with the tokens scheduled for it, starting at
the request's computed-token count (`GPUModelRunner._prepare_inputs`, which the CPU runner
inherits). This module records that layout when the runner prepares a step, lets each router's
capture hook (`BaseRouter.set_capture_fn`) write its layer's top-k ids into a step buffer, and
after the step files the rows under each request, by position:
- a position keeps the first row captured for it: a request whose KV is dropped and recomputed
  (a preemption, `clear_kv` after a weight update) keeps the routes that produced its tokens;
- the rows are also kept per KV slot, so a request whose prompt hits the prefix cache (a group
  of n samples of one prompt) gets the prompt rows of the request that computed those blocks.
A request's rows are taken (or read, while the engine is paused) through `collective_rpc` with
the caller's request ids (`take_rows`): in-process engines call it on the AsyncLLM, HTTP engines
through the server's `/collective_rpc`. The wire form is JSON (`routes.to_state`).

Installed on demand (`megarl_routes_start`, a worker method the vLLM plugin adds), never by
default: capture costs a copy per layer and step. This module stays light: vLLM loads it into
every engine process.
"""
from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from megarl.rollout.engines.engine import EngineError
from megarl.rollout.routes import from_state, to_state

START = "megarl_routes_start"
TAKE = "megarl_routes_take"
# rows of finished requests nobody took (a client that died): the oldest are dropped past this
KEEP_UNTAKEN = 4096


def route_dtype(num_experts: int):
    """uint8 up to 256 experts, uint16 above (Sample.routes)."""
    return np.uint8 if num_experts <= 256 else np.uint16


class RequestRows:
    """One request's rows by position: [positions, MoE layers, top-k], with which are filled."""

    def __init__(self, shape: tuple[int, int], dtype):
        self.rows = np.zeros((0, *shape), dtype)
        self.filled = np.zeros(0, bool)

    def _grow(self, n: int) -> None:
        if n > len(self.rows):
            cap = max(n, 2 * len(self.rows), 16)
            rows = np.zeros((cap, *self.rows.shape[1:]), self.rows.dtype)
            rows[:len(self.rows)] = self.rows
            filled = np.zeros(cap, bool)
            filled[:len(self.filled)] = self.filled
            self.rows, self.filled = rows, filled

    def put(self, start: int, rows: np.ndarray, ok: np.ndarray | None = None) -> None:
        """Rows for positions start.. (those `ok` marks), except positions already filled: the
        first capture of a position is the one that produced the token after it."""
        self._grow(start + len(rows))
        new = ~self.filled[start:start + len(rows)]
        if ok is not None:
            new &= ok
        self.rows[start:start + len(rows)][new] = rows[new]
        self.filled[start:start + len(rows)] |= new

    def prefix(self) -> np.ndarray:
        """The rows of the filled positions from 0 up to the first gap."""
        gaps = np.flatnonzero(~self.filled)
        end = int(gaps[0]) if len(gaps) else len(self.filled)
        return self.rows[:end].copy()


def external_id(internal: str) -> str:
    """The caller's request id: vLLM makes the internal id by appending '-' and 8 characters."""
    return internal.rsplit("-", 1)[0]


class RouteBook:
    """Per worker: the step being captured, every request's rows, the rows of each KV slot."""

    def __init__(self, layer_ids: list[int], top_k: int, num_experts: int):
        self.index = {lid: i for i, lid in enumerate(sorted(layer_ids))}
        self.shape = (len(self.index), top_k)
        self.dtype = route_dtype(num_experts)
        self.requests: dict[str, RequestRows] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.slot_rows = np.zeros((0, *self.shape), self.dtype)
        self.slot_ok = np.zeros(0, bool)
        self.step = None          # torch buffer [tokens, layers, k] of the step in progress
        self.layout = None        # [(request id, start position, tokens)], slots of the step's tokens
        self.active = False
        self.from_cache = 0       # rows filled from KV slots (prefix-cache hits)

    # -- the step ---------------------------------------------------------------------------------
    def begin(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray, slots: np.ndarray,
              prefix_slots) -> None:
        """The runner laid out a step: request i has counts[i] tokens from position starts[i].
        A request first seen past position 0 hit the prefix cache: its first rows are those of
        the KV slots it reuses (`prefix_slots(i, n)`: the slots of its positions 0..n-1)."""
        self.layout = (list(zip(req_ids, starts.tolist(), counts.tolist())), slots)
        for i, (rid, start) in enumerate(zip(req_ids, starts.tolist())):
            if rid not in self.requests:
                self.requests[rid] = RequestRows(self.shape, self.dtype)
                if start > 0:
                    cached = prefix_slots(i, start)
                    ok = cached < len(self.slot_ok)
                    ok[ok] = self.slot_ok[cached[ok]]
                    rows = np.zeros((start, *self.shape), self.dtype)
                    rows[ok] = self.slot_rows[cached[ok]]
                    self.requests[rid].put(0, rows, ok)
                    self.from_cache += int(ok.sum())

    def capture(self, layer_id: int, topk_ids) -> None:
        """A router's hook: this layer's top-k ids of the step's tokens."""
        if not self.active or self.layout is None:
            return                     # a warm-up or dummy forward: no request's tokens
        import torch
        n = int(topk_ids.shape[0])
        if self.step is None or self.step.shape[0] < n:
            self.step = torch.zeros((max(n, 256), *self.shape), dtype=torch.int32)
        self.step[:n, self.index[layer_id]] = topk_ids.to("cpu", torch.int32)

    def end(self) -> None:
        """The step's forward ran: file its rows under each request and each KV slot."""
        if self.layout is None:
            return
        spans, slots = self.layout
        self.layout = None
        total = len(slots)
        if self.step is None or total == 0:
            return
        rows = self.step[:total].numpy().astype(self.dtype)
        at = 0
        for rid, start, n in spans:
            self.requests[rid].put(start, rows[at:at + n])
            at += n
        top = int(slots.max()) + 1
        if top > len(self.slot_ok):
            grown = np.zeros((max(top, 2 * len(self.slot_ok)), *self.shape), self.dtype)
            grown[:len(self.slot_rows)] = self.slot_rows
            ok = np.zeros(len(grown), bool)
            ok[:len(self.slot_ok)] = self.slot_ok
            self.slot_rows, self.slot_ok = grown, ok
        self.slot_rows[slots] = rows
        self.slot_ok[slots] = True

    def finish(self, req_ids) -> None:
        """Requests the scheduler finished: their rows wait to be taken, the oldest dropped
        past KEEP_UNTAKEN (nobody came for them)."""
        for rid in req_ids:
            if rid in self.requests:
                self.finished[rid] = None
        while len(self.finished) > KEEP_UNTAKEN:
            rid, _ = self.finished.popitem(last=False)
            self.requests.pop(rid, None)

    def take(self, ids: list[str], keep: bool) -> dict:
        """{caller's request id: encoded rows} of the requests asked for; `keep`: leave them
        (a paused engine's held requests go on)."""
        wanted = set(ids)
        named = [(rid, ext if ext in wanted else rid) for rid, ext in
                 ((r, external_id(r)) for r in self.requests) if ext in wanted or rid in wanted]
        out = {}
        for rid, name in named:
            book = self.requests[rid] if keep else self.requests.pop(rid)
            if not keep:
                self.finished.pop(rid, None)
            out[name] = to_state(book.prefix())
        return out


def _moe_routers(model) -> dict[int, object]:
    """{layer id: router} of every MoE layer whose router takes a capture hook."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    return {m.layer_id: m.router for m in model.modules()
            if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)}


def _described(book: RouteBook) -> dict:
    return {"layers": book.shape[0], "top_k": book.shape[1], "dtype": np.dtype(book.dtype).name,
            "from_cache": book.from_cache}


def install(worker) -> dict:
    """Hook the worker's model runner and every MoE router (idempotent). Returns what is
    captured: {"layers": MoE layers, "top_k": k, "dtype": ..., "from_cache": rows so far
    filled from prefix-cache blocks}; layers 0 for a dense model."""
    runner = worker.model_runner
    book = getattr(runner, "_megarl_routes", None)
    if book is not None:
        return _described(book)
    routers = _moe_routers(runner.get_model())
    if not routers:
        return {"layers": 0, "top_k": 0, "dtype": "", "from_cache": 0}
    cfg = runner.vllm_config.model_config
    book = RouteBook(list(routers), int(cfg.get_num_experts_per_tok()), int(cfg.get_num_experts()))
    for lid, router in routers.items():
        router.set_capture_fn(lambda ids, lid=lid: book.capture(lid, ids))
    _wrap_runner(runner, book)
    runner._megarl_routes = book
    return _described(book)


def _wrap_runner(runner, book: RouteBook) -> None:
    """The runner's step: record the layout as it prepares the inputs, capture during its
    forward only, file the rows once it returns."""
    prepare, execute = runner._prepare_inputs, runner.execute_model

    def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = runner.input_batch
        n = batch.num_reqs
        counts = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
        starts = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        table = batch.block_table[0]
        blocks, size = table.block_table.np, table.block_size
        book.finish(scheduler_output.finished_req_ids)

        def positions_slots(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
            return blocks[rows, pos // size].astype(np.int64) * size + pos % size

        rows = np.repeat(np.arange(n), counts)
        pos = np.concatenate([s + np.arange(c) for s, c in zip(starts, counts)]) if n else np.zeros(0, np.int64)
        book.begin(list(batch.req_ids[:n]), starts, counts, positions_slots(rows, pos),
                   lambda i, m: positions_slots(np.full(m, i), np.arange(m)))
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    def execute_model(*args, **kwargs):
        book.active = True
        try:
            return execute(*args, **kwargs)
        finally:
            book.active = False
            book.end()

    runner._prepare_inputs, runner.execute_model = _prepare_inputs, execute_model


def engine_args(wanted: bool, cuda: bool) -> dict:
    """Extra vLLM engine arguments for routes: a GPU build captures them itself
    (`enable_return_routed_experts`, returned at a request's end); elsewhere megarl's capture
    is started after the engine is up (`START`) and needs no argument."""
    return {"enable_return_routed_experts": True} if wanted and cuda else {}


def take_request(ids: list[str], keep: bool) -> str:
    """The argument of `collective_rpc(TAKE)` (a string: HTTP's /collective_rpc takes strings)."""
    return json.dumps({"ids": list(ids), "keep": bool(keep)})


def taken(results) -> dict:
    """{request id: rows} from `collective_rpc(TAKE)`'s per-worker answers: every worker of an
    engine saw the same routes (the router is replicated over TP), the first answers."""
    first = next((r for r in results or [] if isinstance(r, dict)), {})
    return {rid: from_state(d) for rid, d in first.items()}


def started(answers, engine: str, model: str) -> bool:
    """Whether `START`'s answers (one per worker) say the capture runs; raises for a model
    without MoE layers: algo.routing_replay=r3 would train without the routes it asked for."""
    first = next((a for a in answers or [] if isinstance(a, dict)), {})
    if not first.get("layers"):
        raise EngineError(f"engine {engine}: algo.routing_replay=r3 replays the experts each token was routed to, "
                          f"but model {model} has no Mixture-of-Experts layer: set algo.routing_replay=off")
    return True


async def fetch(rpc, ids: list[str], keep: bool) -> dict:
    """{request id: rows} of `ids` from an engine's workers; `rpc(method, args)` is the engine's
    collective_rpc (in-process, or a server's /collective_rpc), returning each worker's answer."""
    return taken(await rpc(TAKE, (take_request(ids, keep),)))


def worker_start(self) -> dict:
    """`collective_rpc(START)`: capture from now on in this worker."""
    return install(self)


def worker_take(self, request: str) -> dict:
    """`collective_rpc(TAKE, args=(json,))` with {"ids": [...], "keep": bool} (a JSON string:
    vLLM's HTTP /collective_rpc passes string arguments only)."""
    book = getattr(self.model_runner, "_megarl_routes", None)
    if book is None:
        return {}
    asked = json.loads(request)
    # no book.end() here: execute_model's own `finally` files every step's rows, so between steps
    # nothing is pending; a layout left without its forward must not file the last step's buffer
    return book.take(list(asked["ids"]), bool(asked.get("keep", False)))


def install_worker_methods() -> None:
    """Add the two methods to vLLM's worker class (collective_rpc calls them by name; the
    worker wrapper forwards unknown names to the worker)."""
    from vllm.v1.worker.worker_base import WorkerBase
    if not hasattr(WorkerBase, START):
        setattr(WorkerBase, START, worker_start)
        setattr(WorkerBase, TAKE, worker_take)
