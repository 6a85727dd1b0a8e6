"""The next version prepared beside the live model, so a staged swap only exchanges tensors.

A staged update (staging.py) receives the new version while the engine generates, but loading
it is most of the work: vLLM's loaders shard, fuse and cast every HF tensor, and the CPU backend
then repacks each linear weight for oneDNN (its `process_weights_after_loading`). Done in the
pause, that load was 0.30-0.35 s of a 0.37-0.42 s staged pause (bench/RESULTS.md). A `Shadow`
does all of it before the pause, into copies of the model's layers, and the swap (`swap`, the
engine paused) only hands each live layer its prepared tensors and the state its processing
made (the CPU linear's repacked handle, `cpu_linear`).

Who does the work: the staging thread `feed`s what it received; the engine's own thread
`advance`s the load in slices between its model steps (the sender's readiness polls,
engines/staged_swap.py), so generation goes on, slower, and no thread waits on the GIL behind
the engine's kernels.

How it stays vLLM's own load:
- `load` runs the model's own `load_weights` on the live model, with every live tensor's
  `weight_loader` redirected for the call: each load goes to the same tensor of the layer's
  shadow instead, so the live weights are never written while the engine reads them.
- A layer's shadow is a shallow copy of the live layer (same settings, same quant method)
  with tensors of its own, restored from the metadata vLLM records at model load for its
  layerwise reload (reload/meta.py), and vLLM's online processing (reload/layerwise.py) loads
  and processes it once its last element arrived, as a reload would process the live layer.
  Layers that wait on padding are processed by `finish`, in the last slice before the pause.
- `swap`: on CUDA each tensor is copied into the live one's storage (captured CUDA graphs
  read those addresses), elsewhere the live tensor takes the prepared storage (no copy); the
  attributes processing set (not tensors) are handed over too.

Not for quantized models: their attention layers take scales processed after the whole model
(vLLM's deferred attention), which only an in-place reload handles (`supported`); the staging
area then loads in the pause as before. Memory: one more copy of the model in its kernel layout
per worker, from the first staged bucket to the swap (the old tensors are freed by it).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import time
from types import MethodType

import torch
from vllm.model_executor.model_loader.reload.layerwise import _get_weight_loader
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

# the module attributes that hold a layer's tensors and children: its shadow has its own
_STATE = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
# HF tensors per load_weights call of `advance` (each call walks the model's parameters once)
CHUNK = 16


class ShadowError(RuntimeError):
    """The next version could not be prepared beside the live model."""


def supported(model_config) -> bool:
    """Whether a model can be prepared in a shadow: a vLLM model (its config known) that is
    unquantized (see the module's docstring)."""
    return model_config is not None and getattr(model_config, "quantization", None) is None


def _like(tensor: torch.Tensor, layer, shadow, loader=None) -> torch.Tensor:
    """A new tensor object like `tensor` (shape, class, attributes; on its device: meta stays
    meta), its weight loader unwrapped of an earlier in-place reload's wrapper and bound to the
    shadow where it was bound to the layer (or to vLLM's stand-in for it in recorded metadata).
    `tensor` is never mutated: vLLM's recorded metadata serves every later reload. `loader`:
    the loader to start from in place of the tensor's (_MISSING: none)."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    out = torch.empty_like(tensor)
    out.__class__ = tensor.__class__
    out.__dict__ = dict(tensor.__dict__)
    if loader is not None:             # a live tensor's own loader (redirected while loading)
        _set_loader(out, loader)
    current = getattr(out, "weight_loader", None)   # a property on vLLM's own parameter classes
    if current is not None:
        out.weight_loader = _get_original_loader(out)
    for key, value in out.__dict__.items():
        if isinstance(value, MethodType) and (value.__self__ is layer or value.__self__ is layer_ref_sentinel):
            out.__dict__[key] = value.__func__.__get__(shadow)
    return out


class Shadow:
    """One version's shadow of a vLLM model. `feed(weights)` queues what arrived, `complete()`
    says nothing more comes, `advance(budget_s)` loads for a while (`load` loads at once);
    `swap()` (engine paused) loads the rest and puts it in. Raises ShadowError where the model
    cannot be shadowed."""

    def __init__(self, model, model_config=None):
        if model_config is not None and not supported(model_config):
            raise ShadowError(f"a quantized model ({model_config.quantization}) is reloaded in place")
        self.model = model
        self._shadows: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}   # id(live) -> (live, shadow)
        self._owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}   # id(live tensor) -> its layers
        live: dict[int, torch.Tensor] = {}   # every live tensor once (tied ones are shared)
        for layer in model.modules():
            for name, tensor in get_layer_tensors(layer).items():
                self._owners.setdefault(id(tensor), []).append((layer, name))
                live[id(tensor)] = tensor
        # each one's own loader and its redirect: made once, installed per slice (`_redirected`)
        self._loaders = {i: getattr(t, "weight_loader", None) or _MISSING for i, t in live.items()}
        self._redirects = [(t, self._redirect(t)) for t in live.values()]
        self._pending: collections.deque = collections.deque()   # fed (name, tensor), not yet loaded
        self.completed = False           # nothing more will be fed
        self.finished = False            # every layer processed
        self.error: BaseException | None = None

    # -- preparing -------------------------------------------------------------------------
    def feed(self, weights) -> None:
        """Queue HF (name, tensor) pairs to load (any thread: the staging thread feeds what it
        received); `advance` loads them."""
        if self.completed:
            raise ShadowError("weights fed after the shadow's last bucket")
        self._pending.extend(weights)

    def complete(self) -> None:
        """Nothing more will be fed: `advance` finishes the shadow once the queue is empty."""
        self.completed = True

    @property
    def ready(self) -> bool:
        return self.finished or self.error is not None

    def advance(self, budget_s: float = float("inf")) -> bool:
        """Load queued weights for about `budget_s` (whole chunks of CHUNK tensors), then, once
        everything was fed and loaded, process the waiting layers (`finish`). Runs on the
        engine's own thread, between its model steps: a thread beside it waits for the GIL
        behind the engine's kernels (measured: a 0.5 s load took up to 12 s beside generation),
        where slices between steps take the load's own time. Returns `ready`; a failure is
        kept in `error` (and the shadow is ready: the swap raises it)."""
        if self.ready:
            return True
        deadline = time.perf_counter() + budget_s
        loaded = False
        try:
            if self._pending:
                with self._redirected():
                    while self._pending:     # at least one chunk per call: every poll makes progress
                        self.model.load_weights([self._pending.popleft()
                                                 for _ in range(min(CHUNK, len(self._pending)))])
                        loaded = True
                        if time.perf_counter() >= deadline:
                            break
            if self.completed and not self._pending and (not loaded or time.perf_counter() < deadline):
                self.finish()
        except BaseException as err:  # noqa: BLE001 - the swap raises it
            self.error = err
            self._pending.clear()
        return self.ready

    def load(self, weights) -> None:
        """The model's own load_weights, every load landing in the shadow."""
        if self.finished:
            raise ShadowError("the shadow was already finished")
        with self._redirected():
            self.model.load_weights(weights)

    @contextlib.contextmanager
    def _redirected(self):
        """Every live tensor's weight loader sends its loads to the shadow, for the block's length
        (the engine reads the live tensors meanwhile; only these attributes change)."""
        for tensor, redirect in self._redirects:
            tensor.weight_loader = redirect
        try:
            yield
        finally:
            for tensor, _ in self._redirects:
                _set_loader(tensor, self._loaders[id(tensor)])

    def _redirect(self, live: torch.Tensor):
        owners = self._owners.get(id(live), [])

        def shadow_loader(param, *args, **kwargs):
            if param is not live:
                raise ShadowError("a weight loader was called with another tensor than its own")
            ret = None
            for layer, name in owners:
                shadow = self._shadow(layer)
                target = get_layer_tensors(shadow).get(name)
                if target is None:
                    raise ShadowError(f"{type(layer).__name__}.{name} has no recorded layout to load into")
                ret = _get_weight_loader(target)(target, *args, **kwargs)
            return ret
        return shadow_loader

    def _shadow(self, layer: torch.nn.Module) -> torch.nn.Module:
        found = self._shadows.get(id(layer))
        if found is not None:
            return found[1]
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        info = layerwise.get_layerwise_info(layer)
        if layerwise.is_deferred_attention_layer(layer):
            raise ShadowError(f"{type(layer).__name__} (attention) takes weights only an in-place reload processes")
        shadow = copy.copy(layer)
        state = shadow.__dict__
        state["_parameters"], state["_buffers"] = {}, {}
        state["_non_persistent_buffers_set"] = set(layer._non_persistent_buffers_set)
        state["_modules"] = dict(layer._modules)
        # as vLLM's restore_layer_on_meta: the recorded (model-format) tensors on meta; `bias`,
        # which a reload writes in place, a fresh one like the live; expert maps shared (never
        # loaded); kernel-only tensors dropped (processing makes them again)
        recorded = info.restore_metadata
        for kind, live in (("_parameters", layer._parameters), ("_buffers", layer._buffers)):
            meta = recorded[0] if kind == "_parameters" else recorded[1]
            own = state[kind]
            for name in list(live) + [n for n in meta if n not in live]:
                tensor = live.get(name)
                if name in meta:
                    own[name] = _like(meta[name], layer, shadow)
                elif tensor is None:
                    continue
                elif name in SKIP_LOAD_TENSORS:
                    own[name] = tensor
                elif name in SKIP_TENSORS:
                    own[name] = _like(tensor, layer, shadow, self._loaders.get(id(tensor)))
        layerwise.LAYERWISE_INFO[shadow] = LayerReloadingInfo(restore_metadata=info.restore_metadata,
                                                              restore_device=info.restore_device)
        layerwise.initialize_online_processing(shadow)
        self._shadows[id(layer)] = (layer, shadow)
        return shadow

    def finish(self) -> None:
        """Process the layers still waiting (those whose padding is never loaded), as vLLM's
        finalize does; the shadow is complete after it."""
        from vllm.model_executor.model_loader.reload import layerwise
        for _, shadow in self._shadows.values():
            info = layerwise.get_layerwise_info(shadow)
            if info.can_load() and info.load_numel > 0:
                layerwise._layerwise_process(shadow, info)
            info.reset()
        self.finished = True

    # -- the swap --------------------------------------------------------------------------
    def swap(self) -> int:
        """Put every prepared layer in (engine paused): what is still queued is loaded first.
        Returns how many layers changed; raises ShadowError, changing nothing, where the
        preparation failed."""
        self.complete()
        self.advance()
        if self.error is not None:
            raise ShadowError(f"the next version could not be prepared: {type(self.error).__name__}: "
                              f"{self.error}") from self.error
        for layer, shadow in self._shadows.values():
            live = get_layer_tensors(layer)
            for name, new in get_layer_tensors(shadow).items():
                old = live.get(name)
                if old is new:
                    continue
                if old is None:
                    setattr(layer, name, new)
                elif (old.device.type == "cuda" and old.shape == new.shape and old.dtype == new.dtype
                      and old.stride() == new.stride()):
                    old.data.copy_(new)
                else:
                    old.data = new.data
            for key, value in shadow.__dict__.items():
                if key not in _STATE and layer.__dict__.get(key, _MISSING) is not value:
                    layer.__dict__[key] = value
        n = len(self._shadows)
        self._shadows = {}
        return n


_MISSING = object()


def _set_loader(tensor: torch.Tensor, loader) -> None:
    """Give `tensor` this weight loader, or none (_MISSING): a plain attribute, or the property
    of vLLM's parameter classes."""
    if loader is not _MISSING:
        tensor.weight_loader = loader
    elif "weight_loader" in tensor.__dict__:
        del tensor.__dict__["weight_loader"]
    elif hasattr(type(tensor), "weight_loader"):
        try:
            del tensor.weight_loader
        except AttributeError:
            pass
