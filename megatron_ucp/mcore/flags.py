"""Command-line flags of `pretrain_gpt_ucp.py`, with Megatron-LM's names and defaults.

`build_parser()` declares them; `parse_args(argv, world_size)` parses and validates them
(mcore/flag_validation.py: derived values, and one-line errors naming the flags at fault).
The converters parse a source run's stored arguments with the same parser.
"""

import argparse

from megatron_ucp.mcore import layer_pattern
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.ucp_flags import add_universal_flags


# The checkpointing switches (store_true) and what each does.
_CHECKPOINT_SWITCHES = (
    ("--no-load-optim", "do not load optimizer state (nor the scheduler's, as in Megatron-LM)"),
    ("--finetune", "load the model weights only: iteration and consumed samples start at 0, no "
                   "optimizer, scheduler or RNG state is loaded (Megatron-LM's meaning)"),
    ("--no-load-rng", "do not load RNG state: reseed from --seed and the iteration"),
    ("--no-load-scheduler", "universal: start a fresh learning-rate scheduler (needed when the "
                            "checkpoint holds none: otherwise that is an error)"),
    ("--override-opt_param-scheduler", "the learning-rate schedule (lr, min lr, warmup, decay iterations "
                                        "and style) from the command line, not the checkpoint's; its step "
                                        "count still loads (Megatron-LM's flag)"),
    ("--exit-on-missing-checkpoint", "an error when --load holds no checkpoint (else: train from scratch)"),
    ("--no-save-optim", "universal: save the weights only, no optimizer or scheduler state"),
    ("--no-save-rng", "universal: save no RNG state (a load then reseeds from --seed)"),
    ("--use-checkpoint-args", "universal: take the model's architecture arguments from the checkpoint "
                              "in --load (a differing command-line value is overridden, with a note)"),
    ("--exit-signal-handler", "on SIGTERM, finish the iteration, save (synchronously) and exit 0"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt_ucp.py",
        description="GPT pretraining on megatron-core with universal checkpoints.",
    )
    a = p.add_argument

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=1000, help="true (unpadded) vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument(
        "--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute"
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the query, key and value projections even with --disable-bias-linear (Qwen2)")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize queries and keys per head (with MLA: the compressed q and kv latents)")

    g = p.add_argument_group("multi-latent attention")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's MLA: low-rank compressed queries and keys/values")
    g.add_argument("--q-lora-rank", type=int, default=None, help="query compression rank (none: no compression)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="key/value compression rank")
    g.add_argument("--qk-head-dim", type=int, default=128, help="query/key head size without the rotary part")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="rotary part of the query/key head")
    g.add_argument("--v-head-dim", type=int, default=128, help="value head size")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA's rotary embedding (default yarn, as in megatron-core's MLA config)")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="yarn's context scaling")

    g = p.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="predict this many further tokens with MTP layers on the last stage")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP losses (their mean) in the training loss")

    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument(
        "--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather"
    )
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="MoE every N-th layer (int), or a per-layer pattern such as '([0]+[1])*2'")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing (needs --moe-router-score-function sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped-GEMM experts (needs the grouped_gemm kernels or transformer-engine)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (uneven split; the rest divide evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (uneven split; the rest divide evenly)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")

    g = p.add_argument_group("mixed precision and optimizer state")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 training with megatron's loss scaler (dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=float, default=None, help="a constant loss scale (fp16)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="keep Adam's moments (and master weights) in the dtypes below inside "
                        "transformer-engine's FusedAdam (needs --use-distributed-optimizer)")
    for name in ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        choices = ["fp32", "fp16"] if name == "--main-params-dtype" else ["fp32", "fp16", "bf16"]
        g.add_argument(name, choices=choices, default="fp32")
    g.add_argument("--no-store-param-remainders", dest="store_param_remainders", action="store_false",
                   help="precision-aware optimizer: keep whole fp32 master weights (universal "
                        "checkpoints need them), not bf16 params plus 16-bit remainders")
    g.add_argument("--fused-adam-standin", action="store_true",
                   help="CPU: train with a stand-in for transformer-engine's FusedAdam (its state "
                        "contract, torch's arithmetic), to prove the GPU optimizer's checkpoints "
                        "on CPU (megatron_ucp/mcore/fused_adam_standin.py)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--loss-log", default=None, help="append one JSON line per iteration here")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="megatron-core GPTDataset: one .bin/.idx prefix, or a blend "
                        "'W1 PREFIX1 W2 PREFIX2 ...'")
    g.add_argument("--split", default="969, 30, 1", help="train,valid,test weights (Megatron-LM's)")
    g.add_argument("--data-cache-path", default=None,
                   help="where the shuffled index files go (default: megatron's, beside the data)")
    g.add_argument("--tokenizer-type", choices=["NullTokenizer"], default=None,
                   help="pretokenized data: token ids < --vocab-size, EOD = --vocab-size (the model "
                        "then has --vocab-size + 1 entries, as in Megatron-LM)")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="no attention across an EOD: each document of a sample attends to itself "
                        "(GPTDataset's per-sample mask, seq-length^2 booleans)")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and at the end (default: none)")
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per validation")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write scalars here with torch.utils.tensorboard (needs `tensorboard`)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration, not the latest")
    g.add_argument("--load-universal", action="store_true", help="resume from a universal checkpoint, any layout")
    g.add_argument("--ckpt-format", choices=["universal", "torch_dist", "torch"], default="universal",
                   help="what --save writes and --load expects (a folder of another format is an "
                        "error, never a fallback); torch_dist: megatron-core's distributed format; "
                        "torch: Megatron-LM's legacy per-rank files (mp_rank_XX[_YYY]/model_optim_rng.pt, "
                        "distrib_optim.pt)")
    g.add_argument(
        "--dist-ckpt-optim-format",
        choices=["dp_reshardable", "fully_reshardable"],
        default="dp_reshardable",
        help="torch_dist only: how the distributed optimizer state is sharded",
    )
    g.add_argument("--async-save", action="store_true",
                   help="universal: write checkpoint files in the background; training waits only "
                        "for an in-memory copy")
    add_universal_flags(g)
    for flag, text in _CHECKPOINT_SWITCHES:
        g.add_argument(flag, action="store_true", help=text)
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this iteration")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 after the iteration that passes this much wall time")

    g = p.add_argument_group("local checkpoint tier (docs/elastic.md)")
    g.add_argument("--local-ckpt-dir", default=None,
                   help="node-local dir (/dev/shm or NVMe) for the local tier: each node keeps its "
                        "ranks' pieces of the universal checkpoint and other nodes' replicas under "
                        "DIR/<host name>/; a restart resumes from it when it is newer than --load's")
    g.add_argument("--local-save-interval", type=int, default=None,
                   help="local tier: save every N iterations (in the background)")
    g.add_argument("--local-ckpt-replicas", type=int, default=1,
                   help="local tier: copies of each rank's piece kept on other nodes")
    g.add_argument("--local-ckpt-check-loss", action="store_true",
                   help="local tier: a non-finite first loss after a local restore sets that "
                        "iteration aside and stops, so that the restart resumes from --load")

    g = p.add_argument_group("elastic training")
    g.add_argument("--elastic", action="store_true",
                   help="fit the layout to the world size (keep TP/PP where they fit, DP absorbs the "
                        "change, else shrink PP then TP; global batch kept) and resume the latest "
                        "checkpoint in --load universally, or start fresh when there is none "
                        "(docs/elastic.md)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of collectives: a rank whose peer is gone fails after this long")

    a("--cpu", action="store_true", help="train on CPU processes over gloo (no GPU needed)")
    return p


def moe_layer_freq(text: str):
    """`--moe-layer-freq`: an int N (MoE every N-th layer) or a 0/1 list expression per layer,
    parsed as data (layer_pattern.py), never evaluated: checkpoints carry this text too."""
    try:
        return layer_pattern.parse(text)
    except layer_pattern.PatternError as e:
        raise argparse.ArgumentTypeError(f"expected an integer or a list expression like '([0]+[1])*2', "
                                         f"got {text[:60]!r}{'...' if len(text) > 60 else ''}: {e}") from None


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """The validated arguments of a run of `world_size` processes."""
    return validate(build_parser().parse_args(argv), world_size)
