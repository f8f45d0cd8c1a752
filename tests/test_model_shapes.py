"""model_shapes (the simulator's description of every rank's tensors, benchmarks/bench_scale.py)
against model_map on small real models: the same names, shapes, boxes and distributed-optimizer
fragments on every rank, so the simulation cannot drift from the real mapping."""

import pytest

from harness import BASE, ok, run_steps
from megatron_ucp.mcore.model_shapes import ModelShape, Parallel, rank_tensors

LLAMA = ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
DIST = ["--use-distributed-optimizer"]

# BASE: 4 layers, hidden 32, 4 heads, vocab 250 padded to a multiple of 32 x TP, seq 16.
GPT = ModelShape(num_layers=4, hidden=32, ffn=128, heads=4, kv_groups=4, vocab=250, make_vocab_size_divisible_by=32,
                 gated=False, norm_bias=True, linear_bias=True, tied=True, learned_positions=16)
LLAMA_SHAPE = ModelShape(num_layers=4, hidden=32, ffn=128, heads=4, kv_groups=2, vocab=250,
                         make_vocab_size_divisible_by=32)
MOE_SHAPE = ModelShape(num_layers=4, hidden=32, ffn=128, heads=4, kv_groups=4, vocab=250, make_vocab_size_divisible_by=32,
                       norm_bias=True, tied=True, learned_positions=16, num_experts=4)

CASES = {
    "llama_tp2": (LLAMA + DIST + ["--tensor-model-parallel-size", "2"], LLAMA_SHAPE, Parallel(tp=2, pp=1, dp=1)),
    "llama_dp2": (LLAMA + DIST, LLAMA_SHAPE, Parallel(tp=1, pp=1, dp=2)),
    "gpt_pp2": (DIST + ["--pipeline-model-parallel-size", "2"], GPT, Parallel(tp=1, pp=2, dp=1)),
    "gpt_tp2_plain": (["--tensor-model-parallel-size", "2"], GPT,
                      Parallel(tp=2, pp=1, dp=1, distributed_optimizer=False)),
    "moe_ep2": (MOE + DIST + ["--expert-model-parallel-size", "2"], MOE_SHAPE, Parallel(tp=1, pp=1, dp=2, ep=2)),
}


@pytest.fixture(scope="module")
def geometry(tmp_path_factory):
    steps = [{"name": name, "op": "geometry", "argv": BASE + extra + ["--train-iters", "1"]}
             for name, (extra, _, _) in CASES.items()]
    return run_steps(2, steps, tmp_path_factory.mktemp("geometry"))


def _simulated(shape, par, rank):
    out = []
    for t in rank_tensors(shape, par, rank):
        out.append({"name": t.name, "atomic_shape": list(t.atomic_shape), "padded_rows": t.padded_rows,
                    "writes": t.writes, "stateless": t.stateless, "numel": t.numel,
                    "boxes": [[b.local_start, list(b.offset), list(b.shape)] for b in t.boxes],
                    "fragment": None if t.fragment is None else [t.fragment.start, t.fragment.stop]})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_simulated_ranks_hold_what_the_mapping_says(geometry, name):
    _, shape, par = CASES[name]
    real = ok(geometry, name)["ranks"]
    assert len(real) == par.world
    for rank, tensors in enumerate(real):
        want = sorted(tensors, key=lambda t: t["name"])
        got = sorted(_simulated(shape, par, rank), key=lambda t: t["name"])
        assert [t["name"] for t in got] == [t["name"] for t in want], (name, rank)
        for g, w in zip(got, want):
            assert g == w, (name, rank, g, w)
