"""Command-line arguments of `pretrain_gpt_ucp.py`, with Megatron-LM's names, and their validation.

`validate(args, world_size)` derives the data-parallel size and the padded vocabulary and
stops at start-up with a one-line message naming the arguments at fault.
"""

import argparse
import re

from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.elastic import pipeline_split_problem


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
    g.add_argument("--keep-last", type=int, default=None,
                   help="universal: keep only the newest N checkpoints (never the one the tracker names)")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="universal: skip the block-checksum verification of a checkpoint on load")
    g.add_argument("--ckpt-read-policy", choices=["auto", "once", "per-rank"], default="auto",
                   help="universal: 'once' reads what data-parallel replicas share once per replica group, "
                        "each member a share, exchanged over the group; 'per-rank': every rank reads all it "
                        "holds (faster where the replicas share a node, whose page cache serves them one "
                        "read); 'auto' (default): once where a replica group spans nodes, else per rank")
    g.add_argument("--no-strict-load", action="store_true",
                   help="universal: ignore checkpoint tensors that have no place in the model")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load optimizer state (nor the scheduler's, as in Megatron-LM)")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights only: iteration and consumed samples start at 0, no "
                        "optimizer, scheduler or RNG state is loaded (Megatron-LM's meaning)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="do not load RNG state: reseed from --seed and the iteration")
    g.add_argument("--no-load-scheduler", action="store_true",
                   help="universal: start a fresh learning-rate scheduler (needed when the checkpoint holds "
                        "none: otherwise that is an error)")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this iteration")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="an error when --load holds no checkpoint (else: train from scratch)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="universal: save the weights only, no optimizer or scheduler state")
    g.add_argument("--no-save-rng", action="store_true",
                   help="universal: save no RNG state (a load then reseeds from --seed)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="universal: take the model's architecture arguments from the checkpoint "
                        "in --load (a differing command-line value is overridden, with a note)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save (synchronously) and exit 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 after the iteration that passes this much wall time")

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


_FREQ_PATTERN = re.compile(r"^[\[\]()0-9+*, ]+$")


def moe_layer_freq(text: str):
    """`--moe-layer-freq`: an int N (MoE every N-th layer) or a 0/1 list expression per layer."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if not _FREQ_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"expected an integer or a list expression like '([0]+[1])*2', got {text!r}")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # only digits, brackets, + and * reach here
    except Exception as e:
        raise argparse.ArgumentTypeError(f"cannot evaluate {text!r}: {e}") from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} must give a list of 0/1 per layer, got {value!r}")
    return value


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill derived values and refuse impossible combinations (ConfigError, one line each)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
                 "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        _need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _need(
        world_size % (tp * pp) == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp})",
    )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    _need(
        args.num_attention_heads % tp == 0,
        f"--tensor-model-parallel-size ({tp}) must divide --num-attention-heads ({args.num_attention_heads})",
    )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    _need(args.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
    _need(
        args.num_attention_heads % args.num_query_groups == 0,
        f"--num-query-groups ({args.num_query_groups}) must divide --num-attention-heads ({args.num_attention_heads})",
    )
    _need(
        args.num_query_groups % tp == 0,
        f"--tensor-model-parallel-size ({tp}) must divide --num-query-groups ({args.num_query_groups})",
    )
    _need(
        args.hidden_size % args.num_attention_heads == 0 or args.kv_channels is not None,
        f"--num-attention-heads ({args.num_attention_heads}) must divide --hidden-size ({args.hidden_size}) "
        "or --kv-channels must be given",
    )
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _need(
        args.ffn_hidden_size % tp == 0,
        f"--tensor-model-parallel-size ({tp}) must divide --ffn-hidden-size ({args.ffn_hidden_size})",
    )
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    split_problem = pipeline_split_problem(args.num_layers, pp, first, last)
    _need(split_problem is None, str(split_problem))
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        # Megatron-LM takes the virtual degree of an uneven split from
        # --num-virtual-stages-per-pipeline-rank, which this script does not offer.
        _need(first is None and last is None,
              "--num-layers-per-virtual-pipeline-stage cannot be combined with "
              "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
              "(as in Megatron-LM, an uneven split needs --num-virtual-stages-per-pipeline-rank, "
              "not supported here)")
        per_stage = args.num_layers // pp
        vl = args.num_layers_per_virtual_pipeline_stage
        _need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        _need(
            per_stage % vl == 0,
            f"--num-layers-per-virtual-pipeline-stage ({vl}) must divide --num-layers "
            f"({args.num_layers}) / --pipeline-model-parallel-size ({pp})",
        )
        args.virtual_pipeline_model_parallel_size = per_stage // vl
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM does: nothing to split
    if args.sequence_parallel:
        _need(args.seq_length % tp == 0,
              f"--sequence-parallel needs --tensor-model-parallel-size ({tp}) to divide --seq-length ({args.seq_length})")
    dp = args.data_parallel_size
    _need(
        args.global_batch_size % (args.micro_batch_size * dp) == 0,
        f"--global-batch-size ({args.global_batch_size}) is not divisible by --micro-batch-size "
        f"({args.micro_batch_size}) x data-parallel size ({dp})",
    )
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.virtual_pipeline_model_parallel_size is not None:
        _need(
            args.num_microbatches % pp == 0,
            f"interleaved pipelining needs the number of micro-batches ({args.num_microbatches}) "
            f"to be a multiple of --pipeline-model-parallel-size ({pp})",
        )
    if args.num_experts is not None:
        _need(
            world_size % (ep * pp) == 0 and (world_size // pp) % ep == 0,
            f"--expert-model-parallel-size ({ep}) must divide world size ({world_size}) / "
            f"--pipeline-model-parallel-size ({pp})",
        )
        _need(args.num_experts % ep == 0,
              f"--expert-model-parallel-size ({ep}) must divide --num-experts ({args.num_experts})")
        _need(1 <= args.moe_router_topk <= args.num_experts,
              f"--moe-router-topk ({args.moe_router_topk}) must be in 1..--num-experts ({args.num_experts})")
        etp = args.expert_tensor_parallel_size or tp
        _need(
            (world_size // pp) % (ep * etp) == 0,
            f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must divide "
            f"world size ({world_size}) / --pipeline-model-parallel-size ({pp})",
        )
        _need(tp == 1 or args.sequence_parallel,
              f"megatron-core trains MoE with --tensor-model-parallel-size {tp} only with --sequence-parallel")
        _need(
            etp == 1 or args.disable_bias_linear,
            f"megatron-core supports biases in MoE experts only with --expert-tensor-parallel-size 1 "
            f"(got {etp}): add --disable-bias-linear or set --expert-tensor-parallel-size 1",
        )
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        freq = args.moe_layer_freq
        if isinstance(freq, int):
            _need(freq >= 1, f"--moe-layer-freq must be >= 1, got {freq}")
        else:
            _need(len(freq) == args.num_layers,
                  f"--moe-layer-freq lists {len(freq)} layers, the model has --num-layers {args.num_layers}")
        _need(not args.moe_router_enable_expert_bias or args.moe_router_score_function == "sigmoid",
              "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        _need(not args.moe_grouped_gemm or args.disable_bias_linear,
              "--moe-grouped-gemm needs --disable-bias-linear (megatron-core has no grouped expert biases)")
    else:
        _need(ep == 1, "--expert-model-parallel-size > 1 needs --num-experts")
    validate_attention(args)
    _need(args.mtp_num_layers is None or args.mtp_num_layers >= 1,
          f"--mtp-num-layers must be >= 1, got {args.mtp_num_layers}")
    # megatron-core 0.16.1's GPTModel.sharded_state_dict asserts on the last stage's output layer
    # in this case (its own torch_dist save fails too): no checkpoint can describe the model.
    _need(not (args.mtp_num_layers and not args.untie_embeddings_and_output_weights
               and args.pipeline_model_parallel_size > 1 and (args.save or args.load)),
          "--mtp-num-layers with tied embeddings and --pipeline-model-parallel-size > 1 cannot be "
          "checkpointed: megatron-core cannot describe the last stage's output layer for checkpoints "
          "(its sharded_state_dict asserts); add --untie-embeddings-and-output-weights (as DeepSeek-V3 "
          "does) or train on one pipeline stage")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _need(
        args.max_position_embeddings >= args.seq_length,
        f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --seq-length ({args.seq_length})",
    )
    _need(args.mock_data or args.data_path is not None, "give --mock-data or --data-path")
    _need(not (args.mock_data and args.data_path), "give only one of --mock-data and --data-path")
    validate_data(args)
    _need(args.save_interval is None or args.save_interval >= 1, "--save-interval must be >= 1")
    _need(args.save_interval is None or args.save is not None, "--save-interval needs --save")
    _need(not args.async_save or args.ckpt_format == "universal",
          "--async-save needs --ckpt-format universal")
    _need(not args.elastic or args.ckpt_format == "universal",
          "--elastic needs --ckpt-format universal (torch_dist and torch checkpoints load only on their own layout)")
    for flag in ("no_save_optim", "no_save_rng"):
        _need(not getattr(args, flag) or args.ckpt_format == "universal",
              f"--{flag.replace('_', '-')} needs --ckpt-format universal")
    _need(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
          f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    _need(args.ckpt_step is None or args.ckpt_step >= 0, f"--ckpt-step must be >= 0, got {args.ckpt_step}")
    _need(args.distributed_timeout_minutes > 0,
          f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    _need(args.ckpt_format != "torch" or args.num_experts is None,
          "--ckpt-format torch is supported for dense models only (no --num-experts): use torch_dist or universal")
    _need(not (args.fp16 and args.bf16), "give only one of --fp16 and --bf16")
    _need(not args.fused_adam_standin or args.cpu,
          "--fused-adam-standin is a CPU stand-in: on GPUs megatron-core takes transformer-engine's FusedAdam")
    if args.use_precision_aware_optimizer:
        _need(args.use_distributed_optimizer,
              "--use-precision-aware-optimizer needs --use-distributed-optimizer (as in megatron-core)")
        _need(not args.cpu or args.fused_adam_standin,
              "--use-precision-aware-optimizer needs transformer-engine's FusedAdam: on CPU add "
              "--fused-adam-standin")
    else:
        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            _need(getattr(args, name) == "fp32",
                  f"--{name.replace('_', '-')} {getattr(args, name)} needs --use-precision-aware-optimizer")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
    return args


def validate_attention(args) -> None:
    """Multi-latent attention's sizes, and its rope: MLA rotates its own qk-pos-emb channels."""
    if not args.multi_latent_attention:
        _need(args.rope_type in (None, "rope"), "--rope-type yarn needs --multi-latent-attention")
        return
    _need(not args.group_query_attention,
          "--multi-latent-attention and --group-query-attention exclude each other (as in Megatron-LM)")
    _need(args.position_embedding_type == "rope",
          "--multi-latent-attention applies its own rotary embedding: give --position-embedding-type "
          "rope (learned absolute positions would be added on top)")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _need(args.q_lora_rank is None or args.q_lora_rank >= 1,
          f"--q-lora-rank must be >= 1 (or not given: no query compression), got {args.q_lora_rank}")
    _need(args.qk_pos_emb_head_dim % 2 == 0,
          f"--qk-pos-emb-head-dim ({args.qk_pos_emb_head_dim}) must be even (rotary pairs)")
    _need(args.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0, got {args.rotary_scaling_factor}")


def validate_data(args) -> None:
    """Data, tokenizer and validation flags. A NullTokenizer adds its EOD id (= --vocab-size) to
    the model's vocabulary, as Megatron-LM does; once only, validate may run twice."""
    _need(not args.data_path or args.tokenizer_type == "NullTokenizer",
          "--data-path needs --tokenizer-type NullTokenizer (pretokenized .bin/.idx data)")
    if args.tokenizer_type == "NullTokenizer" and getattr(args, "eod_token", None) is None:
        args.eod_token = args.vocab_size
        args.vocab_size += 1
    _need(not args.reset_attention_mask or args.data_path,
          "--reset-attention-mask needs --data-path (the mock data has no documents)")
    _need(args.eval_interval is None or args.eval_interval >= 1,
          f"--eval-interval must be >= 1, got {args.eval_interval}")
    _need(args.eval_iters >= 1 or args.eval_interval is None,
          f"--eval-interval needs --eval-iters >= 1, got {args.eval_iters}")


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    return validate(build_parser().parse_args(argv), world_size)
