"""Catch host/device mix-ups on a machine that has no GPU.

On a CPU-only machine every tensor is on the CPU, so a batch that was never moved to the
trainer's device works here and fails on the first GPU ("Expected all tensors to be on the
same device"). `DeviceGuard` makes that failure show on CPU: it follows each tensor's
*intended* placement through every torch call and raises `MixedDeviceError` where an op
combines a host tensor with a device tensor.

Placement rules (what a CUDA run would do):
- tensors that exist when the guard starts (models, optimizer state) are on the device;
- a tensor made from Python data or a factory without `device=` is on the host;
  a factory given `device=`, `Tensor.to(device)`, `Tensor.cuda()` make device tensors;
  `Tensor.cpu()` makes a host tensor;
- every other op's result is where its inputs are.
A 0-d host tensor may meet device tensors (CUDA allows CPU scalars), and indexing a device
tensor with host indices is allowed (PyTorch moves them); a host tensor indexed with device
indices is not. `.item()`, `.tolist()` and
`float()` of a device tensor are device-to-host synchronisations; the guard counts them.

Turn it on around any code (`with DeviceGuard(): ...`), or for a whole `megarl train` run
with MEGARL_DEVICE_GUARD=1 (it starts once the models are built).
"""
from __future__ import annotations

import gc
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

_TAG = "_megarl_placement"
DEVICE, HOST = "device", "host"

# calls that move data between host and device on purpose (checked by their own rules)
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_, torch.Tensor.type_as}
_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.numpy}
# ops that read only the other tensor's shape
_SHAPE_ONLY = {torch.Tensor.expand_as, torch.Tensor.view_as, torch.Tensor.reshape_as}


class MixedDeviceError(RuntimeError):
    """An op combined a host tensor with a device tensor."""


def placement(t: torch.Tensor) -> str | None:
    return getattr(t, _TAG, None)


def mark(t: torch.Tensor, where: str) -> torch.Tensor:
    try:
        setattr(t, _TAG, where)
    except (AttributeError, RuntimeError):  # e.g. tensors of C++ subclasses without a __dict__
        pass
    return t


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    return out


def _target_is_device(args, kwargs) -> bool | None:
    """For Tensor.to: True when it moves to a device, False to the host, None for dtype only."""
    candidates = list(args[1:]) + [kwargs.get("device")]
    for a in candidates:
        if isinstance(a, torch.Tensor):
            return placement(a) != HOST
        if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
            return True   # an explicit device: the caller placed it (on CPU "cpu" is the device)
    return None


def _where() -> str:
    """The innermost call site outside torch: the line that made the offending call."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("device_guard.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"


def _describe(tensors) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors[:3])


class DeviceGuard(TorchFunctionMode):
    """Follows intended placement through torch calls; raises MixedDeviceError on a mix.

    `sync_sites` counts device-to-host reads (item/tolist/float...) per call site while active.
    """

    def __init__(self):
        super().__init__()
        self.sync_sites: dict[str, int] = {}

    @property
    def syncs(self) -> int:
        return sum(self.sync_sites.values())

    def __enter__(self):
        # what exists now (models, optimizer state, buffers) is where a GPU run keeps it
        with warnings.catch_warnings():   # isinstance() wakes lazy modules' deprecations
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor) and placement(obj) is None:
                    mark(obj, DEVICE)
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, [])
        _tensors(kwargs, inputs)
        tags = [placement(t) for t in inputs]
        result = func(*args, **kwargs)

        if func in _SYNCS:
            if DEVICE in tags:
                site = _where()
                self.sync_sites[site] = self.sync_sites.get(site, 0) + 1
            return result
        if func in _MOVES:
            return self._moved(func, args, kwargs, tags, result)
        self._check(func, args, inputs, tags)
        outputs = _tensors(result, [])
        if not outputs:
            return result
        if DEVICE in tags:
            out = DEVICE
        elif HOST in tags:
            out = HOST
        elif not inputs:   # a factory: placed where its device= says
            out = DEVICE if kwargs.get("device") is not None else HOST
        else:
            return result  # made from tensors of unknown origin (e.g. unpickled): leave unknown
        for t in outputs:
            if placement(t) is None or not any(t is i for i in inputs):
                mark(t, out)   # (an in-place op's result is its tagged input: left as it is)
        return result

    def _check(self, func, args, inputs, tags) -> None:
        if func is torch.Tensor.__getitem__:
            # host indices into a device tensor are legal (PyTorch moves them); device indices
            # into a host tensor are not ("indices should be either on cpu or on the same device")
            if tags and tags[0] == HOST and inputs[0].dim() > 0 and DEVICE in tags[1:]:
                raise MixedDeviceError(
                    f"indexing a host tensor [{_describe(inputs[:1])}] with device indices at {_where()}: "
                    f"a GPU run fails here (the batch field mixes host tensor(s) with the device's); build "
                    f"it with device= or move it with megarl.distributed.device.put")
            return
        if func in _SHAPE_ONLY:
            return
        if func is torch.Tensor.__setitem__:
            # target[index] = value: the value must be where the target is (indices may be host)
            value = args[2] if len(args) > 2 else None
            if not isinstance(value, torch.Tensor):
                return
            inputs, tags = [args[0], value], [placement(args[0]), placement(value)]
        host = [t for t, g in zip(inputs, tags) if g == HOST and t.dim() > 0]
        dev = [t for t, g in zip(inputs, tags) if g == DEVICE]
        if host and dev:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            raise MixedDeviceError(
                f"{name} mixes host tensor(s) [{_describe(host)}] with device tensor(s) "
                f"[{_describe(dev)}] at {_where()}: a GPU run fails here; build it with "
                f"device= or move it with megarl.distributed.device.put")

    def _moved(self, func, args, kwargs, tags, result):
        if func is torch.Tensor.copy_:
            return result   # copying across devices is explicit and legal
        src = args[0]
        if func is torch.Tensor.cuda:
            where = DEVICE
        elif func is torch.Tensor.type_as:
            where = placement(args[1])
        elif func is torch.Tensor.cpu:
            where = HOST
        else:
            to_device = _target_is_device(args, kwargs)
            where = placement(src) if to_device is None else (DEVICE if to_device else HOST)
        if where is None:
            return result
        if result is src and placement(src) not in (None, where):
            # on CPU .to()/.cpu() return the tensor itself; a GPU run would get a copy: give
            # the caller an alias placed there, and leave the original where it was
            result = src.view_as(src)
        return mark(result, where)

