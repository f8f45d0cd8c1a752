"""Compressed pickles (issue 47, bug 7): every torch.load of a stranger's file bounds what it
inflates (format/zip_bounds.py) before inflating anything: a DEFLATEd `data.pkl` of 300 MiB in
a 0.3 MB file is refused from its central directory, at every loader (bytes of a DCP object or
a DeepSpeed file, a `common.pt` read by the converters or vetted for megatron's own loader, a
memory-mapped legacy file), and the memory is never taken.
"""

import os
import subprocess
import sys
import time
import zipfile

import pytest

from harness import deadline, REPO
from zip_bombs import bomb, torch_entries, zip_bytes
from megatron_ucp.convert import dcp_reader, safe_pickle
from megatron_ucp.errors import FormatError
from megatron_ucp.format import zip_bounds
from megatron_ucp.train import native

BIG = 300 * 2**20  # past MAX_LOADED_BYTES (256 MiB)


@pytest.fixture(scope="module")
def big():
    raw = bomb(BIG)
    assert len(raw) < 2**20  # small on disk
    return raw


def _refused(fn, *words):
    started = time.perf_counter()
    with deadline(5), pytest.raises(FormatError) as ei:
        fn()
    assert time.perf_counter() - started < 2.0, "refused, but not before inflating"
    for w in words:
        assert w in str(ei.value), f"{w!r} not in {ei.value}"
    assert "\n" not in str(ei.value)
    return str(ei.value)


def _common_folder(tmp_path, raw):
    d = tmp_path / "iter_0000004"
    d.mkdir()
    (d / "common.pt").write_bytes(raw)
    return d


LOADERS = {
    # DCP byte objects (fsdp_dtensor's args, torch_dist 0.19's common state, RNG) and DeepSpeed's
    # step.pt / optimizer_state.pt: bytes read (bounded on disk), then torch_load
    "bytes": lambda d, raw: safe_pickle.torch_load(raw, "object 'args'"),
    # torch_dist common.pt through `convert`
    "common.pt": lambda d, raw: dcp_reader.read_common(str(d)),
    # legacy model files and DeepSpeed's model states: memory-mapped
    "mmap": lambda d, raw: safe_pickle.load_file(str(d / "common.pt"), "legacy checkpoint file", mmap=True),
    # `--ckpt-format torch_dist --load`: vetted before megatron's own torch.load
    "torch_dist load": lambda d, raw: native.check_folder(str(d)),
    # legacy distrib_optim.pt, which megatron loads itself: its tensors are not counted, its pickle is
    "distrib_optim.pt": lambda d, raw: safe_pickle.check_torch_file(str(d / "common.pt"), "legacy optimizer file",
                                                                  tensor_data_on_disk=True),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_loader_refuses_a_compressed_pickle_before_inflating_it(big, tmp_path, loader):
    d = _common_folder(tmp_path, big)
    _refused(lambda: LOADERS[loader](d, big), f"'archive/data.pkl' alone to {BIG + 8}", "refused before inflating")


def test_a_2_gib_entry_is_refused_within_a_second(tmp_path):
    raw = bomb(2**20, declared=2**31)
    _refused(lambda: safe_pickle.torch_load(raw, "step.pt"), "step.pt", f"alone to {2**31}")


def test_the_memory_is_never_taken(big, tmp_path):
    """Peak RSS of a process that loads the file: not raised by the refusal (before: +600 MB)."""
    path = tmp_path / "step.pt"
    path.write_bytes(big)
    code = ("import resource, sys\n"
            "from megatron_ucp.convert import safe_pickle\n"
            "import torch\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n"
            f"    safe_pickle.load_file({str(path)!r}, 'DeepSpeed step')\n"
            "    print('loaded')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__)\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    kind, grown_mb = out.stdout.split()
    assert kind == "FormatError", out.stdout + out.stderr
    assert int(grown_mb) < 32, f"peak RSS grew by {grown_mb} MB"


def test_a_directory_that_lies_is_refused(big):
    # it claims 1000 bytes: torch would allocate 1000 and fail; the check reads no more either
    _refused(lambda: zip_bounds.check(bomb(BIG, declared=1000), "x"), "data.pkl", "does not inflate")
    entries = torch_entries()
    _refused(lambda: zip_bounds.check(zip_bytes(entries, count=len(entries) + 1), "x"),
             f"holds {len(entries)} entries, its end record says {len(entries) + 1}")
    stored = [(n, m, d, c, s + 1 if n.endswith("data.pkl") else s) for n, m, d, c, s in entries]
    _refused(lambda: zip_bounds.check(zip_bytes(stored), "x"), "stored zip entry", "data.pkl")
    _refused(lambda: zip_bounds.check(bomb(1000, method=zipfile.ZIP_BZIP2), "x"), "compression method 12")


def test_too_many_entries_are_refused_from_the_end_record(monkeypatch):
    monkeypatch.setattr(zip_bounds, "MAX_ENTRIES", 4)
    _refused(lambda: safe_pickle.torch_load(zip_bytes(torch_entries()), "x"), "lists 7 entries", "at most 4")
    monkeypatch.setattr(zip_bounds, "MAX_CENTRAL_DIRECTORY", 100)
    monkeypatch.setattr(zip_bounds, "MAX_ENTRIES", 100)
    _refused(lambda: safe_pickle.torch_load(zip_bytes(torch_entries()), "x"), "in 100 bytes")


def test_stored_tensor_data_counts_only_where_it_is_read_into_memory(tmp_path):
    import torch

    entries = torch_entries({"w": torch.ones(1000)})  # 4000 bytes of stored tensor data
    raw = zip_bytes(entries)
    path = tmp_path / "model.pt"
    path.write_bytes(raw)
    # bytes already in memory, a mapped file, a checkpoint's own tensors: bounded by the file
    assert safe_pickle.torch_load(raw, "x", max_bytes=1000)["w"].sum() == 1000
    assert safe_pickle.torch_load(str(path), "x", mmap=True, max_bytes=1000)["w"].sum() == 1000
    assert safe_pickle.torch_load(str(path), "x", max_bytes=1000, tensor_data_on_disk=True)["w"].sum() == 1000
    with pytest.raises(FormatError, match="expected at most 1000"):
        safe_pickle.torch_load(str(path), "x", max_bytes=1000)
    # a DEFLATEd pickle within the bound loads (zipfile and torch agree on it)
    assert safe_pickle.torch_load(bomb(1000), "x") == "\0" * 1000


def test_only_safe_pickle_calls_torch_load():
    """One road in: any other torch.load of the package would bypass the bounds (and weights_only)."""
    import ast

    callers = []
    for path in sorted((REPO / "megatron_ucp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                callers.append(str(path.relative_to(REPO)))
    assert callers == ["megatron_ucp/convert/safe_pickle.py"]


def test_torch_dists_own_reader_bounds_each_tensor_item(tmp_path):
    """megatron's loader (`--ckpt-format torch_dist --load`, `--via-megatron`) reads through
    safe_pickle's reader, whose tensor items torch's FileSystemReader torch.loads itself: an
    item whose tensor record is DEFLATEd to declare 300 MiB is refused before torch reads it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from fsdp_dtensor_fixture import replace_object
    from zip_bombs import tensor_bomb

    folder = tmp_path / "iter_0000004"
    dcp.save({"w": torch.zeros(4, dtype=torch.uint8)}, storage_writer=dcp.FileSystemWriter(str(folder)),
             no_dist=True)
    replace_object(folder, "w", tensor_bomb(BIG))  # a uint8 tensor of 300 MiB, its record DEFLATEd
    reader = safe_pickle._reader_class()(str(folder))
    started = time.perf_counter()
    with deadline(5), pytest.raises(CheckpointException) as ei:  # DCP gathers it into one (megatron's loader too)
        dcp.load({"w": torch.zeros(4, dtype=torch.uint8)}, storage_reader=reader, no_dist=True)
    assert time.perf_counter() - started < 2.0, "refused, but not before inflating"
    assert "FormatError" in str(ei.value) and "'w': its zip entries inflate" in str(ei.value), str(ei.value)[-500:]
    assert f"'archive/data/0' alone to {BIG}" in str(ei.value) and "refused before inflating" in str(ei.value)


def test_deepspeeds_pickle_size_reads_the_directory_within_bounds(tmp_path, monkeypatch):
    """The DeepSpeed import sizes a memory-mapped file's pickle from its zip directory before
    loading it: that directory is bounded too (entries, bytes), as every loader's."""
    from megatron_ucp.convert import deepspeed

    path = tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(zip_bytes(torch_entries()))
    assert deepspeed._pickle_size(str(path), "model states") > 0
    monkeypatch.setattr(zip_bounds, "MAX_ENTRIES", 4)
    _refused(lambda: deepspeed._pickle_size(str(path), "model states"), str(path), "lists 7 entries", "at most 4")
