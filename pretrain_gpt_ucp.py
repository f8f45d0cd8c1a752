"""GPT pretraining on megatron-core with universal checkpoints.

Train on 2 CPU processes with tensor parallelism, saving universally, then resume on 1:

    torchrun --nproc-per-node 2 pretrain_gpt_ucp.py --cpu --mock-data \\
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
    torchrun --nproc-per-node 1 pretrain_gpt_ucp.py --cpu --mock-data \\
        --train-iters 30 --load ckpt --load-universal

Arguments follow Megatron-LM's names; `--help` lists them.
"""

import os
import sys
import warnings

from megatron_ucp.errors import ConfigError


def main() -> int:
    # megatron-core warns once per module that apex/TE are absent; say it once instead.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    from megatron_ucp.train.loop import pretrain

    try:
        pretrain(sys.argv[1:])
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt_ucp.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
