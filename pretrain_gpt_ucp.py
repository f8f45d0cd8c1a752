"""The checkout's shim for `python -m megatron_ucp.train` (megatron_ucp/train/__main__.py):
GPT pretraining with universal checkpoints, e.g.

    torchrun --nproc-per-node 2 pretrain_gpt_ucp.py --cpu --mock-data \\
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --save-interval 10
"""

import sys

from megatron_ucp.train.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
