"""dynmo.runtime.safeload: DCP checkpoints are read without running code from them."""

import builtins
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from dynmo.runtime import safeload
from dynmo.runtime.safeload import CheckpointError, SafeFileSystemReader
from tests.conftest import run_train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming ... a single process"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "i": torch.arange(7, dtype=torch.int64) * 3,
        "step": torch.tensor(3.0),  # AdamW's 0-dim step
    }


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _tensors().items()}


def _assert_loaded(sd: dict) -> None:
    for k, v in _tensors().items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("safe") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_tensors(), checkpoint_id=str(path))
    return path


@pytest.fixture
def copy_of(saved, tmp_path):
    """A copy of the saved checkpoint to tamper with."""
    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


class Payload:
    """Pickles as a call of `func(*args)`: what a crafted checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


class Traced(pickle.Unpickler):
    """The stock unpickler, noting every global it resolves."""

    def __init__(self, f):
        super().__init__(f)
        self.seen = set()

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def _globals_of(metadata_file) -> set:
    with open(metadata_file, "rb") as f:
        u = Traced(f)
        u.load()
    return u.seen


def _refuses(path, marker, expected: str) -> None:
    """read_metadata, safeload.load and dcp.load with a SafeFileSystemReader all refuse `path`."""
    with pytest.raises(CheckpointError) as e:
        safeload.read_metadata(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path / ".metadata") in msg and expected in msg, msg
    assert msg.endswith("refusing to load it (the file may be crafted)"), msg
    with pytest.raises(CheckpointError) as e2:
        safeload.load(_zeros(), path)
    assert str(e2.value) == msg
    with pytest.raises((Exception, CheckpointException)) as e3:
        dcp.load(_zeros(), storage_reader=SafeFileSystemReader(path))
    assert expected in str(e3.value)
    assert not marker.exists()


def test_round_trip_without_process_group(saved):
    assert not dist.is_initialized()
    sd = _zeros()
    dcp.load(sd, storage_reader=SafeFileSystemReader(saved))
    _assert_loaded(sd)
    sd = _zeros()
    safeload.load(sd, saved)
    _assert_loaded(sd)
    md = safeload.read_metadata(saved)
    assert isinstance(md, Metadata) and md.state_dict_metadata["step"].size == torch.Size([])
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16


def test_round_trip_with_process_group(saved):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sd = _zeros()
        dcp.load(sd, storage_reader=SafeFileSystemReader(saved))
        _assert_loaded(sd)
        sd = _zeros()
        safeload.load(sd, saved)
        _assert_loaded(sd)
    finally:
        dist.destroy_process_group()


def test_non_tensor_entries_round_trip(tmp_path):
    """DCP stores non-tensor values as pickles (BytesStorageMetadata); they load, restricted."""
    sd = {"w": torch.ones(2), "n": 7, "blob": b"xyz", "nested": {"a": torch.arange(3)}}
    dcp.save(sd, checkpoint_id=str(tmp_path))
    got = {"w": torch.zeros(2), "n": 0, "blob": b"", "nested": {"a": torch.zeros(3, dtype=torch.int64)}}
    safeload.load(got, tmp_path)
    assert got["n"] == 7 and got["blob"] == b"xyz"
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["nested"]["a"], sd["nested"]["a"])
    assert _globals_of(tmp_path / ".metadata") <= set(safeload.ADMITTED)


def test_admitted_covers_the_saved_metadata(saved):
    seen = _globals_of(saved / ".metadata")
    assert {("torch", "bfloat16"), ("torch", "int64"), ("torch", "float32")} <= seen
    assert seen <= set(safeload.ADMITTED)


def test_stock_reader_runs_the_payload(copy_of, tmp_path):
    """The crafted files below are live: torch's own FileSystemReader runs them."""
    marker = tmp_path / "pwned"
    (copy_of / ".metadata").write_bytes(pickle.dumps(Payload(exec, f"open({str(marker)!r}, 'w').close()")))
    with pytest.raises((Exception, CheckpointException)):
        dcp.load(_zeros(), storage_reader=dcp.FileSystemReader(copy_of))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["system", "exec", "open"])
def test_crafted_metadata_is_refused(copy_of, tmp_path, kind):
    marker = tmp_path / "pwned"
    md = safeload.read_metadata(copy_of)
    if kind == "system":  # the whole file is the payload
        obj, expected = Payload(os.system, f"touch {marker}"), f"refers to {os.system.__module__}.system"
    elif kind == "exec":  # a well-formed Metadata with the payload in one field
        md.version = Payload(exec, f"open({str(marker)!r}, 'w').close()")
        obj, expected = md, "refers to builtins.exec"
    else:
        md.storage_meta.modules = [Payload(builtins.open, str(marker), "w")]
        obj, expected = md, "refers to io.open"
    (copy_of / ".metadata").write_bytes(pickle.dumps(obj))
    _refuses(copy_of, marker, expected)


def test_build_onto_an_admitted_class_is_refused(copy_of):
    """The C unpickler would let this overwrite Metadata.__eq__ for the whole process."""
    eq = Metadata.__eq__
    build = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
             b"N}X\x06\x00\x00\x00__eq__X\x03\x00\x00\x00bads\x86b.")
    (copy_of / ".metadata").write_bytes(build)
    _refuses(copy_of, copy_of / "no-marker",
             "sets the state of the class torch.distributed.checkpoint.metadata.Metadata")
    assert Metadata.__eq__ is eq


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_unreadable_metadata_is_one_line(copy_of, how):
    data = (copy_of / ".metadata").read_bytes()
    data = {"truncated": data[: len(data) // 2], "empty": b"", "garbage": bytes(range(256)) * 4}[how]
    (copy_of / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        safeload.read_metadata(copy_of)
    msg = str(e.value)
    assert "\n" not in msg and str(copy_of / ".metadata") in msg
    assert "not a readable DCP metadata file" in msg or "refers to" in msg, msg
    with pytest.raises(CheckpointError):
        safeload.load(_zeros(), copy_of)


def test_missing_metadata(tmp_path):
    with pytest.raises(CheckpointError, match="not a DCP checkpoint folder"):
        safeload.read_metadata(tmp_path)


def test_shard_outside_the_folder_is_refused(copy_of):
    md = safeload.read_metadata(copy_of)
    index = next(iter(md.storage_data))
    md.storage_data[index] = _StorageInfo("../elsewhere.distcp", 0, 10)
    (copy_of / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        safeload.read_metadata(copy_of)


def _craft_shard(path, marker, fqn: str, as_bytes: bool) -> None:
    """Admitted classes only in .metadata, pointing `fqn` at a shard that pickles a payload."""
    blob = path / "evil.distcp"
    torch.save(Payload(exec, f"open({str(marker)!r}, 'w').close()"), blob)
    md = safeload.read_metadata(path)
    md.storage_meta.load_id = None
    if as_bytes:
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(fqn)] = _StorageInfo("evil.distcp", 0, blob.stat().st_size)
    else:
        for index in md.storage_data:
            if index.fqn == fqn:
                md.storage_data[index] = _StorageInfo("evil.distcp", 0, blob.stat().st_size)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    assert _globals_of(path / ".metadata") <= set(safeload.ADMITTED)


def test_crafted_bytes_shard_is_refused(copy_of, tmp_path):
    """A non-tensor entry goes to the planner's torch.load(weights_only=False) in stock DCP."""
    marker = tmp_path / "pwned"
    _craft_shard(copy_of, marker, "w", as_bytes=True)
    with pytest.raises(CheckpointError, match="stores w as a pickled object"):
        safeload.load(_zeros(), copy_of)  # a tensor of ours would be replaced by a pickled object
    sd = _zeros() | {"w": None}
    with pytest.raises(CheckpointError) as e:
        safeload.load(sd, copy_of)
    assert "evil.distcp" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises((Exception, CheckpointException)):
        dcp.load(_zeros(), storage_reader=SafeFileSystemReader(copy_of))
    assert not marker.exists()
    # The same files through torch's own reader run the payload.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(_zeros() | {"w": None}, storage_reader=dcp.FileSystemReader(copy_of))
    assert marker.exists()


def test_crafted_tensor_shard_is_refused(copy_of, tmp_path):
    marker = tmp_path / "pwned"
    _craft_shard(copy_of, marker, "w", as_bytes=False)
    with pytest.raises(CheckpointError) as e:
        safeload.load(_zeros(), copy_of)
    assert "evil.distcp" in str(e.value) and "is not plain tensor data" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.dist
def test_a_dynmo_checkpoint_is_admitted(tmp_path):
    run_train(tmp_path, "--steps", "1", "--checkpoint.final", "true")
    ckpt = tmp_path / "checkpoint-final"
    assert _globals_of(ckpt / ".metadata") <= set(safeload.ADMITTED)
    md = safeload.read_metadata(ckpt)
    entries = md.state_dict_metadata
    assert any(k.startswith("optim.") and k.endswith(".step") and v.size == torch.Size([]) for k, v in entries.items())
    mine = {k: torch.full(v.size, float("nan"), dtype=v.properties.dtype) for k, v in entries.items()}
    stock = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    safeload.load(mine, ckpt)
    dcp.load(stock, checkpoint_id=str(ckpt))
    assert all(torch.equal(mine[k], stock[k]) for k in entries)
