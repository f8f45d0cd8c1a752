"""Model variants of Megatron-LM's flags: uneven pipeline splits, multi-latent attention, QK
layernorm, multi-token prediction, and a small DeepSeek-V3-like MoE.

Each variant trains a few iterations on two layouts of the same model; the losses must be
finite and agree (fp32, same data). Two of them also resume from a universal checkpoint on
another layout. Tensor parallelism does not change initialization, so TP1 and TP2 runs start
from the same weights. Pipeline stages seed their own streams (Megatron-LM's seed + 100 x
stage), so an even and an uneven split start from the same weights only when both load them:
a torch_dist checkpoint of a PP1 run, read without its optimizer (megatron-core reshards the
weights to any split).
"""

import json
import math
import types
from pathlib import Path

import pytest
import torch

from harness import assert_config_error_names, losses, run_steps, train_step
from megatron_ucp.mcore.compat import core_version
from megatron_ucp.mcore.elastic import Batch, Layout, ModelDims, choose_layout, pipeline_split_problem
from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.flags import build_parser

ITERS = 4
# fp32 layouts of one model agree to 5e-7 here; megatron-core's partial MLA rotary-key grad
# at TP2 (docs/design.md, Model variants) moved the loss by 1.6e-5 at iteration 2.
TOL = 1e-5
MOE_TOL = 1e-4  # top-k routing is discontinuous: reduction order can flip a near tie

PP2 = ["--pipeline-model-parallel-size", "2"]
UNEVEN = PP2 + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
TP2 = ["--tensor-model-parallel-size", "2"]
# MLA with key heads of 8 + 4 rotary channels and value heads of 6.
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--qk-layernorm", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6"]
Q_LORA = ["--q-lora-rank", "16"]
QK_NORM = ["--qk-layernorm"]
MTP = ["--mtp-num-layers", "1"]
DEEPSEEK = MLA + Q_LORA + MTP + [
    "--swiglu", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-layer-freq", "[0]+[1]*3", "--expert-model-parallel-size", "2",
]
FROM_REFERENCE = ["--ckpt-format", "torch_dist", "--no-load-optim", "--no-load-rng"]
# MLA with --qk-layernorm and no query compression: megatron-core 0.19 builds it only with
# transformer-engine (train/model.py refuses it by name; tested at the end of this file).
PLAIN_MLA = core_version() < (0, 19)
NO_PLAIN_MLA = "megatron-core 0.19 builds MLA --qk-layernorm without --q-lora-rank only with transformer-engine"


def train(name, extra, iters=ITERS, **kw):
    return train_step(name, extra, iters=iters, **kw)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants")


@pytest.fixture(scope="module")
def w2(work):
    ref = str(work / "REF")
    log = lambda name: ["--loss-log", str(work / f"{name}.jsonl")]  # noqa: E731
    steps = [
        # The reference weights for the pipeline splits: one iteration of PP1, in torch_dist.
        train("ref_pp1", ["--ckpt-format", "torch_dist"], iters=1, save=ref, interval=1),
        train("pp2_even", PP2 + FROM_REFERENCE, iters=1 + ITERS, load=ref, step=1, universal=False),
        train("pp2_uneven", UNEVEN + FROM_REFERENCE, iters=1 + ITERS, load=ref, step=1, universal=False),
        train("pp2_uneven_scratch", UNEVEN, save=str(work / "UNEVEN"), interval=2),
        train("uneven_resumed_pp1", [], load=str(work / "UNEVEN"), step=2),
        train("pp2_even_scratch", PP2),
        train("dense_dp2", []),
    ] + ([train("mla_dp2", MLA), train("mla_tp2", MLA + TP2)] if PLAIN_MLA else []) + [
        train("mla_q_dp2", MLA + Q_LORA),
        train("mla_q_tp2", MLA + Q_LORA + TP2),
        train("mla_q_tp2_sp", MLA + Q_LORA + TP2 + ["--sequence-parallel"]),
        train("qk_dp2", QK_NORM),
        train("qk_tp2", QK_NORM + TP2),
        train("mtp_dp2", MTP + log("mtp_dp2")),
        train("mtp_tp2", MTP + TP2 + log("mtp_tp2")),
        train("mtp_pp2", MTP + PP2 + log("mtp_pp2")),
        train("deepseek_ep2", DEEPSEEK, save=str(work / "DEEPSEEK"), interval=2),
        train("deepseek_resumed_ep1", DEEPSEEK[:-2] + ["--expert-model-parallel-size", "1"],
              load=str(work / "DEEPSEEK"), step=2),
    ]
    return run_steps(2, steps, work / "w2")


@pytest.fixture(scope="module")
def w4(work):
    steps = [
        train("pp2_uneven_tp2", UNEVEN + TP2),
        train("deepseek_ep2_dp4", DEEPSEEK),
        train("deepseek_tp2_ep2", DEEPSEEK + TP2 + ["--sequence-parallel"]),
    ]
    return run_steps(4, steps, work / "w4")


def finite_curve(results, name, first=1, iters=ITERS) -> dict:
    curve = losses(results, name)
    assert sorted(curve) == list(range(first, first + iters)), f"{name}: {sorted(curve)}"
    assert all(math.isfinite(v) for v in curve.values()), f"{name}: {curve}"
    return curve


def assert_same_curve(a: dict, b: dict, tol=TOL) -> None:
    assert a.keys() == b.keys()
    delta = max(abs(a[i] - b[i]) for i in a)
    assert delta < tol, f"losses differ by {delta:.2e}: {a} vs {b}"


def test_uneven_pipeline_split_matches_the_even_one(w2):
    even = finite_curve(w2, "pp2_even", first=2)
    uneven = finite_curve(w2, "pp2_uneven", first=2)
    assert_same_curve(even, uneven)


def test_uneven_pipeline_split_is_in_effect(w2):
    """From scratch, the stage that builds a layer seeds it: moving layer 2 changes the start."""
    even, uneven = losses(w2, "pp2_even_scratch"), losses(w2, "pp2_uneven_scratch")
    assert abs(even[1] - uneven[1]) > 1e-4


def test_uneven_pipeline_split_with_tensor_parallelism(w2, w4):
    assert_same_curve(finite_curve(w2, "pp2_uneven_scratch"), finite_curve(w4, "pp2_uneven_tp2"))


@pytest.mark.parametrize("variant", [
    pytest.param("mla", marks=pytest.mark.skipif(not PLAIN_MLA, reason=NO_PLAIN_MLA)), "mla_q", "qk", "mtp"])
def test_variant_trains_alike_on_tp1_and_tp2(w2, variant):
    assert_same_curve(finite_curve(w2, f"{variant}_dp2"), finite_curve(w2, f"{variant}_tp2"))


def test_mla_with_sequence_parallelism(w2):
    assert_same_curve(finite_curve(w2, "mla_q_dp2"), finite_curve(w2, "mla_q_tp2_sp"))


@pytest.mark.skipif(not PLAIN_MLA, reason=NO_PLAIN_MLA)
def test_query_compression_changes_the_model(w2):
    plain, compressed = losses(w2, "mla_dp2"), losses(w2, "mla_q_dp2")
    assert abs(plain[1] - compressed[1]) > 1e-4


def test_mtp_loss_reaches_the_gradients_not_the_reported_loss(w2):
    """The reported loss is the LM loss (as in Megatron-LM); MTP's loss only adds gradients, so
    the first iteration agrees with the same model without MTP and the second does not."""
    dense, mtp = losses(w2, "dense_dp2"), losses(w2, "mtp_dp2")
    assert abs(dense[1] - mtp[1]) < 1e-6
    assert abs(dense[2] - mtp[2]) > 1e-5
    finite_curve(w2, "mtp_pp2")


def mtp_curve(work, name) -> dict:
    records = [json.loads(line) for line in (work / f"{name}.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["mtp_1 loss"] for r in records}


def test_mtp_loss_is_logged_alike_on_every_layout(work, w2):
    """Megatron-LM's 'mtp_1 loss' in the loss log: a next-but-one-token loss near ln(vocab) at
    the start, the same on TP1 and TP2, and there with the MTP layer on the last of 2 stages."""
    dp2, tp2, pp2 = (mtp_curve(work, name) for name in ("mtp_dp2", "mtp_tp2", "mtp_pp2"))
    assert sorted(dp2) == sorted(pp2) == list(range(1, ITERS + 1))
    assert abs(dp2[1] - math.log(250)) < 0.3 and abs(pp2[1] - math.log(250)) < 0.3
    assert_same_curve(dp2, tp2)


def test_deepseek_like_model_on_two_and_four_processes(w2, w4):
    ep2 = finite_curve(w2, "deepseek_ep2")
    assert_same_curve(ep2, finite_curve(w4, "deepseek_ep2_dp4"), MOE_TOL)
    assert_same_curve(ep2, finite_curve(w4, "deepseek_tp2_ep2"), MOE_TOL)  # TP2 + sequence parallel


@pytest.mark.parametrize("source,resumed,tol", [
    ("pp2_uneven_scratch", "uneven_resumed_pp1", TOL),  # uneven PP2 -> PP1
    ("deepseek_ep2", "deepseek_resumed_ep1", MOE_TOL),  # MLA, MoE, MTP: EP2 -> EP1
])
def test_universal_checkpoint_of_a_variant_resumes_on_another_layout(w2, source, resumed, tol):
    whole = finite_curve(w2, source)
    continued = finite_curve(w2, resumed, first=3, iters=ITERS - 2)
    assert_same_curve({i: whole[i] for i in continued}, continued, tol)


# --- the CPU core attention -------------------------------------------------------------------


class _OneRankGroup:
    def size(self):
        return 1


class _PlainBuffer:
    """Stands in for megatron's global memory buffer (a CUDA allocation) in this process."""

    @staticmethod
    def get_tensor(shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


def _attention_config(heads=4, groups=None, kv_channels=8, dropout=0.0):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=heads * kv_channels, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=kv_channels,
                               attention_dropout=dropout, masked_softmax_fusion=False)
    config.sequence_parallel = True  # both attentions skip the CUDA RNG fork for dropout then
    return config


def _causal_mask(s):
    return torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]


@pytest.mark.parametrize("groups", [None, 2])
def test_cpu_attention_equals_megatrons_with_equal_head_sizes(monkeypatch, groups):
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ucp.mcore.cpu_mode import CpuCoreAttention

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _PlainBuffer)
    config = _attention_config(groups=groups)
    pg = types.SimpleNamespace(tp=_OneRankGroup())
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                  softmax_scale=0.3, pg_collection=pg)
    megatron = DotProductAttention(config, **kwargs)
    ours = CpuCoreAttention(config, k_channels=8, v_channels=8, **kwargs)
    s, b, kv_heads = 6, 2, groups or 4
    torch.manual_seed(0)
    q = torch.randn(s, b, 4, 8, requires_grad=True)
    k = torch.randn(s, b, kv_heads, 8, requires_grad=True)
    v = torch.randn(s, b, kv_heads, 8, requires_grad=True)
    expected = megatron(q, k, v, _causal_mask(s))
    got = ours(q, k, v, _causal_mask(s))
    assert got.shape == expected.shape == (s, b, 32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    # No mask given: the causal mask is built (megatron's own needs CUDA for that).
    torch.testing.assert_close(ours(q, k, v, None), got)


def test_cpu_attention_with_value_heads_of_another_size():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ucp.mcore.cpu_mode import CpuCoreAttention

    config = _attention_config(dropout=0.5)
    attention = CpuCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", k_channels=12, v_channels=6,
                                 pg_collection=types.SimpleNamespace(tp=_OneRankGroup()))
    assert attention.softmax_scale == pytest.approx(12 ** -0.5)
    s, b = 5, 3
    q, k = torch.randn(s, b, 4, 12, requires_grad=True), torch.randn(s, b, 4, 12, requires_grad=True)
    v = torch.randn(s, b, 4, 6, requires_grad=True)
    attention.eval()
    out = attention(q, k, v, None)
    assert out.shape == (s, b, 24)
    # Causal: the first position sees only itself, so it returns its own value.
    torch.testing.assert_close(out[0].view(b, 4, 6), v[0])
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().max() > 0
               for t in (q, k, v))
    later = v.detach().clone()
    later[-1] += 1.0  # a later value changes no earlier position
    torch.testing.assert_close(attention(q, k, later, None)[:-1], out[:-1])
    attention.train()
    torch.manual_seed(1)
    assert not torch.allclose(attention(q, k, v, None), out)  # attention dropout is active


# --- arguments --------------------------------------------------------------------------------


def parse(argv, world=2):
    return validate(build_parser().parse_args(["--mock-data"] + argv), world)


@pytest.mark.parametrize("argv,world,names", [
    (PP2 + ["--decoder-first-pipeline-num-layers", "0"], 2, ["--decoder-first-pipeline-num-layers", ">= 1"]),
    (["--decoder-last-pipeline-num-layers", "2"], 1,
     ["--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-size > 1"]),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"], 3,
     ["--num-layers (4)", "--decoder-first-pipeline-num-layers", "leaves 3 layers", "2 other stages"]),
    (PP2 + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"], 2,
     ["--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers", "leaves 2 layers"]),
    (PP2 + ["--decoder-first-pipeline-num-layers", "5"], 2, ["leaves -1 layers"]),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "2"], 3, ["leaves 0 layers", "at least one layer"]),
    (UNEVEN + ["--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers"]),
    (MLA + ["--group-query-attention", "--num-query-groups", "2"], 1,
     ["--multi-latent-attention", "--group-query-attention"]),
    (["--multi-latent-attention"], 1, ["--multi-latent-attention", "--position-embedding-type rope"]),
    (MLA + ["--q-lora-rank", "0"], 1, ["--q-lora-rank"]),
    (MLA + ["--qk-pos-emb-head-dim", "3"], 1, ["--qk-pos-emb-head-dim"]),
    (MLA + ["--v-head-dim", "0"], 1, ["--v-head-dim"]),
    (["--rope-type", "yarn"], 1, ["--rope-type yarn", "--multi-latent-attention"]),
    (["--mtp-num-layers", "0"], 1, ["--mtp-num-layers"]),
])
def test_bad_variant_flags_name_the_arguments(argv, world, names):
    assert_config_error_names(lambda: parse(argv, world), names)


def test_split_rule_is_megatron_cores():
    """pipeline_split_problem accepts the splits megatron-core's TransformerConfig does, except
    those that give the stages more layers than the model has (megatron-core only checks that
    the rest divides)."""
    from megatron.core.transformer import TransformerConfig

    for num_layers in range(1, 9):
        for pp in range(2, 5):
            for first in (None, 1, 2, 3):
                for last in (None, 1, 2, 3):
                    if first is None and last is None:
                        continue
                    try:
                        TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                                          pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                          num_layers_in_first_pipeline_stage=first,
                                          num_layers_in_last_pipeline_stage=last)
                        megatron_accepts = True
                    except ValueError:
                        megatron_accepts = False
                    ours = pipeline_split_problem(num_layers, pp, first, last)
                    where = (num_layers, pp, first, last, ours)
                    if ours is None or not megatron_accepts:
                        assert (ours is None) == megatron_accepts, where
                    else:  # megatron-core's check lets a split ask for more layers than there are
                        assert (first or 0) + (last or 0) > num_layers and "leaves -" in ours, where


def test_variant_flags_reach_the_transformer_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_ucp.mcore.model import transformer_config

    args = parse(MLA + Q_LORA + MTP + ["--pipeline-model-parallel-size", "3", "--num-layers", "6",
                                       "--decoder-first-pipeline-num-layers", "1",
                                       "--decoder-last-pipeline-num-layers", "1", "--cpu"], 3)
    config = transformer_config(args)
    assert isinstance(config, MLATransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (16, 16, 8, 4, 6)
    assert config.qk_layernorm and config.mtp_num_layers == 1 and config.mtp_loss_scaling_factor == 0.1
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 1.0
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (1, 1)
    plain = transformer_config(parse(["--cpu"], 1))
    assert not isinstance(plain, MLATransformerConfig) and plain.mtp_num_layers is None


def test_stored_arguments_rebuild_the_variant():
    """Converters rebuild a model from its stored arguments; --use-checkpoint-args takes the
    architecture from them."""
    from megatron_ucp.convert.source_model import argv_from_args
    from megatron_ucp.train.checkpointing import use_checkpoint_args

    stored = vars(parse(DEEPSEEK + UNEVEN, 4))
    rebuilt = vars(parse(argv_from_args(stored), 4))
    for name in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "mtp_num_layers",
                 "mtp_loss_scaling_factor", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "moe_layer_freq"):
        assert rebuilt[name] == stored[name], name
    fresh = build_parser().parse_args(["--mock-data"])
    changed = {name for name, _, _ in use_checkpoint_args(fresh, stored)}
    assert {"multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "mtp_num_layers"} <= changed
    assert "decoder_first_pipeline_num_layers" not in changed  # layout: the command line's


def test_elastic_keeps_an_uneven_split_where_it_fits():
    dims = ModelDims(num_layers=8, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                     seq_length=16, first_stage_layers=2, last_stage_layers=2)
    choice = choose_layout(3, dims, Layout(pp=4), Batch(2, 8))
    assert choice.layout.pp == 3  # 2 + 4 + 2 layers
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers"):
        choose_layout(1, dims, Layout(pp=4), Batch(2, 8))


def test_mla_query_norm_without_compression_is_refused_where_megatron_cannot_build_it():
    """megatron-core 0.19 norms MLA's uncompressed query in a fused transformer-engine projection;
    without TE that model cannot be built, and the flags are named instead of a mock's error."""
    from megatron_ucp.mcore.compat import core_version
    from megatron_ucp.mcore import model
    from megatron_ucp.mcore.flag_validation import validate
    from megatron_ucp.mcore.flags import build_parser

    argv = ["--cpu", "--mock-data", "--num-layers", "2"] + MLA
    args = validate(build_parser().parse_args(argv), 2)
    if core_version() < (0, 19):
        assert model._megatron_layer_spec(args, None, None) is not None  # 0.16 builds it (no query norm)
        return
    assert_config_error_names(lambda: model._megatron_layer_spec(args, None, None),
                              ["--multi-latent-attention", "--qk-layernorm", "--q-lora-rank"])
    compressed = validate(build_parser().parse_args(argv + Q_LORA), 2)
    assert model._megatron_layer_spec(compressed, None, None) is not None  # with query compression it builds
