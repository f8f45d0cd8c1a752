"""`megatron-ucp import-deepspeed` on DeepSpeed universal folders written by hand as
ds_to_universal writes them (tests/ds_universal.py; no DeepSpeed run): Megatron-DeepSpeed's
pickled `args.model_type` enum through every entry point, both query_key_value row orders
checked by what megatron-core computes from the import, token-based schedules, the padded
vocabulary's bound, and hostile values (each one line, nothing written).
"""

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ds_universal
from harness import REPO, run_steps
from megatron_ucp.convert import deepspeed_qkv as dsq
from megatron_ucp.convert.deepspeed import import_, main
from megatron_ucp.errors import ConfigError, FormatError, UCPError
from megatron_ucp.format.manifest import read_manifest

FPDT = dict(ds_sequence_parallel_fpdt=False, ds_sequence_parallel_fpdt_chunk_size=65536,
            ds_sequence_parallel_fpdt_offloading=False)  # Megatron-DeepSpeed >= 676a482c's defaults
# name: (ds_gpt variant, args changes, saving TP degree)
LAYOUTS = {
    "thirds_tp1": (dict(tied=False, groups=4, qkv_layout="thirds"), FPDT, 1),
    "thirds_tp2": (dict(tied=False, groups=4, qkv_layout="thirds", qkv_ranks=2), FPDT, 2),
    "grouped_mha": (dict(tied=False, groups=4), dict(deepspeed_config=None), 1),  # a whole older namespace
    "grouped_gqa": (dict(tied=True, groups=2), {}, 1),
}
TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(11))
LOGITS_TOL = 1e-4  # fp32, one process: attention implementations differ by ~1e-6
ORIGINAL_QKV_ROWS = dsq.qkv_rows
MC = ["--cpu", "--mock-data", "--seed", "7", "--log-interval", "1000", "--micro-batch-size", "2"]


def build(folder, name="grouped_gqa", states=None, **args_changes):
    variant, changes, tp = LAYOUTS[name]
    gpt = ds_universal.model(variant)
    args = ds_universal.args_of(gpt, variant, **dict(changes, **args_changes))
    return ds_universal.write(folder, gpt, args, tp, states), gpt


# ---- megatron.core.enums.ModelType in args (Megatron-DeepSpeed's get_model) ---------------------

NO_MEGATRON = """import runpy, sys
class NoMegatron:  # the process must not import megatron (its enums would then be allowed)
    def find_spec(self, name, *args):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, NoMegatron())
kind, target = sys.argv[1], sys.argv[2]
sys.argv = [target] + sys.argv[3:]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def test_model_type_enum_read_by_every_entry_point(tmp_path):
    """args.model_type pickled by reference as megatron.core.enums.ModelType (as Megatron-
    DeepSpeed's get_model() stores it): `megatron-ucp import-deepspeed`, `python -m megatron_ucp
    import-deepspeed` and tools/import_deepspeed.py, each in a process where megatron cannot be
    imported, import the folder and keep the enum as text."""
    folder, _ = build(tmp_path / "ds")
    with zipfile.ZipFile(os.path.join(folder, "mp_rank_00_model_states.pt")) as z:  # pickled by reference
        pickled = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    assert b"cmegatron.core.enums\nModelType\n" in pickled  # protocol 2 GLOBAL, as torch.save writes it
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    script = os.path.join(os.path.dirname(sys.executable), "megatron-ucp")
    entries = {"megatron-ucp": ["path", script, "import-deepspeed"],
               "python -m megatron_ucp": ["module", "megatron_ucp", "import-deepspeed"],
               "tools/import_deepspeed.py": ["path", str(REPO / "tools" / "import_deepspeed.py")]}
    for i, (entry, argv) in enumerate(entries.items()):
        out = tmp_path / f"out{i}"
        proc = subprocess.run([sys.executable, "-c", NO_MEGATRON, *argv, folder, str(out), "--no-progress"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, (entry, proc.stdout[-2000:], proc.stderr[-3000:])
        assert "imported iteration 5" in proc.stdout, (entry, proc.stdout)
        args = read_manifest(str(out / "iter_0000005")).source["megatron_deepspeed_args"]
        assert args["model_type"] == "<ModelType 1>", entry


def test_model_type_other_than_a_gpt_refused(tmp_path):
    """ModelType encoder_and_decoder (2: T5) is no GPT: refused naming args.model_type."""
    import argparse

    from megatron_ucp.convert import deepspeed_map as dsm
    from megatron_ucp.convert.megatron_args import STAND_INS

    enum_class = dict((n, c) for c, n in STAND_INS)["megatron.core.enums.ModelType"]
    base = vars(ds_universal.args_of(ds_universal.model(LAYOUTS["grouped_gqa"][0]), LAYOUTS["grouped_gqa"][0]))
    from megatron_ucp.convert.deepspeed import plain_args

    args = plain_args(argparse.Namespace(**dict(base, model_type=enum_class(2))), "m.pt")
    with pytest.raises(ConfigError, match="model_type '<ModelType 2>'"):
        dsm.from_args(args, {"original_vocab_size": 250, "padded_vocab_size": 256}, [], "m.pt")


# ---- query_key_value's row order, checked by what megatron-core computes -------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Each layout written, imported (thirds_tp1 through the command line's --qkv-layout flag,
    the others as their args tell), and megatron-core's logits of the import (one process)."""
    work = tmp_path_factory.mktemp("qkv")
    out, steps = {}, []
    for name in LAYOUTS:
        folder, gpt = build(work / name, name)
        target = work / f"u_{name}"
        if name == "thirds_tp1":
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                assert main([folder, str(target), "--no-progress", "--qkv-layout", "thirds"]) == 0
            flags = printed.getvalue().split("flags: ", 1)[1].split()
        else:
            flags = import_(folder, str(target), progress=False)["megatron_args"]
        with torch.no_grad():
            reference = gpt.logits(TOKENS)[..., :250].numpy()
        out[name] = {"folder": folder, "target": target, "reference": reference}
        steps.append({"name": name, "op": "logits", "tokens": TOKENS.tolist(),
                      "argv": MC + flags + ["--load", str(target), "--ckpt-step", "5"]})
    results = run_steps(1, steps, work / "mc")
    for name in LAYOUTS:
        assert "logits" in results.get(name, {}), results.get(name)
        out[name]["logits"] = np.array(results[name]["logits"])
        out[name]["proof"] = results[name]["proof"]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_imported_model_computes_the_source_models_logits(layouts, name):
    """megatron-core's logits from the import are the Megatron-DeepSpeed model's: thirds
    ([Q; K; V] per saving TP rank, args with ds_sequence_parallel_fpdt*) and grouped alike."""
    got, want = layouts[name]["logits"], layouts[name]["reference"]
    diff = float(np.abs(got - want).max())
    print(f"{name}: max |logit - Megatron-DeepSpeed's| {diff:.2e} (logits up to {np.abs(want).max():.2f})")
    assert got.shape == want.shape and diff <= LOGITS_TOL


def proof_delta(line: str) -> float:
    """How far megatron-core's probe losses were from those the import recorded (the load's line)."""
    found = re.search(r"resume proof passed: (\d+) probe tokens within (\S+) of the saved losses "
                      r"\(tolerance 0\.001\), (\d+) state digests equal", line or "")
    assert found, line
    return float(found.group(2))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_import_proof_passes(layouts, name):
    """The import records the probe's losses through Megatron-DeepSpeed's forward of the source's
    own tensors (deepspeed_proof.py: per saving TP rank, its QKV split); megatron-core's load of
    the import recomputes them within fp32 noise (the proof's tolerance is 1e-3)."""
    delta = proof_delta(layouts[name]["proof"])
    print(f"{name}: {layouts[name]['proof']}")
    assert delta <= 1e-5


def _prove(ckpt) -> subprocess.CompletedProcess:
    """`inspect --verify --prove`: the checkpoint loaded in one CPU process, its proof checked."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_ucp", "inspect", str(ckpt), "--verify", "--prove"],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("name,rows", [
    # issue 46's bug: Megatron-DeepSpeed master's thirds read as the per-group order (no reordering)
    ("thirds_tp2", lambda layout, m, tp, where=None: None),
    # the converse: an MHA checkpoint's per-head [q; k; v] read as thirds
    ("grouped_mha", lambda layout, m, tp, where=None: ORIGINAL_QKV_ROWS("thirds", m, tp)),
])
def test_wrong_qkv_order_refused_at_first_load(layouts, tmp_path, monkeypatch, name, rows):
    """An importer that reads query_key_value's rows in another order writes weights whose
    digests it records alike; the losses of Megatron-DeepSpeed's forward of the source refuse
    it at the first load, naming a probe token, in one line."""
    monkeypatch.setattr(dsq, "qkv_rows", rows)
    import_(layouts[name]["folder"], str(tmp_path / "wrong"), progress=False)
    monkeypatch.undo()
    proc = _prove(tmp_path / "wrong")
    assert proc.returncode == 1 and "fails its resume proof" in proc.stdout, proc.stdout + proc.stderr
    found = re.search(r"probe token \d+: loss \S+ saved, \S+ now \(\|delta\| (\S+) > tolerance 0.001", proc.stdout)
    assert found, proc.stdout
    print(f"{name} read in the other order: worst probe token off by {found.group(1)}")


def test_import_without_proof(layouts, tmp_path):
    """--no-proof: none recorded, said in one line; the load then says it holds none."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([layouts["grouped_gqa"]["folder"], str(tmp_path / "u"), "--no-progress", "--no-proof"]) == 0
    assert "resume proof not recorded (--no-proof)" in printed.getvalue(), printed.getvalue()
    assert "proof" not in json.loads((tmp_path / "u" / "iter_0000005" / "ucp.json").read_text())


# ---- the proof of the model variants ds_gpt does not build (random tensors, their names and shapes) ----

# name: (model facts, Megatron-DeepSpeed args changes, saving TP degree, GPTModelPipe's names)
VARIANTS = {
    # LayerNorm, GELU fused with the bias (bias_gelu_impl: tanh), linear biases, learned positions, untied
    "layernorm_gelu_learned": (dict(layernorm=True, bias=True, learned=True, tied=False, groups=4, swiglu=False),
                               dict(bias_gelu_fusion=True), 1, False),
    # RMSNorm, GELU (erf: --no-bias-gelu-fusion), biases, learned positions, tied, GQA; saved on TP2:
    # column-parallel biases split, row-parallel ones whole
    "rmsnorm_gelu_bias_tp2": (dict(layernorm=False, bias=True, learned=True, tied=True, groups=2, swiglu=False),
                              dict(bias_gelu_fusion=False), 2, False),
    # GPTModelPipe's names (tied embedding, layer specs from 2, the final norm's), LayerNorm, rotary, SwiGLU
    "pipe_layernorm_rope": (dict(layernorm=True, bias=False, learned=False, tied=True, groups=2, swiglu=True),
                            {}, 1, True),
}


def build_variant(folder, name):
    facts, changes, tp, pipe = VARIANTS[name]
    c = argparse.Namespace(layers=2, hidden=32, heads=4, kv_channels=8, ffn=48, vocab=250, padded_vocab=256, seq=16,
                           eps=1e-5, rope_theta=10000, tp=tp, **facts)
    tensors = ds_universal.Tensors(c, pipe=pipe)
    args = ds_universal.mds_args(c, dict(mbs=2, gbs=ds_universal.GBS, iters=10, lr=5e-3, bf16=False, save_at=5),
                                 5 * ds_universal.GBS)
    for key, value in dict(changes, swiglu=c.swiglu, normalization="layernorm" if c.layernorm else "rmsnorm",
                           use_rotary_position_embeddings=not c.learned, add_bias_linear=c.bias,
                           deepspeed_config=None).items():
        setattr(args, key, value)
    return ds_universal.write(folder, tensors, args, tp)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Each variant written, imported, and megatron-core's load of the import (one process)."""
    work = tmp_path_factory.mktemp("variants")
    steps, out = [], {}
    for name in VARIANTS:
        folder = build_variant(work / name, name)
        summary = import_(folder, str(work / f"u_{name}"), progress=False)
        out[name] = {"folder": folder, "target": work / f"u_{name}", "import": summary["proof"]}
        steps.append({"name": name, "op": "logits", "tokens": TOKENS.tolist(),
                      "argv": MC + summary["megatron_args"] + ["--load", str(work / f"u_{name}"), "--ckpt-step", "5"]})
    results = run_steps(1, steps, work / "mc")
    for name in VARIANTS:
        assert "proof" in results.get(name, {}), results.get(name)
        out[name]["proof"] = results[name]["proof"]
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_proof_passes(variants, name):
    """LayerNorm, GELU, linear biases, learned positions, tied and untied, a TP2 save, GPTModelPipe's
    names: Megatron-DeepSpeed's forward of the source (deepspeed_proof.py) and megatron-core's of the
    import compute the same probe losses (fp32: within 1e-5; the tolerance is 1e-3)."""
    assert variants[name]["import"].startswith("resume proof recorded from Megatron-DeepSpeed's forward"), \
        variants[name]["import"]
    print(f"{name}: {variants[name]['proof']}")
    assert proof_delta(variants[name]["proof"]) <= 1e-5


def test_proof_not_recorded_where_the_reference_cannot_run(tmp_path, monkeypatch):
    """Less free memory than twice the fp32 weights, or heads that do not split over the saving
    TP ranks: the import is written without a proof and says why in one line."""
    import psutil

    folder, _ = build(tmp_path / "src")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 10**4})())
    s = import_(folder, str(tmp_path / "u_memory"), progress=False)
    assert s["proof"].startswith("resume proof not recorded (the reference forward takes about"), s["proof"]
    monkeypatch.undo()
    from megatron_ucp.convert import deepspeed_proof as dp

    with pytest.raises(ConfigError, match="4 attention heads in 2 key-value groups do not split over 4 TP ranks"):
        dp.source_of(dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, seq_length=16),
                     {"original_vocab_size": 250, "padded_vocab_size": 256}, 4, "grouped", "m.pt")
    assert "proof" not in json.loads((tmp_path / "u_memory" / "iter_0000005" / "ucp.json").read_text())


def test_thirds_moments_reordered_with_the_weights(layouts):
    """Adam's moments of query_key_value follow its rows: the import's are DeepSpeed's, permuted."""
    from safetensors.numpy import load_file

    run = layouts["thirds_tp2"]
    m = read_manifest(str(run["target"] / "iter_0000005"))
    assert m.source["qkv_layout"] == "thirds"
    name = "language_model.encoder.layers.1.self_attention.query_key_value.weight"
    qkv = m.tensors["decoder.layers.1.self_attention.linear_qkv.weight"]
    mine = load_file(str(run["target"] / "iter_0000005" / qkv.file))
    model = type("M", (), {"num_attention_heads": 4, "kv_channels": 8})
    rows = dsq.qkv_rows("thirds", model, 2)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        theirs = torch.load(Path(run["folder"]) / "zero" / name / f"{state}.pt", weights_only=True)["param"].numpy()
        assert np.array_equal(mine["param" if state == "fp32" else state], theirs[rows])


@settings(max_examples=40, deadline=None)
@given(per_rank=st.integers(1, 4), tp=st.integers(1, 4), kv=st.integers(1, 5))
def test_thirds_rows_are_megatron_cores_order(per_rank, tp, kv):
    """qkv_rows puts, for every head h, the rows Megatron-DeepSpeed's thirds split reads as h's
    query, key and value (each TP rank's block viewed [3, heads/tp, kv]) where megatron-core's
    grouped order (groups = heads) reads them: [q_h; k_h; v_h]."""
    heads = per_rank * tp
    model = type("M", (), {"num_attention_heads": heads, "kv_channels": kv})
    source = np.arange(3 * heads * kv).reshape(tp, 3, per_rank, kv)  # rank, part, local head, channel
    want = np.concatenate([source[h // per_rank, part, h % per_rank] for h in range(heads) for part in range(3)])
    assert np.array_equal(np.arange(3 * heads * kv)[dsq.qkv_rows("thirds", model, tp)], want)
    assert dsq.qkv_rows("grouped", model, tp) is None


def test_qkv_layout_undecided_or_impossible_is_refused(tmp_path):
    """MHA args with neither mark: one line naming --qkv-layout (and the flag decides); the
    FPDT mark with GQA, or --qkv-layout thirds for GQA: refused (thirds computes no GQA)."""
    folder, _ = build(tmp_path / "mha", "grouped_mha", deepspeed_config=None)
    os.remove(folder + "/mp_rank_00_model_states.pt")
    variant, _, _ = LAYOUTS["grouped_mha"]
    gpt = ds_universal.model(variant)
    args = ds_universal.args_of(gpt, variant)  # no deepspeed_config, no FPDT keys
    folder = ds_universal.write(tmp_path / "mha2", gpt, args)
    with pytest.raises(ConfigError, match="cannot tell the order of query_key_value's rows.*--qkv-layout thirds or "
                                          "--qkv-layout grouped"):
        import_(folder, str(tmp_path / "o1"), progress=False)
    assert not (tmp_path / "o1").exists()
    assert import_(folder, str(tmp_path / "o2"), progress=False, qkv_layout="grouped")["qkv_layout"] == "grouped"
    gqa, _ = build(tmp_path / "gqa", "grouped_gqa", **FPDT)
    with pytest.raises(ConfigError, match="ds_sequence_parallel_fpdt.*cannot compute 4 attention heads in 2 "
                                          "key-value groups: pass --qkv-layout grouped"):
        import_(gqa, str(tmp_path / "o3"), progress=False)
    with pytest.raises(ConfigError, match="--qkv-layout thirds: 4 attention heads in 2 key-value groups"):
        import_(gqa, str(tmp_path / "o4"), progress=False, qkv_layout="thirds")
    assert import_(gqa, str(tmp_path / "o5"), progress=False, qkv_layout="grouped")["qkv_layout"] == "grouped"


# ---- schedules and the vocabulary ----------------------------------------------------------------

@pytest.mark.parametrize("keys", [{"lr_warmup_tokens": 1000}, {"lr_decay_tokens": 10**6},
                                  {"lr_warmup_tokens": 1000, "lr_decay_tokens": 10**6}])
def test_token_based_schedule_refused(tmp_path, keys):
    """A Megatron-DeepSpeed schedule in tokens (megatron-core's scheduler has none) is refused
    naming the keys, not imported with step-based flags."""
    scheduler = dict(ds_universal.megatron_deepspeed_scheduler(5), **keys)
    folder, _ = build(tmp_path / "ds", states={"lr_scheduler": scheduler})
    with pytest.raises(ConfigError, match="token-based learning-rate schedule .lr_scheduler " + ", ".join(keys)):
        import_(folder, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("padded,divisible,named", [
    (4_000_000, 128,
     "padded_vocab_size 4000000 .*pads it to a multiple of make_vocab_size_divisible_by 128 x TP 1: 256"),
    (65536, 65536, "padded_vocab_size 65536 adds 65286 padding rows .*at most 8192 are accepted"),
    (4_000_000, 4_000_000, r"args.make_vocab_size_divisible_by is 4000000, expected an integer in \[1, 1048576\]"),
    (512, 128, "padded_vocab_size 512 .*: 256"),
])
def test_padded_vocabulary_bounded(tmp_path, padded, divisible, named):
    """universal_checkpoint_info's padded vocabulary (no param_shapes) must be what Megatron-
    DeepSpeed's divisibility rule makes of the true one, and bounded: no GBs of zero rows."""
    variant, _, _ = LAYOUTS["grouped_gqa"]
    gpt = ds_universal.model(variant)
    args = ds_universal.args_of(gpt, variant, padded_vocab_size=padded, make_vocab_size_divisible_by=divisible)
    folder = ds_universal.write(tmp_path / "ds", gpt, args, states={"param_shapes": None})
    info = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), weights_only=False)
    info["universal_checkpoint_info"]["padded_vocab_size"] = padded
    torch.save(info, os.path.join(folder, "mp_rank_00_model_states.pt"))
    with pytest.raises(FormatError, match=named):
        import_(folder, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


# ---- hostile values: one line naming the file and what was expected, nothing written -------------

DEEP = "<a list in a list ... 5000 deep>"  # built in the test (pytest's repr of it would recurse)


def _deep(n=5000):
    value = 1
    for _ in range(n):
        value = [value]
    return value


ARGS_CASES = {  # args.KEY: value -> what the line says
    "hidden_size": [("32", "args.hidden_size is '32', expected an integer"),
                    (float("inf"), "args.hidden_size is 'inf', expected an integer"), (-32, "args.hidden_size")],
    "num_key_value_heads": [("2", "args.num_key_value_heads is '2'"), (0, "args.num_key_value_heads is 0")],
    "layernorm_epsilon": [(float("nan"), "args.layernorm_epsilon is 'nan', expected a finite number"),
                          ("1e-5", "args.layernorm_epsilon is '1e-5'")],
    "rope_theta": [(float("inf"), "args.rope_theta is 'inf'"), (-1.0, "args.rope_theta is -1.0")],
    "global_batch_size": [(-8, "args.global_batch_size is -8"), (True, "args.global_batch_size is True")],
    "consumed_train_samples": [(-40, "consumed samples .*is -40"), (float("nan"), "consumed samples .*is 'nan'")],
    "swiglu": [("yes", "args.swiglu is 'yes', expected true or false")],
    "make_vocab_size_divisible_by": [(0, "args.make_vocab_size_divisible_by is 0"),
                                     ("128", "make_vocab_size_divisible_by is '128'")],
    "num_layers": [(100000, "the args describe 100000 transformer layers, the checkpoint's parameter folders hold 2"),
                   (float("inf"), "args.num_layers is 'inf'")],
    "data_path": [(DEEP, "args.data_path: nested deeper than 16 levels")],
}
SCHEDULER = ds_universal.megatron_deepspeed_scheduler(5)
STATE_CASES = {  # model states' KEY: value -> what the line says
    "iteration": [(-5, "iteration is -5"), ("5", "iteration is '5'")],
    "checkpoint_parallel_dimensions": [({"tp_degree": "2", "pp_degree": 1}, "TP degree .* is '2'"),
                                       ({"tp_degree": float("inf"), "pp_degree": 1}, "TP degree .* is inf"),
                                       ({"tp_degree": 1, "pp_degree": -1}, "PP degree .* is -1"),
                                       ("tp2", "checkpoint_parallel_dimensions is 'tp2', expected a dict")],
    "dp_world_size": [(-2, "dp_world_size is -2"), (float("nan"), "dp_world_size is nan")],
    "skipped_steps": [(-1, "skipped_steps is -1")],
    "ds_config": [([1], "ds_config is a list of 1, expected DeepSpeed's config dict"),
                  ({"zero_optimization": "x"}, "ds_config.zero_optimization is 'x'"),
                  ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage is -1")],
    "param_shapes": [("x", "param_shapes is 'x', expected a list of dicts"),
                     (["x"], r"param_shapes\[0\] is 'x'"),
                     ([{"language_model.embedding.word_embeddings.weight": "abc"}], "expected a shape"),
                     ([{"language_model.embedding.word_embeddings.weight": [float("nan"), 32]}], "expected a shape")],
    "lr_scheduler": [(dict(SCHEDULER, max_lr=float("nan")), "lr_scheduler.max_lr is nan"),
                     (dict(SCHEDULER, num_steps=-1), "lr_scheduler.num_steps is -1"),
                     (dict(SCHEDULER, min_lr=-0.1), "lr_scheduler.min_lr is -0.1"),
                     (dict(SCHEDULER, lr_decay_style="x"), "lr_decay_style is 'x'"),
                     ("sched", "lr_scheduler is 'sched', expected a dict"),
                     (dict(SCHEDULER, start_wd=float("inf")), "start_wd is inf")],
}
GROUP_CASES = [  # zero/optimizer_state.pt's param group changes -> what the line says
    ({"betas": ("a", 0.999)}, r"betas\[0\] is 'a'"), ({"betas": (0.9, float("nan"))}, r"betas\[1\] is nan"),
    ({"betas": (0.9,)}, "betas is a tuple of 1, expected two numbers"), ({"betas": 0.9}, "betas is 0.9"),
    ({"betas": (0.9, 1.5)}, r"betas\[1\] is 1.5"), ({"eps": -1e-8}, "eps is -1e-08"),
    ({"eps": "tiny"}, "eps is 'tiny'"),
    ({"weight_decay": -0.1}, "weight_decay is -0.1"), ({"weight_decay": float("inf")}, "weight_decay is inf"),
    ({"lr": float("nan")}, "lr is nan"),
]
STEP_CASES = [(torch.tensor(float("nan")), "step 'nan'|step nan"), (torch.tensor(float("inf")), "step inf"),
              (-1, "step -1"), ("5", "step '5'"), (torch.tensor(2.5), "step 2.5")]


def _cases():
    for key, cases in ARGS_CASES.items():
        for value, named in cases:
            yield pytest.param("args", key, value, named, id=f"args.{key}={str(value)[:12]}")
    for key, cases in STATE_CASES.items():
        for value, named in cases:
            yield pytest.param("states", key, value, named, id=f"{key}={str(value)[:20]}")
    for change, named in GROUP_CASES:
        yield pytest.param("group", None, change, named, id=f"group{str(change)[:20]}")
    for value, named in STEP_CASES:
        yield pytest.param("step", None, value, named, id=f"step={value}")


@pytest.mark.parametrize("where,key,value,named", list(_cases()))
def test_hostile_value_one_line(tmp_path, where, key, value, named):
    """Text, inf, NaN, negative and deeply nested values where DeepSpeed or Megatron-DeepSpeed
    store numbers and records: one error naming the file and what was expected; no output."""
    if value == DEEP:
        value = _deep()
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20000)  # pickling it recurses; the import's reading must not
        try:
            folder, _ = build(tmp_path / "ds", **{key: value})
        finally:
            sys.setrecursionlimit(limit)
    elif where == "args":
        folder, _ = build(tmp_path / "ds", **{key: value})
    elif where == "states":
        folder, _ = build(tmp_path / "ds", states={key: value})
    else:
        folder, _ = build(tmp_path / "ds")
    zero = Path(folder) / "zero"
    if where == "group":
        state = torch.load(zero / "optimizer_state.pt", weights_only=True)
        state["param_groups"][0].update(value)
        torch.save(state, zero / "optimizer_state.pt")
    if where == "step":
        torch.save(value, zero / "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight" / "step.pt")
    out = tmp_path / "out"
    with pytest.raises(UCPError) as e:
        import_(folder, str(out), progress=False)
    message = str(e.value)
    assert "\n" not in message and len(message) < 600, message
    assert folder in message and __import__("re").search(named, message), message
    assert not out.exists()


def test_unused_non_finite_args_are_written_as_text(tmp_path):
    """inf and NaN in args the import does not use are kept as text: ucp.json stays strict JSON,
    and `inspect --verify` passes."""
    folder, _ = build(tmp_path / "ds", min_loss_scale=float("inf"), loss_scale=float("nan"))
    import_(folder, str(tmp_path / "out"), progress=False)

    def refuse(constant):
        raise AssertionError(f"{constant} in ucp.json")
    manifest = json.loads((tmp_path / "out" / "iter_0000005" / "ucp.json").read_text(), parse_constant=refuse)
    args = manifest["source"]["megatron_deepspeed_args"]
    assert (args["min_loss_scale"], args["loss_scale"]) == ("inf", "nan")
    from megatron_ucp.commands.inspect_checkpoint import main as inspect

    assert inspect([str(tmp_path / "out"), "--verify"]) == 0


# ---- where the output goes, and how many writers --------------------------------------------------

@pytest.mark.parametrize("inside", [".", "zero/out", "sub/out"])
def test_output_inside_the_input_refused(tmp_path, inside):
    """`import-deepspeed DS DS/zero/out` would write into the folder it reads: refused, as
    `convert` refuses an output inside a checkpoint; nothing is created."""
    folder, _ = build(tmp_path / "ds")
    before = sorted(p.relative_to(folder) for p in Path(folder).rglob("*"))
    with pytest.raises(ConfigError, match="lies inside the input"):
        import_(folder, os.path.join(folder, inside), progress=False)
    assert sorted(p.relative_to(folder) for p in Path(folder).rglob("*")) == before


def test_workers_capped_by_tensors_and_cpus(tmp_path, monkeypatch):
    """--workers 64 for a handful of tensors starts no more writers than tensors (nor CPUs)."""
    import multiprocessing

    from megatron_ucp.convert import writer

    cpus = len(os.sched_getaffinity(0))
    assert writer.worker_count(64, 15) == min(15, cpus) and writer.worker_count(1, 15) == 1
    assert writer.worker_count(64, 0) == 1
    started = []
    context = multiprocessing.get_context("fork")
    real_pool = type(context).Pool

    def pool(self, processes=None, *a, **k):
        started.append(processes)
        return real_pool(self, processes, *a, **k)
    monkeypatch.setattr(type(context), "Pool", pool)
    folder, _ = build(tmp_path / "ds")
    summary = import_(folder, str(tmp_path / "out"), progress=False, workers=64)
    assert all(n <= min(summary["tensors"], cpus) for n in started), (started, summary["tensors"])
