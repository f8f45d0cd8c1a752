"""DeepSpeed universal checkpoints imported (tools/import_deepspeed.py): a Megatron-DeepSpeed-style
GPT trained by DeepSpeed ZeRO-1 on 2 CPU processes (tests/ds_gpt.py: GQA, SwiGLU, RMSNorm,
RoPE, a padded vocabulary; untied, tied, and bf16 with BF16_Optimizer), saved at iteration 5 and
converted by ds_to_universal, resumes on megatron-core on TP2, PP2 and DP2 with the distributed
optimizer with DeepSpeed's own continuation's losses (iterations 6-10); a TP2 DeepSpeed run (its own
tensor parallelism: whole query groups per rank, SwiGLU halves per rank, split vocabulary) resumes
on PP2 and DP2.

DeepSpeed is the `deepspeed` extra (CI installs it; its CPU communication op is JIT-built once
into the venv's torch_extensions/). Nothing is downloaded.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("deepspeed")
import torch  # noqa: E402

import launch  # noqa: E402
from harness import REPO, losses, max_loss_delta, run_steps  # noqa: E402
from megatron_ucp.convert import deepspeed_map as dsm  # noqa: E402
from megatron_ucp.convert.deepspeed import import_  # noqa: E402
from megatron_ucp.errors import ConfigError, FormatError  # noqa: E402
from megatron_ucp.format.manifest import read_manifest  # noqa: E402

ORIGINAL_NAMES = dsm.megatron_names
TOL = 1e-4
BF16_TOL = 1e-3  # test_resume_matrix.BF16_TOL: bf16 matmuls round differently when TP splits them
RUN = dict(iters=10, save_at=5, mbs=2, gbs=8, lr=5e-3, vocab=250, seq=16)
VARIANTS = {"fp32_untied": dict(tied=False, bf16=False), "fp32_tied": dict(tied=True, bf16=False),
            "bf16_untied": dict(tied=False, bf16=True),
            # saved on TP2 (DP1): whole query groups per rank, SwiGLU halves per rank, vocabulary rows split
            "fp32_tp2": dict(tied=False, bf16=False, tp=2)}
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "dp2_distopt": ["--use-distributed-optimizer"]}
# megatron-core's run: the stored flags give model, AdamW and schedule; this, the rest.
MC = ["--cpu", "--mock-data", "--seed", "7", "--log-interval", "1000", "--micro-batch-size", "2", "--clip-grad", "0"]


def ds_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                # DeepSpeed's CPU comm op is JIT-built on first use: cached beside the venv's packages
                TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                    os.path.join(sys.prefix, "torch_extensions")))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ds")


@pytest.fixture(scope="module")
def deepspeed_runs(work):
    """Every variant trained, saved at 5, converted and resumed by DeepSpeed (one torchrun group)."""
    from harness import free_port

    spec = {"root": str(work), "result": str(work / "ds_result.json"),
            "variants": [dict(RUN, name=n, **v) for n, v in VARIANTS.items()]}
    (work / "ds_spec.json").write_text(json.dumps(spec))
    proc = launch.run_group(sys.executable, 2, [str(REPO / "tests" / "ds_gpt.py"), str(work / "ds_spec.json")],
                            ds_env(), work, free_port(), 900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {n: {k: ({int(i): x for i, x in r[k].items()} if k != "universal" else r[k]) for k in r}
            for n, r in json.loads((work / "ds_result.json").read_text()).items()}


@pytest.fixture(scope="module")
def imported(work, deepspeed_runs):
    """Each variant imported (the untied fp32 one by the command line): {name: (folder, flags)}."""
    out = {}
    for name, run in deepspeed_runs.items():
        target = work / f"u_{name}"
        if name == "fp32_untied":
            env = dict(os.environ, PYTHONPATH=str(REPO))
            proc = subprocess.run([sys.executable, str(REPO / "tools" / "import_deepspeed.py"), run["universal"],
                                   str(target), "--no-progress"], capture_output=True, text=True, env=env,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "imported iteration 5 (Adam step 5, 40 samples consumed)" in proc.stdout, proc.stdout
            flags = proc.stdout.split("flags: ", 1)[1].split()
        else:
            summary = import_(run["universal"], str(target), progress=False)
            flags = summary["megatron_args"]
            out[f"{name}_checkpoint_args"] = summary["training_args"]
        out[name] = (target, flags)
    return out


def layouts(variant):
    """Where each variant resumes: every layout, but the TP2 source's on layouts other than its own."""
    return [k for k in LAYOUTS if not (VARIANTS[variant].get("tp") == 2 and k == "tp2")]


@pytest.fixture(scope="module")
def group(work, imported):
    steps = []
    for name in VARIANTS:
        folder, flags = imported[name]
        for layout in layouts(name):
            extra = LAYOUTS[layout]
            if name == "fp32_tied" and layout == "pp2":  # the model's flags from the manifest
                flags = imported[f"{name}_checkpoint_args"] + ["--use-checkpoint-args"]
            argv = MC + flags + extra + ["--load", str(folder), "--ckpt-step", "5", "--load-universal"]
            if VARIANTS[name]["bf16"]:
                argv.append("--bf16")
            steps.append({"name": f"{name}_{layout}", "op": "train", "argv": argv})
    return run_steps(2, steps, work / "mc")


@pytest.mark.parametrize("variant,layout", [(v, k) for v in VARIANTS for k in layouts(v)])
def test_resume(deepspeed_runs, group, variant, layout):
    """megatron-core resumed from the import trains iterations 6-10 as DeepSpeed resumed from
    its own universal folder does."""
    reference = deepspeed_runs[variant]["continued"]
    resumed = losses(group, f"{variant}_{layout}")
    assert sorted(resumed) == list(range(6, 11)), sorted(resumed)
    delta = max_loss_delta(reference, resumed)
    print(f"{variant} on {layout}: max |loss - DeepSpeed's| over iterations 6-10: {delta:.2e}")
    assert delta <= (BF16_TOL if VARIANTS[variant]["bf16"] else TOL)


PROOF_LINE = (r"resume proof passed: 16 probe tokens within (\S+) of the saved losses \(tolerance (\S+)\), "
              r"(\d+) state digests equal")


@pytest.mark.parametrize("variant,layout", [(v, k) for v in VARIANTS for k in layouts(v)])
def test_resume_proof(imported, group, variant, layout):
    """Each import carries the proof of Megatron-DeepSpeed's forward of the source's tensors
    (deepspeed_proof.py, fp32 on CPU); megatron-core's first load on each layout recomputes it:
    within fp32 noise, or for the bf16 run (which resumes in bf16) within bf16's rounding under
    the tolerance between implementations."""
    manifest = json.loads((imported[variant][0] / "iter_0000005" / "ucp.json").read_text())
    assert manifest["proof"]["device"] == "cpu/megatron-deepspeed" and len(manifest["proof"]["losses"]) == 16
    stdout = group[f"{variant}_{layout}"]["stdout"]
    found = re.search(PROOF_LINE, stdout)
    assert found, stdout[-3000:]
    delta, tolerance = float(found.group(1)), float(found.group(2))
    print(f"{variant} on {layout}: megatron-core's probe losses within {delta:.2g} of Megatron-DeepSpeed's "
          f"(tolerance {tolerance:g})")
    if VARIANTS[variant]["bf16"]:
        assert tolerance == 6e-2 and delta <= 2e-2
    else:
        assert tolerance == 1e-3 and delta <= 1e-5


def _layers_swapped(names):
    """The importer's names with transformer layers 0 and 1 exchanged (a wrong mapping)."""
    swap = {"decoder.layers.0.": "decoder.layers.1.", "decoder.layers.1.": "decoder.layers.0."}
    return {ds: next((swap[k] + mc[len(k):] for k in swap if mc.startswith(k)), mc)
            for ds, mc in ORIGINAL_NAMES(names).items()}


def test_wrong_mapping_refused_at_first_load(work, deepspeed_runs, monkeypatch):
    """An importer that swaps two layers writes weights whose digests it records alike; the
    losses of Megatron-DeepSpeed's forward of the source refuse it at the first load, naming a
    probe token in one line (`inspect --verify --prove`: one CPU process)."""
    monkeypatch.setattr(dsm, "megatron_names", _layers_swapped)
    import_(deepspeed_runs["fp32_untied"]["universal"], str(work / "u_swapped"), progress=False)
    monkeypatch.undo()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp", "inspect", str(work / "u_swapped"), "--verify",
                           "--prove"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1 and "fails its resume proof" in proc.stdout, proc.stdout + proc.stderr
    found = re.search(r"probe token \d+: loss \S+ saved, \S+ now \(\|delta\| (\S+) > tolerance 0.001", proc.stdout)
    assert found, proc.stdout
    print(f"layers 0 and 1 swapped by the importer: worst probe token off by {found.group(1)}")


def _ds_state(universal, name, state="fp32"):
    return torch.load(Path(universal) / "zero" / name / f"{state}.pt", weights_only=True)["param"].detach().numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_state(deepspeed_runs, imported, variant):
    """The manifest's iteration, samples, step and scheduler; every tensor the DeepSpeed file's,
    bit for bit, padding rows zero; bf16's masters are the fp32 ones, not the bf16 weights."""
    from safetensors.numpy import load_file

    universal = deepspeed_runs[variant]["universal"]
    folder = imported[variant][0] / "iter_0000005"
    m = read_manifest(str(folder))
    assert (m.iteration, m.consumed_samples, m.optimizer["step"]) == (5, 40, 5)
    assert m.scheduler["num_steps"] == 40 and m.rng_saved is False
    assert ("output_layer.weight" in m.tensors) == (not VARIANTS[variant]["tied"])
    names = dsm.megatron_names(p.name for p in (Path(universal) / "zero").iterdir() if p.is_dir())
    assert sorted(names.values()) == sorted(m.tensors)
    for ds, mc in names.items():
        tensors = load_file(str(folder / m.tensors[mc].file))
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            mine = tensors["param" if state == "fp32" else state]
            assert np.array_equal(mine.view(np.uint32), _ds_state(universal, ds, state).view(np.uint32)), (mc, state)
        if mc in dsm.VOCAB:
            assert m.tensors[mc].padding_rows == 6 and not tensors["padding.param"].any()
    if VARIANTS[variant]["bf16"]:  # fp32 masters: most are not bf16 numbers
        qkv = load_file(str(folder / m.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].file))["param"]
        assert (qkv.view(np.uint32) & 0xFFFF).any()


def test_swiglu_halves_unmarked_refused(work, deepspeed_runs):
    """From TP2, a dense_h_to_4h merged without its two sub-parameters ([gate_0; up_0; gate_1;
    up_1]: universal_checkpoint_info did not list it) is refused naming it."""
    bad = work / "unmarked"
    shutil.copytree(deepspeed_runs["fp32_tp2"]["universal"], bad)
    path = bad / "zero" / "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight" / "fp32.pt"
    record = torch.load(path, weights_only=True)
    assert record.pop("param_n_sub_params") == 2
    torch.save(record, path)
    with pytest.raises(ConfigError, match=r"language_model\.encoder\.layers\.0\.mlp\.dense_h_to_4h\.weight.*"
                                          "parameter_with_2_sub_params_cat_dim_0"):
        import_(str(bad), str(work / "out_unmarked"), progress=False)
    assert not (work / "out_unmarked").exists()


def _evil(marker: Path):
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    return Payload()


@pytest.mark.parametrize("target", ["zero/optimizer_state.pt", "zero/{param}/fp32.pt", "mp_rank_00_model_states.pt"])
def test_pickle_payload_refused(work, deepspeed_runs, target):
    """A payload planted in the optimizer state, a parameter's fp32.pt or the model states runs
    nothing and is refused naming the file; no output is left."""
    source = Path(deepspeed_runs["fp32_untied"]["universal"])
    bad = work / f"evil_{target.split('/')[-1]}"
    shutil.copytree(source, bad)
    marker = work / f"ran_{bad.name}"
    path = bad / target.format(param="language_model.encoder.layers.1.mlp.dense_h_to_4h.weight")
    torch.save({"param": torch.zeros(96, 32), "cat_dim": 0, "param_n_sub_params": 2, "x": _evil(marker)}, path)
    with pytest.raises(FormatError, match=f"{path}: refused to unpickle posix.system"):
        import_(str(bad), str(work / f"out_{bad.name}"), progress=False)
    assert not marker.exists() and not (work / f"out_{bad.name}").exists()


# ---- the mapping, without DeepSpeed runs ---------------------------------------------------------

ARGS = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
            kv_channels=8, seq_length=16, swiglu=True, normalization="rmsnorm", layernorm_epsilon=1e-5,
            use_rotary_position_embeddings=True, untie_embeddings_and_output_weights=False, add_bias_linear=False)
UC = {"original_vocab_size": 250, "padded_vocab_size": 256}
LAYER_PARAMS = ["input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.dense.weight",
                "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight"]


def test_pipeline_names():
    """GPTModelPipe's names: the tied embedding, layer specs from 2, the final norm's spec after
    them; numbered from what the names show."""
    names = ["tied_modules.embed.word_embeddings.weight"] + [f"{i + 2}.{p}" for i in range(2) for p in LAYER_PARAMS]
    names.append("4.weight")
    mapping = dsm.megatron_names(names)
    assert mapping["3.mlp.dense_h_to_4h.weight"] == "decoder.layers.1.mlp.linear_fc1.weight"
    assert mapping["2.input_layernorm.weight"] == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert mapping["4.weight"] == "decoder.final_layernorm.weight"
    model = dsm.from_args(ARGS, UC, names, "ckpt")
    dsm.check_names(model, mapping)
    untied = ["1.word_embeddings.weight"] + names[1:] + ["5.lm_head.weight"]
    assert dsm.megatron_names(untied)["5.lm_head.weight"] == "output_layer.weight"
    dsm.check_names(dsm.from_args(dict(ARGS, untie_embeddings_and_output_weights=True), UC, untied, "ckpt"),
                    dsm.megatron_names(untied))


@pytest.mark.parametrize("names,named", [
    (["language_model.encoder.layers.0.mlp.gate.weight"], "language_model.encoder.layers.0.mlp.gate.weight"),
    (["2.input_layernorm.weight", "3.input_layernorm.weight", "3.foo.weight"], "3.foo.weight"),
    (["2.input_layernorm.weight", "4.input_layernorm.weight"], "not consecutive"),
    (["tied_modules.embed.word_embeddings.norm.weight"], "tied_modules.embed.word_embeddings.norm.weight"),
])
def test_unknown_names_refused(names, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        dsm.megatron_names(names)


@pytest.mark.parametrize("change,named", [
    (dict(apply_layernorm_1p=True), "apply_layernorm_1p"),
    (dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
    (dict(num_experts=[4]), "mixture of experts"),
    (dict(use_rotary_position_embeddings=False), "neither rotary nor learned"),
    (dict(rotary_percent=0.5), "rotary_percent 0.5"),
    (dict(normalization="scalenorm"), "normalization 'scalenorm'"),
    (dict(ds_sequence_parallel_fpdt=True), r"FPDT chunked attention \(args.ds_sequence_parallel_fpdt\)"),
])
def test_options_refused(change, named):
    with pytest.raises(ConfigError, match=named):
        dsm.from_args(dict(ARGS, **change), UC, [], "ckpt")


def test_merge_records_checked():
    """Under TP, SwiGLU halves merged as one tensor (interleaved per rank), a row-parallel weight
    merged on rows, a wrong shape, a vocabulary mark missing: each refused naming the parameter."""
    model = dsm.from_args(ARGS, UC, [], "ckpt")
    fc1, proj = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_proj.weight"
    dsm.check_record("x.fc1", fc1, {"cat_dim": 0, "param_n_sub_params": 2}, (96, 32), model, tp=2)
    dsm.check_record("x.fc1", fc1, {"cat_dim": 0}, (96, 32), model, tp=1)  # one rank: nothing interleaved
    cases = [("x.fc1", fc1, {"cat_dim": 0}, (96, 32), "parameter_with_2_sub_params_cat_dim_0"),
             ("x.dense", proj, {"cat_dim": 0}, (32, 32), "row-parallel"),
             ("x.dense", proj, {"cat_dim": 1}, (32, 16), r"shape \[32, 16\]"),
             ("x.emb", "embedding.word_embeddings.weight", {"cat_dim": 0}, (250, 32), "vocab_tensor is unset"),
             ("x.qkv", "decoder.layers.0.self_attention.linear_qkv.weight", {"cat_dim": 0, "sub_param_shape": object()},
              (64, 32), "fused sub-parameters")]
    for ds, mc, record, shape, named in cases:
        with pytest.raises(ConfigError, match=named) as e:
            dsm.check_record(ds, mc, record, shape, model, tp=2)
        assert ds in str(e.value)


def test_zero_checkpoint_named(deepspeed_runs):
    """The ZeRO checkpoint itself (not converted yet) is refused, naming ds_to_universal."""
    from megatron_ucp.errors import IncompleteCheckpointError

    saved = Path(deepspeed_runs["fp32_untied"]["universal"]).parent / "global_step5"
    with pytest.raises(IncompleteCheckpointError, match="convert it first with python -m "
                                                        r"deepspeed\.checkpoint\.ds_to_universal"):
        import_(str(saved), str(saved.parent / "never"), progress=False)


def test_fifo_refused(work, deepspeed_runs):
    """A state file that is a FIFO (a read would block forever) is refused, naming it."""
    bad = work / "fifo"
    shutil.copytree(deepspeed_runs["fp32_untied"]["universal"], bad)
    path = bad / "zero" / "language_model.encoder.final_layernorm.weight" / "exp_avg.pt"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(FormatError, match=f"{path} is a FIFO, expected a regular file"):
        import_(str(bad), str(work / "out_fifo"), progress=False)


class _Enum:
    """Pickles as megatron.enums.PositionEmbeddingType(value), as Megatron-DeepSpeed forks' args do."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _Enum, (self.value,)


@pytest.mark.parametrize("value,rope", [(1, True), (3, None)])
def test_position_embedding_enum(tmp_path, monkeypatch, value, rope):
    """Megatron-DeepSpeed's position embedding enum in args is read as its member's name into an
    inert stand-in: rotary maps to RoPE, ALiBi is refused."""
    import argparse
    import types

    from megatron_ucp.convert import deepspeed as ds

    fake = types.ModuleType("megatron.enums")
    _Enum.__module__, _Enum.__qualname__ = "megatron.enums", "PositionEmbeddingType"
    fake.PositionEmbeddingType = _Enum
    monkeypatch.setitem(sys.modules, "megatron.enums", fake)
    try:
        torch.save({"args": argparse.Namespace(position_embedding_type=_Enum(value))}, tmp_path / "m.pt")
    finally:
        _Enum.__module__, _Enum.__qualname__ = __name__, "_Enum"
    monkeypatch.delitem(sys.modules, "megatron.enums")
    loaded = ds._load(str(tmp_path / "m.pt"), "model states", str(tmp_path), 2**20)
    kind = ds.plain_args(loaded["args"], "model states")["position_embedding_type"]
    assert kind == {1: "rotary", 3: "alibi"}[value]
    args = dict(ARGS, use_rotary_position_embeddings=False, position_embedding_type=kind)
    if rope:
        assert dsm.from_args(args, UC, [], "ckpt").rope
    else:
        with pytest.raises(ConfigError, match="position_embedding_type 'alibi'"):
            dsm.from_args(args, UC, [], "ckpt")


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 6), first=st.integers(1, 4), tied=st.booleans(), norm_bias=st.booleans())
def test_pipeline_names_match_plain(layers, first, tied, norm_bias):
    """GPTModelPipe's names, wherever its layer specs start, map one to one onto the megatron-core
    names GPTModel's names of the same model map to, layer i of the pipe being layer i."""
    pipe = ["tied_modules.embed.word_embeddings.weight"] if tied else [f"{first - 1}.word_embeddings.weight"]
    plain = ["language_model.embedding.word_embeddings.weight"]
    for i in range(layers):
        pipe += [f"{first + i}.{p}" for p in LAYER_PARAMS]
        plain += [f"language_model.encoder.layers.{i}.{p}" for p in LAYER_PARAMS]
    ends = ["weight", "bias"] if norm_bias else ["weight"]
    pipe += [f"{first + layers}.{e}" for e in ends]
    plain += [f"language_model.encoder.final_layernorm.{e}" for e in ends]
    if not tied:
        pipe.append(f"{first + layers + 1}.lm_head.weight")
        plain.append("language_model.output_layer.weight")
    a, b = dsm.megatron_names(pipe), dsm.megatron_names(plain)
    assert len(set(a.values())) == len(a) and sorted(a.values()) == sorted(b.values())
    assert a[f"{first + layers - 1}.mlp.dense_4h_to_h.weight"] == f"decoder.layers.{layers - 1}.mlp.linear_fc2.weight"
