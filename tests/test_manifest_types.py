"""The manifest as types (format/manifest.py's Manifest, format/tensor_entry.py's TensorEntry):
the JSON they write, read back the same, and what reading refuses."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import FormatError
from megatron_ucp.format import durability, manifest as mf
from megatron_ucp.format.tensor_entry import STATES, TensorEntry, file_layout

PATH = "iter_0000003/ucp.json"
NAME = "decoder.layers.0.mlp.linear_fc1.weight"

def _entry(shape, vocab, padding, n_states, buffer, written, block, sums):
    entry = TensorEntry.new(NAME, shape, vocab, padding if vocab else 0, STATES[:n_states], buffer)
    return entry.written(block * len(sums) + 8, block, sums) if written else entry


entries = st.builds(_entry, st.lists(st.integers(0, 2**20), max_size=3), st.booleans(), st.integers(0, 64),
                    st.sampled_from([1, 3]), st.booleans(), st.booleans(), st.integers(1, 2**22),
                    st.lists(st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"), max_size=4))


@settings(max_examples=200, deadline=None)
@given(entries)
def test_json_round_trip(entry):
    assert TensorEntry.from_json(NAME, entry.to_json(), PATH, 2) == entry


@settings(max_examples=100, deadline=None)
@given(entries)
def test_json_is_the_formats(entry):
    """Keys of docs/FORMAT.md 4.3: the marks only when true, the file's facts once written."""
    out = entry.to_json()
    assert out["file"] == f"tensors/{NAME}.safetensors" and out["dtype"] == "F32"
    assert out["shape"] == list(entry.shape) and out["states"] == list(entry.states)
    assert ("vocab" in out) == entry.vocab and ("buffer" in out) == entry.buffer
    assert all((k in out) == (entry.file_size is not None) for k in ("file_size", "block_bytes", "checksums"))
    assert all(type(v) in (str, int, bool, list) for v in out.values())


def test_written_copies_and_leaves_the_entry():
    entry = TensorEntry.new("embedding.word_embeddings.weight", [250, 32], True, 6, STATES)
    done = entry.written(file_layout(entry).file_size, 4 * 2**20, ["0000abcd"])
    assert entry.file_size is None and done.file_size == 98768  # docs/FORMAT.md 3's example
    assert done.to_json() == {"file": "tensors/embedding.word_embeddings.weight.safetensors",
                              "shape": [250, 32], "dtype": "F32", "padding_rows": 6,
                              "states": ["param", "exp_avg", "exp_avg_sq"], "vocab": True,
                              "file_size": 98768, "block_bytes": 4194304, "checksums": ["0000abcd"]}


def test_version_1_rule_becomes_the_vocab_mark():
    raw = {"file": f"tensors/{NAME}.safetensors", "shape": [4, 2], "states": ["param"]}
    assert TensorEntry.from_json(NAME, dict(raw, rule={"kind": "vocab", "dim": 0}), PATH, 1).vocab
    assert not TensorEntry.from_json(NAME, dict(raw, rule={"kind": "split", "dim": 1}), PATH, 1).vocab
    with pytest.raises(FormatError, match=rf"{PATH}: tensor '{NAME}': bad rule"):
        TensorEntry.from_json(NAME, dict(raw, rule={"kind": "diagonal"}), PATH, 1)


GOOD = {"file": f"tensors/{NAME}.safetensors", "shape": [4, 2], "dtype": "F32", "padding_rows": 0,
        "states": ["param"]}


@pytest.mark.parametrize("change, says", [
    ({"file": "tensors/other.safetensors"}, "file 'tensors/other.safetensors', expected"),
    ({"shape": [4, -1]}, "bad shape [4, -1]"),
    ({"shape": "4x2"}, "bad shape '4x2'"),
    ({"padding_rows": -1}, "bad padding_rows"),
    ({"states": []}, "bad states []"),
    ({"states": ["param", "momentum"]}, "bad states ['param', 'momentum']"),
    ({"vocab": 1}, "'vocab' is not true or false"),
    # issue 38: a repeated state read as 'no optimizer state'; a dtype the format never writes loaded
    ({"states": ["param", "param", "param"]}, "states ['param', 'param', 'param'], expected ['param', 'exp_avg', 'exp_avg_sq'] or ['param']"),
    ({"states": ["exp_avg", "param"]}, "states ['exp_avg', 'param'], expected"),
    ({"dtype": "Q4_K"}, "dtype 'Q4_K', expected 'F32'"),
])
def test_refused_entries_name_file_tensor_and_key(change, says):
    with pytest.raises(FormatError) as e:
        TensorEntry.from_json(NAME, {**GOOD, **change}, PATH, 2)
    assert str(e.value).startswith(f"{PATH}: tensor '{NAME}': ") and says in str(e.value)


def test_an_entry_that_is_not_an_object():
    with pytest.raises(FormatError, match=f"{PATH}: tensor '{NAME}': not an object"):
        TensorEntry.from_json(NAME, [1, 2], PATH, 2)


def test_unsafe_names_have_no_entry():
    with pytest.raises(FormatError, match="not a safe file name"):
        TensorEntry.new("../escape", [1], False, 0, ["param"])


def _layout():
    return mf.Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                     virtual_pipeline_model_parallel_size=None, data_parallel_size=1, expert_model_parallel_size=1,
                     expert_tensor_parallel_size=2, use_distributed_optimizer=True, world_size=2)


def test_head_json_has_the_optional_blocks_only_when_they_say_something():
    from test_inspect import ARCHITECTURE

    plain = mf.head(iteration=3, consumed_samples=24, architecture=ARCHITECTURE, layout=_layout(),
                    optimizer=None, scheduler=None, args={"lr": 0.1, "sizes": (1, 2)})
    assert plain.to_json() == {"format": "megatron-ucp", "version": mf.FORMAT_VERSION, "iteration": 3,
                               "consumed_samples": 24, "architecture": ARCHITECTURE, "layout": _layout().to_json(),
                               "optimizer": None, "scheduler": None, "args": {"lr": 0.1, "sizes": [1, 2]},
                               "tensors": {}}
    imported = mf.head(iteration=0, consumed_samples=0, architecture=ARCHITECTURE, layout=_layout(),
                       optimizer=None, scheduler=None, args=None, rng_saved=False,
                       progress={"skipped_iterations": 0}, source={"huggingface": "/hf"}).to_json()
    assert (imported["rng_saved"], imported["progress"], imported["source"], imported["args"]) == (
        False, {"skipped_iterations": 0}, {"huggingface": "/hf"}, {})


def test_manifest_read_back_is_the_one_written(tmp_path):
    from test_inspect import ARCHITECTURE

    entry = TensorEntry.new(NAME, [4, 2], False, 0, STATES)
    architecture = {**mf.ARCHITECTURE_SINCE, **ARCHITECTURE}  # as read: later facts at their defaults
    written = mf.Manifest(iteration=3, consumed_samples=24, architecture=architecture, layout=_layout().to_json(),
                          optimizer={"type": "adam", "step": 3, "param_groups": [{"lr": 0.1}]}, scheduler=None,
                          args={}, tensors={NAME: entry.written(file_layout(entry).file_size, 64, ["00000000"])},
                          rng_saved=False, progress={"skipped_iterations": 1})
    folder = tmp_path / "iter_0000003"
    os.makedirs(folder)
    durability.atomic_write_json(str(folder / mf.MANIFEST), written.to_json())
    assert mf.read_manifest(str(folder)) == written


def test_rng_states_apply_on_the_same_layout_and_older_manifests_were_cp1():
    """The layout records context_parallel_size; a manifest written before it was recorded was
    CP1, so its RNG states still apply on the same layout, and not on CP2."""
    from megatron_ucp.engine.load import _same_layout

    current = _layout().to_json()
    assert current["context_parallel_size"] == 1
    older = {k: v for k, v in current.items() if k != "context_parallel_size"}
    assert _same_layout(older, current)
    assert not _same_layout(older, {**current, "context_parallel_size": 2})
    assert not _same_layout({**current, "context_parallel_size": 2}, current)
