"""Universal checkpoints inside Megatron-LM's own trainer: `pretrain_gpt_ucp.py` on megatron-core
>= 0.17 (Megatron-LM's trainer, the plug-in, the project's GPT script), and an unchanged script
through `python -m megatron_ucp.megatron_lm`. Runs save universal checkpoints at the trainer's own
save points and resume them on other layouts (TP, PP, VPP, DP with the distributed optimizer, SP,
EP and expert TP, uneven pipelines, MLA, another padded vocabulary, --elastic after a lost
node) with the uninterrupted run's losses (fp32, dropout 0); Megatron-LM features the own loop
never had (activation recomputation, EOD masking with reset position ids on GPTDataset, warmup and
--override-opt_param-scheduler) survive a resume on another layout. Needs megatron-core >= 0.17
(mlm_harness)."""

import json
import math
import os
import re
import shutil

import pytest

from mlm_harness import BASE, max_delta, run, trainer_python

N, K = 10, 4  # the reference trains to N, saving every K (iterations 4 and 8, then the final 10)
TOL = 1e-4
UNIVERSAL = ["--ckpt-format", "universal"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
SP = ["--sequence-parallel"]
DIST = ["--use-distributed-optimizer"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1"]
# alltoall, the common dispatcher (issue 49: it failed on CPU); experts with biases below
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]
# MLA with compressed queries, key heads of 8 + 4 rotary channels and value heads of 6.
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--qk-layernorm", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]


@pytest.fixture(scope="module")
def python():
    return trainer_python()


@pytest.fixture(scope="module")
def reference(python, tmp_path_factory):
    """TP2, universal checkpoints written in the background (--async-save) every K iterations."""
    work = tmp_path_factory.mktemp("reference")
    r = run(python, work / "run", 2, TP2 + UNIVERSAL + ["--async-save", "--save", str(work / "ckpt"),
                                                        "--save-interval", str(K)], N, as_script=True).check()
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


# PP2 alone: test_resume_with_another_padded_vocabulary; DP2 with the distributed optimizer alone:
# the elastic test's TP2 x DP2.
@pytest.mark.parametrize("name,nproc,layout", [
    ("tp2_sp_pp2", 4, TP2 + SP + PP2),
    ("pp2_vpp_dp2_dist", 4, PP2 + VPP + DIST),  # interleaved: 2 virtual stages of 1 layer per stage
    ("pp2_uneven", 2, PP2 + UNEVEN),  # 1 layer on the first stage, 3 on the last
])
def test_resume_on_another_layout(python, reference, tmp_path, name, nproc, layout):
    r = resume(python, reference, tmp_path, nproc, layout)
    assert f"successfully loaded universal checkpoint from {reference['ckpt']} at iteration {K}" in r.output
    delta = max_delta(reference["losses"], r.losses(), range(K + 1, N + 1))
    assert min(r.losses()) == K + 1, "the resumed run starts after the checkpoint's iteration"
    assert delta <= TOL, f"{name}: max |dloss| {delta:.3g}"
    assert "resume proof passed" in r.output  # the probe recomputed on this layout (engine/proof.py)


def test_a_wrong_state_with_intact_checksums_is_refused_by_the_resume_proof(python, reference, tmp_path):
    """Two heads' key rows swapped in the fp32 master weight, the file's checksums redone: the
    load stops before the first step with one line naming the checkpoint, the tensor and the
    values (tests/test_resume_proof.py: more faults, on the own loop)."""
    import meaning_faults

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"] / f"iter_{K:07d}", ckpt / f"iter_{K:07d}")
    meaning_faults.swap_key_rows(ckpt / f"iter_{K:07d}", layer=2, heads=4)
    r = run(python, tmp_path / "run", 2, PP2 + UNIVERSAL + ["--load", str(ckpt), "--ckpt-step", str(K)], N)
    assert r.returncode != 0 and not r.losses(), "trained on a wrong state"
    lines = {line for line in r.output.splitlines() if "fails its resume proof" in line}
    assert lines, r.output[-4000:]
    line = sorted(lines)[0]
    assert f"iter_{K:07d}" in line and "decoder.layers.2.self_attention.linear_qkv.weight' param" in line
    assert "saved" in line and "now" in line and "--no-resume-proof" in line


def test_resume_with_another_padded_vocabulary(python, reference, tmp_path):
    """On PP2, --make-vocab-size-divisible-by 100 pads 250 to 300; the checkpoint's 256 rows are
    kept (padding rows take part in the softmax) and the loss continues."""
    # --attention-backend fused: accepted and ignored by the CPU mode's local spec, which says so
    r = resume(python, reference, tmp_path, 2, PP2, ["--make-vocab-size-divisible-by", "100",
                                                     "--attention-backend", "fused"])
    assert "WARNING: --cpu ignores --attention-backend: the local spec's attention is megatron's" in r.output
    assert f"successfully loaded universal checkpoint from {reference['ckpt']} at iteration {K}" in r.output
    assert min(r.losses()) == K + 1
    assert "keeping the checkpoint's padded vocabulary of 256 rows (instead of 300)" in r.output
    assert max_delta(reference["losses"], r.losses(), range(K + 1, N + 1)) <= TOL


@pytest.mark.slow  # run by hand (CI time); the signal save: test_megatron_flags.py (own loop) runs in CI
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
    """--finetune on another layout (PP2): the weights only, iteration 0 and no consumed samples."""
    r = resume(python, reference, tmp_path, 2, PP2, ["--finetune"])
    assert sorted(r.losses()) == list(range(1, N + 1))
    # The loaded weights, not fresh ones: the first loss is that of a model trained K iterations.
    assert r.losses()[1] < reference["losses"][1] - 0.05


def test_a_torch_dist_job_switches_to_universal(python, reference, tmp_path):
    """A job on Megatron-LM's own torch_dist checkpoints (distributed optimizer) continues with
    --ckpt-format universal: its next checkpoint is universal and resumes on another layout."""
    ckpt = tmp_path / "ckpt"
    # --exit-interval: the same --train-iters throughout (megatron's scheduler checks it on load).
    run(python, tmp_path / "a", 2, TP2 + DIST + ["--ckpt-format", "torch_dist", "--save", str(ckpt),
                                                     "--save-interval", str(K), "--exit-interval", str(K)], N).check()
    # --load-universal: that folder is a universal checkpoint or an error naming what it holds
    refused = run(python, tmp_path / "refused", 2, TP2 + DIST + UNIVERSAL + ["--load", str(ckpt), "--load-universal"], N)
    lines = [line for line in refused.output.splitlines() if "not the universal one --load-universal asks for" in line]
    assert refused.returncode != 0 and lines, refused.output[-3000:]
    assert f"{ckpt / f'iter_{K:07d}'}: holds a torch_dist checkpoint" in lines[0]
    b = run(python, tmp_path / "b", 2, TP2 + DIST + UNIVERSAL + ["--load", str(ckpt), "--save", str(ckpt),
                                                          "--save-interval", str(K),
                                                          "--exit-interval", str(2 * K)], N).check()
    assert (ckpt / f"iter_{2 * K:07d}" / "ucp.json").exists()
    assert not (ckpt / f"iter_{K:07d}" / "ucp.json").exists()
    c = run(python, tmp_path / "c", 2, PP2 + UNIVERSAL + ["--load", str(ckpt)], N).check()
    losses = {**b.losses(), **c.losses()}
    assert max_delta(reference["losses"], losses, range(K + 1, N + 1)) <= TOL


@pytest.fixture(scope="module")
def moe_reference(python, tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    r = run(python, work / "run", 2, MOE + ["--expert-model-parallel-size", "2"] + UNIVERSAL
            + ["--save", str(work / "ckpt"), "--save-interval", str(K)], N).check()
    return {"losses": r.losses(), "ckpt": work / "ckpt"}


@pytest.mark.parametrize("name,layout", [
    ("ep1_dp2_dist", DIST),
    # megatron trains MoE under TP only with SP; the experts split over TP instead of EP
    ("tp2_sp_expert_tp2", TP2 + SP + ["--expert-tensor-parallel-size", "2"]),
    # Megatron-FSDP shards the dense weights over both ranks and holds two experts on each;
    # `optim`, as its default strategy mis-accumulates the experts' gradients (test_fsdp_flags.py)
    pytest.param("megatron_fsdp_ep2", ["--use-megatron-fsdp", "--expert-model-parallel-size", "2",
                                       "--data-parallel-sharding-strategy", "optim"],
                 marks=pytest.mark.slow),  # by hand (CI time); Megatron-FSDP's dense resume runs in CI
])
def test_moe_resumes_from_ep2_on_another_layout(python, moe_reference, tmp_path, name, layout):
    r = run(python, tmp_path, 2, MOE + layout + UNIVERSAL + ["--load", str(moe_reference["ckpt"]),
                                                            "--ckpt-step", str(K)], N).check()
    assert max_delta(moe_reference["losses"], r.losses(), range(K + 1, N + 1)) <= TOL


@pytest.mark.slow  # run by hand (CI time); the experts' bias fix: test_local_spec_gaps.py
def test_moe_with_expert_biases_resumes_from_ep2_on_ep1(python, tmp_path):
    """Experts with biases (megatron allows them at expert TP1 only) on the local spec: their
    bias add failed from scratch (mcore/compat.py); EP2 saves, EP1 x DP2 resumes within TOL."""
    ckpt = tmp_path / "ckpt"
    biased = [f for f in MOE if f != "--disable-bias-linear"]
    ref = run(python, tmp_path / "ref", 2, biased + ["--expert-model-parallel-size", "2"] + UNIVERSAL
              + ["--save", str(ckpt), "--save-interval", str(K)], N).check()
    r = run(python, tmp_path / "ep1", 2, biased + DIST + UNIVERSAL + ["--load", str(ckpt), "--ckpt-step", str(K)],
            N).check()
    assert min(r.losses()) == K + 1
    assert max_delta(ref.losses(), r.losses(), range(K + 1, N + 1)) <= TOL


@pytest.mark.slow  # run by hand (CI time); MLA's resume matrix runs in the own loop (test_variant_matrix)
def test_mla_resumes_from_tp2_on_pp2(python, tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = run(python, tmp_path / "ref", 2, MLA + TP2 + UNIVERSAL + ["--save", str(ckpt),
                                                                   "--save-interval", str(K)], N).check()
    r = run(python, tmp_path / "pp2", 2, MLA + PP2 + UNIVERSAL + ["--load", str(ckpt), "--ckpt-step", str(K)],
            N).check()
    assert max_delta(ref.losses(), r.losses(), range(K + 1, N + 1)) <= TOL


def test_elastic_resumes_on_the_surviving_node(python, reference, tmp_path):
    """Two torchrun agents of 2 workers (TP2 x DP2, --elastic); one is killed with its workers
    after iteration 5 (a lost node). The survivor's torchrun restarts its workers on 2 ranks, the
    plug-in picks TP2 x DP1 before megatron builds its parallel state, and the run resumes the
    latest checkpoint with the uninterrupted run's losses."""
    from elastic_harness import lose_a_node

    ckpt = tmp_path / "ckpt"
    argv = BASE + TP2 + DIST + UNIVERSAL + ["--cpu", "--train-iters", str(N), "--save-interval", "2",
                                            "--distributed-timeout-minutes", "1"]
    r = lose_a_node(tmp_path, python, argv, ckpt, kill_after=5, min_saved=2)
    assert r["rc"] == 0, r["output"][-6000:]
    before, after = r["segments"]
    resumed_from = after[0][0] - 1
    assert resumed_from >= r["saved_at_kill"] >= 2 and after[-1][0] == N
    assert "elastic: world size 2: training on TP2 PP1 DP1, 4 micro-batches per step" in r["output"]
    assert f"resuming iteration {resumed_from} saved on TP2 PP1 DP2 on 4 ranks" in r["output"]
    losses = dict(before)
    losses.update(after)
    assert max_delta(reference["losses"], losses, range(1, N + 1)) <= TOL
    print(f"\nkilled after iteration {before[-1][0]}, resumed from {resumed_from}; "
          f"{r['after_kill']:.1f} s from the kill to the end")


# -- the local checkpoint tier (docs/elastic.md "The local tier"): Megatron-LM's flags for its own
# local checkpoints select the project's tier with --ckpt-format universal --

def test_local_tier_restores_a_lost_nodes_job_on_another_layout(python, reference, tmp_path):
    """4 processes on 2 pretended nodes (TP2 x DP2, --elastic) save locally every 2 iterations
    with one replica on the other node (--replication-factor 2) and persistently every 10; they
    are SIGKILLed after iteration 7, node1's tier is deleted, and 2 processes on node0 (TP2 x DP1)
    restore iteration 6 from node0's pieces and node1's replicas: 1 iteration lost, not 7. A new
    job pointed at that tier then starts from scratch."""
    ckpt, local = tmp_path / "ckpt", tmp_path / "local"
    argv = TP2 + DIST + UNIVERSAL + ["--elastic", "--save", str(ckpt), "--save-interval", "10", "--load", str(ckpt),
                                     "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                                     str(local), "--non-persistent-save-interval", "2", "--replication",
                                     "--replication-jump", "2", "--replication-factor", "2"]
    complete = [local / node / "iter_0000006" / "COMPLETE" for node in ("node0", "node1")]
    job = run(python, tmp_path / "job", 4, argv, N, hosts=["node0", "node0", "node1", "node1"],
              kill_when=lambda losses: 7 in losses and all(p.exists() for p in complete))
    assert max(job.losses()) < N, "the job finished before it was killed"
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()  # no persistent checkpoint yet
    shutil.rmtree(local / "node1")  # the lost node's memory
    r = run(python, tmp_path / "restart", 2, argv, N, hosts=["node0", "node0"]).check()
    assert "local checkpoint tier: restored iteration 6 saved on 4 ranks from node0" in r.output, r.output[-4000:]
    assert "persistent: none" in r.output
    assert min(r.losses()) == 7
    assert max_delta(reference["losses"], r.losses(), range(7, N + 1)) <= TOL
    print(f"\nwork lost: {max(job.losses()) - 6} iteration(s) from the local tier, "
          f"{max(job.losses())} without the tier (no persistent checkpoint before iteration 10)")
    # issue 47: a new job (its own --save) on this tier trains from scratch; the old job's
    # iterations are named in one line and never used (before, it restored the newest of them)
    fresh = [str(tmp_path / "new_ckpt") if a == str(ckpt) else a for a in argv]
    n = run(python, tmp_path / "new_job", 2, fresh, 2, hosts=["node0", "node0"]).check()
    assert sorted(n.losses()) == [1, 2]  # from scratch (a restore would resume after 6)
    lines = [x for x in n.output.splitlines() if "local checkpoint tier: local iteration" in x]
    assert len(lines) == 1 and "not used" in lines[0] and "another job's (job " in lines[0], n.output[-4000:]


# -- context parallelism: CP ranks are replicas in sharded_state_dict (the third replica coordinate
# is the rank in data x context); the distributed optimizer shards over data x context. Rotary
# embeddings: megatron splits them by CP rank too (rope_utils' pinned chunk index). One CP2
# reference serves every resume; a resumed run's own checkpoint serves the next. --

ROPE = ["--position-embedding-type", "rope"]
CP2 = ["--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def cp2_reference(python, tmp_path_factory):
    """A rope GPT on CP2 with the distributed optimizer (it shards over data x context), saving
    at K and running on to N."""
    work = tmp_path_factory.mktemp("cp2")
    r = run(python, work / "run", 2, ROPE + CP2 + DIST + UNIVERSAL + ["--save", str(work / "ckpt"),
                                                                     "--save-interval", str(K)], N).check()
    return {"losses": r.losses(), "ckpt": work / "ckpt"}


def test_cp2_resumes_on_cp1_whose_checkpoint_resumes_on_cp2_tp2(python, cp2_reference, tmp_path):
    """CP2 -> CP1 (DP2) at K, saving every 2 -> CP2 x TP2 (4 processes) at K + 2; both within
    TOL of the CP2 run, and each manifest records its context-parallel size."""
    layout = json.loads((cp2_reference["ckpt"] / f"iter_{K:07d}" / "ucp.json").read_text())["layout"]
    assert layout["context_parallel_size"] == 2 and layout["data_parallel_size"] == 1
    ckpt = tmp_path / "cp1_ckpt"
    cp1 = run(python, tmp_path / "cp1", 2, ROPE + UNIVERSAL + ["--load", str(cp2_reference["ckpt"]), "--ckpt-step",
                                                               str(K), "--save", str(ckpt), "--save-interval", "2"],
              N).check()
    assert min(cp1.losses()) == K + 1
    assert max_delta(cp2_reference["losses"], cp1.losses(), range(K + 1, N + 1)) <= TOL
    assert json.loads((ckpt / f"iter_{K + 2:07d}" / "ucp.json").read_text())["layout"]["context_parallel_size"] == 1
    cp2tp2 = run(python, tmp_path / "cp2tp2", 4, ROPE + CP2 + TP2 + UNIVERSAL
                 + ["--load", str(ckpt), "--ckpt-step", str(K + 2)], N).check()
    assert min(cp2tp2.losses()) == K + 3
    assert max_delta(cp2_reference["losses"], cp2tp2.losses(), range(K + 3, N + 1)) <= TOL


@pytest.mark.slow  # run by hand (CI time); CP2 -> CP1 -> CP2 x TP2 runs in CI
def test_cp2_resumes_on_pp2_with_the_distributed_optimizer(python, cp2_reference, tmp_path):
    r = run(python, tmp_path, 2, ROPE + PP2 + DIST + UNIVERSAL + ["--load", str(cp2_reference["ckpt"]),
                                                                 "--ckpt-step", str(K)], N).check()
    assert min(r.losses()) == K + 1
    assert max_delta(cp2_reference["losses"], r.losses(), range(K + 1, N + 1)) <= TOL


# -- torch FSDP2 (--use-torch-fsdp2): parameters and Adam moments are DTensors sharded on dim 0
# over data parallelism; megatron describes the local shards, and we map the optimizer state.
# FSDP2 needs untied embeddings (arguments.py:1010). --

FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]


def there_and_back(python, tmp_path, sharded, other, back=()):
    """`sharded` saves at K -> `other` resumes it, saving every 2 -> `sharded` + `back` resumes
    that at K + 2; both within TOL of the `sharded` run."""
    ref = run(python, tmp_path / "ref", 2, sharded + UNIVERSAL + ["--save", str(tmp_path / "ckpt"),
                                                                  "--save-interval", str(K)], N).check()
    moved = run(python, tmp_path / "moved", 2, other + UNIVERSAL + [
        "--load", str(tmp_path / "ckpt"), "--ckpt-step", str(K), "--save", str(tmp_path / "moved_ckpt"),
        "--save-interval", "2"], N).check()
    assert min(moved.losses()) == K + 1
    assert max_delta(ref.losses(), moved.losses(), range(K + 1, N + 1)) <= TOL
    returned = run(python, tmp_path / "back", 2, sharded + list(back) + UNIVERSAL + [
        "--load", str(tmp_path / "moved_ckpt"), "--ckpt-step", str(K + 2)], N).check()
    assert min(returned.losses()) == K + 3
    assert max_delta(ref.losses(), returned.losses(), range(K + 3, N + 1)) <= TOL


@pytest.mark.slow  # run by hand (CI time); Megatron-FSDP's there-and-back runs in CI, FSDP2's mapping in test_fsdp2_map.py
def test_fsdp2_resumes_on_tp2_with_the_distributed_optimizer_and_back(python, tmp_path):
    there_and_back(python, tmp_path, FSDP2, ["--untie-embeddings-and-output-weights"] + TP2 + DIST)


# -- Megatron-FSDP (--use-megatron-fsdp): each data-parallel rank holds uneven row shards of the
# parameters, cut from flat buffers (some ranks none of a tensor), and steps the main-weight
# shards; we map both (mcore/megatron_fsdp.py). Untied embeddings, as FSDP2; SwiGLU puts the
# shard boundaries inside the packed fc1. --

MEGATRON_FSDP = ["--use-megatron-fsdp", "--untie-embeddings-and-output-weights", "--swiglu"]


def test_megatron_fsdp_resumes_on_pp2_with_the_distributed_optimizer_and_back(python, tmp_path):
    """Megatron-FSDP's default strategy (weights sharded too) -> PP2 -> back under the strategy
    that shards the optimizer state only (whole weights, sharded main weights)."""
    there_and_back(python, tmp_path, MEGATRON_FSDP, ["--untie-embeddings-and-output-weights", "--swiglu"] + PP2 + DIST,
                   back=["--data-parallel-sharding-strategy", "optim"])


@pytest.mark.slow  # run by hand (CI time); fine-tuning: test_finetune_loads_the_weights_and_starts_over
def test_megatron_fsdp_finetunes_from_the_weights_as_pp2_does(python, tmp_path):
    """--finetune (weights only, a fresh Adam) into Megatron-FSDP, whose main weights are its own
    copy (fp32 runs too) that megatron does not refresh from loaded weights: they must be, or
    its first step starts from the initial weights. Its losses equal PP2's from the same
    checkpoint."""
    ckpt = tmp_path / "ckpt"
    run(python, tmp_path / "ref", 2, MEGATRON_FSDP + UNIVERSAL + ["--save", str(ckpt), "--save-interval", "2"],
        2).check()
    finetune = UNIVERSAL + ["--finetune", "--load", str(ckpt)]
    fsdp = run(python, tmp_path / "fsdp", 2, MEGATRON_FSDP + finetune, 3).check()
    pp2 = run(python, tmp_path / "pp2", 2, ["--untie-embeddings-and-output-weights", "--swiglu"] + PP2 + DIST
              + finetune, 3).check()
    assert max_delta(pp2.losses(), fsdp.losses(), range(1, 4)) <= TOL


# -- the project's own loop (megatron-core 0.16.1) and Megatron-LM's trainer share checkpoints --

# The same model, optimizer and data in both: megatron-core's GPTDataset over a small corpus
# (test_megatron_data.write_corpus). The own loop's NullTokenizer takes the tokens' count and
# adds EOD (--vocab-size 250: 251 entries); Megatron-LM 0.19's takes the entries (251).
SHARED = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--make-vocab-size-divisible-by", "32",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--weight-decay", "0.01", "--clip-grad", "1.0",
          "--split", "90,5,5", "--tokenizer-type", "NullTokenizer", "--disable-bias-linear"]


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


def own_loop(python, workdir, extra, iters, save=None, load=None, step=None, shared=SHARED):
    from harness import losses, run_steps, train_step

    argv = ["--cpu"] + shared + ["--vocab-size", "250"] + extra
    step_ = train_step("run", argv, iters=iters, save=save, interval=K, load=load, step=step)
    step_["argv"] = [a for a in step_["argv"] if a not in ("--mock-data",)]
    return losses(run_steps(2, [step_], workdir, python=python), "run")


# --eval-iters 1: megatron's sampler refuses the empty validation split that 0 would give.
TRAINER_ONLY = ["--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1", "--num-workers", "0"]
ON_CORPUS = SHARED + ["--vocab-size", "251"] + TRAINER_ONLY


def test_own_loop_checkpoint_resumes_in_megatron_lm_and_back(python, own_loop_python, corpus, tmp_path):
    """Saved by the own loop (0.16.1, TP2) -> resumed by Megatron-LM's trainer (0.19.2, PP2); saved
    by the trainer (TP2) -> resumed by the own loop (PP2); each within TOL of its uninterrupted run.
    The trainer resumes with the own loop's --vocab-size 250 and --use-checkpoint-args: the
    checkpoint's 251 entries are 251 to its NullTokenizer (issue 46: it took 250, one short)."""
    own_ckpt, mlm_ckpt = tmp_path / "own_ckpt", tmp_path / "mlm_ckpt"
    own_ref = own_loop(own_loop_python, tmp_path / "own_ref", TP2 + corpus, N, save=str(own_ckpt))
    # no --disable-bias-linear either: the model's shape is the checkpoint's, which Megatron-LM
    # calls add_bias_linear (issue 46: "add_bias_linear: checkpoint False, model True")
    in_mlm = run(python, tmp_path / "in_mlm", 2, PP2 + corpus + UNIVERSAL
                 + ["--load", str(own_ckpt), "--ckpt-step", str(K), "--vocab-size", "250", "--use-checkpoint-args"], N,
                 base=[f for f in ON_CORPUS if f != "--disable-bias-linear"]).check()
    assert "--use-checkpoint-args: --vocab-size 251 from the checkpoint (was 250)" in in_mlm.output
    assert "--use-checkpoint-args: --disable-bias-linear True from the checkpoint (was False)" in in_mlm.output
    assert max_delta(own_ref, in_mlm.losses(), range(K + 1, N + 1)) <= TOL

    mlm_ref = run(python, tmp_path / "mlm_ref", 2, TP2 + corpus + UNIVERSAL
                  + ["--save", str(mlm_ckpt), "--save-interval", str(K)], N,
                  base=ON_CORPUS).check()
    # the trainer's --vocab-size 251 and --use-checkpoint-args: 250 to the own loop (it adds EOD)
    in_own = own_loop(own_loop_python, tmp_path / "in_own", PP2 + corpus + ["--vocab-size", "251",
                                                                            "--use-checkpoint-args"],
                      N, load=str(mlm_ckpt), step=K, shared=[f for f in SHARED if f != "--disable-bias-linear"])
    assert max_delta(mlm_ref.losses(), in_own, range(K + 1, N + 1)) <= TOL


# -- Megatron-LM features the own loop never had, through pretrain_gpt_ucp.py --

# Full activation recomputation of every layer, EOD-masked loss with position ids reset at each
# document of GPTDataset's samples, a cosine schedule after 3 warmup iterations.
FEATURES = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--eod-mask-loss", "--reset-position-ids", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
            "--min-lr", "1e-4"]


def lr_log(run_) -> dict:
    return {r["iteration"]: r["lr"] for r in map(json.loads, (run_.workdir / "loss.jsonl").read_text().splitlines())}


def megatron_lr(iteration, lr, min_lr, warmup_iters, decay_iters, gbs=8) -> float:
    """The learning rate of an iteration's update as Megatron-LM's OptimizerParamScheduler defines
    it (steps in samples, linear warmup from 0, then cosine to min_lr over decay_iters)."""
    step, warmup, decay = (iteration - 1) * gbs, warmup_iters * gbs, decay_iters * gbs
    if warmup and step <= warmup:
        return lr * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


@pytest.fixture(scope="module")
def features(python, corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("features")
    r = run(python, work / "run", 2, TP2 + corpus + FEATURES + UNIVERSAL
            + ["--save", str(work / "ckpt"), "--save-interval", str(K)], N, base=ON_CORPUS).check()
    return {"run": r, "losses": r.losses(), "ckpt": work / "ckpt"}


@pytest.mark.slow  # run by hand (CI time); EOD masks and position resets: test_megatron_data.py (own loop)
def test_recompute_eod_masking_and_warmup_survive_a_resume_on_another_layout(python, corpus, features, tmp_path):
    for name, value in (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                        ("eod_mask_loss", "True"), ("reset_position_ids", "True")):
        assert re.search(rf"^\s*{name} \.+ {value}$", features["run"].output, re.M), \
            f"megatron's argument list lacks {name} = {value}"
    reference_lr = lr_log(features["run"])
    assert [reference_lr[i] for i in (1, 2, 3)] == pytest.approx([0.0, 5e-3 / 3, 2 * 5e-3 / 3])
    r = run(python, tmp_path, 2, PP2 + corpus + FEATURES + UNIVERSAL
            + ["--load", str(features["ckpt"]), "--ckpt-step", str(K)], N, base=ON_CORPUS).check()
    assert max_delta(features["losses"], r.losses(), range(K + 1, N + 1)) <= TOL
    assert {i: lr_log(r)[i] for i in range(K + 1, N + 1)} == pytest.approx(
        {i: reference_lr[i] for i in range(K + 1, N + 1)}, rel=1e-12)


@pytest.mark.slow  # run by hand (CI time); one flag's schedule
def test_override_opt_param_scheduler_takes_the_command_lines_schedule(python, corpus, features, tmp_path):
    """Megatron-LM's semantics: a schedule that differs from the checkpoint's is refused, unless
    --override-opt_param-scheduler, which takes the command line's values and keeps the
    checkpoint's step count."""
    new = ["--lr", "1e-2", "--min-lr", "2e-4", "--lr-warmup-iters", "2"]
    load = UNIVERSAL + ["--load", str(features["ckpt"]), "--ckpt-step", str(K)]
    refused = run(python, tmp_path / "refused", 2, PP2 + corpus + FEATURES + new + load, N, base=ON_CORPUS)
    assert refused.returncode != 0
    assert "OptimizerParamScheduler: class input value 0.01 and checkpoint" in refused.output, refused.output[-3000:]
    r = run(python, tmp_path / "override", 2, PP2 + corpus + FEATURES + new + load
            + ["--override-opt_param-scheduler"], N, base=ON_CORPUS).check()
    assert min(r.losses()) == K + 1
    expected = {i: megatron_lr(i, 1e-2, 2e-4, 2, N) for i in range(K + 1, N + 1)}
    assert {i: lr_log(r)[i] for i in range(K + 1, N + 1)} == pytest.approx(expected, rel=1e-9)


def test_the_synonym_table_is_the_trainers_parser(python):
    """Each model argument --use-checkpoint-args adopts has, in Megatron-LM's parser, the own
    loop's name or a synonym of mcore/saved_args.SYNONYMS (negated where one flag stores false)."""
    import subprocess

    from harness import REPO
    from megatron_ucp.mcore.flags import build_parser
    from megatron_ucp.mcore.saved_args import CHECKPOINT_ARGS, SYNONYMS

    code = ("import argparse, json; from megatron.training.arguments import add_megatron_arguments; "
            "p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)); "
            "print(json.dumps({o: [a.dest, a.const if a.nargs == 0 else None] for a in p._actions "
            "for o in a.option_strings}))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    own = {a.dest: a for a in build_parser()._actions}
    for name in CHECKPOINT_ARGS:
        flag = own[name].option_strings[0]
        assert flag in theirs, f"{flag} is not a flag of Megatron-LM's trainer"
        dest, const = theirs[flag]
        if dest == name:
            assert name not in SYNONYMS
            continue
        assert SYNONYMS.get(name, (None,))[0] == dest, f"{flag}: the trainer stores {dest}, not in SYNONYMS"
        read = SYNONYMS[name][1]
        if own[name].nargs == 0:
            assert (read(True) if read else True) == const, f"{flag}: the trainer stores {dest}={const}"
