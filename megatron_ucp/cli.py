"""`megatron-ucp` (and `python -m megatron_ucp`): one command, a subcommand per tool.

Each subcommand hands its arguments to the main(argv) of the module that does the work, the
same function the checkout's tools/*.py shims call, so both print the same one-line errors and
exit with the same codes (2 for bad input). Modules are imported only when their subcommand
runs: `--help`, `--version` and `inspect` import neither torch nor megatron.
"""

import importlib
import os
import sys

from megatron_ucp import __version__
from megatron_ucp.errors import UCPError, report

PROG = "megatron-ucp"

# name: (module, its main, the name its errors carry, one line, an example)
COMMANDS = {
    "train": ("megatron_ucp.train.__main__", "main", "pretrain_gpt_ucp.py",
              "GPT pretraining with universal checkpoints under torchrun (megatron-core >= 0.17: "
              "Megatron-LM's trainer; 0.16: the own loop)",
              "torchrun --nproc-per-node 2 -m megatron_ucp.train --cpu --mock-data --save ckpt ..."),
    "megatron-lm": ("megatron_ucp.megatron_lm.__main__", "main", "megatron_ucp.megatron_lm",
                    "Megatron-LM's own trainer (a pretrain_gpt.py) with universal checkpoints",
                    "torchrun --nproc-per-node 8 -m megatron_ucp.megatron_lm pretrain_gpt.py ... "
                    "--ckpt-format universal"),
    "convert": ("megatron_ucp.convert.to_universal", "main", "convert_to_universal",
                "Megatron checkpoint (torch_dist, or legacy per-rank torch) -> universal",
                "megatron-ucp convert --input megatron_ckpt --output ucp_ckpt"),
    "inspect": ("megatron_ucp.commands.inspect_checkpoint", "main", "inspect_checkpoint",
                "a universal checkpoint's manifest and tensors; --verify checks its checksums",
                "megatron-ucp inspect ucp_ckpt --verify"),
    "export-hf": ("megatron_ucp.commands.hf", "export_main", "export_hf",
                  "universal checkpoint -> Hugging Face model folder (Llama, Qwen2, Mixtral)",
                  "megatron-ucp export-hf ucp_ckpt hf_model --dtype bf16"),
    "import-hf": ("megatron_ucp.commands.hf", "import_main", "import_hf",
                  "Hugging Face model folder -> universal checkpoint (weights only, iteration 0)",
                  "megatron-ucp import-hf hf_model ucp_ckpt"),
    "import-deepspeed": ("megatron_ucp.convert.deepspeed", "main", "import_deepspeed",
                         "DeepSpeed universal checkpoint (Megatron-DeepSpeed GPT) -> universal",
                         "megatron-ucp import-deepspeed ds_ckpt/global_step5_universal ucp_ckpt"),
    "export-torch-dist": ("megatron_ucp.convert.export_torch_dist", "main", "export_torch_dist",
                          "universal checkpoint -> megatron-core torch_dist for a chosen layout",
                          "megatron-ucp export-torch-dist ucp_ckpt out -- --tensor-model-parallel-size 4"),
    "gpu-check": ("megatron_ucp.commands.gpu_check", "main", "gpu_check",
                  "the GPU path: TE spec, FusedAdam, bf16/fp16, NCCL (3-5 min on one GPU)",
                  "megatron-ucp gpu-check"),
}


def usage() -> str:
    lines = [f"usage: {PROG} COMMAND [ARGS...]   (or: python -m megatron_ucp COMMAND ...)",
             f"       {PROG} --help | --version;  {PROG} COMMAND --help: a command's flags", "",
             "Universal checkpoints for megatron-core GPT training: save on one parallel layout,",
             "resume on any other.", "", "commands:"]
    for name, (_, _, _, line, example) in COMMANDS.items():
        lines += [f"  {name:<18} {line}", f"  {'':<18}   e.g. {example}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {__version__} ({os.path.dirname(os.path.abspath(__file__))})")
        return 0
    if argv[0] not in COMMANDS:
        return report(PROG, UCPError(f"unknown command {argv[0]!r}; expected one of: "
                                     f"{', '.join(COMMANDS)} (`{PROG} --help`)"))
    module, function, prog, _, _ = COMMANDS[argv[0]]
    command = getattr(importlib.import_module(module), function)
    try:
        return command(argv[1:])
    except UCPError as e:  # a bad input: one line per job, as the tools/ scripts print it
        return report(prog, e)


if __name__ == "__main__":
    sys.exit(main())
