"""GPT pretraining on megatron-core with universal checkpoints: `python -m megatron_ucp.train`,
`megatron-ucp train`, and the checkout's `pretrain_gpt_ucp.py`.

Train on 2 CPU processes with tensor parallelism, saving universally, then resume on 1:

    torchrun --nproc-per-node 2 -m megatron_ucp.train --cpu --mock-data \\
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
    torchrun --nproc-per-node 1 -m megatron_ucp.train --cpu --mock-data \\
        --train-iters 30 --load ckpt --load-universal

Arguments follow Megatron-LM's names; `--help` lists them.
"""

import sys
import warnings

from megatron_ucp.errors import UCPError, report


def main(argv=None) -> int:
    # megatron-core warns once per module that apex/TE are absent; say it once instead.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    from megatron_ucp.engine.collective import close_distributed
    from megatron_ucp.train.loop import pretrain

    try:
        pretrain(sys.argv[1:] if argv is None else list(argv))
        status = 0
    except UCPError as e:  # bad arguments or a bad checkpoint: one line per job, no traceback
        status = report("pretrain_gpt_ucp.py", e)
    close_distributed()  # before the interpreter's exit, which gloo may abort (engine/collective.py)
    return status


if __name__ == "__main__":
    sys.exit(main())
