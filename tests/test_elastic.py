"""Elastic training under torchrun: a node dies mid-run, the survivor continues on a new layout.

Two torchrun agents on this machine share a c10d rendezvous (--nnodes 1:2, 2 workers each) and
train TP2 x DP2 with the distributed optimizer, saving universally. One agent and its workers
are SIGKILLed (a node lost); the survivor's workers fail, torchrun restarts them with world size
2, and --elastic resumes the latest checkpoint on TP2 x DP1 with the same global batch. The
losses must match an uninterrupted 4-process run.
"""

import subprocess
import sys
import time

import pytest

from elastic_harness import env, lose_a_node, read_log, tracker
from harness import BASE, REPO, free_port

pytestmark = pytest.mark.slow  # 2-6 minutes on 2 busy CPU cores; run by hand (docs/elastic.md)

N, SAVE_INTERVAL, KILL_AFTER = 16, 4, 6  # train to N; kill once iteration KILL_AFTER is logged
ARGS = BASE + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
               "--train-iters", str(N), "--save-interval", str(SAVE_INTERVAL),
               "--distributed-timeout-minutes", "1"]


def test_node_loss_resumes_on_fewer_ranks(tmp_path):
    start = time.monotonic()
    # The uninterrupted reference: 4 processes, TP2 x DP2.
    ref_log = tmp_path / "ref.jsonl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    str(REPO / "pretrain_gpt_ucp.py"), *ARGS, "--save", str(tmp_path / "ref"),
                    "--loss-log", str(ref_log)],
                   env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=600, check=True)
    reference = dict(read_log(ref_log))
    assert sorted(reference) == list(range(1, N + 1))
    ref_seconds = time.monotonic() - start

    # The elastic run: two agents ("nodes") of 2 workers in one rendezvous.
    ckpt = tmp_path / "ckpt"
    run = lose_a_node(tmp_path, sys.executable, ARGS, ckpt, KILL_AFTER, SAVE_INTERVAL)
    text, saved_at_kill = run["output"], run["saved_at_kill"]
    assert run["rc"] == 0, text[-6000:]

    parts = run["segments"]
    assert len(parts) == 2, parts
    before, after = parts
    last_before = before[-1][0]
    resumed_from = after[0][0] - 1
    assert last_before < N, "the kill came after the end of training"
    assert resumed_from >= saved_at_kill >= SAVE_INTERVAL  # nothing committed before the kill is lost
    assert 0 <= last_before - resumed_from <= SAVE_INTERVAL  # iterations redone
    assert after[-1][0] == N and tracker(ckpt) == N
    # The survivor restarted its workers on 2 ranks and the policy kept TP2: TP2 x DP1.
    assert "elastic: world size 2: training on TP2 PP1 DP1, 4 micro-batches per step" in text, text[-4000:]
    assert f"resuming iteration {resumed_from} saved on TP2 PP1 DP2 on 4 ranks" in text
    delta_before = max(abs(loss - reference[it]) for it, loss in before)
    delta_after = max(abs(loss - reference[it]) for it, loss in after)
    assert delta_before < 1e-4 and delta_after < 1e-4, (delta_before, delta_after)
    print(f"\nreference 4-process run {ref_seconds:.1f} s; elastic run {run['to_kill'] + run['after_kill']:.1f} s, "
          f"of which {run['after_kill']:.1f} s after the kill; killed after iteration {last_before}, "
          f"resumed from {resumed_from} ({last_before - resumed_from} redone); max |loss - reference| "
          f"{delta_before:.2e} before, {delta_after:.2e} after")
