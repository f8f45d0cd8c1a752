"""Universal checkpoints inside Megatron-LM's own trainer (megatron_ucp.megatron_lm): an unchanged
Megatron-LM-style script (examples/megatron_lm/pretrain_gpt.py) trains through the plug-in, saves
universal checkpoints at the trainer's own save points and resumes them on other layouts with
the uninterrupted run's losses (fp32, dropout 0). Needs megatron-core >= 0.17 (mlm_harness)."""

import json
import os

import pytest

from mlm_harness import max_delta, run, trainer_python

N, K = 10, 4  # the reference trains to N, saving every K (iterations 4 and 8, then the final 10)
TOL = 1e-4
UNIVERSAL = ["--ckpt-format", "universal"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def python():
    return trainer_python()


@pytest.fixture(scope="module")
def reference(python, tmp_path_factory):
    """TP2, universal checkpoints written in the background (--async-save) every K iterations."""
    work = tmp_path_factory.mktemp("reference")
    r = run(python, work / "run", 2, TP2 + UNIVERSAL + ["--async-save", "--save", str(work / "ckpt"),
                                                        "--save-interval", str(K)], N).check()
    return {"losses": r.losses(), "ckpt": work / "ckpt", "output": r.output}


def resume(python, reference, tmp_path, nproc, layout, extra=()):
    r = run(python, tmp_path, nproc, layout + UNIVERSAL + ["--load", str(reference["ckpt"]),
                                                          "--ckpt-step", str(K)] + list(extra), N).check()
    return r


def test_reference_saves_universal_checkpoints_at_the_trainers_save_points(reference):
    ckpt = reference["ckpt"]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    manifest = json.loads((ckpt / "iter_0000004" / "ucp.json").read_text())
    assert manifest["layout"]["tensor_model_parallel_size"] == 2
    assert manifest["consumed_samples"] == K * 8
    assert manifest["progress"]["num_floating_point_operations_so_far"] > 0
    assert sorted(reference["losses"]) == list(range(1, N + 1))


@pytest.mark.parametrize("name,nproc,layout", [
    ("pp2", 2, PP2),
    ("dp2_dist", 2, DIST),  # 2 processes, no TP: data-parallel 2
    ("tp2pp2", 4, TP2 + PP2),
])
def test_resume_on_another_layout(python, reference, tmp_path, name, nproc, layout):
    r = resume(python, reference, tmp_path, nproc, layout)
    assert f"successfully loaded universal checkpoint from {reference['ckpt']} at iteration {K}" in r.output
    delta = max_delta(reference["losses"], r.losses(), range(K + 1, N + 1))
    assert min(r.losses()) == K + 1, "the resumed run starts after the checkpoint's iteration"
    assert delta <= TOL, f"{name}: max |dloss| {delta:.3g}"


def test_resume_with_another_padded_vocabulary(python, reference, tmp_path):
    """--make-vocab-size-divisible-by 100 pads 250 to 300; the checkpoint's 256 rows are kept
    (padding rows take part in the softmax) and the loss continues."""
    r = resume(python, reference, tmp_path, 2, PP2, ["--make-vocab-size-divisible-by", "100"])
    assert "keeping the checkpoint's padded vocabulary of 256 rows (instead of 300)" in r.output
    assert max_delta(reference["losses"], r.losses(), range(K + 1, N + 1)) <= TOL


def test_sigterm_with_exit_signal_handler_saves_and_resumes(python, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    cut = run(python, tmp_path / "cut", 2, TP2 + UNIVERSAL + ["--exit-signal-handler", "--save", str(ckpt),
                                                              "--save-interval", "1000"], N,
              kill_after_iteration=3)
    assert "exiting program after receiving SIGTERM" in cut.output, cut.output[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < N and f"successfully saved universal checkpoint from iteration {saved:7d}" in cut.output
    # --use-checkpoint-args: the model's shape from the checkpoint, over the command line's.
    r = run(python, tmp_path / "resume", 2, PP2 + UNIVERSAL + ["--load", str(ckpt), "--use-checkpoint-args",
                                                               "--hidden-size", "64"], N).check()
    assert "--use-checkpoint-args: --hidden-size 32 from the checkpoint (was 64)" in r.output
    assert min(r.losses()) == saved + 1
    assert max_delta(reference["losses"], r.losses(), range(saved + 1, N + 1)) <= TOL


def test_finetune_loads_the_weights_and_starts_over(python, reference, tmp_path):
    """--finetune: the weights only, iteration 0 and no consumed samples, on any layout: the
    saving layout and another train alike from the loaded weights."""
    same = resume(python, reference, tmp_path / "tp2", 2, TP2, ["--finetune"])
    other = resume(python, reference, tmp_path / "pp2", 2, PP2, ["--finetune"])
    assert sorted(same.losses()) == sorted(other.losses()) == list(range(1, N + 1))
    assert max_delta(same.losses(), other.losses(), range(1, N + 1)) <= TOL
    # The loaded weights, not fresh ones: the first loss is that of a model trained K iterations.
    assert same.losses()[1] < reference["losses"][1] - 0.05


def test_a_torch_dist_job_switches_to_universal(python, reference, tmp_path):
    """A job on Megatron-LM's own torch_dist checkpoints (distributed optimizer) continues with
    --ckpt-format universal: its next checkpoint is universal and resumes on another layout."""
    ckpt = tmp_path / "ckpt"
    # --exit-interval: the same --train-iters throughout (megatron's scheduler checks it on load).
    run(python, tmp_path / "a", 2, TP2 + DIST + ["--ckpt-format", "torch_dist", "--save", str(ckpt),
                                                     "--save-interval", str(K), "--exit-interval", str(K)], N).check()
    b = run(python, tmp_path / "b", 2, TP2 + DIST + UNIVERSAL + ["--load", str(ckpt), "--save", str(ckpt),
                                                          "--save-interval", str(K),
                                                          "--exit-interval", str(2 * K)], N).check()
    assert (ckpt / f"iter_{2 * K:07d}" / "ucp.json").exists()
    assert not (ckpt / f"iter_{K:07d}" / "ucp.json").exists()
    c = run(python, tmp_path / "c", 2, PP2 + UNIVERSAL + ["--load", str(ckpt)], N).check()
    losses = {**b.losses(), **c.losses()}
    assert max_delta(reference["losses"], losses, range(K + 1, N + 1)) <= TOL


def test_moe_resumes_from_ep2_on_ep1(python, tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = run(python, tmp_path / "ref", 2, MOE + ["--expert-model-parallel-size", "2"] + UNIVERSAL
              + ["--save", str(ckpt), "--save-interval", str(K)], N).check()
    r = run(python, tmp_path / "ep1", 2, MOE + DIST + UNIVERSAL + ["--load", str(ckpt),
                                                                      "--ckpt-step", str(K)], N).check()
    assert max_delta(ref.losses(), r.losses(), range(K + 1, N + 1)) <= TOL


# -- the project's own loop (megatron-core 0.16.1) and Megatron-LM's trainer share checkpoints --

# The same model, optimizer and data in both: megatron-core's GPTDataset over a small corpus
# (test_megatron_data.write_corpus). The own loop's NullTokenizer takes the tokens' count and
# adds EOD (--vocab-size 250: 251 entries); Megatron-LM 0.19's takes the entries (251).
SHARED = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--make-vocab-size-divisible-by", "32",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--weight-decay", "0.01", "--clip-grad", "1.0",
          "--split", "90,5,5", "--tokenizer-type", "NullTokenizer"]


@pytest.fixture(scope="module")
def own_loop_python():
    """An interpreter with megatron-core 0.16 (the project's own loop's release)."""
    import subprocess
    import sys

    from harness import REPO

    code = "from megatron_ucp.mcore.compat import core_version; print(core_version() < (0, 17))"
    for python in [sys.executable] + [p for p in [os.environ.get("UCP_OTHER_PYTHON")] if p]:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if proc.returncode == 0 and proc.stdout.strip().endswith("True"):
            return python
    if os.environ.get("UCP_REQUIRE_OTHER") == "1":
        pytest.fail("UCP_REQUIRE_OTHER=1 but no megatron-core 0.16 interpreter for the own loop")
    pytest.skip("no megatron-core 0.16 interpreter (the project's own loop)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_megatron_data import RANGES, write_corpus

    root = tmp_path_factory.mktemp("corpus")
    for seed, (name, low) in enumerate(RANGES.items()):
        write_corpus(root / name, seed, low)
    return ["--data-path", "0.5", str(root / "A"), "0.5", str(root / "B")]


def own_loop(python, workdir, extra, iters, save=None, load=None, step=None):
    from harness import losses, run_steps, train_step

    argv = ["--cpu"] + SHARED + ["--vocab-size", "250"] + extra
    step_ = train_step("run", argv, iters=iters, save=save, interval=K, load=load, step=step)
    step_["argv"] = [a for a in step_["argv"] if a not in ("--mock-data",)]
    return losses(run_steps(2, [step_], workdir, python=python), "run")


# --eval-iters 1: megatron's sampler refuses the empty validation split that 0 would give.
TRAINER_ONLY = ["--eval-iters", "1", "--eval-interval", "1000", "--transformer-impl", "local",
                "--log-interval", "1", "--num-workers", "0",
                "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]


def test_own_loop_checkpoint_resumes_in_megatron_lm_and_back(python, own_loop_python, corpus, tmp_path):
    """Saved by the own loop (0.16.1, TP2) -> resumed by Megatron-LM's trainer (0.19.2, PP2); saved
    by the trainer (TP2) -> resumed by the own loop (PP2); each within TOL of its uninterrupted run."""
    own_ckpt, mlm_ckpt = tmp_path / "own_ckpt", tmp_path / "mlm_ckpt"
    own_ref = own_loop(own_loop_python, tmp_path / "own_ref", TP2 + corpus, N, save=str(own_ckpt))
    in_mlm = run(python, tmp_path / "in_mlm", 2, PP2 + corpus + UNIVERSAL
                 + ["--load", str(own_ckpt), "--ckpt-step", str(K)], N,
                 base=SHARED + ["--vocab-size", "251"] + TRAINER_ONLY).check()
    assert max_delta(own_ref, in_mlm.losses(), range(K + 1, N + 1)) <= TOL

    mlm_ref = run(python, tmp_path / "mlm_ref", 2, TP2 + corpus + UNIVERSAL
                  + ["--save", str(mlm_ckpt), "--save-interval", str(K)], N,
                  base=SHARED + ["--vocab-size", "251"] + TRAINER_ONLY).check()
    in_own = own_loop(own_loop_python, tmp_path / "in_own", PP2 + corpus, N, load=str(mlm_ckpt), step=K)
    assert max_delta(mlm_ref.losses(), in_own, range(K + 1, N + 1)) <= TOL
