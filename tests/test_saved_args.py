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
