"""Argument validation: impossible layouts stop at start-up with one line naming the arguments."""

import subprocess
import sys

import pytest

from harness import REPO, assert_config_error_names
from megatron_ucp.mcore.flag_validation import pad_vocab_size, validate
from megatron_ucp.mcore.flags import build_parser


def parse(argv, world):
    return validate(build_parser().parse_args(["--mock-data"] + argv), world)


@pytest.mark.parametrize("argv,world,names", [
    (["--tensor-model-parallel-size", "3"], 3, ["--tensor-model-parallel-size", "--num-attention-heads"]),
    (["--tensor-model-parallel-size", "2"], 3, ["world size 3", "--tensor-model-parallel-size"]),
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6,
     ["world size 6", "--pipeline-model-parallel-size"]),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, ["--global-batch-size", "--micro-batch-size"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--pipeline-model-parallel-size", "--num-layers"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1, ["--num-query-groups"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "3", "--global-batch-size", "6"], 3,
     ["--expert-model-parallel-size"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ["--num-layers-per-virtual-pipeline-stage"]),
    (["--elastic", "--ckpt-format", "torch_dist"], 1, ["--elastic", "--ckpt-format universal"]),
    (["--distributed-timeout-minutes", "0"], 1, ["--distributed-timeout-minutes"]),
    (["--ckpt-format", "torch", "--num-experts", "4"], 1, ["--ckpt-format torch", "--num-experts"]),
])
def test_bad_combinations_name_the_arguments(argv, world, names):
    assert_config_error_names(lambda: parse(argv, world), names)


def test_derived_values():
    args = parse(["--tensor-model-parallel-size", "2", "--vocab-size", "1000"], 8)
    assert args.data_parallel_size == 4
    assert args.num_microbatches == 1
    assert args.padded_vocab_size == 1024
    assert pad_vocab_size(50257, 128, 8) == 51200


def test_cli_prints_one_line_and_exits_2():
    proc = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt_ucp.py"), "--cpu", "--mock-data",
         "--num-attention-heads", "4", "--tensor-model-parallel-size", "3"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--tensor-model-parallel-size" in lines[0], proc.stderr[-2000:]
