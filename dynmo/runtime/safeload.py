"""Read torch.distributed.checkpoint (DCP) checkpoints without running code from them.

A DCP checkpoint folder holds `.metadata` (a pickle of `Metadata`) and shard files
(`__{rank}_{n}.distcp`). torch's `FileSystemReader` reads `.metadata` with `pickle.load`, so
a crafted file runs arbitrary code on every rank that resumes from it. On the load path there
are three places a pickle meets the checkpoint's bytes:

* `.metadata` (and the rank-local `__{rank}.metadata` DCP falls back to): plain `pickle.load`.
  Here it is read by `_MetadataUnpickler`, which resolves only the globals in `ADMITTED` (the
  DCP metadata dataclasses, `_StorageInfo`, `torch.Size`, torch dtypes and layouts,
  `collections.OrderedDict`, `pathlib.PosixPath`) and sets state only on instances of the DCP
  dataclasses, with their own field names. It is the pure-Python unpickler: the C one lets a
  file `BUILD` attributes onto an admitted class (say `Metadata.__eq__`) for the whole process.
  The result is then checked field by field (`_validate`): types, sizes, chunk bounds, and
  shard names that stay inside the checkpoint folder.
* Tensor entries of the shards: a `torch.save` archive each, read with
  `torch.load(weights_only=True)`, torch's restricted unpickler, as FileSystemReader does.
* Non-tensor entries (`BytesStorageMetadata`): FileSystemReader hands their bytes to the
  planner, whose `load_bytes` calls `torch.load(weights_only=False)`; the metadata alone
  decides which entries take that path, so a crafted `.metadata` plus a crafted shard would
  run code even with a safe metadata reader. Here those bytes are read with
  `torch.load(weights_only=True)` and only a fresh `torch.save` of the result reaches the
  planner.

Every refusal or unreadable file is a `CheckpointError` (a ValueError) with a one-line message.
`load` calls `dcp.load` with a `SafeFileSystemReader` and unwraps DCP's own exception, so the
caller sees that `CheckpointError`; `read_metadata` and `check_files` (the metadata, then each
shard it names present and long enough) need no process group.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import os
import pathlib
import pickle
from pathlib import Path, PurePath
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["ADMITTED", "CheckpointError", "SafeFileSystemReader", "check_files", "load", "read_metadata"]

METADATA_FILE = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or is refused; the message is one line naming the file."""


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: object) -> torch.layout:
    """Stands in for `torch.serialization._get_layout`, which is how a torch.layout pickles."""
    if type(name) is not str or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


# The dataclasses a DCP metadata file instantiates (and may set state on), with their fields.
_DATACLASSES = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                TensorProperties, StorageMeta, MetadataIndex, _StorageInfo)
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES}


def _admitted() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {}
    for cls in (*_DATACLASSES, _MEM_FORMAT_ENCODING, torch.Size):
        table[cls.__module__, cls.__qualname__] = cls
    for name, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout)):
            table["torch", name] = v
    table["torch.serialization", "_get_layout"] = _layout
    table["collections", "OrderedDict"] = collections.OrderedDict
    # StorageMeta.checkpoint_id is the Path the checkpoint was saved to (pathlib._local on 3.13).
    table["pathlib", "PosixPath"] = table["pathlib._local", "PosixPath"] = pathlib.PosixPath
    return table


# (module, name) -> the object a `.metadata` file may refer to; nothing else resolves.
ADMITTED: dict[tuple[str, str], Any] = _admitted()


def _show(s: object, limit: int = 100) -> str:
    """`s` for a one-line message: printable and short."""
    text = s if isinstance(s, str) else repr(s)
    if not text.isprintable() or len(text) > limit:
        text = repr(text[:limit])
    return text


def _one_line(e: BaseException) -> str:
    """The telling line of an exception's message (torch.load's carry a paragraph of advice)."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    telling = [ln for ln in lines if not ln.startswith(boiler)]
    text = (telling or lines or [""])[0]
    if text.startswith("WeightsUnpickler error:"):
        text = text[len("WeightsUnpickler error:"):].strip() or text
    text = text if len(text) <= 200 else text[:197] + "..."
    name = type(e).__name__
    if name == "error":  # struct.error and kin
        name = f"{type(e).__module__}.error"
    return f"{name}: {text}" if text else name


def _describe(obj: object) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__qualname__}"


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP `.metadata` file, resolving only `ADMITTED` globals."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ADMITTED[module, name]
        except (KeyError, TypeError):
            pass
        raise CheckpointError(f"checkpoint {self.where} refers to {_show(module)}.{_show(name)}, which a DCP "
                              "metadata file never needs; refusing to load it (the file may be crafted)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"checkpoint {self.where} refers to a persistent object, which a DCP metadata "
                              "file never needs; refusing to load it (the file may be crafted)")

    def load_build(self) -> None:
        """BUILD, only onto an instance of a DCP metadata dataclass and only its own fields."""
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in _FIELDS:
            raise CheckpointError(f"checkpoint {self.where} sets the state of {_describe(inst)}, which a DCP "
                                  "metadata file never does; refusing to load it (the file may be crafted)")
        if cls is TensorProperties:
            if type(state) is not tuple or len(state) != 5:
                raise pickle.UnpicklingError("TensorProperties state is not a 5-tuple")
            TensorProperties.__setstate__(inst, state)
            return
        if type(state) is not dict or not all(type(k) is str and k in _FIELDS[cls] for k in state):
            raise CheckpointError(f"checkpoint {self.where} sets attributes of a {cls.__name__} it does not have; "
                                  "refusing to load it (the file may be crafted)")
        inst.__dict__.update(state)

    dispatch[pickle.BUILD[0]] = load_build


class _Invalid(Exception):
    pass


def _need(ok: bool, problem: str) -> None:
    if not ok:
        raise _Invalid(problem)


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


def _is_size(x: object) -> bool:
    return type(x) is torch.Size and all(_is_count(d) for d in x)


def _check_fields(obj: object, cls: type, what: str) -> None:
    _need(type(obj) is cls, f"{what} is {_describe(obj)}, not a {cls.__name__}")
    extra = set(vars(obj)) - _FIELDS[cls]
    _need(not extra, f"{what} has attributes a {cls.__name__} does not have: {sorted(map(_show, extra))}")
    missing = [f for f in sorted(_FIELDS[cls]) if not hasattr(obj, f)]
    _need(not missing, f"{what} lacks the field(s) {missing}")


def _is_plain_file_name(name: object) -> bool:
    return (type(name) is str and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name)


def _validate(md: object) -> None:
    """Raises _Invalid unless `md` is a well-formed DCP Metadata whose shards lie in its folder."""
    _check_fields(md, Metadata, "the file")
    _need(type(md.state_dict_metadata) is dict, "state_dict_metadata is not a dict")
    needed: dict[MetadataIndex, str] = {}
    for key, entry in md.state_dict_metadata.items():
        _need(type(key) is str, f"the key {_show(key)} is not a string")
        what = f"entry {_show(key)}"
        if type(entry) is BytesStorageMetadata:
            _check_fields(entry, BytesStorageMetadata, what)
            needed[MetadataIndex(key)] = key
            continue
        _check_fields(entry, TensorStorageMetadata, what)
        p = entry.properties
        _check_fields(p, TensorProperties, f"{what}'s properties")
        _need(type(p.dtype) is torch.dtype and type(p.layout) is torch.layout
              and type(p.memory_format) is torch.memory_format
              and type(p.requires_grad) is bool and type(p.pin_memory) is bool,
              f"{what} has malformed tensor properties")
        _need(_is_size(entry.size), f"{what} has a malformed size")
        _need(type(entry.chunks) is list, f"{what} has no list of chunks")
        for chunk in entry.chunks:
            _check_fields(chunk, ChunkStorageMetadata, f"a chunk of {what}")
            _need(_is_size(chunk.offsets) and _is_size(chunk.sizes)
                  and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                  and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size)),
                  f"{what} has a chunk outside its tensor")
            needed[MetadataIndex(key, chunk.offsets)] = key
    pd = md.planner_data
    _need(pd is None or (type(pd) is dict and all(
        type(k) is str and type(v) in (tuple, list) and all(type(x) in (str, int) for x in v)
        for k, v in pd.items())), "planner_data is not a map from keys to key paths")
    sd = md.storage_data
    _need(type(sd) is dict, "storage_data is not a dict")
    for index, info in sd.items():
        _check_fields(index, MetadataIndex, "a storage index")
        _need(type(index.fqn) is str and (index.offset is None or _is_size(index.offset))
              and (index.index is None or _is_count(index.index)), "a storage index is malformed")
        what = f"the storage of {_show(index.fqn)}"
        _check_fields(info, _StorageInfo, what)
        _need(_is_plain_file_name(info.relative_path),
              f"{what} is the file {_show(info.relative_path)}, outside the checkpoint folder")
        _need(_is_count(info.offset) and _is_count(info.length), f"{what} has a malformed offset or length")
        td = info.transform_descriptors
        _need(td is None or (type(td) in (list, tuple) and all(type(d) is str for d in td)),
              f"{what} has malformed transform descriptors")
    for index, key in needed.items():
        _need(index in sd, f"entry {_show(key)} has no storage record")
    sm = md.storage_meta
    if sm is not None:
        _check_fields(sm, StorageMeta, "storage_meta")
        _need((sm.checkpoint_id is None or type(sm.checkpoint_id) is str or isinstance(sm.checkpoint_id, PurePath))
              and all(x is None or type(x) is str for x in (sm.save_id, sm.load_id))
              and type(sm.modules) is list and all(type(m) is str for m in sm.modules),
              "storage_meta is malformed")
    _need(md.version is None or type(md.version) is str, "version is not a string")


def _parse_metadata(data: bytes, where: str) -> Metadata:
    try:
        md = _MetadataUnpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint {where} is not a readable DCP metadata file ({_one_line(e)}); "
                              "it may be truncated or corrupt") from None
    try:
        _validate(md)
    except _Invalid as e:
        raise CheckpointError(f"checkpoint {where} is not a valid DCP metadata file: {e}; refusing to load it "
                              "(the file may be crafted or corrupt)") from None
    return md


def _read_metadata_file(path: os.PathLike | str, open_: Callable[[], Any]) -> Metadata:
    where = str(path)
    try:
        with open_() as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} does not exist: not a DCP checkpoint folder, "
                              "or its save did not finish") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {where} cannot be read: {e.strerror or e}") from None
    return _parse_metadata(data, where)


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader that runs no code from the checkpoint: the metadata goes through a
    restricted unpickler and every shard entry through `torch.load(weights_only=True)`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        metadata = _read_metadata_file(path, lambda: self.fs.create_stream(path, "rb"))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _load(self, stream: Any, shard: str, fqn: str) -> Any:
        try:
            return torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"checkpoint shard {shard} (entry {_show(fqn)}) is not plain tensor data "
                                  f"({_one_line(e)}); refusing to load it (the file may be crafted or corrupt)"
                                  ) from None

    def _read_item(self, stream: Any, shard: str, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        fqn = req.storage_index.fqn
        raw = self._slice_file(stream, info)
        data = self.transforms.transform_load_stream(req, info.transform_descriptors or (), raw)
        if req.type == LoadItemType.BYTE_IO:
            obj = self._load(io.BytesIO(data.read(-1)), shard, fqn)
            resaved = io.BytesIO()
            torch.save(obj, resaved)  # the planner unpickles these bytes without restriction
            resaved.seek(0)
            planner.load_bytes(req, resaved)
            return
        if not data.seekable():
            data = io.BytesIO(data.read(-1))
        tensor = self._load(data, shard, fqn)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"checkpoint shard {shard} (entry {_show(fqn)}) holds {_describe(tensor)} "
                                  "where a tensor belongs; refusing to load it (the file may be crafted)")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"checkpoint shard {shard} (entry {_show(fqn)}) holds a tensor of size "
                                  f"{list(tensor.size())} where one of size {list(target.size())} belongs")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            shard = self.fs.concat_path(self.path, relative_path)
            with contextlib.ExitStack() as files:
                try:
                    stream = files.enter_context(self.fs.create_stream(shard, "rb"))
                except OSError as e:
                    raise CheckpointError(f"checkpoint shard {shard} cannot be read: {e.strerror or e}") from None
                for req in reqs:
                    self._read_item(stream, str(shard), req, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of the checkpoint folder `path` (or of a `.metadata` file), read without
    running code from it; needs no process group. Raises CheckpointError."""
    p = Path(path)
    if p.is_file():
        return _read_metadata_file(p, lambda: open(p, "rb"))
    return SafeFileSystemReader(p).read_metadata()


def check_files(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of the checkpoint folder `path` (`read_metadata`), and every shard file
    it names present and at least as long as the bytes it is said to hold there (offset +
    length). A shard cut short (a full disk, a partial copy) is refused before launch, naming
    the file, instead of by the rank that reads it. Needs no process group; raises CheckpointError."""
    folder = Path(path)
    md = read_metadata(folder)
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, need in sorted(needed.items()):
        shard = folder / name
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {folder} lacks the shard {name} its {METADATA_FILE} lists; the copy is "
                                  "incomplete: copy it again, or resume from another checkpoint") from None
        except OSError as e:
            raise CheckpointError(f"checkpoint shard {shard} cannot be read: {e.strerror or e}") from None
        if size < need:
            raise CheckpointError(f"checkpoint shard {shard} is truncated: {size} bytes, but its {METADATA_FILE} "
                                  f"places data up to byte {need}; copy it again, or resume from another checkpoint")
    return md


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group: Any = None,
         no_dist: bool = False, planner: LoadPlanner | None = None) -> None:
    """`dcp.load(state_dict, ...)` from the folder `path` through a SafeFileSystemReader.

    Collective over `process_group` when torch.distributed is initialised (as dcp.load). Every
    rank reads the metadata first, so a refused file fails each rank alike before any collective.
    Raises CheckpointError for a refused or unreadable checkpoint, with DCP's wrapping removed."""
    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    for key, value in state_dict.items():
        # DCP would replace such a tensor by the unpickled object instead of loading into it.
        if isinstance(value, torch.Tensor) and type(stored.get(key)) is BytesStorageMetadata:
            raise CheckpointError(f"checkpoint {reader.path} stores {_show(key)} as a pickled object, "
                                  "not a tensor; refusing to load it (the file may be crafted)")
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise CheckpointError(str(exc)) from None
        raise
