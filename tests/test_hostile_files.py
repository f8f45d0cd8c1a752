"""Hostile and damaged checkpoint files: no code runs from a checkpoint, nothing hangs or reads
without bound, and no load silently falls back to another format (docs/faults.md, "Hostile files").

Every case either loads correctly or fails within seconds with an error naming the file. Pickle
payloads would leave a marker file if they ran; every such test asserts the marker is absent.
Tiny checkpoints of each format are written once per module (one process) and copied per case;
most cases call the library in-process, a few run the entry points with a timeout.
"""

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch
from harness import BASE, REPO, deadline, ok, run_steps
from megatron_ucp.convert import safe_pickle
from megatron_ucp.format import folder, inspection, safe_files, tensor_file
from megatron_ucp.mcore import rng
from megatron_ucp.format import manifest as mf
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, UCPError
from megatron_ucp.train import checkpointing

ARGS = BASE + ["--use-distributed-optimizer", "--train-iters", "2"]
IT = "iter_0000002"
TENSOR = "decoder.layers.1.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One tiny checkpoint per format: {"universal" | "torch" | "torch_dist": save folder}."""
    work = tmp_path_factory.mktemp("hostile")
    fmts = ["universal", "torch", "torch_dist"]  # torch_dist last: its writer leaves threads behind
    steps = [{"name": f, "op": "train", "argv": ARGS + ["--ckpt-format", f, "--save", str(work / f),
                                                        "--save-interval", "2"]} for f in fmts]
    results = run_steps(1, steps, work / "run", timeout=300)
    for f in fmts:
        ok(results, f)
    return {f: work / f for f in fmts}


@pytest.fixture
def copy_of(saved, tmp_path):
    """A fresh copy of one format's save folder, to damage."""
    def copy(fmt):
        dst = tmp_path / fmt
        shutil.copytree(saved[fmt], dst, symlinks=True)
        return dst
    return copy


class _Payload:
    """Unpickling this runs a shell command that leaves the marker: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused(fn, *names, kind=UCPError):
    """fn() raises `kind` within seconds, its message naming each of `names`."""
    with deadline(10, "blocked for"), pytest.raises(kind) as ei:
        fn()
    for name in names:
        assert str(name) in str(ei.value), f"{name!r} not in: {ei.value}"
    return str(ei.value)


def _entry_point(argv, timeout=180):
    """Run a command of this repository; (exit code, stdout + stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _train(extra, timeout=180):
    """pretrain_gpt_ucp.py in one worker, started as torchrun starts it (tests/launch.py: forked
    from a warm interpreter; the launcher is not what these tests are about)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = launch.start(sys.executable, 1, [str(REPO / "pretrain_gpt_ucp.py")] + ARGS[:-1] + ["3"] + extra, env,
                        REPO, timeout, lambda: False)
    return proc.returncode, proc.stdout + proc.stderr


def _convert(src, out, *extra, timeout=180):
    return _entry_point([sys.executable, str(REPO / "tools" / "convert_to_universal.py"), "--input", str(src),
                         "--output", str(out), "--no-progress", *extra], timeout)


# ---------------------------------------------------------------- pickles: no code runs


def _plain_metadata(d: Path):
    with open(d / IT / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own fresh save: trusted


def _poison_metadata(d: Path, marker: Path) -> Path:
    """`.metadata` whose pickle runs the payload before it returns the real metadata."""
    meta = _plain_metadata(d)
    path = d / IT / ".metadata"
    path.write_bytes(pickle.dumps((_Payload(marker), meta)))
    return path


def _poison_object(d: Path, marker: Path, prefix="rng_state") -> str:
    """Point a DCP byte object (megatron's RNG ShardedObject) at a torch.save'd payload appended
    to its .distcp file; returns the object's key."""
    meta = _plain_metadata(d)
    index = next(i for i in meta.storage_data if i.fqn.startswith(prefix))
    info = meta.storage_data[index]
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    data_file = d / IT / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    with open(d / IT / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return index.fqn


def _with_common_pt(iter_dir: Path) -> None:
    """megatron-core 0.19 keeps the common state inside the DCP files and writes no common.pt;
    readers still prefer a common.pt found in the folder, so a planted one is as hostile: plant
    the folder's own common state as common.pt, to damage it."""
    from megatron_ucp.convert.dcp_reader import read_common

    if not (iter_dir / "common.pt").exists():
        torch.save(read_common(str(iter_dir)), iter_dir / "common.pt")


def _poison_torch_file(path: Path, marker: Path) -> None:
    sd = torch.load(path, weights_only=False)  # the test's own fresh save: trusted
    sd["payload"] = _Payload(marker)
    torch.save(sd, path)


def test_metadata_classes_allowed_are_those_a_fresh_save_uses(saved):
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(saved["torch_dist"] / IT / ".metadata", "rb") as f:
        Recorder(f).load()
    assert seen and seen <= safe_pickle.DCP_METADATA_CLASSES, seen - safe_pickle.DCP_METADATA_CLASSES
    meta = safe_pickle.read_dcp_metadata(str(saved["torch_dist"] / IT))
    assert meta.state_dict_metadata.keys() == _plain_metadata(saved["torch_dist"]).state_dict_metadata.keys()


def test_metadata_payload_is_refused_by_the_converters_reader(copy_of, tmp_path):
    from megatron_ucp.convert.dcp_reader import DcpReader

    d, marker = copy_of("torch_dist"), tmp_path / "MARKER"
    path = _poison_metadata(d, marker)
    _refused(lambda: safe_pickle.read_dcp_metadata(str(d / IT)), path, "posix.system", kind=FormatError)
    _refused(lambda: DcpReader(str(d / IT)), path, "posix.system", kind=FormatError)
    assert not marker.exists()


def test_distcp_object_payload_is_refused(copy_of, tmp_path):
    from megatron_ucp.convert.dcp_reader import DcpReader

    d, marker = copy_of("torch_dist"), tmp_path / "MARKER"
    fqn = _poison_object(d, marker)
    _refused(lambda: DcpReader(str(d / IT)).read_object(fqn), fqn, "posix.system", kind=FormatError)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["common.pt", "mp_rank_00/model_optim_rng.pt", "mp_rank_00/distrib_optim.pt"])
def test_torch_save_payload_is_refused(copy_of, tmp_path, name):
    d, marker = copy_of("torch_dist" if name == "common.pt" else "torch"), tmp_path / "MARKER"
    path = d / IT / name
    if name == "common.pt":
        _with_common_pt(d / IT)
    _poison_torch_file(path, marker)
    _refused(lambda: safe_pickle.load_file(str(path), "checkpoint file"), path, "posix.system", kind=FormatError)
    _refused(lambda: safe_pickle.check_torch_file(str(path), "checkpoint file"), path, "posix.system",
             kind=FormatError)
    assert not marker.exists()


def test_legacy_converter_refuses_payload(copy_of, tmp_path):
    from megatron_ucp.convert import legacy as legacy_convert
    from megatron_ucp.convert.legacy_files import forget_loaded

    d, marker = copy_of("torch"), tmp_path / "MARKER"
    path = d / IT / "mp_rank_00" / "model_optim_rng.pt"
    _poison_torch_file(path, marker)
    forget_loaded()
    _refused(lambda: legacy_convert.convert(str(d / IT), str(tmp_path / "out"), {}, progress=False),
             path, "posix.system", kind=FormatError)
    assert not marker.exists()


def test_megatron_loader_refuses_object_payload(copy_of, tmp_path):
    """pretrain_gpt_ucp.py --ckpt-format torch_dist --load: megatron's loader would unpickle the
    RNG object with weights_only=False; through safe_pickle.megatron_reader it is refused."""
    d, marker = copy_of("torch_dist"), tmp_path / "MARKER"
    fqn = _poison_object(d, marker)
    code, out = _train(["--ckpt-format", "torch_dist", "--load", str(d)])
    assert code != 0 and fqn in out and "posix.system" in out, out[-3000:]
    assert not marker.exists()


def test_megatron_loader_and_converters_refuse_metadata_payload(copy_of, tmp_path):
    d, marker = copy_of("torch_dist"), tmp_path / "MARKER"
    path = _poison_metadata(d, marker)
    code, out = _train(["--ckpt-format", "torch_dist", "--load", str(d)])
    assert code != 0 and str(path) in out and "posix.system" in out, out[-3000:]
    code, out = _convert(d, tmp_path / "streamed")
    assert code == 2 and str(path) in out and "posix.system" in out, out[-3000:]
    code, out = _convert(d, tmp_path / "via", "--via-megatron", "--nproc", "1")
    assert code != 0 and str(path) in out and "posix.system" in out, out[-3000:]
    assert not marker.exists()


def test_legacy_loader_refuses_payload(copy_of, tmp_path):
    d, marker = copy_of("torch"), tmp_path / "MARKER"
    path = d / IT / "mp_rank_00" / "model_optim_rng.pt"
    _poison_torch_file(path, marker)
    code, out = _train(["--ckpt-format", "torch", "--load", str(d)])
    assert code != 0 and str(path) in out and "posix.system" in out, out[-3000:]
    assert not marker.exists()


# ---------------------------------------------------------------- no silent fallback


@pytest.mark.parametrize("fmt, evidence, flag", [("torch_dist", ".metadata", "--ckpt-format torch_dist"),
                                                 ("torch", "mp_rank_", "--ckpt-format torch")])
def test_universal_load_of_another_format_names_it_and_its_flag(saved, fmt, evidence, flag):
    _refused(lambda: checkpointing.check_format(str(saved[fmt] / IT), "universal"), evidence, flag,
             "megatron-ucp convert", kind=FormatError)


def test_other_format_load_of_a_universal_checkpoint_names_the_flag(saved):
    _refused(lambda: checkpointing.check_format(str(saved["universal"] / IT), "torch_dist"), "ucp.json",
             "--ckpt-format universal", kind=FormatError)
    checkpointing.check_format(str(saved["universal"] / IT), "universal")


def test_plain_load_of_torch_dist_does_not_fall_back(copy_of, tmp_path):
    d, marker = copy_of("torch_dist"), tmp_path / "MARKER"
    _poison_metadata(d, marker)
    code, out = _train(["--load", str(d)])
    assert code != 0 and "holds a torch_dist checkpoint" in out and "--ckpt-format torch_dist" in out, out[-3000:]
    assert not marker.exists()


# ---------------------------------------------------------------- files that are not files


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    os.symlink("/dev/zero", path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _oversize(limit):
    def grow(path: Path) -> None:  # sparse: no disk used
        os.truncate(path, limit + 1)
    return grow


NOT_FILES = {"fifo": (_fifo, "FIFO"), "dev_zero": (_dev_zero, "/dev/zero"), "directory": (_directory, "directory")}


def _universal_cases():
    for kind, (make, says) in NOT_FILES.items():
        yield f"manifest_{kind}", f"{IT}/ucp.json", make, says
        yield f"rng_{kind}", f"{IT}/rng/rank_00000.json", make, says
        yield f"tracker_{kind}", "latest_checkpointed_iteration.txt", make, says
        yield f"tensor_{kind}", f"{IT}/tensors/{TENSOR}.safetensors", make, says
    yield "manifest_oversize", f"{IT}/ucp.json", _oversize(safe_files.MAX_MANIFEST_BYTES), "at most"
    yield "rng_oversize", f"{IT}/rng/rank_00000.json", _oversize(safe_files.MAX_RNG_BYTES), "at most"
    yield "tracker_oversize", "latest_checkpointed_iteration.txt", _oversize(safe_files.MAX_TRACKER_BYTES), "at most"


def _reads(d: Path, rel: str):
    """What reads file `rel` of a universal checkpoint: the loader's and the inspect tool's paths."""
    it = d / IT
    if rel.endswith("ucp.json"):
        return [lambda: mf.read_manifest(str(it)), lambda: inspection.describe(str(d))]
    if "/rng/" in rel:
        return [lambda: rng.load(str(it / "rng"), 0),
                lambda: _raise_problems(inspection._verify_rng(str(it), {"world_size": 1}))]
    if rel.endswith(".txt"):
        return [lambda: folder.read_tracker(str(d)), lambda: inspection.resolve(str(d))]
    entry = mf.read_manifest(str(it)).tensors[TENSOR]
    return [lambda: inspection.check_header(str(it), TENSOR, entry),
            lambda: _raise_problems(inspection.verify(str(d)))]


def _raise_problems(problems):
    """The inspect tool's verify reports problems as a list: one error of them, for _refused."""
    if problems:
        raise FormatError("; ".join(problems))


@pytest.mark.parametrize("case, rel, make, says", list(_universal_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_universal_file_that_is_not_a_regular_small_file(copy_of, case, rel, make, says):
    d = copy_of("universal")
    make(d / rel)
    for read in _reads(d, rel):
        _refused(read, d / rel, says)


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "common.pt", "metadata.json"])
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_torch_dist_file_that_is_not_a_regular_file(copy_of, name, kind):
    from megatron_ucp.convert.dcp_reader import DcpReader
    from megatron_ucp.convert.torch_dist_plan import plan_conversion
    from megatron_ucp.train.native import check_folder

    d = copy_of("torch_dist")
    make, says = NOT_FILES[kind]
    if name == "common.pt":
        _with_common_pt(d / IT)
    make(d / IT / name)
    _refused(lambda: check_folder(str(d / IT)), d / IT / name, says)
    if name == ".metadata":
        _refused(lambda: DcpReader(str(d / IT)), d / IT / name, says)
    if name == "__0_0.distcp":
        reader = DcpReader(str(d / IT))
        fqn = next(i.fqn for i, s in reader.meta.storage_data.items() if s.relative_path == name)
        _refused(lambda: _read_any(reader, fqn), d / IT / name, says)
    if name == "common.pt":
        _refused(lambda: plan_conversion(str(d / IT)), d / IT / name, says)


def _read_any(reader, fqn):
    """What the converter reads of `fqn`: the whole tensor, or the object."""
    if reader.has_tensor(fqn):
        shape = reader.shape(fqn)
        return reader.read_box(fqn, [0] * len(shape), list(shape))
    return reader.read_object(fqn)


def test_torch_dist_data_file_outside_the_checkpoint_is_refused(copy_of):
    from megatron_ucp.convert.dcp_reader import DcpReader

    d = copy_of("torch_dist")
    meta = _plain_metadata(d)
    for index, info in meta.storage_data.items():
        meta.storage_data[index] = dataclasses.replace(info, relative_path="../../../../etc/passwd")
    with open(d / IT / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    reader = DcpReader(str(d / IT))
    fqn = next(iter(meta.storage_data)).fqn
    _refused(lambda: _read_any(reader, fqn), "etc/passwd", kind=FormatError)
    fs_reader = safe_pickle._reader_class()(str(d / IT))

    def open_outside():
        with fs_reader.fs.create_stream(fs_reader.fs.concat_path(fs_reader.path, "../../../../etc/passwd"), "rb"):
            pass
    _refused(open_outside, "etc/passwd", "outside", kind=FormatError)


def test_torch_dist_object_longer_than_its_file_is_refused(copy_of):
    from megatron_ucp.convert.dcp_reader import DcpReader

    d = copy_of("torch_dist")
    meta = _plain_metadata(d)
    index = next(i for i in meta.storage_data if i.fqn.startswith("rng_state"))
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], length=2**50)
    with open(d / IT / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    _refused(lambda: DcpReader(str(d / IT)).read_object(index.fqn), index.fqn, "beyond the file",
             kind=IncompleteCheckpointError)


@pytest.mark.parametrize("name", ["model_optim_rng.pt", "distrib_optim.pt"])
@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_legacy_file_that_is_not_a_regular_file(copy_of, name, kind):
    from megatron_ucp.convert import legacy as legacy_convert
    from megatron_ucp.convert.legacy_files import forget_loaded

    d = copy_of("torch")
    make, says = NOT_FILES[kind]
    path = d / IT / "mp_rank_00" / name
    make(path)
    _refused(lambda: safe_pickle.load_file(str(path), "legacy checkpoint file"), path, says)
    _refused(lambda: safe_pickle.check_torch_file(str(path), "legacy checkpoint file"), path, says)
    forget_loaded()
    _refused(lambda: legacy_convert.convert(str(d / IT), str(d / "out"), {}, progress=False), path, says)


# ---------------------------------------------------------------- JSON text


def _edit_text(path: Path, old: str, new) -> None:
    raw = path.read_bytes()
    old_b = old.encode()
    assert old_b in raw
    path.write_bytes(raw.replace(old_b, new if isinstance(new, bytes) else new.encode(), 1))


def test_manifest_with_a_repeated_key_is_refused(copy_of):
    d = copy_of("universal")
    path = d / IT / "ucp.json"
    _edit_text(path, '"iteration": 2,', '"iteration": 2,\n "iteration": -4,')
    _refused(lambda: mf.read_manifest(str(d / IT)), path, "'iteration'", "twice", kind=FormatError)
    _refused(lambda: inspection.describe(str(d)), path, "'iteration'", kind=FormatError)


def test_rng_file_with_a_repeated_key_is_refused(copy_of):
    d = copy_of("universal")
    path = d / IT / "rng" / "rank_00000.json"
    _edit_text(path, '"cuda": null', '"cuda": null, "cuda": null')
    _refused(lambda: rng.load(str(d / IT / "rng"), 0), path, "'cuda'", kind=FormatError)


def test_manifest_that_is_not_utf8_is_refused(copy_of):
    d = copy_of("universal")
    path = d / IT / "ucp.json"
    _edit_text(path, '"megatron-ucp"', b'"megatron-\xff\xfeucp"')
    _refused(lambda: mf.read_manifest(str(d / IT)), path, "UTF-8", kind=FormatError)


def test_manifest_with_nan_is_refused(copy_of):
    d = copy_of("universal")
    path = d / IT / "ucp.json"
    _edit_text(path, '"consumed_samples": 16', '"consumed_samples": NaN')
    _refused(lambda: mf.read_manifest(str(d / IT)), path, "NaN", kind=FormatError)


# ---------------------------------------------------------------- tensor headers, verified or not


def _longer_header(path: Path) -> None:
    """The same tensors at the same values, behind a longer (valid) header: offsets shift."""
    layout = tensor_file.read_header(str(path))
    raw = path.read_bytes()
    meta = json.loads(layout.header[8:])
    meta["__metadata__"] = {"padding": "x" * 64}
    body = json.dumps(meta).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[len(layout.header):])
    tensor_file.read_header(str(path))  # a valid safetensors file


def _swapped_offsets(path: Path) -> None:
    """param and exp_avg trade places in the header (same length, a valid file): a reader that
    takes offsets from the manifest's layout would load the moments as weights."""
    layout = tensor_file.read_header(str(path))
    meta = json.loads(layout.header[8:])
    meta["param"]["data_offsets"], meta["exp_avg"]["data_offsets"] = (meta["exp_avg"]["data_offsets"],
                                                                      meta["param"]["data_offsets"])
    body = json.dumps(meta, separators=(",", ":")).encode().ljust(len(layout.header) - 8)
    assert len(body) == len(layout.header) - 8
    raw = bytearray(path.read_bytes())
    raw[8:len(layout.header)] = body
    path.write_bytes(bytes(raw))
    tensor_file.read_header(str(path))  # a valid safetensors file


@pytest.mark.parametrize("damage, says", [("longer_header", "too long"), ("swapped_offsets", "header")])
def test_unverified_check_refuses_another_header(copy_of, damage, says):
    d = copy_of("universal")
    path = d / IT / "tensors" / f"{TENSOR}.safetensors"
    (_longer_header if damage == "longer_header" else _swapped_offsets)(path)
    entry = mf.read_manifest(str(d / IT)).tensors[TENSOR]
    _refused(lambda: inspection.check_header(str(d / IT), TENSOR, entry), path, says, kind=UCPError)


@pytest.mark.parametrize("damage", ["longer_header", "fifo"])
def test_unverified_load_refuses_a_bad_tensor_file(copy_of, damage):
    """--no-verify-checkpoint: the header is still parsed; before, a longer header was misread
    (loss NaN, exit 0) and a FIFO hung the load (swapped offsets: in-process, above)."""
    d = copy_of("universal")
    path = d / IT / "tensors" / f"{TENSOR}.safetensors"
    {"longer_header": _longer_header, "swapped_offsets": _swapped_offsets, "fifo": _fifo}[damage](path)
    code, out = _train(["--load", str(d), "--no-verify-checkpoint"], timeout=120)
    assert code != 0 and str(path) in out, out[-3000:]
