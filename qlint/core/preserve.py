"""Leaving the user's model, data and process as they were.

``preserved_state(*models)`` is the one guard that lint, verify, compare and sensitivity
run under. However the block ends, on exit it gives back:

* every module's class and attributes, one level deep: plain attributes forward wrote,
  the parameter, buffer, submodule and hook dictionaries, training flags. So attributes
  set during tracing (a torch.fx Proxy included), hooks qlint added and lazy modules a
  forward pass materialized are undone;
* every buffer's value, shape and binding. Buffers are copied on entry: they are small
  (BN statistics, observer min/max, fake-quant scales) and kernels such as batch_norm or
  the fused observers update them where Python cannot see;
* every parameter's value, shape and binding. Parameters are not copied up front, which
  would double the model's memory. A ``TorchFunctionMode`` watches the block and copies a
  parameter just before the first call that can write it: in-place methods and functions
  (``clamp_``, ``copy_``, ``resize_``, ``nn.init.*_``, ``x[i] = v``), ``out=``,
  ``inplace=True``, ``.data =`` and a hand-over to numpy or DLPack. A write it cannot see
  (a C extension through ``data_ptr``) still bumps the version counter, and the guard
  then raises :class:`~qlint.errors.StateError` rather than claim the model is intact.
  The watch costs a Python call per torch call: a guard around a whole command opens
  with ``watch_parameters=False`` and each step that runs forward opens a watching one;
* the process: torch's CPU (and initialized CUDA) RNG state, ``random``'s, numpy's global
  one when numpy is already imported, and the ``logging.disable`` level.

Inputs are protected differently: every forward pass gets its own copy of the batch
(:func:`cloned`), so a model that writes its input in place (``x.mul_(2)``) changes
neither the caller's tensor nor what qlint's next forward pass sees.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode

from qlint.core.nested import map_tensors
from qlint.errors import StateError

_MISSING = object()


# --- the caller's data ------------------------------------------------------------------
def cloned(batch: Any) -> Any:
    """``batch`` with every tensor cloned, through tuples, lists and mappings (a mapping
    becomes a dict). Cloning keeps autograd history, so a clone of an input that requires
    grad can be written in place by the model."""
    return map_tensors(batch, torch.Tensor.clone)


# --- the process ------------------------------------------------------------------------
class _ProcessState:
    """Global RNG states and the logging.disable level."""

    def __init__(self) -> None:
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")  # never imported here: only restored if the user has it
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.logging_disabled = logging.root.manager.disable

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if self.numpy_rng is not None and numpy is not None:
            numpy.random.set_state(self.numpy_rng)
        if logging.root.manager.disable != self.logging_disabled:
            logging.disable(self.logging_disabled)


# --- modules ------------------------------------------------------------------------------
class _KeptModule:
    """A module's class and ``__dict__``, with the dicts, lists and sets in it copied."""

    __slots__ = ("module", "name", "cls", "attributes", "containers")

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name, self.cls = module, name, type(module)
        self.attributes = dict(module.__dict__)
        self.containers = {
            key: _shallow_copy(value) for key, value in self.attributes.items() if isinstance(value, (dict, list, set))
        }

    def restore(self) -> None:
        if type(self.module) is not self.cls:  # a lazy module becomes its cls_to_become
            self.module.__class__ = self.cls
        state = self.module.__dict__
        for key in [key for key in state if key not in self.attributes]:
            del state[key]
        for key, value in self.attributes.items():
            if state.get(key, _MISSING) is not value:
                state[key] = value
        for key, saved in self.containers.items():
            _refill(self.attributes[key], saved)


def _shallow_copy(container: Any) -> Any:
    if isinstance(container, dict):
        return list(container.items())
    return list(container)


def _refill(container: Any, saved: list) -> None:
    """Put the saved items back into ``container`` in place, if they differ."""
    if isinstance(container, dict):
        items = list(container.items())
        if len(items) != len(saved) or any(a[0] is not b[0] or a[1] is not b[1] for a, b in zip(items, saved)):
            container.clear()
            container.update(saved)
    elif isinstance(container, list):
        if len(container) != len(saved) or any(a is not b for a, b in zip(container, saved)):
            container[:] = saved
    elif set(container) != set(saved):
        container.clear()
        container.update(saved)


def stored_proxies(*models: nn.Module) -> list[str]:
    """Names of module attributes holding a torch.fx Proxy: values a forward pass stored
    while it was traced, which the graph does not represent."""
    found = []
    for model in models:
        for prefix, module in model.named_modules():
            prefix = f"{prefix}." if prefix else ""
            for key, value in vars(module).items():
                if isinstance(value, fx.Proxy):
                    found.append(prefix + key)
                elif isinstance(value, dict):
                    # _parameters, _buffers and _modules entries read as attributes of the module
                    label = "{}" if key in ("_parameters", "_buffers", "_modules") else key + "[{!r}]"
                    found += [prefix + label.format(k) for k, v in value.items() if isinstance(v, fx.Proxy)]
                elif isinstance(value, (list, tuple, set)) and any(isinstance(v, fx.Proxy) for v in value):
                    found.append(prefix + key)
    return found


# --- tensors ------------------------------------------------------------------------------
def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # no storage: lazy, sparse, fake or meta tensors; nothing to watch
        return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and _storage_key(a) == _storage_key(b)
    )


def made_in_inference_mode(tensor: torch.Tensor) -> bool:
    """An inference tensor (made under torch.inference_mode); a lazy parameter is none yet."""
    return not is_lazy(tensor) and tensor.is_inference()


class _KeptTensor:
    """A parameter or buffer: the storage and view it had, and (once written) its values."""

    __slots__ = ("name", "tensor", "alias", "key", "cls", "version", "requires_grad", "values")

    def __init__(self, name: str, tensor: torch.Tensor, copy_now: bool) -> None:
        self.name, self.tensor, self.cls = name, tensor, type(tensor)
        self.alias = tensor.data  # no copy: the same storage and view, for restoring the binding
        self.key = _storage_key(self.alias)
        # an inference tensor (a model built under inference_mode) has no version counter,
        # and nothing outside inference mode can write it
        self.version = None if made_in_inference_mode(tensor) else tensor._version
        self.requires_grad = tensor.requires_grad
        self.values: torch.Tensor | None = None
        if copy_now:
            self.keep_values()

    def keep_values(self) -> None:
        if self.values is None:
            with torch.no_grad():
                self.values = self.alias.clone()

    def written_unseen(self) -> bool:
        """Written in place by something the watch could not see, so not restorable."""
        return (
            self.values is None
            and self.version is not None
            and type(self.tensor) is self.cls
            and self.tensor._version != self.version
        )

    def restore(self) -> None:
        tensor = self.tensor
        if type(tensor) is not self.cls:  # a lazy parameter materialized by a forward pass
            tensor.data = self.alias
            tensor.__class__ = self.cls
        with torch.no_grad():
            if self.values is not None and not _identical(self.alias, self.values):
                try:
                    self.alias.copy_(self.values)
                except RuntimeError:  # the original storage is gone (resized to nothing)
                    self.alias = self.values
            if not _same_view(tensor.data, self.alias):
                tensor.data = self.alias
        if tensor.requires_grad != self.requires_grad:
            tensor.requires_grad_(self.requires_grad)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and bool(torch.equal(a, b))
    except RuntimeError:  # dtypes torch.equal does not take: assume changed
        return False


# --- watching for writes ------------------------------------------------------------------
# In-place methods whose trailing underscore changes metadata only, never values.
_METADATA_ONLY = frozenset({"requires_grad_"})
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__set__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__imatmul__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)
# Handing the memory to another library: whatever it does next is out of sight.
_EXPORTS = frozenset({"numpy", "__array__", "__dlpack__"})
# torch.nn.functional calls that write arguments other than the first: (arguments, condition).
_ARGUMENT_WRITERS: dict[str, tuple[tuple[str, ...], Callable[[Mapping[str, Any]], bool]]] = {
    "embedding": (("weight",), lambda a: a.get("max_norm") is not None),
    "embedding_bag": (("weight",), lambda a: a.get("max_norm") is not None),
    "batch_norm": (("running_mean", "running_var"), lambda a: bool(a.get("training", False))),
    "instance_norm": (("running_mean", "running_var"), lambda a: bool(a.get("use_input_stats", True))),
}


class _Writes:
    """What one torch callable may write, worked out once: the watch sees every call."""

    __slots__ = ("first", "signature", "inplace_at", "arguments", "only_by_keyword")

    def __init__(self, func: Any) -> None:
        name = getattr(func, "__name__", "").split(".", 1)[0]  # aten overloads: "add_.Tensor"
        self.first = (
            (name.endswith("_") and not name.endswith("__") and name not in _METADATA_ONLY)
            or name in _INPLACE_DUNDERS
            or name in _EXPORTS
        )
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError, RuntimeError):  # builtins without a Python signature
            self.signature = None
        parameters = list(self.signature.parameters) if self.signature is not None else []
        self.inplace_at = parameters.index("inplace") if "inplace" in parameters else None
        self.arguments = _ARGUMENT_WRITERS.get(name) if self.signature is not None else None
        # Most calls (conv2d, add, .shape): only an out= keyword could make them write.
        self.only_by_keyword = not self.first and self.inplace_at is None and self.arguments is None

    def first_argument(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """The argument an in-place call writes: its first, which some torch functions
        (nn.init.constant_) hand to torch function modes as a keyword."""
        if args:
            return args[0]
        if self.signature is not None and self.signature.parameters:
            return kwargs.get(next(iter(self.signature.parameters)))
        return next(iter(kwargs.values()), None)

    def written(self, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The tensors this call may write in place (over-approximated, never under)."""
        if self.first:
            return _tensors(self.first_argument(args, kwargs))
        written = _tensors(kwargs.get("out")) if kwargs else []
        if self.inplace_at is not None:
            flag = (
                kwargs["inplace"]
                if "inplace" in kwargs
                else (args[self.inplace_at] if len(args) > self.inplace_at else False)
            )
            if flag is True:
                written += _tensors(self.first_argument(args, kwargs))
        if self.arguments is not None and self.signature is not None:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError:
                return written
            bound.apply_defaults()
            names, condition = self.arguments
            if condition(bound.arguments):
                for argument in names:
                    written += _tensors(bound.arguments.get(argument))
        return written


_writes: dict[Any, _Writes] = {}


def written_arguments(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors a torch call may write in place (over-approximated, never under)."""
    try:
        writes = _writes[func]
    except KeyError:
        writes = _writes[func] = _Writes(func)
    except TypeError:  # an unhashable callable
        writes = _Writes(func)
    if writes.only_by_keyword and not kwargs:
        return []
    return writes.written(args, kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


class _CopyOnWrite(TorchFunctionMode):
    """Copies a watched tensor's values just before the first call that may write them.

    One per thread serves every open guard, so nested guards (lint's, and the one around
    each of its stages) cost one Python call per torch call, not one each. Guards opened
    with ``watch_parameters=False`` register their tensors too, so a write seen while an
    inner guard watches is copied for them as well; the mode itself is on torch's stack
    only while some guard watches."""

    def __init__(self) -> None:
        super().__init__()
        self.by_storage: dict[int, list[_KeptTensor]] = {}
        self.guards = 0
        self.watching = 0

    def add(self, tensors: Iterable[_KeptTensor]) -> None:
        for kept in tensors:
            if kept.key is not None and kept.values is None:
                self.by_storage.setdefault(kept.key, []).append(kept)

    def remove(self, tensors: Iterable[_KeptTensor]) -> None:
        for kept in tensors:
            key = kept.key
            watchers = self.by_storage.get(key) if key is not None else None
            if key is not None and watchers is not None:
                watchers[:] = [other for other in watchers if other is not kept]
                if not watchers:
                    del self.by_storage[key]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.by_storage:  # empty once every watched tensor is copied: then only pass through
            for tensor in written_arguments(func, args, kwargs):
                for kept in self.by_storage.pop(_storage_key(tensor), ()):
                    kept.keep_values()
        return func(*args, **kwargs)


_this_thread = threading.local()


def _open_watch(tensors: list[_KeptTensor], watching: bool) -> _CopyOnWrite:
    watch = getattr(_this_thread, "watch", None)
    if watch is None:
        watch = _this_thread.watch = _CopyOnWrite()
    watch.guards += 1
    watch.add(tensors)
    if watching:
        watch.watching += 1
        if watch.watching == 1:
            watch.__enter__()
    return watch


def _close_watch(watch: _CopyOnWrite, tensors: list[_KeptTensor], watching: bool) -> None:
    watch.remove(tensors)
    if watching:
        watch.watching -= 1
        if watch.watching == 0:
            watch.__exit__(None, None, None)
    watch.guards -= 1
    if watch.guards == 0:
        _this_thread.watch = None


# --- the guard ------------------------------------------------------------------------------
class preserved_state:
    """Context manager: ``models`` and the process are given back as they were on entry.

    ``watch_parameters=False`` is for a block whose forward passes each run under a
    watching guard of their own (lint as a whole): the watch costs a Python call per torch
    call, and lint's rules and graph building make many. Its parameters are copied by the
    inner guards' watch when written, so it still gives them back, and raises StateError
    for a write no watch saw.
    ``add_handle`` registers hook handles to remove on exit (restoring the hook dicts
    would drop them anyway; removing them is explicit).
    """

    def __init__(self, *models: nn.Module, watch_parameters: bool = True) -> None:
        self.models = models
        self.watch_parameters = watch_parameters
        self.handles: list[Any] = []

    def add_handle(self, handle: Any) -> None:
        self.handles.append(handle)

    def __enter__(self) -> preserved_state:
        # Called under torch.inference_mode, qlint's own tensors (observer statistics, copies
        # of the model) would be inference tensors: no version counter, no in-place update
        # once outside. qlint's work runs in normal mode; the caller's mode returns on exit.
        # (inference_mode(False) also turns grad mode on: the caller's grad mode is kept inside.)
        self.normal_mode = contextlib.ExitStack()
        if torch.is_inference_mode_enabled():
            grad = torch.is_grad_enabled()
            self.normal_mode.enter_context(torch.inference_mode(False))
            self.normal_mode.enter_context(torch.set_grad_enabled(grad))
        self.process = _ProcessState()
        self.modules: list[_KeptModule] = []
        self.tensors: list[_KeptTensor] = []
        seen_modules: set[int] = set()
        seen_tensors: set[int] = set()
        for model in self.models:
            for name, module in model.named_modules(remove_duplicate=False):
                if id(module) in seen_modules:
                    continue
                seen_modules.add(id(module))
                self.modules.append(_KeptModule(module, name))
                for kind, table in ((False, module._parameters), (True, module._buffers)):
                    for key, tensor in table.items():
                        if tensor is not None and id(tensor) not in seen_tensors:
                            seen_tensors.add(id(tensor))
                            self.tensors.append(_KeptTensor(f"{name}.{key}" if name else key, tensor, kind))
        self.watch = _open_watch(self.tensors, self.watch_parameters)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        _close_watch(self.watch, self.tensors, self.watch_parameters)
        unseen = [kept.name for kept in self.tensors if kept.written_unseen()]
        try:
            for handle in self.handles:
                handle.remove()
            self.handles.clear()
            for module in self.modules:
                module.restore()
            for kept in self.tensors:
                kept.restore()
        finally:
            self.process.restore()  # the process comes back even if a module would not
            self.normal_mode.close()
        if unseen and exc_type is None:
            raise StateError(
                f"the model's forward wrote {', '.join(unseen[:3])}{', ...' if len(unseen) > 3 else ''} in place "
                "in a way qlint could not see (outside torch's Python API), so qlint could not put it back"
            )
