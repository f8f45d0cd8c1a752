"""Tests for megatron_ucp.format.inspection and tools/inspect_checkpoint.py on a synthetic universal
checkpoint written with storage primitives only (no torch, no megatron, no processes group)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ucp.format import manifest as mf
from megatron_ucp.format import checksums, durability, tensor_io
from megatron_ucp.format.tensor_entry import STATES, TensorEntry, file_layout, tensor_file
from megatron_ucp.format.tensor_file import TensorFileLayout
from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.format.inspection import describe, format_table, verify

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "inspect_checkpoint.py"
BLOCK = 64
ITERATION = 12
TENSORS = {  # name: (shape, vocabulary rows, padding_rows)
    "embedding.word_embeddings.weight": ([10, 8], True, 6),
    "decoder.layers.0.mlp.linear_fc1.weight": ([32, 8], False, 0),
    "decoder.layers.0.self_attention.linear_proj.weight": ([8, 8], False, 0),
    "decoder.final_layernorm.weight": ([8], False, 0),
}


# Complete blocks, as a save writes them (read_manifest refuses a partial one).
ARCHITECTURE = {
    "num_layers": 1, "hidden_size": 8, "ffn_hidden_size": 32, "num_attention_heads": 2,
    "num_query_groups": 2, "kv_channels": 4, "gated_linear_unit": True, "normalization": "RMSNorm",
    "add_bias_linear": False, "num_experts": None, "moe_ffn_hidden_size": None, "moe_layer_pattern": None,
    "moe_shared_expert_intermediate_size": None, "vocab_size": 10,
    "position_embedding_type": "rope", "share_embeddings_and_output_weights": True,
}
LAYOUT = {"world_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 1,
          "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
          "use_distributed_optimizer": False, "padded_vocab_size": 16}
RNG_STATE = {"python": [3, [5] * 624 + [624], None], "numpy": ["MT19937", [7] * 624, 624, 0, 0.0],
             "torch": [1] * 16, "cuda": None, "tracker": {"model-parallel-rng": [2] * 16}}


def _make_checkpoint(save: Path) -> Path:
    root = save / f"iter_{ITERATION:07d}"
    (root / "tensors").mkdir(parents=True)
    (root / "rng").mkdir()
    rng = np.random.default_rng(0)
    entries = {}
    for name, (shape, vocab, padding) in TENSORS.items():
        entry = TensorEntry.new(name, shape, vocab, padding, STATES)
        layout = file_layout(entry)
        path = str(root / entry.file)
        tensor_io.create_tensor_file(path, layout)
        for tname, tshape, _ in layout.entries:
            data = rng.standard_normal(tshape).astype(np.float32)
            tensor_io.write_runs(path, layout, tname, [(0, 0, data.size)], data)
        entries[name] = entry.written(layout.file_size, BLOCK,
                                      checksums.block_checksums(path, len(layout.header), layout.file_size, BLOCK))
    durability.atomic_write_json(str(root / mf.MANIFEST), mf.Manifest(
        iteration=ITERATION, consumed_samples=96, architecture=ARCHITECTURE, layout=LAYOUT,
        optimizer={"type": "adam", "step": 3, "param_groups": []}, scheduler=None, args={},
        tensors=entries).to_json())
    durability.atomic_write_json(str(root / "rng" / "rank_00000.json"), RNG_STATE)
    (save / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    return root


@pytest.fixture
def ckpt(tmp_path):
    save = tmp_path / "save"
    return save, _make_checkpoint(save)


def _cli(*args):
    """The CLI as a user runs it: a fresh interpreter."""
    return subprocess.run([sys.executable, str(CLI), *map(str, args)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def cli(capsys):
    """The CLI's main() in this process (fast): returns (exit code, stdout, stderr)."""
    from megatron_ucp.commands.inspect_checkpoint import main

    def run(*args):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _file(root: Path, name: str) -> Path:
    return root / tensor_file(name)


def test_describe_and_table(ckpt):
    save, root = ckpt
    desc = describe(str(save))
    assert desc == describe(str(root))
    assert desc["iteration"] == ITERATION and desc["consumed_samples"] == 96
    assert desc["optimizer_step"] == 3 and desc["num_tensors"] == len(TENSORS)
    assert desc["total_bytes"] == sum(os.path.getsize(_file(root, n)) for n in TENSORS)
    rows = {r["name"]: r for r in desc["tensors"]}
    assert rows["embedding.word_embeddings.weight"]["padding_rows"] == 6
    assert rows["embedding.word_embeddings.weight"]["vocab"]
    assert not rows["decoder.layers.0.self_attention.linear_proj.weight"]["vocab"]
    json.dumps(desc)
    table = format_table(desc)
    assert str(ITERATION) in table and " vocab " in table
    for name in TENSORS:
        assert name in table
    # aligned: every tensor row starts its "bytes" column at the same place
    body = [line for line in table.splitlines() if line.startswith(("embedding", "decoder"))]
    assert len(body) == len(TENSORS) and len({len(line) for line in body}) == 1


def test_verify_ok(ckpt):
    save, _ = ckpt
    assert verify(str(save)) == []


def test_cli_table_and_json(ckpt, cli):
    save, root = ckpt
    r = _cli(save)
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in TENSORS) and str(ITERATION) in r.stdout
    code, out, err = cli(root, "--json", "--verify")
    assert code == 0, err
    desc = json.loads(out)
    assert desc["num_tensors"] == len(TENSORS) and desc["problems"] == [] and err.startswith("OK: ")


def test_cli_verify_ok(ckpt):
    save, _ = ckpt
    r = _cli(save, "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OK: {len(TENSORS)} files" in r.stdout


def test_flipped_byte_names_file_and_block(ckpt):
    save, root = ckpt
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    path = _file(root, name)
    header = len(file_layout(describe_entry(root, name)).header)
    offset = header + 3 * BLOCK + 5  # inside data block 3
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    problems = verify(str(save))
    assert len(problems) == 1 and str(path) in problems[0] and "block 3 " in problems[0]
    r = _cli(save, "--verify")
    assert r.returncode == 1
    assert str(path) in r.stdout and "block 3 " in r.stdout


def test_a_file_check_stops_at_its_first_bad_block(ckpt):
    """A damaged file is damaged either way; a lying entry may name a terabyte of blocks
    (issue 38), so the check of a file stops at its first failing block."""
    save, root = ckpt
    name = "embedding.word_embeddings.weight"
    path = _file(root, name)
    header = len(file_layout(describe_entry(root, name)).header)
    raw = bytearray(path.read_bytes())
    for block in (0, 4):
        raw[header + block * BLOCK] ^= 0xFF
    path.write_bytes(bytes(raw))
    problems = verify(str(save))
    assert [("block 0 " in p, "block 4 " in p) for p in problems] == [(True, False)]


def test_truncated_file(ckpt, cli):
    save, root = ckpt
    path = _file(root, "decoder.final_layernorm.weight")
    os.truncate(path, os.path.getsize(path) - 4)
    problems = verify(str(save))
    assert len(problems) == 1 and str(path) in problems[0] and "truncated" in problems[0]
    assert cli(save, "--verify")[0] == 1


def test_deleted_file(ckpt, cli):
    save, root = ckpt
    path = _file(root, "decoder.final_layernorm.weight")
    path.unlink()
    problems = verify(str(save))
    assert len(problems) == 1 and str(path) in problems[0] and "missing" in problems[0]
    code, out, _ = cli(save, "--verify")
    assert code == 1 and str(path) in out


def test_unknown_file(ckpt, cli):
    save, root = ckpt
    (root / "tensors" / "stray.safetensors").write_bytes(b"x")
    problems = verify(str(save))
    assert len(problems) == 1 and "stray.safetensors" in problems[0] and "not listed" in problems[0]
    code, out, _ = cli(save, "--verify")
    assert code == 1 and "stray.safetensors" in out


@pytest.mark.parametrize("sums, shown", [(["00000000"], "1 sums"), ("00000000", "'00000000' sums"),
                                         ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "10 sums")])
def test_bad_recorded_checksums_are_named(ckpt, sums, shown):
    save, root = ckpt
    name = "decoder.layers.0.mlp.linear_fc1.weight"  # 32x8x3 floats: 48 blocks of 64 bytes
    m = json.loads((root / mf.MANIFEST).read_text())
    m["tensors"][name]["checksums"] = sums
    durability.atomic_write_json(str(root / mf.MANIFEST), m)
    problems = verify(str(save))
    assert problems == [f"{_file(root, name)}: manifest records bad checksums for {name!r} "
                        f"(block_bytes {BLOCK}, {shown})"]


def test_wrong_header(ckpt):
    save, root = ckpt
    name = "decoder.final_layernorm.weight"
    path = _file(root, name)
    # Same byte count, other layout: the states reordered.
    entry = describe_entry(root, name)
    other = TensorFileLayout.build([(s, (8,), "F32") for s in reversed(entry.states)])
    tensor_io.create_tensor_file(str(path), other)
    problems = verify(str(save))
    assert len(problems) == 1 and str(path) in problems[0] and "header" in problems[0]


def test_bad_rng_file(ckpt):
    save, root = ckpt
    (root / "rng" / "rank_00000.json").write_text("{not json")
    problems = verify(str(save))
    assert len(problems) == 1 and "rank_00000.json" in problems[0]


def test_corrupt_manifest(ckpt, cli):
    save, root = ckpt
    manifest = root / mf.MANIFEST
    manifest.write_text(manifest.read_text()[:100])
    with pytest.raises(FormatError):
        describe(str(save))
    r = _cli(save, "--verify")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and mf.MANIFEST in lines[0]
    code, out, err = cli(save)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and mf.MANIFEST in err


def test_not_a_checkpoint(tmp_path, cli):
    with pytest.raises(IncompleteCheckpointError):
        describe(str(tmp_path))
    code, _, err = cli(tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_no_torch_import():
    code = ("import sys, megatron_ucp.format.inspection; "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr


def describe_entry(root: Path, name: str) -> TensorEntry:
    return mf.read_manifest(str(root)).tensors[name]


def test_cli_quiet_when_its_reader_is_gone(ckpt):
    """`megatron-ucp inspect CKPT | head -n 6`: a reader that stopped reading is no error (no
    BrokenPipeError traceback, as the Slurm resume job printed)."""
    save, _ = ckpt
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the table is written
    proc = subprocess.run([sys.executable, str(CLI), str(save), "--verify"], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
