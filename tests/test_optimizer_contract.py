"""The GPU optimizer's state contract, proved on CPU: FusedAdam (step in the param groups, lazy
state), the precision-aware optimizer (bf16 moments behind get/set accessors), fp16's loss scaler.

The fused-Adam runs use megatron_ucp/mcore/fused_adam_standin.py, put where megatron-core puts
transformer-engine's FusedAdam. Its arithmetic is torch's AdamW, so its losses are compared with
torch's, bit for bit on one layout and within TOL across layouts.
"""

import json
import shutil
from pathlib import Path

import pytest

from harness import assert_same_state, atomic_tensors, losses, max_loss_delta, ok, roundtrip_step, run_steps, train_step

N, K = 10, 5
TOL = 1e-4  # fp32: what the resume matrix holds every layout change to
# bf16 weights: TP splits round matmuls differently (as in test_resume_matrix.BF16_TOL). The same
# bound holds for moving between bf16 and fp32 moments: the checkpoint's moments are exact in
# both, and the runs then differ only by rounding each later moment update to bf16 (a relative
# 2^-8 of an update that is itself lr-sized). Measured: 0.7-2.7e-4 (2026-12-04, CI machine).
BF16_TOL = 1e-3
# fp16 weights and activations (10 mantissa bits): TP changes the summation order of every matmul.
FP16_TOL = 1e-3

F = ["--fused-adam-standin"]
DIST = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
BF16 = ["--bf16"]
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
# A loss scale that grows every 2 iterations (from 1024, far from overflowing these gradients:
# a scale that settles at the overflow edge makes a skipped step depend on rounding, i.e. on TP).
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2"]


def train(name, extra, **kw):
    return train_step(name, extra, iters=N, **kw)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optimizer_contract")


@pytest.fixture(scope="module")
def w2(work):
    d = lambda name: str(work / name)  # noqa: E731
    steps = [
        # fp32, fused Adam: DP2 (distributed optimizer) -> TP2, -> PP2; TP2 -> PP2 (distributed), -> DP2.
        train("torch_dp2", DIST),
        train("f_dp2", F + DIST, save=d("FA"), interval=K),
        train("f_dp2_same", F + DIST, load=d("FA"), step=K),
        train("f_dp2_tp2", F + TP2, load=d("FA"), step=K),
        train("f_dp2_pp2", F + PP2 + DIST, load=d("FA"), step=K),
        train("f_tp2", F + TP2, save=d("FB"), interval=K),
        train("f_tp2_pp2", F + PP2 + DIST, load=d("FB"), step=K),
        train("f_tp2_dp2", F, load=d("FB"), step=K),
        roundtrip_step("r_f_tp2", F + TP2, d("FA"), K, d("R_FA")),
        # Across optimizers: torch's Adam -> fused, and fused -> torch's Adam.
        train("torch_tp2", TP2, save=d("TB"), interval=K),
        train("torch_to_f_dp2", F + DIST, load=d("TB"), step=K),
        train("f_to_torch_pp2", PP2 + DIST, load=d("FA"), step=K),
        # bf16 weights, fused Adam with fp32 moments: same layout, and TP2 -> DP2.
        train("fb_tp2", F + BF16 + TP2 + DIST, save=d("FBF"), interval=K),
        train("fb_tp2_same", F + BF16 + TP2 + DIST, load=d("FBF"), step=K),
        train("fb_tp2_dp2", F + BF16 + DIST, load=d("FBF"), step=K),
        # The precision-aware optimizer: bf16 moments (and fp32 masters) inside the fused Adam.
        train("p_dp2", F + BF16 + DIST + BF16_MOMENTS, save=d("P"), interval=K),
        train("p_dp2_same", F + BF16 + DIST + BF16_MOMENTS, load=d("P"), step=K),
        train("p_dp2_tp2", F + BF16 + TP2 + DIST + BF16_MOMENTS, load=d("P"), step=K),
        train("p_to_fp32_moments", F + BF16 + DIST, load=d("P"), step=K),  # bf16 -> fp32 moments
        train("fp32_to_p_moments", F + BF16 + TP2 + DIST + BF16_MOMENTS, load=d("FBF"), step=K),
        roundtrip_step("r_p_tp2", F + BF16 + TP2 + DIST + BF16_MOMENTS, d("P"), K, d("R_P")),
        # fp16 with megatron's dynamic loss scaler (torch's Adam and fused), to another layout.
        train("h_dp2", FP16 + DIST, save=d("H"), interval=K),
        train("h_dp2_tp2", FP16 + TP2, load=d("H"), step=K),
        roundtrip_step("r_h_tp2", FP16 + TP2, d("H"), K, d("R_H")),
        train("hf_tp2", F + FP16 + TP2 + DIST, save=d("HF"), interval=K),
        train("hf_tp2_dp2", F + FP16 + DIST, load=d("HF"), step=K),
        # MoE: a dense and an expert fused Adam chained, EP2 -> EP1.
        train("m_f_ep2", F + MOE + DIST + ["--expert-model-parallel-size", "2"], save=d("FM"), interval=K),
        train("m_f_ep1", F + MOE + DIST, load=d("FM"), step=K),
    ]
    return run_steps(2, steps, work / "w2")


@pytest.fixture(scope="module")
def w2n(work):
    """The same fused-Adam runs saved in megatron's own formats (a group of their own: the
    torch_dist writer leaves threads behind)."""
    d = lambda name: str(work / name)  # noqa: E731
    native = ["--ckpt-format", "torch_dist"]
    legacy = ["--ckpt-format", "torch"]
    return run_steps(2, [
        train("fn_dp2", F + DIST + native, save=d("NF"), interval=K),
        train("fn_dp2_resume", F + DIST + native, load=d("NF"), step=K, universal=False),
        train("fl_tp2", F + TP2 + legacy, save=d("LF"), interval=K),
        train("fl_dp2", F + DIST + legacy, save=d("LFD"), interval=K),
    ], work / "w2n")


def _after(history: dict) -> dict:
    return {i: v for i, v in history.items() if i > K}


def test_the_standin_computes_what_torch_adamw_computes(w2):
    assert losses(w2, "f_dp2") == losses(w2, "torch_dp2")


@pytest.mark.parametrize("reference,resumed", [("f_dp2", "f_dp2_same"), ("fb_tp2", "fb_tp2_same"),
                                               ("p_dp2", "p_dp2_same")])
def test_fused_adam_resumes_bitwise_on_its_layout(w2, reference, resumed):
    assert losses(w2, resumed) == _after(losses(w2, reference))


@pytest.mark.parametrize("reference,resumed,tol", [
    ("f_dp2", "f_dp2_tp2", TOL), ("f_dp2", "f_dp2_pp2", TOL), ("f_tp2", "f_tp2_pp2", TOL),
    ("f_tp2", "f_tp2_dp2", TOL),
    ("torch_tp2", "torch_to_f_dp2", TOL), ("f_dp2", "f_to_torch_pp2", TOL),  # across optimizers
    ("fb_tp2", "fb_tp2_dp2", BF16_TOL), ("p_dp2", "p_dp2_tp2", BF16_TOL),
    ("p_dp2", "p_to_fp32_moments", BF16_TOL), ("fb_tp2", "fp32_to_p_moments", BF16_TOL),
    ("h_dp2", "h_dp2_tp2", FP16_TOL), ("hf_tp2", "hf_tp2_dp2", FP16_TOL), ("m_f_ep2", "m_f_ep1", TOL),
])
def test_fused_adam_resumes_on_another_layout(w2, reference, resumed, tol):
    assert sorted(losses(w2, resumed)) == list(range(K + 1, N + 1))
    assert max_loss_delta(losses(w2, reference), losses(w2, resumed)) <= tol


def _manifest(work, name, it=K) -> dict:
    return json.loads((work / name / f"iter_{it:07d}" / "ucp.json").read_text())


def test_the_step_in_the_param_groups_is_saved(w2, work):
    ok(w2, "f_dp2")
    assert _manifest(work, "FA")["optimizer"]["step"] == K
    assert _manifest(work, "P")["optimizer"]["step"] == K
    assert all("step" not in g for g in _manifest(work, "FA")["optimizer"]["param_groups"])


@pytest.mark.parametrize("step,source,result", [("r_f_tp2", "FA", "R_FA"), ("r_p_tp2", "P", "R_P")])
def test_state_after_a_fused_adam_load_is_bitwise_equal(w2, work, step, source, result):
    """Loaded into another layout and saved again: the same atomic tensors. For bf16 moments
    this holds because the files keep fp32 values, which bf16 moments convert exactly."""
    ok(w2, step)
    assert_same_state(work / source / f"iter_{K:07d}", work / result / f"iter_{K:07d}")


def test_bf16_moments_are_saved_as_fp32_values(w2, work):
    import numpy as np
    import torch

    ok(w2, "p_dp2")
    tensors = atomic_tensors(work / "P" / f"iter_{K:07d}")
    moments = [a for (_, entry), a in tensors.items() if entry in ("exp_avg", "exp_avg_sq")]
    assert moments and all(a.dtype == np.float32 for a in moments)
    assert any(np.abs(a).max() > 0 for a in moments)
    for a in moments:  # bf16 values, unscaled, in fp32
        assert (torch.from_numpy(a.copy()).bfloat16().float().numpy() == a).all()


def test_the_loss_scaler_state_moves_with_the_checkpoint(w2, work):
    ok(w2, "r_h_tp2")
    saved = _manifest(work, "H")["optimizer"]["grad_scaler"]
    assert saved == {"scale": 4096.0, "growth_tracker": 1, "hysteresis_tracker": 2}  # 1024 x 2 x 2
    assert _manifest(work, "R_H")["optimizer"]["grad_scaler"] == saved  # not 1024, 0: restored
    assert _manifest(work, "HF")["optimizer"]["grad_scaler"] == saved


def test_megatron_resumes_its_own_format_with_fused_adam(w2n):
    assert losses(w2n, "fn_dp2_resume") == _after(losses(w2n, "fn_dp2"))


@pytest.mark.parametrize("run,source,direct", [("fn_dp2", "NF", "FA"), ("fl_tp2", "LF", "FB"),
                                               ("fl_dp2", "LFD", "FA")])
def test_fused_adam_checkpoints_in_megatrons_formats_convert_exactly(w2, w2n, work, run, source, direct):
    """torch_dist (distributed optimizer) and legacy torch (with and without) checkpoints of a
    fused-Adam run: the step from the param groups, the same state as the direct save."""
    from megatron_ucp.convert.to_universal import convert

    ok(w2n, run), ok(w2, "f_dp2"), ok(w2, "f_tp2")
    assert losses(w2n, run) == losses(w2, {"FA": "f_dp2", "FB": "f_tp2"}[direct])
    # bitwise against the direct save below; the proof of megatron's own load of the source (a
    # megatron process group each) is tests/test_resume_proof.py's subject
    convert(str(work / source), str(work / f"C{source}"), iteration=K, progress=False, prove=False)
    assert _manifest(work, f"C{source}")["optimizer"]["step"] == K
    assert_same_state(work / direct / f"iter_{K:07d}", work / f"C{source}" / f"iter_{K:07d}")


def _edited_copy(work, source, name, edit) -> str:
    copy = work / name
    shutil.copytree(work / source, copy, dirs_exist_ok=True)
    path = copy / f"iter_{K:07d}" / "ucp.json"
    manifest = json.loads(path.read_text())
    edit(manifest["optimizer"])
    path.write_text(json.dumps(manifest))
    return str(copy)


@pytest.fixture(scope="module")
def broken(w2, work):
    """A resume from what the old save wrote for a fused Adam: step 0 (it read only
    per-parameter state)."""
    ok(w2, "f_dp2")
    step0 = _edited_copy(work, "FA", "FA_step0", lambda o: o.update(step=0))
    return run_steps(2, [train("f_step0_tp2", F + TP2, load=step0, step=K)], work / "broken")


def test_a_checkpoint_that_says_step_0_leaves_the_curve(w2, broken):
    """Adam's bias correction restarts at step 1: the matrix above would fail."""
    assert max_loss_delta(losses(w2, "f_dp2"), losses(broken, "f_step0_tp2")) > 100 * TOL
