"""Arguments adopted from a checkpoint (mcore/saved_args.py): typed, bounded and checked against
the same manifest's architecture and tensors before anything is built from them, by
`--use-checkpoint-args` (train/checkpointing.py) and by export_torch_dist (its plan, before any
process starts). On tests/fixtures/v1_moe (2 layers, hidden 32, 4 experts, vocab 250)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, free_port

from megatron_ucp.convert.export_torch_dist import plan
from megatron_ucp.errors import FormatError
from megatron_ucp.format.manifest import read_manifest
from megatron_ucp.mcore import saved_args
from megatron_ucp.train.checkpointing import CHECKPOINT_ARGS

FIXTURE = Path(__file__).parent / "fixtures" / "v1_moe"


def _copy(tmp_path, args=None, architecture=None) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    path = root / "iter_0000004" / "ucp.json"
    m = json.loads(path.read_text())
    m["args"].update(args or {})
    m["architecture"].update(architecture or {})
    path.write_text(json.dumps(m))
    return root


def _check(root: Path):
    d = str(root / "iter_0000004")
    m = read_manifest(d)
    saved_args.check(m.args, CHECKPOINT_ARGS + ("eod_token",), m, os.path.join(d, "ucp.json"))


# (args changed, architecture changed, words of the one-line error)
CASES = {
    "num_layers_beyond_the_tensors": ({"num_layers": 100000}, {}, "'args.num_layers' is 100000, but 'architecture.num_layers' is 2"),
    "architecture_beyond_the_tensors": ({"num_layers": 100000}, {"num_layers": 100000},
                                        "'architecture.num_layers' is 100000, the tensors hold 2 layers"),
    "hidden_size_a_float": ({"hidden_size": 1e6}, {}, "'args.hidden_size' is 1000000.0, expected an integer"),
    "hidden_size_beyond_the_embedding": ({"hidden_size": 1000000}, {"hidden_size": 1000000},
                                         "'architecture.hidden_size' is 1000000, embedding.word_embeddings.weight has 32 columns"),
    "seq_length_a_float": ({"seq_length": 1e5}, {}, "'args.seq_length' is 100000.0, expected an integer"),
    "seq_length_beyond_positions": ({"seq_length": 100000}, {}, "'args.seq_length' is 100000, but the position embedding"),
    "num_layers_text": ({"num_layers": "2"}, {}, "'args.num_layers' is '2', expected an integer"),
    "vocab_a_list": ({"vocab_size": [250]}, {}, "'args.vocab_size' is [250], expected an integer"),
    "divisible_by_zero": ({"make_vocab_size_divisible_by": 0}, {}, "'args.make_vocab_size_divisible_by' is 0, expected an integer >= 1"),
    "normalization_not_a_choice": ({"normalization": "EvilNorm"}, {}, "'args.normalization' is 'EvilNorm', expected one of ['LayerNorm', 'RMSNorm']"),
    "pattern_text": ({"moe_layer_freq": "9**9**9"}, {}, "'args.moe_layer_freq' is '9**9**9', expected an integer 1..10000 or a list"),
    "pattern_huge": ({"moe_layer_freq": [1] * 20000}, {}, "'args.moe_layer_freq' is a list of 20000"),
    "switch_a_string": ({"swiglu": "false"}, {}, "'args.swiglu' is 'false', expected true or false"),
    "rotary_base_text": ({"rotary_base": "abc"}, {}, "'args.rotary_base' is 'abc', expected an integer"),
    "rotary_base_huge": ({"rotary_base": 10**400}, {}, "'args.rotary_base' is 1000000000"),
    "norm_epsilon_list": ({"norm_epsilon": [1]}, {}, "'args.norm_epsilon' is [1], expected a finite number"),
    "norm_epsilon_null": ({"norm_epsilon": None}, {}, "'args.norm_epsilon' is None, expected a finite number"),
    "eod_token_text": ({"eod_token": "x"}, {}, "'args.eod_token' is 'x'"),
    "experts_beyond_the_tensors": ({"num_experts": 64}, {}, "'args.num_experts' is 64, but 'architecture.num_experts' is 4"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_adopted_arguments_are_refused_in_one_line(tmp_path, name):
    args, architecture, words = CASES[name]
    root = _copy(tmp_path, args, architecture)
    start = time.perf_counter()
    with pytest.raises(FormatError) as e:
        _check(root)
    message = str(e.value)
    assert message.startswith(str(root / "iter_0000004" / "ucp.json") + ": "), message
    assert words in message, message
    assert "\n" not in message
    assert time.perf_counter() - start < 2.0


def test_the_checkpoints_own_arguments_pass(tmp_path):
    _check(_copy(tmp_path))


@pytest.mark.parametrize("name", ["num_layers_beyond_the_tensors", "pattern_text", "rotary_base_text",
                                  "norm_epsilon_null", "normalization_not_a_choice"])
def test_export_torch_dist_refuses_before_any_process(tmp_path, name):
    args, architecture, words = CASES[name]
    root = _copy(tmp_path, args, architecture)
    start = time.perf_counter()
    with pytest.raises(FormatError) as e:
        plan(str(root), str(tmp_path / "out"), extra=["--tensor-model-parallel-size", "1"])
    assert words in str(e.value)
    assert time.perf_counter() - start < 5.0
    assert not (tmp_path / "out").exists()


def test_use_checkpoint_args_refuses_before_building(tmp_path):
    """The run of the issue: num_layers 100000 beside 2 layers of tensors built layers for 40 s
    up to 5 GB; now one line naming the manifest and the key, exit 2, before the model exists."""
    root = _copy(tmp_path, {"num_layers": 100000})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--master-port", str(free_port()), str(REPO / "pretrain_gpt_ucp.py"), "--cpu",
                        "--mock-data", "--load", str(root), "--use-checkpoint-args", "--train-iters", "5",
                        "--micro-batch-size", "2", "--global-batch-size", "2"],
                       capture_output=True, text=True, env=env, timeout=120)
    errors = [line for line in r.stderr.splitlines() if "pretrain_gpt_ucp.py: error:" in line]
    assert r.returncode != 0
    assert len(errors) == 1 and "'args.num_layers' is 100000, but 'architecture.num_layers' is 2" in errors[0], r.stderr[-2000:]
    assert time.perf_counter() - start < 90


# -- another trainer's arguments (issue 46, item 5): Megatron-LM's trainer stores
# --disable-bias-linear as add_bias_linear and --norm-epsilon as layernorm_epsilon, and counts
# a NullTokenizer's --vocab-size by release; the adopted model must be the checkpoint's. --

def _megatron_lm_saved(tmp_path, **change):
    """The fixture's manifest with the arguments as Megatron-LM's trainer names them."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    path = root / "iter_0000004" / "ucp.json"
    m = json.loads(path.read_text())
    args = {k: v for k, v in m["args"].items() if k not in ("disable_bias_linear", "norm_epsilon")}
    m["args"] = dict(args, add_bias_linear=False, layernorm_epsilon=1e-5, **change)
    path.write_text(json.dumps(m))
    return read_manifest(str(root / "iter_0000004"))


def _trainer_namespace(**values):
    """The model arguments of Megatron-LM's trainer (its attribute names) for a biased model."""
    import argparse

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, add_bias_linear=True,
                layernorm_epsilon=1e-6, vocab_size=100, tokenizer_type="NullTokenizer")
    return argparse.Namespace(**{**base, **values})


def test_megatron_lm_names_pass_the_check_and_are_adopted_by_either_trainer(tmp_path):
    m = _megatron_lm_saved(tmp_path)
    saved_args.check(m.args, CHECKPOINT_ARGS, m, "ucp.json")
    trainer = _trainer_namespace()
    saved_args.use_checkpoint_args(trainer, m.args, entries=250, extra=0)
    assert (trainer.add_bias_linear, trainer.layernorm_epsilon, trainer.num_layers) == (False, 1e-5, 2)
    assert not hasattr(trainer, "disable_bias_linear")
    from megatron_ucp.mcore.flags import build_parser

    own = build_parser().parse_args(["--hidden-size", "64"])
    saved_args.use_checkpoint_args(own, m.args, entries=250, extra=0)
    assert (own.disable_bias_linear, own.norm_epsilon, own.hidden_size) == (True, 1e-5, 32)


def test_the_own_loops_names_are_adopted_by_megatron_lms_trainer():
    """The run of the issue: saved with --disable-bias-linear by the own loop, read by the
    trainer, whose model kept its bias ("add_bias_linear: checkpoint False, model True")."""
    trainer = _trainer_namespace()
    changed = saved_args.use_checkpoint_args(trainer, {"disable_bias_linear": True, "norm_epsilon": 1e-5})
    assert (trainer.add_bias_linear, trainer.layernorm_epsilon) == (False, 1e-5)
    assert ("disable_bias_linear", False, True) in changed


@pytest.mark.parametrize("extra,flag", [(1, 600), (0, 601), (None, 100)])
def test_the_vocabulary_is_the_checkpoints_as_this_tokenizer_counts_it(extra, flag):
    """601 entries saved: --vocab-size 600 where the NullTokenizer adds EOD (own loop, Megatron-LM
    0.16), 601 where it does not (0.17+), the command line's where the flag is no vocabulary."""
    for saved in ({"vocab_size": 601}, {"vocab_size": 600, "eod_token": 600}, {"vocab_size": 600}):
        trainer = _trainer_namespace()
        saved_args.use_checkpoint_args(trainer, saved, entries=601, extra=extra)
        assert trainer.vocab_size == flag, saved


def test_a_megatron_lm_016_vocabulary_passes_the_check(tmp_path):
    """0.16's trainer stores --vocab-size 249 for 250 entries (its NullTokenizer adds EOD); 248
    is another model."""
    m = _megatron_lm_saved(tmp_path, vocab_size=249, tokenizer_type="NullTokenizer")
    saved_args.check(m.args, CHECKPOINT_ARGS, m, "ucp.json")
    m = _megatron_lm_saved(tmp_path / "b", vocab_size=248, tokenizer_type="NullTokenizer")
    with pytest.raises(FormatError, match="'args.vocab_size' is 248, but 'architecture.vocab_size' is 250"):
        saved_args.check(m.args, CHECKPOINT_ARGS, m, "ucp.json")


@pytest.mark.parametrize("saved,model,words", [
    (601, 600, "give this run a --vocab-size 1 larger"), (600, 601, "give this run a --vocab-size 1 smaller")])
def test_a_vocabulary_mismatch_names_the_cause_and_the_fix(saved, model, words):
    from megatron_ucp.errors import LayoutError
    from megatron_ucp.format.manifest import check_architecture

    with pytest.raises(LayoutError) as e:
        check_architecture({"vocab_size": saved, "hidden_size": 8}, {"vocab_size": model, "hidden_size": 8}, "CKPT")
    message = str(e.value)
    assert f"vocab_size: checkpoint {saved}, model {model}" in message and words in message, message
    assert "--use-checkpoint-args" in message and "NullTokenizer" in message and "\n" not in message
