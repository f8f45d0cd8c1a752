"""Megatron-FSDP `fsdp_dtensor` checkpoints into universal ones (`megatron-ucp convert`).

The pure parts first (keys, group settings, detection, the arguments' stand-ins); then real
checkpoints of Megatron-LM's trainer (megatron-core >= 0.17, mlm_harness): the converted
checkpoint carries the resume proof of Megatron-LM's own load of the source, which the resume
checks (a converter that swaps two layers is refused there), resumes on TP2 with the
uninterrupted run's losses (fp32, dropout 0), equals a
direct universal save of the same run file for file (dense fp32, and SwiGLU in bf16: an fp32
Megatron-FSDP run with --swiglu cannot save fsdp_dtensor on megatron-core 0.19.2, whose
`handle_swiglu_in_state_dict` looks for a Float16Module level that only 16-bit runs have), and
damaged or mismatched checkpoints stop the conversion naming the file or key.
"""

import argparse
import io
import os
import pickle
import re
import subprocess

import pytest

from harness import REPO
from megatron_ucp.convert import fsdp_dtensor_keys as keys
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format.folder import found_format
from mlm_harness import max_delta, run, trainer_python

N, K = 10, 4
TOL = 1e-4
FSDP = ["--use-megatron-fsdp", "--untie-embeddings-and-output-weights"]  # Megatron-FSDP needs untied embeddings
SAVE_DTENSOR = ["--ckpt-format", "fsdp_dtensor"]
SWIGLU_BF16 = ["--swiglu", "--bf16"]
WHERE = "iter_0000004"


# ---------------------------------------------------------------- keys, without megatron


def test_wrapped_root_is_the_one_wrapper_prefix_of_a_root():
    names = ["model.module.decoder.a", "model.module.output_layer.weight", "args",
             "optimizer.state.module.module.module.decoder.a.exp_avg"]
    assert keys.wrapped_root(names, keys.MODEL, WHERE) == "model.module."
    assert keys.wrapped_root(names, keys.STATE, WHERE) == "optimizer.state.module.module.module."
    assert keys.wrapped_root(names, keys.GROUP_META, WHERE) is None
    with pytest.raises(FormatError, match=r"different wrapper prefixes \['model.module.', 'model.module.module.'\]"):
        keys.wrapped_root(names + ["model.module.module.decoder.b"], keys.MODEL, WHERE)


def test_box_keys_of_a_whole_parameter_and_of_swiglu_halves():
    shapes = {"fc1.weight_w": (4, 3), "fc1.weight_v": (4, 3), "proj.weight": (3, 3)}
    assert keys.box_keys("proj.weight", (3, 3), False, shapes, "model.module.", WHERE) == [("proj.weight", 3, 0)]
    assert keys.box_keys("fc1.weight", (8, 3), True, shapes, "model.module.", WHERE) == [
        ("fc1.weight_w", 4, 0), ("fc1.weight_v", 4, 4)]


def test_box_keys_name_the_key_that_does_not_fit():
    shapes = {"fc1.weight_w": (4, 3), "fc1.weight_v": (4, 3), "proj.weight": (3, 3)}
    with pytest.raises(LayoutError, match=r"'model.module.proj.weight' has shape \[3, 3\], the model built from "
                                          r"the stored arguments has \[3, 4\]"):
        keys.box_keys("proj.weight", (3, 4), False, shapes, "model.module.", WHERE)
    with pytest.raises(LayoutError, match=r"'model.module.fc1.weight_w' has shape \[4, 3\].* has \[5, 3\]"):
        keys.box_keys("fc1.weight", (10, 3), True, shapes, "model.module.", WHERE)
    with pytest.raises(LayoutError, match="stored as SwiGLU halves; the stored arguments describe no --swiglu"):
        keys.box_keys("fc1.weight", (8, 3), False, shapes, "model.module.", WHERE)
    with pytest.raises(LayoutError, match="'model.module.proj.weight' is stored whole"):
        keys.box_keys("proj.weight", (3, 3), True, shapes, "model.module.", WHERE)
    with pytest.raises(IncompleteCheckpointError, match=r"no tensor 'model.module.fc1.weight_v' \(the SwiGLU half"):
        keys.box_keys("fc1.weight", (8, 3), True, {"fc1.weight_w": (4, 3)}, "model.module.", WHERE)
    with pytest.raises(IncompleteCheckpointError, match="no tensor 'model.module.norm.weight'"):
        keys.box_keys("norm.weight", (3,), False, shapes, "model.module.", WHERE)


def test_param_groups_one_per_setting_set_in_model_order():
    decay = {"lr": 5e-3, "weight_decay": 0.01, "wd_mult": 1.0, "step": 4}
    no_decay = {"lr": 5e-3, "weight_decay": 0.0, "wd_mult": 0.0, "step": 4}
    metas = {"b.bias": no_decay, "w.weight": decay, "n.weight": no_decay, "v.weight": decay}
    step, groups = keys.param_groups(metas, WHERE)
    assert step == 4
    assert groups == [{"lr": 5e-3, "weight_decay": 0.0, "wd_mult": 0.0},
                      {"lr": 5e-3, "weight_decay": 0.01, "wd_mult": 1.0}]
    with pytest.raises(FormatError, match=r"optimizer steps are \[3, 4\]"):
        keys.param_groups({**metas, "x.weight": {**decay, "step": 3}}, WHERE)
    with pytest.raises(FormatError, match="x.weight have no 'step'"):
        keys.param_groups({"x.weight": {"lr": 1.0}}, WHERE)


def _iteration_folder(tmp_path, metadata: bytes, *others):
    d = tmp_path / "iter_0000004"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(metadata)
    (d / "__0_0.distcp").write_bytes(b"")
    for name in others:
        (d / name).write_bytes(b"{}")
    return d


def test_fsdp_dtensor_is_found_by_its_keys_and_the_absence_of_megatrons_files(tmp_path):
    # The mark across a block boundary of the scan is found too.
    mark = b"\x00" * ((1 << 20) - 5) + b"model.module.decoder.layers.0.mlp.linear_fc1.weight"
    assert found_format(str(_iteration_folder(tmp_path / "a", mark)))[0] == "fsdp_dtensor"
    assert found_format(str(_iteration_folder(tmp_path / "b", mark, "metadata.json")))[0] == "torch_dist"
    assert found_format(str(_iteration_folder(tmp_path / "c", mark, "common.pt")))[0] == "torch_dist"
    assert found_format(str(_iteration_folder(tmp_path / "d", b"decoder.layers.0")))[0] == "torch_dist"


def test_megatron_lm_arguments_are_read_with_inert_stand_ins():
    import torch
    from megatron.core.transformer.enums import AttnBackend

    from megatron_ucp.convert.megatron_args import STAND_INS, EnumValue, plain_args
    from megatron_ucp.convert.safe_pickle import torch_load

    buf = io.BytesIO()
    torch.save(argparse.Namespace(attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16, vocab_size=250),
               buf)
    # Once megatron-core is imported it marks its enums safe for weights_only itself
    # (megatron/core/safe_globals.py), and torch may then build its class instead of the stand-in
    # (by value: no other code): either way the arguments read the same.
    stored = torch_load(buf.getvalue(), "args", stand_ins=STAND_INS)
    assert isinstance(stored.attention_backend, (EnumValue, AttnBackend))
    assert plain_args(stored, "args") == {"attention_backend": "<AttnBackend 5>", "params_dtype": "torch.bfloat16",
                                          "vocab_size": 250}
    assert plain_args(argparse.Namespace(b=EnumValue(5)), "args") == {"b": "<EnumValue 5>"}
    with pytest.raises(FormatError, match="holds list, expected the training arguments"):
        plain_args([1], "args")


# ---------------------------------------------------------------- Megatron-LM's trainer


@pytest.fixture(scope="module")
def python():
    return trainer_python()


def _train(python, work, extra, fmt):
    return run(python, work / "run", 2, FSDP + extra + ["--ckpt-format", fmt, "--save", str(work / "ckpt"),
                                                          "--save-interval", str(K)], N).check()


@pytest.fixture(scope="module")
def dense(python, tmp_path_factory):
    """fp32 Megatron-FSDP over DP2, fsdp_dtensor checkpoints every K iterations."""
    work = tmp_path_factory.mktemp("dense")
    return {"losses": _train(python, work, [], "fsdp_dtensor").losses(), "ckpt": work / "ckpt"}


def convert(python, source, output, *extra):
    return subprocess.run([python, "-m", "megatron_ucp.convert.to_universal", "--input", str(source),
                           "--output", str(output), "--iteration", str(K), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))


def converted(python, source, output, *extra):
    r = convert(python, source, output, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return output


def _error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("convert_to_universal: error:")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def test_a_megatron_fsdp_save_is_found_as_fsdp_dtensor_for_megatrons_loader_too(dense):
    from megatron_ucp.megatron_lm.checkpoint import found_format as designated

    assert found_format(str(dense["ckpt"] / "iter_0000004"))[0] == "fsdp_dtensor"
    assert designated(str(dense["ckpt"]), K) == "fsdp_dtensor"  # handed to megatron's loader as such


PROOF_RECORDED = "resume proof recorded from megatron's own load of the source"
TP2_RESUME = ["--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2", "--ckpt-format",
              "universal", "--ckpt-step", str(K)]


def test_converted_fsdp_dtensor_resumes_on_tp2_with_the_reference_losses(python, dense, tmp_path):
    """The conversion records the proof of Megatron-LM's own load of the source (Megatron-FSDP in
    one CPU process, megatron_lm/prove_source.py); the resume on TP2 checks it before its first
    step, then continues the uninterrupted run's losses."""
    result = convert(python, dense["ckpt"], tmp_path / "ucp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert PROOF_RECORDED in result.stdout, result.stdout[-3000:]
    r = run(python, tmp_path / "resume", 2, TP2_RESUME + ["--load", str(tmp_path / "ucp")], N).check()
    proved = re.search(r"resume proof passed: \d+ probe tokens within (\S+) of the saved losses", r.output)
    assert proved, r.output[-4000:]
    print(f"probe: source (megatron's load, 1 process) vs converted (TP2): max |delta| {proved.group(1)}")
    assert float(proved.group(1)) <= 1e-5  # fp32 on both sides: layout noise only (4.8e-7 measured)
    assert sorted(r.losses()) == list(range(K + 1, N + 1))
    delta = max_delta(dense["losses"], r.losses(), range(K + 1, N + 1))
    print(f"max |delta loss| over iterations {K + 1}..{N}: {delta:.3g}")
    assert delta <= TOL


def test_a_converter_that_swaps_two_layers_is_refused_at_the_first_resume(python, dense, tmp_path, monkeypatch):
    """A plan that reads layer 1's fc1 into layer 0's and back writes sound files of the wrong
    state; the proof, from megatron's own load of the source, refuses it before the first step."""
    from megatron_ucp.convert import fsdp_dtensor
    from megatron_ucp.convert.to_universal import convert as to_universal

    real = fsdp_dtensor.plan_conversion
    a, b = (f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1))

    def swapped(*args):
        plan = real(*args)
        plan.atomics[a].boxes, plan.atomics[b].boxes = plan.atomics[b].boxes, plan.atomics[a].boxes
        return plan

    monkeypatch.setattr(fsdp_dtensor, "plan_conversion", swapped)
    summary = to_universal(str(dense["ckpt"]), str(tmp_path / "ucp"), iteration=K, progress=False)
    assert summary["proof"].startswith(PROOF_RECORDED), summary["proof"]
    r = run(python, tmp_path / "resume", 2, TP2_RESUME + ["--load", str(tmp_path / "ucp")], N)
    assert r.returncode != 0 and not r.losses(), "trained on a wrong state"
    # ResumeProofError's one line (engine/proof.check), as the trainer reports it
    lines = sorted({line for line in r.output.splitlines() if "fails its resume proof (persistent tier)" in line})
    assert lines, r.output[-4000:]
    assert f"tensor '{a}' " in lines[0] and "digest" in lines[0] and "saved" in lines[0] and "now" in lines[0], \
        lines[0]


def test_without_the_trainer_or_with_no_proof_the_conversion_says_so(dense, tmp_path, monkeypatch):
    """Where no megatron-core with Megatron-LM's trainer is at hand the converted checkpoint
    carries no proof and the summary says why in one line; --no-proof records none."""
    import json

    from megatron_ucp.convert.to_universal import convert as to_universal
    from megatron_ucp.mcore import compat

    monkeypatch.setattr(compat, "ships_megatron_lm", lambda: False)
    monkeypatch.delenv("UCP_OTHER_PYTHON", raising=False)
    summary = to_universal(str(dense["ckpt"]), str(tmp_path / "a"), iteration=K, progress=False)
    assert summary["proof"] == ("resume proof not recorded (Megatron-LM's trainer is not installed here "
                                "(megatron-core >= 0.17 ships it; set UCP_OTHER_PYTHON to the python of such "
                                "an install))"), summary["proof"]
    monkeypatch.setenv("UCP_OTHER_PYTHON", str(tmp_path / "no-python"))
    summary = to_universal(str(dense["ckpt"]), str(tmp_path / "b"), iteration=K, progress=False)
    assert summary["proof"] == (f"resume proof not recorded (UCP_OTHER_PYTHON={tmp_path / 'no-python'}: no such "
                                "executable (expected the python of a megatron-core >= 0.17 install, which ships "
                                "Megatron-LM's trainer))"), summary["proof"]
    summary = to_universal(str(dense["ckpt"]), str(tmp_path / "c"), iteration=K, progress=False, prove=False)
    assert "proof" not in summary
    for name in ("a", "b", "c"):
        assert "proof" not in json.loads((tmp_path / name / "iter_0000004" / "ucp.json").read_text())


def test_an_fsdp_dtensor_checkpoint_resumes_through_megatrons_loader_then_saves_universal(python, dense, tmp_path):
    """--ckpt-format universal with an fsdp_dtensor checkpoint in --load: megatron's own loader
    reads it (its optimizer state keyed by parameter names, into FusedAdam's contract), and the
    job's next saves are universal."""
    r = run(python, tmp_path / "resume", 2, FSDP + ["--ckpt-format", "universal", "--load", str(dense["ckpt"]),
                                                   "--ckpt-step", str(K), "--save", str(tmp_path / "ucp"),
                                                   "--save-interval", "2"], N).check()
    assert sorted(r.losses()) == list(range(K + 1, N + 1))
    assert max_delta(dense["losses"], r.losses(), range(K + 1, N + 1)) <= TOL
    assert (tmp_path / "ucp" / f"iter_{K + 2:07d}" / "ucp.json").is_file()


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.mark.slow  # run by hand (CI time); the dense conversions run in CI
def test_a_converted_moe_checkpoint_resumes_on_ep2_with_the_distributed_optimizer(python, tmp_path):
    """Megatron-FSDP over DP2 with 4 sequential experts (one expert rank: megatron's global expert
    ids are the meta model's) -> convert -> EP2 with the distributed optimizer, within TOL."""
    ref = _train(python, tmp_path / "moe", MOE, "fsdp_dtensor")
    out = converted(python, tmp_path / "moe" / "ckpt", tmp_path / "ucp")
    r = run(python, tmp_path / "ep2", 2, ["--untie-embeddings-and-output-weights", "--expert-model-parallel-size", "2",
                                          "--use-distributed-optimizer", "--ckpt-format", "universal", "--load",
                                          str(out), "--ckpt-step", str(K)] + MOE, N).check()
    assert "resume proof passed" in r.output, r.output[-4000:]  # megatron's load of the source, on EP2
    assert sorted(r.losses()) == list(range(K + 1, N + 1))
    assert max_delta(ref.losses(), r.losses(), range(K + 1, N + 1)) <= TOL


def _same_checkpoint(converted_dir, direct_dir):
    """Every tensor file byte for byte, and the manifest but for the RNG layout (a conversion
    has no RNG states: world_size null, the loader reseeds)."""
    from megatron_ucp.format.manifest import read_manifest

    a, b = read_manifest(str(converted_dir)), read_manifest(str(direct_dir))
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, entry in a.tensors.items():
        assert (converted_dir / entry.file).read_bytes() == (direct_dir / b.tensors[name].file).read_bytes(), name
        assert entry.to_json() == b.tensors[name].to_json(), name
    for field in ("iteration", "consumed_samples", "architecture", "optimizer", "scheduler", "progress"):
        assert getattr(a, field) == getattr(b, field), field
    assert {**a.layout, "world_size": b.layout["world_size"]} == b.layout
    assert a.layout["world_size"] is None and a.rng_saved is False


# swiglu-bf16 (about 2 min: a bf16 Megatron-FSDP run, its conversion and proof) runs by hand
@pytest.mark.parametrize("extra", [[], pytest.param(SWIGLU_BF16, marks=pytest.mark.slow)],
                         ids=["dense-fp32", "swiglu-bf16"])
def test_conversion_equals_a_direct_universal_save_of_the_same_run(python, dense, tmp_path, extra):
    """... and, in bf16 (where Megatron-FSDP loads weights only with the optimizer state), the
    proof of megatron's load of the source in one process is the direct save's on DP2: every
    weight and moment digest, the probe within bf16's layout noise. fp32: --no-proof records
    none (its proof is checked by the TP2 resume above)."""
    from megatron_ucp.engine import proof
    from megatron_ucp.format.manifest import read_manifest

    source = dense["ckpt"]
    if extra:  # its own fsdp_dtensor run
        _train(python, tmp_path / "dtensor", extra, "fsdp_dtensor")
        source = tmp_path / "dtensor" / "ckpt"
    direct = tmp_path / "direct"
    _train(python, direct, extra, "universal")
    out = converted(python, source, tmp_path / "ucp", *([] if extra else ["--no-proof"]))
    _same_checkpoint(out / "iter_0000004", direct / "ckpt" / "iter_0000004")
    recorded = read_manifest(str(out / "iter_0000004")).proof
    if not extra:
        assert recorded is None
        return
    saved = read_manifest(str(direct / "ckpt" / "iter_0000004")).proof
    assert sorted(recorded["digests"]) == sorted(saved["digests"])  # param, exp_avg, exp_avg_sq of each
    assert proof.compare(saved, recorded) is None, proof.compare(saved, recorded)
    print(f"bf16 probe: megatron's load of the source vs the direct save: max |delta| "
          f"{proof.largest_delta(saved, recorded)[0]:.3g}")


@pytest.fixture
def copy_of(dense, tmp_path):
    import shutil

    def copy():
        d = tmp_path / "damaged"
        shutil.copytree(dense["ckpt"] / "iter_0000004", d / "iter_0000004")
        return d / "iter_0000004"

    return copy


def test_a_truncated_or_missing_data_file_is_named(python, copy_of, tmp_path):
    d = copy_of()
    victim = d / "__1_0.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    line = _error(convert(python, d, tmp_path / "out1"))
    assert "__1_0.distcp" in line and "truncated" in line, line
    os.remove(victim)
    line = _error(convert(python, d, tmp_path / "out2"))
    assert "__1_0.distcp" in line, line
    assert not any((tmp_path / n).exists() and any((tmp_path / n).glob("iter_*")) for n in ("out1", "out2"))


def test_a_tensor_shape_the_stored_arguments_do_not_give_is_named(python, copy_of, tmp_path):
    import torch  # noqa: F401  (the metadata's classes)

    d = copy_of()
    meta = pickle.loads((d / ".metadata").read_bytes())  # our own copy of our own fixture
    key = "model.module.decoder.layers.0.mlp.linear_fc2.weight"
    meta.state_dict_metadata[key].size = torch.Size([32, 96])
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    line = _error(convert(python, d, tmp_path / "out"))
    assert f"'{key}' has shape [32, 96], the model built from the stored arguments has [32, 128]" in line, line


def test_what_is_not_converted_is_refused_by_name(python, dense, tmp_path):
    line = _error(convert(python, dense["ckpt"], tmp_path / "out", "--", "--num-experts", "4"))
    assert "no tensor 'model.module.decoder.layers.0.mlp.router.weight'" in line, line  # not this model
    line = _error(convert(python, dense["ckpt"], tmp_path / "out", "--via-megatron"))
    assert "--via-megatron reads torch_dist checkpoints" in line, line
