"""GPT pretraining with universal checkpoints: `python -m megatron_ucp.train`, `megatron-ucp
train`, and the checkout's `pretrain_gpt_ucp.py`. Which trainer runs depends on megatron-core:

- 0.17 and later: Megatron-LM's own trainer (`megatron.training`, in the wheel), with the
  plug-in installed and the project's GPT script (megatron_ucp/megatron_lm/gpt.py). Every
  Megatron-LM flag works, plus the project's (`--cpu`, `--elastic`, `--loss-log`, the
  universal checkpoint flags); `--ckpt-format universal` saves universal checkpoints.
- 0.16: the project's own loop (megatron_ucp/train/loop.py), frozen: bug fixes only.

Train on 2 CPU processes with tensor parallelism, saving universally, then resume on 1 (the
own loop's defaults; Megatron-LM's trainer also needs the model's flags: README "Which trainer"
gives one job script for both):

    torchrun --nproc-per-node 2 -m megatron_ucp.train --cpu --mock-data \\
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
    torchrun --nproc-per-node 1 -m megatron_ucp.train --cpu --mock-data \\
        --train-iters 30 --load ckpt
"""

import sys
import warnings

from megatron_ucp.errors import UCPError, report

PROG = "pretrain_gpt_ucp.py"
GPT_SCRIPT = "megatron_ucp.megatron_lm.gpt"


def main(argv=None) -> int:
    # megatron-core warns once per module that apex/TE are absent; say it once instead.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    argv = sys.argv[1:] if argv is None else list(argv)
    from megatron_ucp.mcore.compat import ships_megatron_lm

    if ships_megatron_lm():
        return _megatron_lm(argv)
    from megatron_ucp.engine.collective import close_distributed
    from megatron_ucp.train.loop import pretrain

    try:
        pretrain(argv)
        status = 0
    except UCPError as e:  # bad arguments or a bad checkpoint: one line per job, no traceback
        status = report(PROG, e)
    close_distributed()  # before the interpreter's exit, which gloo may abort (engine/collective.py)
    return status


def _megatron_lm(argv) -> int:
    from megatron_ucp.megatron_lm import __main__ as plug_in

    try:  # the script is imported after the plug-in (and the CPU mode) is installed
        plug_in.run(None, [PROG] + argv, cpu="--cpu" in argv, module=GPT_SCRIPT)
        return 0
    except UCPError as e:
        return report(PROG, e)


if __name__ == "__main__":
    sys.exit(main())
