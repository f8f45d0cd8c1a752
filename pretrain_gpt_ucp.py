"""GPT pretraining on megatron-core with universal checkpoints.

Train on 2 CPU processes with tensor parallelism, saving universally, then resume on 1:

    torchrun --nproc-per-node 2 pretrain_gpt_ucp.py --cpu --mock-data \
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
    torchrun --nproc-per-node 1 pretrain_gpt_ucp.py --cpu --mock-data \
        --train-iters 30 --load ckpt --load-universal

Arguments follow Megatron-LM's names; `--help` lists them.
"""

import sys

from megatron_ucp.errors import ConfigError
from megatron_ucp.train.loop import pretrain


def main() -> int:
    try:
        pretrain(sys.argv[1:])
    except ConfigError:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
