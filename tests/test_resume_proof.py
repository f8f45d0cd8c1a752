"""The resume proof (engine/proof.py): every checkpoint records what its state computes, every
load recomputes it on the new layout.

- in process: the layout math of the state digests (hypothesis), the comparison and its
  tolerances, the manifest's check of the record;
- the own loop (2 gloo processes): checkpoints whose bytes are intact (checksums redone) but
  whose meaning is wrong are refused at load with one line naming the values: two heads' key
  rows swapped, another iteration's moments, a tensor of another model; a sound one passes on
  another layout in fp32 and bf16 (the tolerance's margin asserted); one without a proof loads
  with a line; a local-tier copy that fails is set aside and the persistent tier serves;
- Megatron-LM's trainer through the plug-in: the same refusal (tests/test_megatron_lm.py's
  resumes all pass through the proof).
"""

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import meaning_faults as faults
from harness import BASE, losses, max_loss_delta, ok, run_steps, train_step
from megatron_ucp.engine import proof
from megatron_ucp.errors import FormatError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import Region

# ---------------------------------------------------------------------------------------------
# The digests' layout math, in process.


@st.composite
def _range_in_shape(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    stop = draw(st.integers(start, n))
    return shape, start, stop


@given(_range_in_shape())
@settings(max_examples=300, deadline=None)
def test_a_flat_range_is_the_sub_boxes_in_order(case):
    shape, start, stop = case
    boxes = proof.flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = []
    for offset, sub in boxes:
        for idx in np.ndindex(*sub):
            flat.append(int(np.ravel_multi_index(tuple(o + i for o, i in zip(offset, idx)), shape)))
    assert flat == list(range(start, stop))


def _direct_digest(name, part, x: np.ndarray) -> float:
    """sum x[i0, i1, ...] * w0[i0] * w1[i1] * ... element by element."""
    ws = [proof.pattern(name, part, d, n, "cpu").numpy() for d, n in enumerate(x.shape)]
    total = 0.0
    for idx in np.ndindex(*x.shape):
        total += float(x[idx]) * math.prod(w[i] for w, i in zip(ws, idx))
    return total


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_digests_of_any_split_sum_to_the_whole(data):
    """What makes the digest layout-free: boxes cut along any dimension (TP), each cut into flat
    ranges (distributed-optimizer fragments), contribute terms that sum to the whole tensor's."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    x = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal(shape).astype(np.float32)
    dim = data.draw(st.integers(0, len(shape) - 1))
    cut = data.draw(st.integers(0, shape[dim]))
    total = 0.0
    for lo, hi in ((0, cut), (cut, shape[dim])):
        if lo == hi:
            continue
        box = np.take(x, range(lo, hi), axis=dim)
        offset = tuple(lo if d == dim else 0 for d in range(len(shape)))
        flat = torch.from_numpy(np.ascontiguousarray(box).reshape(-1))
        split = data.draw(st.integers(0, flat.numel()))
        for start, stop in ((0, split), (split, flat.numel())):
            if start < stop:
                region = Region("", offset, box.shape, start, stop)
                total += proof.region_digest("t", shape, region, flat[start:stop])[0]
    whole = _direct_digest("t", "", x)
    # the innermost dimension contracts in fp32: its rounding is DIGEST_ROUNDING's share
    assert abs(total - whole) <= proof.DIGEST_ROUNDING * float(np.abs(x).sum())


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_a_box_digest_in_slices_is_the_direct_sum(data):
    """A CPU digest contracts a box in slices of a few rows (a row larger than a slice alone,
    as it is: no buffer of its size kept), bf16/fp16 widened into a reused buffer: any slicing,
    any offset in the part, any dtype, the digest is the element-by-element sum within
    DIGEST_ROUNDING of sum |x|, and its scale is that sum (the tolerance's, an upper bound of
    sum |x w|), boxes of other shapes and dtypes digested in between."""
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    offset = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    part = tuple(o + n + data.draw(st.integers(0, 2)) for o, n in zip(offset, shape))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    x = torch.from_numpy(np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal(shape)).to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(proof, "_CPU_CHUNK", data.draw(st.integers(1, 40)))
        other = torch.full((data.draw(st.integers(1, 50)),), 7.0, dtype=data.draw(st.sampled_from([dtype, torch.float32])))
        proof.box_digest("u", "", other.shape, (0,), other)  # leaves its values in the buffers
        digest, scale = proof.box_digest("t", "", part, offset, x)
    exact = x.double().numpy()
    ws = [proof.pattern("t", "", d, n, "cpu").numpy()[o:o + s] for d, (n, o, s) in enumerate(zip(part, offset, shape))]
    weights = ws[0]
    for w in ws[1:]:
        weights = np.multiply.outer(weights, w)
    assert abs(digest - float((exact * weights).sum())) <= proof.DIGEST_ROUNDING * float(np.abs(exact).sum())
    assert scale == pytest.approx(float(np.abs(exact).sum()), rel=1e-6)
    assert scale >= float(np.abs(exact * weights).sum()) * (1 - 1e-6)


def _record(losses=(2.0, 3.0), digests=None, dtype="float32", padded=256, state_dtypes=None):
    return {"version": 1, "probe": {"seed": proof.PROBE_SEED, "tokens": len(losses), "vocab_size": 250},
            "dtype": dtype, "device": "cpu/local", "padded_vocab_size": padded, "losses": list(losses),
            "state_dtypes": state_dtypes or {"param": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"},
            "digests": digests if digests is not None else {"w|param": [1.5, 4.0], "w|exp_avg": [0.25, 1.0],
                                                            "emb|padding|param": [0.5, 2.0]}}


def test_compare_passes_layout_noise_and_names_what_differs():
    saved = _record()
    assert proof.compare(saved, _record(losses=(2.0 + 3e-6, 3.0))) is None  # fp32 layout noise
    why = proof.compare(saved, _record(losses=(2.0, 3.01)))
    assert "probe token 1" in why and "3.0 saved" in why and "3.01 now" in why
    why = proof.compare(saved, _record(digests={"w|param": [1.5, 4.0], "w|exp_avg": [0.26, 1.0],
                                                "emb|padding|param": [0.5, 2.0]}))
    assert "'w' exp_avg" in why and "0.25 saved" in why
    # float64 rounding of another summation order passes; a state this load does not restore is skipped
    assert proof.compare(saved, _record(digests={"w|param": [1.5 + 1e-15, 4.0]})) is None


def test_bf16_noise_passes_within_the_wider_tolerance_and_a_fault_does_not():
    saved = _record(dtype="bfloat16")
    assert proof.compare(saved, _record(losses=(2.01, 3.0))) is None
    assert proof.compare(saved, _record(losses=(2.05, 3.0))) is not None
    gpu = dict(_record(dtype="bfloat16"), device="cuda/te")  # saved on GPUs with TE, loaded on CPU
    assert proof.compare(gpu, _record(losses=(2.05, 3.0))) is None
    # fp32 through another layer implementation on the same kind of device (import-hf's proof)
    hf = dict(_record(), device="cpu/hf")
    assert proof.compare(hf, _record(losses=(2.0 + 1e-6, 3.0))) is None
    assert proof.compare(hf, _record(losses=(2.004, 3.0))) is not None
    # moments kept in bf16 on one side: equal within bf16 rounding of the sum of |terms|
    bf16 = {"param": "float32", "exp_avg": "bfloat16", "exp_avg_sq": "float32"}
    assert proof.compare(saved, _record(digests={"w|exp_avg": [0.25 + 2e-3, 1.0]}, state_dtypes=bf16)) is None
    assert proof.compare(saved, _record(digests={"w|exp_avg": [0.25 + 2e-2, 1.0]}, state_dtypes=bf16)) is not None


def test_another_padding_skips_the_losses_and_the_padding_rows_only():
    saved = _record()
    other = _record(losses=(9.0, 9.0), padded=384, digests={"w|param": [1.5, 4.0], "emb|padding|param": [7.0, 9.0]})
    assert proof.compare(saved, other) is None
    assert proof.same_padding(saved, other) is False
    other["digests"]["w|param"] = [1.6, 4.0]
    assert "'w' param" in proof.compare(saved, other)


@pytest.mark.parametrize("edit, words", [
    (lambda p: p.update(losses=[1.0]), "'proof.losses'"),
    (lambda p: p.update(losses=[1.0, float("nan")]), "'proof.losses'"),
    (lambda p: p["probe"].update(tokens=10 ** 9), "'proof.probe.tokens'"),
    (lambda p: p.update(digests={"w|param": ["x", 1.0]}), "'proof.digests'"),
    (lambda p: p.update(digests=[1, 2]), "'proof.digests'"),
    (lambda p: p.update(version=7), "'proof.version'"),
    (lambda p: p.pop("padded_vocab_size"), "'proof' lacks 'padded_vocab_size'"),
])
def test_a_bad_proof_record_is_one_line_naming_its_key(edit, words):
    record = _record()
    edit(record)
    with pytest.raises(FormatError) as e:
        mf.check_proof(record, "X/ucp.json")
    assert words in str(e.value) and str(e.value).startswith("X/ucp.json: ")


def test_the_probe_is_fixed_by_the_vocabulary_alone():
    a, b = proof.Probe(32, 307).ids(), proof.Probe(32, 307).ids()
    assert torch.equal(a, b) and int(a.max()) < 307
    assert not torch.equal(proof.Probe(32, 308).ids(), a)
    assert proof.probe_length(4096, 8) == proof.MAX_PROBE_TOKENS and proof.probe_length(30, 4) == 28


# ---------------------------------------------------------------------------------------------
# The own loop: meaning faults with intact bytes, refused at load.

N, K = 8, 6
PROOF_BASE = ["--vocab-size", "307", "--make-vocab-size-divisible-by", "128"]  # 384 at TP1, 512 at TP2
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]


def _proved(result: dict) -> float:
    """The max |delta| of the probe's losses the load printed (it passed)."""
    found = re.search(r"resume proof passed: \d+ probe tokens within (\S+) of the saved losses", result["stdout"])
    assert found, result["stdout"][-3000:]
    return float(found.group(1))


def _refusals(result: dict) -> list:
    assert "raised" in result, f"loaded without a word: {result}"
    return result["raised"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """TP2 fp32 saves at K (and 3), another model (seed 8) at K, a bf16 run at K; the faults
    applied to copies."""
    work = tmp_path_factory.mktemp("proof")
    steps = [
        train_step("ref", PROOF_BASE + TP2, iters=N, save=str(work / "a"), interval=3),
        train_step("other", PROOF_BASE + TP2 + ["--seed", "8"], iters=K, save=str(work / "b"), interval=K),
        train_step("bf16", PROOF_BASE + TP2 + ["--bf16"], iters=N, save=str(work / "bf16"), interval=K),
        # an async save digests what it writes in the background, row merges of the distributed
        # optimizer included
        train_step("async", PROOF_BASE + TP2 + DIST + ["--async-save"], iters=K, save=str(work / "async"),
                   interval=K),
        dict(train_step("torch_dist", PROOF_BASE + TP2 + DIST, iters=K, save=str(work / "td"), interval=K),
             argv=BASE + PROOF_BASE + TP2 + DIST + ["--train-iters", str(K), "--save", str(work / "td"),
                                                    "--save-interval", str(K), "--ckpt-format", "torch_dist"]),
        dict(train_step("legacy", PROOF_BASE + TP2, iters=K, save=str(work / "lg"), interval=K),
             argv=BASE + PROOF_BASE + TP2 + ["--train-iters", str(K), "--save", str(work / "lg"),
                                             "--save-interval", str(K), "--ckpt-format", "torch"]),
    ]
    results = run_steps(2, steps, work / "runs")
    for name in ("ref", "other", "bf16", "async", "torch_dist", "legacy"):
        ok(results, name)
    # the streaming converter records the proof of megatron's own one-process load of the source
    from megatron_ucp.convert.to_universal import convert

    summary = convert(str(work / "td"), str(work / "converted"), iteration=K, progress=False)
    shutil.copytree(work / "converted", work / "misconverted")
    layer = "decoder.layers.{}.mlp.linear_fc1.weight"  # a mapping that mixes up two layers
    first, second = (faults.read_state(work / "misconverted" / f"iter_{K:07d}", layer.format(i)) for i in (0, 1))
    faults.write_state(work / "misconverted" / f"iter_{K:07d}", layer.format(0), "param", second)
    faults.write_state(work / "misconverted" / f"iter_{K:07d}", layer.format(1), "param", first)
    results["convert"] = summary
    # legacy: megatron's load in processes of the source's layout (TP2 here)
    results["convert_legacy"] = convert(str(work / "lg"), str(work / "lg_converted"), iteration=K, progress=False)
    it = f"iter_{K:07d}"
    for fault in ("swap", "moments", "tensor", "unproved"):
        shutil.copytree(work / "a", work / fault)
    faults.swap_key_rows(work / "swap" / it, layer=1, heads=4)
    faults.moments_from(work / "moments" / it, work / "a" / "iter_0000003")
    faults.tensor_from(work / "tensor" / it, work / "b" / it, "decoder.layers.2.mlp.linear_fc2.weight")
    manifest = work / "unproved" / it / "ucp.json"
    m = json.loads(manifest.read_text())
    del m["proof"]
    manifest.write_text(json.dumps(m))
    return work, results


def _load(name, folder, extra):
    argv = BASE + PROOF_BASE + extra + ["--train-iters", str(N), "--load", str(folder), "--ckpt-step", str(K)]
    return {"name": name, "op": "load_expecting_error", "fatal": False, "argv": argv}


@pytest.fixture(scope="module")
def resumed(saved):
    work, _ = saved
    steps = [_load(f, work / f, PP2) for f in ("swap", "moments", "tensor")]
    steps.append(dict(_load("swap_unchecked", work / "swap", PP2 + ["--no-resume-proof"])))
    steps += [train_step("pp2", PROOF_BASE + PP2, iters=N, load=str(work / "a"), step=K),
              train_step("dp2_dist", PROOF_BASE + DIST, iters=N, load=str(work / "a"), step=K),
              train_step("async_pp2", PROOF_BASE + PP2, iters=K + 1, load=str(work / "async"), step=K),
              train_step("unproved", PROOF_BASE + PP2, iters=N, load=str(work / "unproved"), step=K),
              train_step("bf16_dp2_dist", PROOF_BASE + DIST + ["--bf16"], iters=N, load=str(work / "bf16"), step=K),
              train_step("converted_pp2", PROOF_BASE + PP2, iters=K + 1, load=str(work / "converted"), step=K),
              _load("misconverted", work / "misconverted", PP2),
              train_step("legacy_converted_pp2", PROOF_BASE + PP2, iters=K + 1, load=str(work / "lg_converted"),
                         step=K)]
    return run_steps(2, steps, work / "resumes")


@pytest.mark.parametrize("fault, words", [
    ("swap", ["decoder.layers.1.self_attention.linear_qkv.weight' param", "saved", "now"]),
    ("moments", ["exp_avg", "digest", "saved", "now"]),
    ("tensor", ["decoder.layers.2.mlp.linear_fc2.weight' param"]),
])
def test_intact_bytes_of_a_wrong_state_are_refused_by_the_proof(resumed, saved, fault, words):
    messages = _refusals(ok(resumed, fault))
    assert len(set(messages)) == 1, messages  # the same line on every rank
    line = messages[0]
    assert "ResumeProofError" in line and f"{fault}/iter_{K:07d}" in line and "persistent tier" in line
    assert "\n" not in line and "--no-resume-proof" in line
    for w in words:
        assert w in line, line


def test_no_resume_proof_loads_it_anyway(resumed):
    assert ok(resumed, "swap_unchecked")["loaded"] == K


def test_a_sound_checkpoint_passes_on_other_layouts_with_margin(resumed, saved):
    _, results = saved
    reference = losses(results, "ref")
    for name in ("pp2", "dp2_dist"):
        delta = _proved(ok(resumed, name))
        # fp32 layout noise measured 4.8e-7: the tolerance keeps a margin of 100x
        assert delta * 100 <= proof.TOLERANCE["float32"], (name, delta)
        assert max_loss_delta(reference, losses(resumed, name)) < 1e-4


def test_the_digests_of_an_async_save_are_those_of_its_state(resumed, saved):
    """The save digests what each rank writes as it writes it (in the background here): the
    sum is the state's, as the load on another layout computes it from what it holds."""
    work, _ = saved
    delta = _proved(ok(resumed, "async_pp2"))
    assert delta * 100 <= proof.TOLERANCE["float32"], delta
    record = json.loads((work / "async" / f"iter_{K:07d}" / "ucp.json").read_text())["proof"]
    sync = json.loads((work / "a" / f"iter_{K:07d}" / "ucp.json").read_text())["proof"]
    assert sorted(record["digests"]) == sorted(sync["digests"])  # every state of every tensor, once
    assert record["state_dtypes"] == sync["state_dtypes"] == {s: "float32" for s in ("param", "exp_avg", "exp_avg_sq")}


def test_bf16_passes_within_its_tolerance_with_margin(resumed):
    delta = _proved(ok(resumed, "bf16_dp2_dist"))
    # bf16 layout noise measured 1.8e-3: a margin of 5x at least (11x measured)
    assert delta * 5 <= proof.TOLERANCE["reduced"], delta


def test_a_checkpoint_without_a_proof_loads_with_one_line(resumed, saved):
    work, results = saved
    r = ok(resumed, "unproved")
    assert f"iter_{K:07d} holds no resume proof" in r["stdout"]
    assert max_loss_delta(losses(results, "ref"), losses(resumed, "unproved")) < 1e-4


def test_a_converted_checkpoint_carries_the_proof_of_its_source(saved, resumed):
    """The streamed torch_dist and legacy conversions record what megatron's own load of the
    source computes; the converted checkpoint passes it on another layout, and a conversion that mixed
    up two layers' weights is refused at its first resume."""
    _, results = saved
    assert results["convert"]["proof"].startswith("resume proof recorded from megatron's own load"), results["convert"]
    assert _proved(ok(resumed, "converted_pp2")) <= proof.TOLERANCE["float32"]
    assert results["convert_legacy"]["proof"].startswith("resume proof recorded"), results["convert_legacy"]
    assert _proved(ok(resumed, "legacy_converted_pp2")) <= proof.TOLERANCE["float32"]
    line = _refusals(ok(resumed, "misconverted"))[0]
    assert "decoder.layers.0.mlp.linear_fc1.weight' param" in line and "fails its resume proof" in line


def _inspect(*args):
    import subprocess
    import sys

    from harness import REPO

    return subprocess.run([sys.executable, "-m", "megatron_ucp", "inspect", *map(str, args)], capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def test_inspect_shows_the_proof_and_prove_recomputes_it_in_one_process(saved):
    work, _ = saved
    shown = _inspect(work / "a")
    assert shown.returncode == 0 and "proof        16 probe tokens of vocab 307 (padded 512)" in shown.stdout
    good = _inspect(work / "a", "--verify", "--prove")
    assert good.returncode == 0 and "resume proof passed" in good.stdout, good.stdout + good.stderr
    bad = _inspect(work / "swap" / f"iter_{K:07d}", "--verify", "--prove")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED: 1 problem" in bad.stdout and "linear_qkv.weight' param" in bad.stdout
    unproved = _inspect(work / "unproved" / f"iter_{K:07d}", "--verify", "--prove")
    assert unproved.returncode == 1 and "no resume proof to check" in unproved.stdout
    assert "proof        none recorded" in unproved.stdout
