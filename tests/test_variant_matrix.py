"""The resume matrix on the model variants megatron-core builds beyond a plain GPT: an uneven
pipeline, multi-latent attention, QK layernorm, and a small DeepSeek-V3-like model (MLA + MoE
with a shared expert, sigmoid router with expert bias, an MTP layer, a dense first layer).

Each is saved on one layout and resumed on two or more others that change TP, PP (even <->
uneven), EP and DP / the distributed optimizer: the losses after the resume follow the
uninterrupted run, and a load-then-save on another layout writes the saved files bit for bit.
"""

from pathlib import Path

import pytest

from harness import assert_same_state, losses, max_loss_delta, ok, roundtrip_step, run_steps, train_step

N, K = 10, 5  # train to N, resume from K: 5 iterations after the resume
TOL = 1e-4

DIST = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
UNEVEN = PP2 + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
UNEVEN_LAST = PP2 + ["--decoder-last-pipeline-num-layers", "1"]  # 3 layers, then 1
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
QK = ["--qk-layernorm", "--swiglu", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"]
DEEPSEEK = MLA + ["--q-lora-rank", "16", "--qk-layernorm", "--mtp-num-layers", "1",
                  "--untie-embeddings-and-output-weights", "--swiglu",
                  "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "32",
                  "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-layer-freq", "[0]+[1]*3"]
EP = lambda n: ["--expert-model-parallel-size", str(n)]  # noqa: E731

# variant: (model flags, saving layout, [(name, resuming layout)], tolerance)
MATRIX = {
    "uneven": ([], UNEVEN + DIST, [("tp2pp2_even", TP2 + PP2), ("dp4", DIST), ("pp2_other_uneven", UNEVEN_LAST)],
               TOL),
    "even_to_uneven": ([], TP2 + PP2, [("uneven_dp2", UNEVEN + DIST), ("uneven_tp2", UNEVEN + TP2)], TOL),
    "mla": (MLA, TP2 + DIST, [("dp4", []), ("uneven", UNEVEN + DIST), ("tp2pp2", TP2 + PP2)], TOL),
    "qk": (QK, TP2 + PP2, [("dp4", DIST), ("tp4", ["--tensor-model-parallel-size", "4"]), ("uneven", UNEVEN)],
           TOL),
    "deepseek": (DEEPSEEK, EP(2) + DIST, [("ep1", []), ("ep4", EP(4) + DIST), ("ep2_pp2", EP(2) + PP2)], TOL),
}
ROUNDTRIPS = {"uneven": "tp2pp2_even", "mla": "uneven", "qk": "tp4", "deepseek": "ep4"}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants_matrix")


@pytest.fixture(scope="module")
def matrix(work):
    steps = []
    for variant, (model, saving, resumes, _) in MATRIX.items():
        src = str(work / variant)
        steps.append(train_step(f"{variant}:a", model + saving, iters=N, save=src, interval=K))
        for name, layout in resumes:
            steps.append(train_step(f"{variant}:{name}", model + layout, iters=N, load=src, step=K))
        if variant in ROUNDTRIPS:
            layout = dict(resumes)[ROUNDTRIPS[variant]]
            steps.append(roundtrip_step(f"{variant}:r", model + layout, src, K, str(work / f"{variant}_R"), iters=N))
    return run_steps(4, steps, work / "runs", timeout=1800)


CASES = [(v, name) for v, (_, _, resumes, _) in MATRIX.items() for name, _ in resumes]


@pytest.mark.parametrize("variant,name", CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_resumed_losses_follow(matrix, variant, name):
    reference, resumed = losses(matrix, f"{variant}:a"), losses(matrix, f"{variant}:{name}")
    assert sorted(resumed) == list(range(K + 1, N + 1)), sorted(resumed)
    delta = max_loss_delta(reference, resumed)
    print(f"{variant} -> {name}: max |loss delta| {delta:.3g}")
    assert delta <= MATRIX[variant][3], f"{variant} -> {name}: {delta}"


@pytest.mark.parametrize("variant", sorted(ROUNDTRIPS))
def test_state_equal_after_reshard(matrix, work, variant):
    ok(matrix, f"{variant}:r")
    assert_same_state(work / variant / f"iter_{K:07d}", work / f"{variant}_R" / f"iter_{K:07d}")
