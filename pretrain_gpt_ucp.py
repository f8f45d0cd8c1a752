"""GPT pretraining on megatron-core with universal checkpoints.

Train on 2 CPU processes with tensor parallelism, saving universally, then resume on 1:

    torchrun --nproc-per-node 2 pretrain_gpt_ucp.py --cpu --mock-data \\
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
    torchrun --nproc-per-node 1 pretrain_gpt_ucp.py --cpu --mock-data \\
        --train-iters 30 --load ckpt --load-universal

Arguments follow Megatron-LM's names; `--help` lists them.
"""

import sys
import warnings

from megatron_ucp.errors import UCPError, report


def main() -> int:
    # megatron-core warns once per module that apex/TE are absent; say it once instead.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    from megatron_ucp.train.loop import close_distributed, pretrain

    try:
        pretrain(sys.argv[1:])
        status = 0
    except UCPError as e:  # bad arguments or a bad checkpoint: one line per job, no traceback
        status = report("pretrain_gpt_ucp.py", e)
    close_distributed()  # before the interpreter's exit, which gloo may abort (loop.py)
    return status


if __name__ == "__main__":
    sys.exit(main())
