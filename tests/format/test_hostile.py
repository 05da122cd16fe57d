"""Hostile and damaged checkpoints on load (issue 6): every case raises a clear error naming the
file and the problem, nothing outside the checkpoint directory is read, no code from the
checkpoint runs. Fixtures are real stock- and fastdcp-written checkpoints, then damaged."""

from __future__ import annotations

import builtins
import io
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter
from fastdcp.format import metadata as fmd
from fastdcp.format.blob_parse import parse_tensor_blob
from fastdcp.format.metadata import CheckpointFormatError, CheckpointNotFoundError, parse_metadata
from fastdcp.io.checkpoint_files import check_relative_path, load_metadata, resolve_data_file

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

KINDS = ("stock", "fast")


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(256, 512, generator=g),  # 512 KiB: read as head + tail windows
        "b": torch.randn(7, generator=g).to(torch.bfloat16),  # small: read whole
        "step": 7,  # a byte item
    }


def _empty():
    return {"w": torch.zeros(256, 512), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1}


def _writer(kind, path):
    return FileSystemWriter(path) if kind == "stock" else FastFileSystemWriter(path)


def _load(path, reader=None):
    out = _empty()
    dcp.load(out, storage_reader=reader or FastFileSystemReader(path), no_dist=True)
    return out


@pytest.fixture(scope="module")
def _originals(tmp_path_factory):
    base = tmp_path_factory.mktemp("originals")
    out = {}
    for kind in KINDS:
        path = base / kind / "ckpt"
        path.mkdir(parents=True)
        dcp.save(_state(), storage_writer=_writer(kind, path), no_dist=True)
        out[kind] = path
    return out


@pytest.fixture(params=KINDS)
def ckpt(request, _originals, tmp_path_factory):
    """A fresh copy of a real checkpoint (stock- or fastdcp-written). Its path does not contain
    the test's name, so asserting a word of an error message that names the path means something;
    files "outside the checkpoint" go to its parent."""
    dest = tmp_path_factory.mktemp("case") / "ckpt"
    shutil.copytree(_originals[request.param], dest)
    return dest


def _data_file(path: pathlib.Path) -> pathlib.Path:
    (f,) = path.glob("*.distcp")
    return f


def _read_md(path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_md(path, md, protocol=None) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=protocol)


def _entry(md, fqn):
    return md.storage_data[next(k for k in md.storage_data if k.fqn == fqn)]


def _load_error(path, reader=None) -> str:
    with pytest.raises(CheckpointException) as info:
        _load(path, reader)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Not a checkpoint / damaged .metadata
# ---------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        load_metadata(missing)
    assert str(missing) in str(info.value) and isinstance(info.value, FileNotFoundError)
    message = _load_error(missing)
    assert str(missing) in message and "not a DCP checkpoint" in message


def test_directory_without_metadata(tmp_path):
    (tmp_path / "x.distcp").write_bytes(b"junk")
    with pytest.raises(CheckpointNotFoundError, match=r"is not a DCP checkpoint: no \.metadata") as info:
        load_metadata(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "no .metadata" in _load_error(tmp_path)


def test_empty_metadata(ckpt):
    (ckpt / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="empty") as info:
        load_metadata(ckpt)
    assert str(ckpt / ".metadata") in str(info.value)
    assert "empty" in _load_error(ckpt)


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.98])
def test_truncated_metadata(ckpt, fraction):
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointFormatError) as info:
        load_metadata(ckpt)
    message = str(info.value)
    assert str(ckpt / ".metadata") in message and "truncated" in message
    assert "truncated" in _load_error(ckpt)


def test_metadata_that_is_not_a_pickle(ckpt):
    (ckpt / ".metadata").write_bytes(b"this is not a pickle\n" * 10)
    with pytest.raises(CheckpointFormatError) as info:
        load_metadata(ckpt)
    assert str(ckpt / ".metadata") in str(info.value)


def test_metadata_that_is_a_fifo_or_directory(ckpt):
    os.remove(ckpt / ".metadata")
    os.mkfifo(ckpt / ".metadata")  # opening it for reading would wait for a writer forever
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        load_metadata(ckpt)
    os.remove(ckpt / ".metadata")
    (ckpt / ".metadata").mkdir()
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        load_metadata(ckpt)


def test_metadata_holding_something_else(ckpt):
    (ckpt / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointFormatError, match="does not hold DCP Metadata"):
        load_metadata(ckpt)


class _Payload:
    """Pickles as a call of ``func(*args)``: what a malicious .metadata contains."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: pathlib.Path):
    return {
        "os.system": (_Payload(os.system, f"touch {marker}"), "system"),
        "builtins.eval": (_Payload(eval, f"open({str(marker)!r}, 'w').close()"), "builtins.eval"),
        "builtins.exec": (_Payload(exec, f"open({str(marker)!r}, 'w').close()"), "builtins.exec"),
        "subprocess": (_Payload(subprocess.call, ["touch", str(marker)]), "subprocess.call"),
        "getattr": (_Payload(getattr, _Payload(__import__, "os"), "system"), "builtins.getattr"),
    }


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "builtins.exec", "subprocess", "getattr"])
@pytest.mark.parametrize("where", ["planner_data", "whole_file"])
def test_metadata_pickle_that_runs_code_is_refused(ckpt, tmp_path, payload, where):
    marker = tmp_path / "pwned"
    obj, global_name = _payloads(marker)[payload]
    if where == "whole_file":
        (ckpt / ".metadata").write_bytes(pickle.dumps(obj))
    else:  # a real Metadata carrying the payload
        md = _read_md(ckpt)
        md.planner_data = {"x": obj}
        _write_md(ckpt, md)
    with pytest.raises(CheckpointFormatError) as info:
        load_metadata(ckpt)
    message = str(info.value)
    assert "disallowed global" in message and global_name in message and str(ckpt / ".metadata") in message
    assert "disallowed global" in _load_error(ckpt)
    assert not marker.exists()


def test_stock_reader_runs_the_payload_control(ckpt, tmp_path):
    """The threat is real: stock read_metadata is pickle.load."""
    marker = tmp_path / "pwned"
    md = _read_md(ckpt)
    md.planner_data = _Payload(os.system, f"touch {marker}")
    _write_md(ckpt, md)
    FileSystemReader(ckpt).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\x80\x04N" + b"r" + struct.pack("<I", 0xFFFFFFFF) + b".", "memo index"),  # 64 GiB memo table
        (b"\x80\x02N" + b"p4000000000\n" + b".", "memo index"),
        (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 60) + b".", "declares"),  # BINBYTES8 preallocation
        (b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b".", "declares"),  # BYTEARRAY8
        (b"\x80\x04\x95" + struct.pack("<Q", 1 << 50) + b"N.", "frame"),
        (b"\x80\x02X" + struct.pack("<I", 0xFFFFFFF0) + b".", "declares"),
        (b"\x80\x02K\x01Q.", "not allowed"),  # BINPERSID
        (b"\x80\x02\x82\x01.", "not allowed"),  # EXT1: the copyreg extension registry
    ],
)
def test_pickle_memory_bombs_and_refused_opcodes(data, reason):
    started = time.perf_counter()
    with pytest.raises(CheckpointFormatError, match=reason) as info:
        parse_metadata(data, "bomb.metadata")
    assert "bomb.metadata" in str(info.value)
    assert time.perf_counter() - started < 1.0


_MD = b"ctorch.distributed.checkpoint.metadata\n"


def test_pickle_cannot_tamper_with_the_real_classes():
    eq_before = Metadata.__eq__
    # BUILD aimed at the Metadata class itself: (None, {"__eq__": torch.float32}) as slot state.
    attack = b"\x80\x02" + _MD + b"Metadata\nN}X\x06\x00\x00\x00__eq__ctorch\nfloat32\ns\x86b."
    with pytest.raises(CheckpointFormatError, match="set attribute '__eq__'"):
        parse_metadata(attack, "attack")
    assert Metadata.__eq__ is eq_before and "__eq__" in vars(Metadata)
    # The memory-format enum members are shared singletons: a BUILD on one must fail.
    member = fmd._md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    attack = b"\x80\x02" + _MD + b"_MEM_FORMAT_ENCODING\nK\x00\x85R}X\x06\x00\x00\x00_value_K\x05sb."
    with pytest.raises(CheckpointFormatError):
        parse_metadata(attack, "attack")
    assert member._value_ == 0
    # Allow-listed functions resolve to stand-ins that take no attributes.
    attack = b"\x80\x02ctorch.serialization\n_get_layout\nN}X\x01\x00\x00\x00xK\x01s\x86b."
    with pytest.raises(CheckpointFormatError, match="allow-listed function"):
        parse_metadata(attack, "attack")
    # A pickle returning a class or stand-in itself is not metadata.
    for attack in (b"\x80\x02" + _MD + b"Metadata\n.", b"\x80\x02ctorch.serialization\n_get_layout\n."):
        with pytest.raises(CheckpointFormatError, match="does not hold DCP Metadata"):
            parse_metadata(attack, "attack")


def test_restricted_load_equals_pickle_for_real_checkpoints(tmp_path):
    """Every dtype, bytes, nested objects, optimizer state, a pathlib checkpoint id, both writers,
    every pickle protocol stock could have used (2..5)."""
    sd = {}
    for name, dtype in vars(torch).items():
        if not isinstance(dtype, torch.dtype):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized dtypes are deprecated
                t = torch.zeros(2, dtype=dtype)
            torch.save(t, io.BytesIO())
            torch._utils._element_size(dtype)
        except Exception:
            continue
        sd[f"t_{name}"] = t
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd.update(model=model.state_dict(), optim=opt.state_dict(), blob=io.BytesIO(b"abc"), obj={"a": [1, (2, "x")]})
    sd["channels_last"] = torch.zeros(1, 2, 3, 3).to(memory_format=torch.channels_last)
    for kind in KINDS:
        path = tmp_path / kind
        dcp.save(sd, storage_writer=_writer(kind, pathlib.Path(path)), no_dist=True)
        reference = _read_md(path)
        assert isinstance(reference.storage_meta.checkpoint_id, pathlib.PurePath)
        loaded = load_metadata(path)
        assert loaded == reference
        assert type(loaded.storage_meta.checkpoint_id) is type(reference.storage_meta.checkpoint_id)
        assert pickle.dumps(loaded) == pickle.dumps(reference)  # same classes, same content
        for protocol in (2, 3, 4, 5):
            assert parse_metadata(pickle.dumps(reference, protocol=protocol), "p") == reference
        # Python 3.13 pickles pathlib paths as pathlib._local.PosixPath, earlier ones as
        # pathlib.PosixPath: a .metadata written under either loads under the other.
        p2 = pickle.dumps(reference, protocol=2)
        spellings = (b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
        written = [s for s in spellings if s in p2]
        assert len(written) == 1 and (written[0] == spellings[1]) == (sys.version_info >= (3, 13))
        other = spellings[1] if written[0] == spellings[0] else spellings[0]
        moved = parse_metadata(p2.replace(written[0], other), "p")
        assert moved == reference


def test_dtensor_and_sharded_tensor_metadata(tmp_path):
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = STShard(torch.ones(4, 2), ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))
        sd = {
            "dt": distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)]),
            "rep": distribute_tensor(torch.ones(3), mesh, [Replicate()]),
            "st": init_from_local_shards([shard], [4, 2]),
        }
        for kind in KINDS:
            path = tmp_path / kind
            dcp.save(sd, storage_writer=_writer(kind, path))
            assert load_metadata(path) == _read_md(path)
    finally:
        dist.destroy_process_group()


def test_invalid_structures_are_refused(ckpt):
    cases = {
        "negative length": lambda md: setattr(_entry(md, "w"), "length", -1),
        "float offset": lambda md: setattr(_entry(md, "w"), "offset", 1.5),
        "absurd length": lambda md: setattr(_entry(md, "w"), "length", 1 << 70),
        "chunk outside the tensor": lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([257, 512])),
        "bad relative_path type": lambda md: setattr(_entry(md, "w"), "relative_path", 5),
        "bad storage_data": lambda md: setattr(md, "storage_data", [1, 2]),
        "bad checksum": lambda md: setattr(_entry(md, "w"), fmd.CHECKSUM_ATTRIBUTE, "deadbeef"),
    }
    original = _read_md(ckpt)
    for name, damage in cases.items():
        md = pickle.loads(pickle.dumps(original))
        damage(md)
        _write_md(ckpt, md)
        with pytest.raises(CheckpointFormatError) as info:
            load_metadata(ckpt)
        message = str(info.value)
        assert str(ckpt / ".metadata") in message, name
        if name != "bad storage_data":
            assert "'w'" in message, (name, message)
        assert str(ckpt / ".metadata") in _load_error(ckpt), name


def test_checksum_attribute_name_matches_the_writer():
    from fastdcp.format.metadata import CHECKSUM_ATTRIBUTE

    assert fmd.CHECKSUM_ATTRIBUTE == CHECKSUM_ATTRIBUTE


def test_rank_local_metadata(ckpt):
    os.rename(ckpt / ".metadata", ckpt / "__0.metadata")
    with pytest.raises(CheckpointNotFoundError, match="no .metadata"):
        load_metadata(ckpt)
    assert load_metadata(ckpt, rank=0).storage_data
    out = _load(ckpt)  # dcp.load falls back to read_metadata(rank=0)
    assert torch.equal(out["w"], _state()["w"]) and out["step"] == 7


def test_a_failed_rank_local_fallback_raises_the_global_reads_error(ckpt):
    """DCP's load (2.11 on) swallows read_metadata()'s Exception and asks for rank=; 2.11 then loses
    the message. The reader raises the global read's error as a CheckpointException there, which
    stock's fallback does not catch, on every release."""
    original = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(b"")
    reader = FastFileSystemReader(ckpt)
    with pytest.raises(CheckpointFormatError, match="empty") as first:
        reader.read_metadata()
    with pytest.raises(CheckpointException) as fallback:
        reader.read_metadata(rank=0)
    (error, _trace), = fallback.value.failures.values()
    assert error is first.value and str(ckpt / ".metadata") in str(fallback.value)
    assert isinstance(fallback.value.__cause__, CheckpointNotFoundError)  # no __0.metadata either
    # Without a failed global read just before, a rank= read raises its own error, as stock's does.
    with pytest.raises(CheckpointNotFoundError):
        reader.read_metadata(rank=0)
    # A rank-local file that exists is read after a failed global read, as stock reads it.
    (ckpt / "__0.metadata").write_bytes(original)
    with pytest.raises(CheckpointFormatError, match="empty"):
        reader.read_metadata()
    assert reader.read_metadata(rank=0).storage_data


class CustomPlannerData:
    """A class a custom planner might store in the metadata (importable: tests/ is on sys.path)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, CustomPlannerData) and other.value == self.value


def test_allow_unsafe_metadata_opts_out(ckpt):
    md = _read_md(ckpt)
    md.planner_data = CustomPlannerData(42)
    _write_md(ckpt, md)
    message = _load_error(ckpt)
    assert "disallowed global" in message and "CustomPlannerData" in message
    assert "allow_unsafe_metadata=True" in message
    out = _load(ckpt, FastFileSystemReader(ckpt, allow_unsafe_metadata=True))
    assert torch.equal(out["w"], _state()["w"]) and out["step"] == 7
    assert load_metadata(ckpt, allow_unsafe=True).planner_data == CustomPlannerData(42)
    # Validation still applies in the unsafe mode.
    _entry(md, "w").length = -5
    _write_md(ckpt, md)
    with pytest.raises(CheckpointFormatError, match="invalid byte range"):
        load_metadata(ckpt, allow_unsafe=True)


class UnregisteredPlannerData(CustomPlannerData):
    pass


@pytest.fixture
def user_globals(monkeypatch):
    """fastdcp's registry of allowed metadata globals, empty for the test and restored after; on
    a torch with stock's registry, registrations are not forwarded there (it cannot be restored)."""
    monkeypatch.setattr(fmd, "_user_globals", {})
    if hasattr(fmd._stock_fs, "add_safe_metadata_globals"):
        monkeypatch.setattr(fmd._stock_fs, "add_safe_metadata_globals", lambda safe_globals: None)


@pytest.mark.parametrize("form", ["classes", "mapping"])
def test_add_safe_metadata_globals_allows_exactly_the_registered_classes(ckpt, user_globals, form):
    md = _read_md(ckpt)
    md.planner_data = CustomPlannerData(42)
    _write_md(ckpt, md)
    message = _load_error(ckpt)
    assert "disallowed global" in message and "add_safe_metadata_globals" in message

    if form == "classes":
        fastdcp.add_safe_metadata_globals([CustomPlannerData])
    else:
        fastdcp.add_safe_metadata_globals({CustomPlannerData.__module__: {"CustomPlannerData"}})
    out = _load(ckpt)
    assert torch.equal(out["w"], _state()["w"]) and out["step"] == 7
    assert load_metadata(ckpt).planner_data == CustomPlannerData(42)

    # Only what was registered: another class of the same module is still refused.
    md.planner_data = UnregisteredPlannerData(1)
    _write_md(ckpt, md)
    assert "UnregisteredPlannerData" in _load_error(ckpt)


def test_add_safe_metadata_globals_rejects_malformed_entries(user_globals):
    with pytest.raises(TypeError, match="__module__"):
        fastdcp.add_safe_metadata_globals([42])
    with pytest.raises(TypeError, match="module and name"):
        fastdcp.add_safe_metadata_globals({"": {"X"}})
    with pytest.raises(TypeError, match="names for module 'my.module' must be"):
        fastdcp.add_safe_metadata_globals({"my.module": 5})
    with pytest.raises(TypeError, match="got the string 'my.module'"):
        fastdcp.add_safe_metadata_globals("my.module")
    assert fmd._user_globals == {}


def test_globals_registered_with_stock_are_accepted(ckpt, user_globals, monkeypatch):
    """Newer torch reads .metadata with a restricted unpickler whose allow-list users extend with
    ``torch.distributed.checkpoint.filesystem.add_safe_metadata_globals`` (a mapping of module to
    names, or the objects). What users registered there, fastdcp accepts too: it asks stock's
    unpickler. The torch installed here may predate that API, so a stand-in with its interface
    plays stock; fastdcp's own function forwards to it."""
    registered: set[tuple[str, str]] = set()

    def stock_add(safe_globals):
        if isinstance(safe_globals, dict):
            registered.update((module, name) for module, names in safe_globals.items() for name in names)
        else:
            registered.update((g.__module__, g.__qualname__) for g in safe_globals)

    class StockUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in registered:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"Blocked unpickling of {module}.{name}")

    monkeypatch.setattr(fmd._stock_fs, "add_safe_metadata_globals", stock_add, raising=False)
    monkeypatch.setattr(fmd._stock_fs, "_RestrictedMetadataUnpickler", StockUnpickler, raising=False)
    md = _read_md(ckpt)
    md.planner_data = [CustomPlannerData(7), UnregisteredPlannerData(8)]
    _write_md(ckpt, md)
    assert "CustomPlannerData" in _load_error(ckpt)

    fmd._stock_fs.add_safe_metadata_globals({CustomPlannerData.__module__: {"CustomPlannerData"}})
    assert fmd._user_globals == {}, "registered with stock only"
    assert "UnregisteredPlannerData" in _load_error(ckpt)

    fastdcp.add_safe_metadata_globals([UnregisteredPlannerData])
    assert (UnregisteredPlannerData.__module__, "UnregisteredPlannerData") in registered, "not forwarded to stock"
    assert load_metadata(ckpt).planner_data == [CustomPlannerData(7), UnregisteredPlannerData(8)]
    out = _load(ckpt)
    assert torch.equal(out["w"], _state()["w"])


# ---------------------------------------------------------------------------------------------
# Data file paths
# ---------------------------------------------------------------------------------------------


class _OpenSpy:
    """Records every path opened through builtins.open and the engine's File while active."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        real_open, real_file = builtins.open, fastdcp._C.File

        def spy_open(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)):
                self.paths.append(os.path.realpath(os.fsdecode(file)))
            return real_open(file, *args, **kwargs)

        def spy_file(path, *args):
            self.paths.append(os.path.realpath(path))
            return real_file(path, *args)

        monkeypatch.setattr(builtins, "open", spy_open)
        monkeypatch.setattr(fastdcp._C, "File", spy_file)


@pytest.mark.parametrize(
    "relative, reason",
    [
        ("ABSOLUTE", "absolute path"),
        ("/etc/passwd", "absolute path"),
        ("../outside.distcp", "'..' component"),
        ("sub/../../outside.distcp", "'..' component"),
        ("a\0b", "NUL byte"),
        ("", "empty file name"),
        ("link.distcp", "outside the checkpoint directory"),
        ("linkdir/outside.distcp", "outside the checkpoint directory"),
    ],
)
def test_relative_paths_leading_out_are_refused(ckpt, monkeypatch, relative, reason):
    outside = ckpt.parent / "outside.distcp"  # a valid copy of the data: stock would load it
    shutil.copy(_data_file(ckpt), outside)
    os.symlink(outside, ckpt / "link.distcp")
    os.symlink(ckpt.parent, ckpt / "linkdir")
    if relative == "ABSOLUTE":
        relative = str(outside)
    md = _read_md(ckpt)
    for info in md.storage_data.values():
        info.relative_path = relative
    _write_md(ckpt, md)
    with pytest.raises(CheckpointFormatError, match=reason) as info:
        check_relative_path(ckpt, relative)
    assert "refused" in str(info.value)
    spy = _OpenSpy(monkeypatch)
    message = _load_error(ckpt)
    assert "refused" in message and reason in message and "checkpoint metadata entry" in message
    assert str(outside) not in spy.paths


def test_stock_reader_follows_dotdot_control(ckpt):
    """The threat is real: stock joins relative_path unchecked and reads outside the directory."""
    outside = ckpt.parent / "outside.distcp"
    shutil.copy(_data_file(ckpt), outside)
    md = _read_md(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    _write_md(ckpt, md)
    os.remove(_data_file(ckpt))
    out = _empty()
    dcp.load(out, storage_reader=FileSystemReader(ckpt), no_dist=True)
    assert torch.equal(out["w"], _state()["w"])


def test_symlink_inside_the_directory_is_fine(ckpt):
    data = _data_file(ckpt)
    (ckpt / "sub").mkdir()
    os.rename(data, ckpt / "sub" / "real.distcp")
    os.symlink("sub/real.distcp", data)
    out = _load(ckpt)
    assert torch.equal(out["w"], _state()["w"])
    assert resolve_data_file(ckpt, data.name) == str(data)


def test_fifo_and_directory_as_data_file_are_refused(ckpt):
    data = _data_file(ckpt)
    os.remove(data)
    os.mkfifo(data)  # opening it for reading would block forever
    started = time.perf_counter()
    message = _load_error(ckpt)
    assert "not a regular file" in message and data.name in message
    assert time.perf_counter() - started < 30
    os.remove(data)
    data.mkdir()
    assert "not a regular file" in _load_error(ckpt)


def test_missing_data_file(ckpt):
    data = _data_file(ckpt)
    os.remove(data)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_data_file(ckpt, data.name)
    message = _load_error(ckpt)
    assert data.name in message and "does not exist" in message


# ---------------------------------------------------------------------------------------------
# Byte ranges and blobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fqn", ["w", "b", "step"])
@pytest.mark.parametrize("damage", ["offset past EOF", "length past EOF", "huge length"])
def test_byte_ranges_past_the_end_of_the_file(ckpt, fqn, damage):
    md = _read_md(ckpt)
    info = _entry(md, fqn)
    size = _data_file(ckpt).stat().st_size
    if damage == "offset past EOF":
        info.offset = size + 4096
    elif damage == "length past EOF":
        info.length = size - info.offset + 1
    else:
        info.length = 1 << 50  # would be a 1 PiB allocation for a byte item
    _write_md(ckpt, md)
    message = _load_error(ckpt)
    assert _data_file(ckpt).name in message and "truncated or the checkpoint is damaged" in message


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.999])
def test_truncated_data_file(ckpt, fraction):
    data = _data_file(ckpt)
    os.truncate(data, int(data.stat().st_size * fraction))
    message = _load_error(ckpt)
    assert data.name in message and "truncated" in message


@pytest.mark.parametrize("where", ["local header", "end of central directory", "central directory", "data.pkl global"])
def test_corrupted_zip_headers(ckpt, where):
    md = _read_md(ckpt)
    info = _entry(md, "w")
    data_file = _data_file(ckpt)
    raw = bytearray(data_file.read_bytes())
    blob = raw[info.offset : info.offset + info.length]
    if where == "local header":
        pos = 0
        assert blob[pos : pos + 4] == b"PK\x03\x04"
    elif where == "end of central directory":
        pos = len(blob) - 22
        assert blob[pos : pos + 4] == b"PK\x05\x06"
    elif where == "central directory":
        pos = blob.rfind(b"PK\x01\x02")
    else:
        pos = blob.find(b"_rebuild_tensor_v2")
        assert pos > 0
        blob[pos : pos + 18] = b"_rebuild_system_v2"
        pos = -1
    if pos >= 0:
        blob[pos : pos + 4] = b"XXXX"
    raw[info.offset : info.offset + info.length] = blob
    data_file.write_bytes(bytes(raw))
    message = _load_error(ckpt)
    assert data_file.name in message


def test_corrupted_headers_of_every_blob_never_load_silently(ckpt):
    """A byte flipped in each header byte of the small blob either fails clearly or loads the
    right values (bytes the format does not use: CRCs, timestamps, padding)."""
    md = _read_md(ckpt)
    info = _entry(md, "b")
    data_file = _data_file(ckpt)
    original = data_file.read_bytes()
    expected = _state()["b"]
    blob = original[info.offset : info.offset + info.length]
    parsed = parse_tensor_blob(blob, blob, len(blob), None, "b")
    data = range(parsed.data_offset, parsed.data_offset + parsed.storage_nbytes)
    for rel in list(range(0, 64, 7)) + list(range(info.length - 140, info.length, 7)):
        raw = bytearray(original)
        raw[info.offset + rel] ^= 0xFF
        data_file.write_bytes(bytes(raw))
        try:
            out = _load(ckpt)
        except CheckpointException as e:
            assert data_file.name in str(e) or ".metadata" in str(e), rel
        else:
            # Flipped tensor bytes load silently: no checksums are recorded (yet).
            assert torch.equal(out["b"], expected) or rel in data, rel
