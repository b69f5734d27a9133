"""Inspection of zip archives before torch reads them: bounded size, and no code from a ``.pt2``.

``torch.export.load`` runs code from the archive in several ways: it unpickles weights and
tensor constants marked ``use_pickle`` (``weights_only=False``), opaque-object constants
(``pickle.loads``) and TorchScript objects, falls back to unpickling example inputs that fail
``weights_only`` loading, and loads AOTInductor shared libraries as native code. The program's
JSON adds operator names, shape expressions, pytree specs and guard code
(see :mod:`qlint.core.pt2_program`). :func:`inspect_pt2` reads the zip directory and those
members with the standard library and ``weights_only`` loads, and refuses (``LoadError``,
exit 2, one line naming the member) anything that would take one of those paths, unless
the user trusts the file (``--trust-pickle``). The size bounds hold even then.

Layout written by ``torch.export.save`` (archive version 0), every member under one root folder:
``models/<m>.json`` (the program), ``data/weights/<m>_weights_config.json`` + ``weight_<i>``,
``data/constants/<m>_constants_config.json`` + ``tensor_<i>`` | ``custom_obj_<i>`` |
``opaque_obj_<i>``, ``data/sample_inputs/<m>.pt`` (``torch.save((args, kwargs))``),
``data/aotinductor/<m>/...`` (compiled code), ``extra/...`` (text).
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from typing import Any, BinaryIO, NoReturn

import torch

from qlint.core.pt2_program import review_program
from qlint.errors import LoadError

# Decompression bounds, from the zip directory before anything is extracted. torch writes
# members uncompressed (ratio 1); recompressed archives of float weights stay near 1 too.
# A zip bomb is far beyond: 3 MB of zeros that unpack to 3.3 GB is a ratio of 1100.
MAX_EXPANSION_RATIO = 10  # unpacked bytes per archive byte ...
EXPANSION_ALLOWANCE_BYTES = 64 * 2**20  # ... plus this, so small archives of compressible JSON pass
MAX_UNPACKED_BYTES = 32 * 2**30  # and never more than this, whatever the archive's size
MAX_MEMBERS = 100_000

TRUST_HINT = "; pass --trust-pickle only if you trust where the file came from"
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # what torch.export.save writes: weight_0, tensor_3
_NATIVE_LIBRARY = re.compile(r"\.(so|dll|dylib|pyd)(\.[0-9]+)*$", re.IGNORECASE)
_MODELS_DIR = "models/"
_AOTI_DIR = "data/aotinductor/"
_WEIGHTS_DIR = "data/weights/"
_CONSTANTS_DIR = "data/constants/"
_SAMPLE_INPUTS = "data/sample_inputs/{}.pt"
_TENSOR_CONSTANT_PREFIX = "tensor_"


def check_unpacked_size(archive: zipfile.ZipFile, packed_bytes: int, label: str) -> None:
    """Refuse an archive whose directory says it unpacks beyond the module's bounds."""
    infos = archive.infolist()
    if len(infos) > MAX_MEMBERS:
        raise LoadError(f"{label}: refused: {len(infos)} archive members, more than {MAX_MEMBERS}")
    total = sum(info.file_size for info in infos)
    limit = min(MAX_UNPACKED_BYTES, packed_bytes * MAX_EXPANSION_RATIO + EXPANSION_ALLOWANCE_BYTES)
    if total <= limit:
        return
    worst = max(infos, key=lambda info: info.file_size - info.compress_size)
    raise LoadError(
        f"{label}: refused: it would unpack to {_size(total)}, more than {_size(limit)} "
        f"({MAX_EXPANSION_RATIO}x its {_size(packed_bytes)} + {_size(EXPANSION_ALLOWANCE_BYTES)}, "
        f"at most {_size(MAX_UNPACKED_BYTES)}); member {worst.filename} expands "
        f"{_size(worst.compress_size)} to {_size(worst.file_size)}"
    )


def check_zip_file(path: os.PathLike, label: str) -> None:
    """Bound a zip-format file (a ``torch.save`` .pt) before ``torch.load`` inflates it."""
    if not zipfile.is_zipfile(path):
        return  # legacy pickle format: nothing compressed
    try:
        with zipfile.ZipFile(path) as archive:
            check_unpacked_size(archive, os.path.getsize(path), label)
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # torch.load reports the corrupt file in its own words


def is_torchscript_archive(path: os.PathLike) -> bool:
    """Whether a zip-format file is a TorchScript archive (``torch.jit.save``: its record holds
    ``constants.pkl`` and the ``code/`` of the script), not a ``torch.save`` file."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = {name.split("/", 2)[1] for name in archive.namelist() if name.count("/") >= 1}
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return "constants.pkl" in names and "code" in names


def refuse_torchscript(path: os.PathLike) -> None:
    """LoadError naming a TorchScript archive as such (torch's own weights_only error reads as
    a corrupt file), with what to give instead."""
    if is_torchscript_archive(path):
        raise LoadError(
            f"{path} is a TorchScript archive (torch.jit.save), which qlint cannot trace or inspect; give the "
            "Python model: package.module:factory (with --weights), a .pt2 from torch.export.save, or a pickled "
            "nn.Module with --trust-pickle (the int8 model qlint quantize writes is for deployment: to inspect "
            "it, build it with QuantPlan.quantize in a package.module:factory)"
        )


def inspect_pt2(handle: BinaryIO, label: str, *, trust: bool) -> None:
    """Refuse (LoadError) a ``.pt2`` that would run code when torch loads it, or that is too big."""
    handle.seek(0, os.SEEK_END)
    packed = handle.tell()
    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise LoadError(
            f"{label} is not a valid .pt2 archive (truncated or not written by torch.export.save): {error}"
        ) from error
    with archive:
        check_unpacked_size(archive, packed, label)
        _ArchiveReview(archive, label, trust).run()
    handle.seek(0)


class _ArchiveReview:
    """One pass over one archive; raises at the first refusal."""

    def __init__(self, archive: zipfile.ZipFile, label: str, trust: bool) -> None:
        self.archive = archive
        self.label = label
        self.trust = trust
        self.root = ""
        # Members by name under the root, case-folded: torch's zip reader finds a record whatever
        # the case of its name, so every lookup here must too (or it reviews a different member).
        self.names: dict[str, zipfile.ZipInfo] = {}

    def run(self) -> None:
        for info in self.archive.infolist():
            if info.flag_bits & 0x1:
                raise LoadError(f"{self.label}: member {info.filename} is encrypted")
        if self.trust:
            return  # torch reads it as it is, older layouts included
        self.root = self._root()
        self.names = {
            info.filename[len(self.root) :].lower(): info for info in self.archive.infolist() if not info.is_dir()
        }
        for name in self.names:
            if name.startswith(_AOTI_DIR):
                self._fail(name, "is AOTInductor compiled code, which torch would load as native code")
            if _NATIVE_LIBRARY.search(name):
                self._fail(name, "is a native shared library, which could run code when loaded")
        models = [name for name in self.names if name.startswith(_MODELS_DIR)]
        for name in models:
            if not name.endswith(".json"):
                self._fail(name, "is not a serialized program (models/ holds only .json files)")
        if f"{_MODELS_DIR}model.json" not in self.names:
            raise LoadError(
                f"{self.label} holds no exported program ({self.root}models/model.json); "
                "save one with torch.export.save"
            )
        for name in models:
            self._review_model(name[len(_MODELS_DIR) : -len(".json")], name)

    # ------------------------------------------------------------------ structure
    def _root(self) -> str:
        """torch reads every record under the first member's folder; one folder, no look-alikes."""
        infos = self.archive.infolist()
        if not infos:
            raise LoadError(f"{self.label} is an empty archive, not a .pt2")
        root = infos[0].filename.partition("/")[0] + "/"
        seen: set[str] = set()
        for info in infos:
            folded = info.filename.lower()
            if folded in seen:  # torch's zip reader may match names without regard to case
                raise LoadError(f"{self.label}: refused: member {info.filename} appears twice")
            seen.add(folded)
            if not info.filename.startswith(root):  # e.g. the pre-2.8 layout, which torch unpickles
                raise LoadError(
                    f"{self.label}: refused: member {info.filename} lies outside the archive "
                    f"folder {root} (not the layout torch.export.save writes)" + TRUST_HINT
                )
        return root

    def _fail(self, name: str, reason: str, needs_trust: bool = True) -> NoReturn:
        info = self.names.get(name.lower())
        member = info.filename if info is not None else self.root + name
        raise LoadError(f"{self.label}: refused member {member}: {reason}" + (TRUST_HINT if needs_trust else ""))

    def _read(self, name: str) -> bytes:
        try:
            return self.archive.read(self.names.get(name.lower()) or self.root + name)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as error:
            raise LoadError(f"{self.label}: member {self.root}{name} cannot be read: {error}") from error

    def _json(self, name: str) -> Any:
        try:
            return json.loads(self._read(name))
        except (ValueError, RecursionError) as error:
            raise LoadError(f"{self.label}: member {self.root}{name} is not valid JSON") from error

    # -------------------------------------------------------------------- program
    def _review_model(self, model: str, name: str) -> None:
        problem = review_program(self._json(name))
        if problem:
            self._fail(name, problem)
        self._review_payloads(model, _WEIGHTS_DIR, "weights", "weight")
        self._review_payloads(model, _CONSTANTS_DIR, "constants", "constant")
        inputs = _SAMPLE_INPUTS.format(model).lower()
        if inputs in self.names:
            self._weights_only(inputs, "example inputs", expect=(tuple, dict))

    def _review_payloads(self, model: str, folder: str, kind: str, what: str) -> None:
        legacy = f"{folder}{model}.pt".lower()
        if legacy in self.names:  # torch.load with a weights_only=False fallback
            self._weights_only(legacy, f"legacy {kind} file", expect=(dict, tuple))
            return
        config_name = f"{folder}{model}_{kind}_config.json".lower()
        if config_name not in self.names:
            return  # torch refuses the archive itself
        config = self._json(config_name)
        entries = config.get("config") if isinstance(config, dict) else None
        if not isinstance(entries, dict):
            self._fail(config_name, f"is not a {kind} table", needs_trust=False)
        for fqn, entry in entries.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
                self._fail(config_name, f"describes {what} {fqn!r} without a payload name", needs_trust=False)
            self._review_payload(folder, config_name, fqn, entry, what)

    def _review_payload(self, folder: str, config_name: str, fqn: str, entry: dict, what: str) -> None:
        path_name = entry["path_name"]
        if not _PLAIN_FILE_NAME.fullmatch(path_name) or set(path_name) == {"."}:
            # torch joins it to the folder with os.path.join: "/x" or "../x" names another member
            self._fail(config_name, f"gives {what} {fqn!r} the payload name {path_name[:80]!r}, not a file in {folder}")
        member = (folder + path_name).lower()
        if folder == _CONSTANTS_DIR and not path_name.startswith(_TENSOR_CONSTANT_PREFIX):
            kind = (
                "an opaque Python object (torch would pickle.loads it)"
                if path_name.startswith("opaque_obj_")
                else "a TorchScript object (torch would unpickle it)"
                if path_name.startswith("custom_obj_")
                else f"of unknown kind {path_name!r}"
            )
            self._fail(member if member in self.names else config_name, f"constant {fqn!r} is {kind}")
        if entry.get("use_pickle"):
            if member not in self.names:
                self._fail(config_name, f"marks {what} {fqn!r} for unpickling from missing member {path_name!r}")
            self._weights_only(member, f"{what} {fqn!r} (marked for pickle loading)", expect=(torch.Tensor,))
            return
        info = self.names.get(member)
        meta = entry.get("tensor_meta")
        sizes = meta.get("sizes") if isinstance(meta, dict) else None
        declared = _declared_elements(sizes)
        if info is not None and info.file_size == 0 and declared is not None and declared > 0:
            # torch allocates torch.zeros(sizes) for an empty record: a terabyte from nothing
            self._fail(
                member, f"{what} {fqn!r} stores no bytes but declares shape {_shape_text(sizes)}", needs_trust=False
            )

    def _weights_only(self, name: str, what: str, expect: tuple[type, ...]) -> None:
        """torch would read this member with ``weights_only=False`` (or fall back to it): it must
        load with ``weights_only=True`` exactly as torch first tries it, or it is refused."""
        data = self._read(name)
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as inner:
                check_unpacked_size(inner, len(data), f"{self.label}: member {self.root}{name}")
        try:
            value = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # any failure makes torch retry with weights_only=False
            self._fail(
                name,
                f"{what} cannot be loaded as plain tensors ({_unpickling_reason(error)}); "
                "torch would unpickle it with weights_only=False, which can run code from the file",
            )
        if not isinstance(value, expect):
            self._fail(name, f"{what} is a {type(value).__name__}, not what torch stores there", needs_trust=False)


def _declared_elements(sizes: Any) -> int | None:
    if not isinstance(sizes, list):
        return None
    count = 1
    for size in sizes:
        value = size.get("as_int") if isinstance(size, dict) else None
        if not isinstance(value, int):
            return None
        count *= value
    return count


def _shape_text(sizes: Any) -> str:
    if not isinstance(sizes, list):
        return "?"
    return "(" + ", ".join(str(s.get("as_int", "?")) if isinstance(s, dict) else "?" for s in sizes)[:80] + ")"


def _unpickling_reason(error: BaseException) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        detail = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        if detail:
            return detail[0].split(". ")[0][:160]
    lines = text.strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


def _size(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"
