"""Safe loading of models, weights and example inputs.

Nothing here unpickles arbitrary objects or loads native code unless the caller passes
``trust_pickle=True``: every ``torch.load`` uses ``weights_only=True`` first, a ``.pt2`` is
inspected member by member before torch reads it (:mod:`qlint.core.archive`), and a file
that needs more is refused with a message that says why and what to do. Zip files are
bounded in size before anything is inflated.

The user's own code (``module:factory`` specs, data functions, classes in a trusted pickle)
is imported with the working directory on ``sys.path`` after the installed packages, and
only while it is resolved (:func:`user_import_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import math
import os
import pickle
import stat
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qlint.core.archive import check_zip_file, inspect_pt2, refuse_torchscript
from qlint.errors import EmptyCalibrationError, LoadError, QlintError, first_line

MODEL_SUFFIXES = (".pt2", ".pt", ".pth", ".ckpt", ".bin")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    module: nn.Module
    name: str
    example_inputs: tuple[Any, ...] | None = None
    exported_program: Any = None  # torch.export.ExportedProgram for .pt2 files


def split_factory_spec(spec: str) -> tuple[str, str] | None:
    """(module or file, attribute) when ``spec`` is written like 'package.module:factory' or
    'path/to/file.py:factory', else None. Syntax only: see :func:`is_factory_spec`."""
    module_part, colon, attr = spec.rpartition(":")
    return (module_part, attr) if colon and module_part and attr.isidentifier() else None


def is_factory_spec(spec: str) -> bool:
    """'package.module:factory' or 'path/to/file.py:factory' (but not an existing path)."""
    return not os.path.exists(spec) and split_factory_spec(spec) is not None


def load_batches(spec: str) -> Any:
    """Batches from ``spec``: a saved tensor/list or a folder of them (loaded weights_only),
    or ``package.module:function`` / ``file.py:function`` of the user's code, called with no
    arguments (a non-callable attribute is used as is). Every command that takes data uses this."""
    if is_factory_spec(spec):
        with user_import_path():
            target = resolve_object(spec)
            if not callable(target):
                return target
            try:
                data = target()
            except Exception as error:  # the user's function may raise anything
                raise LoadError(f"data function {spec} raised {type(error).__name__}: {error}") from error
            if data is None:  # a forgotten return: not "no calibration data"
                raise LoadError(f"data function {spec} returned None; return the batches (a list, or an iterable)")
            return data
    if os.path.isdir(spec):
        for file in sorted(Path(spec).iterdir()):
            if file.is_file() and not file.name.startswith("."):
                check_zip_file(file, str(file))
    elif os.path.exists(spec):
        check_zip_file(_existing_file(spec, what="calibration file"), spec)  # a FIFO would block forever
    return load_calibration(spec)


def load_calibration(path: Any) -> list[Any]:
    """Batches from a saved tensor / list of tensors / list of tuples, or a folder of such files."""
    source = Path(path)
    if not source.exists():
        raise LoadError(f"calibration data not found: {source}")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise EmptyCalibrationError(f"calibration folder {source} holds no files")
        batches: list[Any] = []
        for file in files:
            batches.extend(_load_batch_file(file))
        return batches
    return _load_batch_file(source)


def _load_batch_file(file: Path) -> list[Any]:
    _check_torch_save_format(file, "calibration file")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle errors, truncated zip, non-tensor objects
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LoadError(f"cannot load calibration file {file}: {detail}"[:400]) from error
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        return [dict(data)]
    if isinstance(data, tuple) and _is_batch(data):
        # torch.save((x, state), f): one batch of several inputs, as --example-inputs reads a
        # tuple; a list (or a tuple of batches) holds batches
        return [data]
    if isinstance(data, (list, tuple)):
        batches = list(data)
        for number, batch in enumerate(batches):
            if not _is_batch(batch):
                raise LoadError(
                    f"calibration file {file}: item {number} is a {type(batch).__name__}; "
                    "expected a tensor, a tuple of tensors or a dict"
                )
        return batches
    raise LoadError(f"calibration file {file} holds a {type(data).__name__}; expected a tensor or a list of batches")


def _is_batch(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (torch.Tensor, int, float, bool)) or v is None for v in value)
    return isinstance(value, Mapping)


# Random batches describe random inputs only, and their statistics settle within a few hundred
# batches (torch's PTQ tutorial calibrates on 32 batches of real data); each batch is a forward
# pass, so a count far beyond this only runs for hours (and past sys.maxsize it cannot be a length).
MAX_RANDOM_BATCHES = 10_000


def random_calibration(example_inputs: Sequence[Any], n: int, seed: int = 0) -> RandomBatches:
    """``n`` random batches shaped like ``example_inputs`` (standard normal floats; ints kept in range),
    made one at a time as they are used; ``n`` is at most :data:`MAX_RANDOM_BATCHES`."""
    if n <= 0:
        raise QlintError(f"--random-calibration needs a positive number of batches, got {n}")
    if n > MAX_RANDOM_BATCHES:
        raise QlintError(
            f"--random-calibration takes at most {MAX_RANDOM_BATCHES:,} batches, got {n}: random data "
            "says nothing more after a few hundred; calibrate on real data with --calibration"
        )
    return RandomBatches(tuple(example_inputs), n, seed)


class RandomBatches(Sequence[tuple[Any, ...]]):
    """A sequence of random batches that holds none of them: batch ``i`` is made from its own
    seed when asked for, so the same index always gives the same batch."""

    def __init__(self, example_inputs: tuple[Any, ...], n: int, seed: int) -> None:
        self._example = example_inputs
        self._n = n
        self._seed = seed

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + index)
        batch: list[Any] = []
        for value in self._example:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                batch.append(torch.randn(value.shape, generator=generator, dtype=value.dtype))
            elif isinstance(value, torch.Tensor) and value.dtype != torch.bool and value.numel():
                low, high = int(value.min()), int(value.max()) + 1
                batch.append(
                    torch.randint(low, max(high, low + 1), value.shape, generator=generator, dtype=value.dtype)
                )
            else:
                batch.append(value)
        return tuple(batch)


def load_model(spec: str, *, weights: str | None = None, trust_pickle: bool = False) -> LoadedModel:
    if is_factory_spec(spec):
        module = build_from_factory(spec)
        if weights is not None:
            load_weights_into(module, weights)
        return LoadedModel(module=module, name=spec)
    path = _existing_file(spec, what="model file")
    if weights is not None:
        raise LoadError("--weights only applies to a 'module:factory' model")
    if path.suffix == ".pt2":
        return _load_pt2(path, trust_pickle)
    return _load_pickled_module(path, trust_pickle)


def _existing_file(spec: str, what: str) -> Path:
    path = Path(spec)
    try:
        mode = path.stat().st_mode  # follows symlinks: a link to a regular file is fine
    except FileNotFoundError:
        raise LoadError(f"{what} not found: {spec}") from None
    except OSError as error:
        raise LoadError(f"cannot read {what} {spec}: {error.strerror}") from error
    if stat.S_ISDIR(mode):
        raise LoadError(f"{spec} is a directory, expected a {what}")
    if not stat.S_ISREG(mode):  # reading a FIFO or a device would wait or never end
        raise LoadError(f"{spec} is not a regular file (a FIFO, socket or device), expected a {what}")
    if path.stat().st_size == 0:
        raise LoadError(f"{spec} is empty (0 bytes), expected a {what}")
    return path


@contextlib.contextmanager
def user_import_path(*folders: os.PathLike) -> Iterator[None]:
    """Make the user's own modules importable while their code is resolved and run.

    The working directory (and ``folders``) go at the END of ``sys.path``, so installed
    packages win over look-alikes in the project (a local ``rich.py`` cannot shadow rich),
    and come off again afterwards. Entries already on ``sys.path`` are left where they are.
    """
    added: list[str] = []
    for folder in (os.getcwd(), *map(os.fspath, folders)):
        if folder not in sys.path and folder not in added:
            sys.path.append(folder)
            added.append(folder)
    try:
        yield
    finally:
        for folder in added:
            if folder in sys.path:
                sys.path.remove(folder)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch logs full tracebacks for bad archives; the user gets our one line instead."""
    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export", "torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _load_pt2(path: Path, trust_pickle: bool) -> LoadedModel:
    # One open file for the inspection and for torch: what was inspected is what torch reads.
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise LoadError(f"cannot read {path}: {error.strerror}") from error
    with handle:
        inspect_pt2(handle, str(path), trust=trust_pickle)
        try:
            with _quiet_torch(), user_import_path() if trust_pickle else contextlib.nullcontext():
                program = torch.export.load(handle)
                module = program.module()  # builds (execs) the program's guard code
        except Exception as error:  # torch raises many types for corrupt archives
            raise LoadError(f"{path} could not be read as a .pt2 archive: {_short(error)}") from error
    example = None
    if getattr(program, "example_inputs", None) is not None:
        args, kwargs = program.example_inputs
        if kwargs:
            raise LoadError(f"{path} has keyword example inputs, which qlint does not support yet")
        example = tuple(args)
    return LoadedModel(module=module, name=path.name, example_inputs=example, exported_program=program)


def _load_pickled_module(path: Path, trust_pickle: bool) -> LoadedModel:
    try:
        obj = _weights_only_load(path, "model file")
    except pickle.UnpicklingError as error:
        if not trust_pickle:
            raise LoadError(
                f"{path} contains pickled Python objects (such as a whole nn.Module); loading it "
                "would run code from the file. If you trust its source, pass --trust-pickle; "
                "otherwise save a state_dict and use 'package.module:factory --weights FILE', "
                "or save with torch.export.save to a .pt2"
            ) from error
        obj = _load_trusted(path)
    if isinstance(obj, nn.Module):
        return LoadedModel(module=obj, name=path.name)
    if _looks_like_state_dict(obj):
        raise LoadError(
            f"{path} holds only a state_dict ({len(_unwrap_state_dict(obj))} tensors), not a model; "
            f"pass the architecture as 'package.module:factory --weights {path}'"
        )
    raise LoadError(f"{path} holds a {type(obj).__name__}, not an nn.Module")


def _load_trusted(path: Path) -> Any:
    """Unpickle a file the user trusts; its classes resolve from the working directory too,
    as ``module:factory`` specs do (the issue: 'No module named mymodels' from the project folder)."""
    try:
        with _quiet_torch(), user_import_path():
            return torch.load(str(path), weights_only=False, map_location="cpu")
    except Exception as error:  # code from the file may raise anything
        raise LoadError(f"{path} could not be unpickled: {_short(error)}") from error


def _looks_like_state_dict(obj: Any) -> bool:
    inner = _unwrap_state_dict(obj)
    return (
        isinstance(inner, dict)
        and bool(inner)
        and all(isinstance(k, str) and torch.is_tensor(v) for k, v in inner.items())
    )


def _unwrap_state_dict(obj: Any) -> Any:
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if key in obj and isinstance(obj[key], dict):
                return obj[key]
    return obj


def build_from_factory(spec: str) -> nn.Module:
    with user_import_path():  # the factory may import the project's modules when called
        factory = resolve_object(spec)
        if isinstance(factory, nn.Module):
            return factory
        if not callable(factory):
            raise LoadError(f"{spec} is not callable and not an nn.Module")
        try:
            module = factory()
        except Exception as error:  # the user's factory may raise anything
            raise LoadError(f"factory {spec} raised {_short(error)}") from error
    if not isinstance(module, nn.Module):
        raise LoadError(f"factory {spec} returned {type(module).__name__}, expected an nn.Module")
    return module


def resolve_object(spec: str) -> Any:
    """Import 'package.module:attr' or 'path/to/file.py:attr' and return the attribute."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise LoadError(f"expected 'package.module:name', got {spec!r}")
    try:
        if module_part.endswith(".py"):
            file_path = Path(module_part)
            if not file_path.is_file():
                raise LoadError(f"python file not found: {module_part}")
            module_spec = importlib.util.spec_from_file_location(file_path.stem, file_path)
            if module_spec is None or module_spec.loader is None:
                raise LoadError(f"cannot import {module_part}")
            module = importlib.util.module_from_spec(module_spec)
            with user_import_path(file_path.resolve().parent):  # its sibling modules
                module_spec.loader.exec_module(module)
        else:
            with user_import_path():  # 'examples.tiny:build' works from a project root
                module = importlib.import_module(module_part)
    except LoadError:
        raise
    except Exception as error:  # import errors, syntax errors, errors at import time
        raise LoadError(f"cannot import {module_part}: {_short(error)}") from error
    if not hasattr(module, attr):
        raise LoadError(f"{module_part} has no attribute {attr!r}")
    return getattr(module, attr)


def load_weights_into(module: nn.Module, weights: str) -> None:
    path = _existing_file(weights, what="weights file")
    try:
        obj = _weights_only_load(path, "weights file")
    except pickle.UnpicklingError as error:
        raise LoadError(f"{path} is not a plain state_dict (it holds pickled objects)") from error
    state = _unwrap_state_dict(obj)
    if not _looks_like_state_dict(state):
        raise LoadError(f"{path} does not hold a state_dict")
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor whose shape does not match the model's
        lines = [line.strip() for line in str(error).splitlines()]
        detail = next((line for line in lines if line.startswith("size mismatch")), _short(error))
        raise LoadError(f"{path} does not fit the model: {detail}"[:400]) from error
    if result.missing_keys or result.unexpected_keys:
        raise LoadError(
            f"{path} does not fit the model: missing {_preview(result.missing_keys)}, "
            f"unexpected {_preview(result.unexpected_keys)}"
        )


def _preview(keys: Sequence[str]) -> str:
    if not keys:
        return "none"
    shown = ", ".join(keys[:3])
    return f"{shown} (+{len(keys) - 3} more)" if len(keys) > 3 else shown


# An example input qlint makes up itself: 2**28 elements is 1 GiB of float32, far beyond
# any one example; a typo such as 1,3,2240,2240000 must not allocate until the machine dies.
MAX_INPUT_ELEMENTS = 2**28

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "bool": torch.bool,
    "uint8": torch.uint8,
}


def check_input_shape(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype that '1,3,224,224' or '1,128:int64' asks for; nothing is allocated.

    A ValueError says what is wrong with ``text``; the caller names where it came from (the
    --input-shape flag, or the pyproject.toml setting)."""
    shape_text, _, dtype_text = text.partition(":")
    separator = "," if "," in shape_text else "x"
    try:
        shape = tuple(int(d) for d in shape_text.split(separator))
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated integers like 1,3,224,224") from None
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"{text!r}: dimensions must be positive integers")
    elements = math.prod(shape)
    if elements > MAX_INPUT_ELEMENTS:
        raise ValueError(
            f"{text!r} has {elements:.3g} elements, more than qlint generates "
            f"({MAX_INPUT_ELEMENTS:.3g}); pass a real input with --example-inputs FILE"
        )
    dtype = _DTYPES.get(dtype_text.strip().lower() or "float32")
    if dtype is None:
        raise ValueError(f"{text!r}: unknown dtype; use one of {', '.join(sorted(_DTYPES))}")
    return shape, dtype


def parse_input_shape(text: str) -> torch.Tensor:
    """'1,3,224,224' or '1,128:int64' → a deterministic example tensor."""
    try:
        shape, dtype = check_input_shape(text)
    except ValueError as error:
        raise LoadError(f"bad --input-shape {error}") from None
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool)
    return torch.randint(0, 2, shape, generator=generator, dtype=dtype)


def load_example_inputs(path_text: str) -> tuple[Any, ...]:
    path = _existing_file(path_text, what="example inputs file")
    try:
        obj = _weights_only_load(path, "example inputs file")
    except pickle.UnpicklingError as error:
        raise LoadError(f"{path} holds pickled objects; save example inputs as tensors") from error
    if torch.is_tensor(obj):
        return (obj,)
    if isinstance(obj, (tuple, list)) and obj and all(torch.is_tensor(t) for t in obj):
        return tuple(obj)
    raise LoadError(f"{path} must hold a tensor or a tuple of tensors, not {type(obj).__name__}")


def _check_torch_save_format(path: Path, what: str) -> None:
    """torch.save writes a zip archive (or, before torch 1.6 or with the legacy flag, a
    protocol-2 pickle): anything else is the wrong file, said before torch's own riddles."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise LoadError(f"cannot read {path}: {error.strerror}") from error
    if not (head.startswith(b"PK") or head.startswith(b"\x80")):
        hint = f"; to run code from it, name a function: {path}:function" if path.suffix == ".py" else ""
        raise LoadError(
            f"{path} is not a file torch.save wrote (torch.save writes a zip archive; this {what} "
            f"starts with {head!r}){hint}"
        )


def _weights_only_load(path: Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` of a file torch.save wrote. pickle.UnpicklingError (the
    file holds objects that need trust) passes to the caller to word; any other failure is a
    LoadError: a weights_only load runs no code, so whatever it raises means a corrupt file."""
    _check_torch_save_format(path, what)
    check_zip_file(path, str(path))
    refuse_torchscript(path)
    try:
        with _quiet_torch():
            return torch.load(str(path), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise
    except Exception as error:  # torch raises KeyError, RuntimeError, EOFError ... for corrupt files
        raise LoadError(f"{path} is not a readable PyTorch file (truncated or corrupt?): {_short(error)}") from error


def _short(error: BaseException) -> str:
    return first_line(error, limit=240)
