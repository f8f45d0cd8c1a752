"""Validation of the parsed flags of `pretrain_gpt_ucp.py` (declared in mcore/flags.py).

`validate(args, world_size)` fills what the flags imply (the data-parallel size, the padded
vocabulary, the virtual pipeline size, the number of micro-batches) and refuses at start-up, with
a one-line ConfigError naming the flags at fault, every combination megatron-core would fail on
later or no checkpoint could describe. The converters validate a source run's stored arguments
for its world the same way (convert/source_model.py); the elastic layout policy
(mcore/elastic.py) is tested against these rules.
"""

import argparse

from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.elastic import pipeline_split_problem


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def keeps_saved_padding(saved_padded, vocab_size: int, tp: int) -> bool:
    """A checkpoint's padded vocabulary that a run can keep: it holds the vocabulary and divides
    over tensor parallelism (padding rows take part in the softmax: keeping their number keeps
    the loss curve)."""
    return bool(saved_padded) and saved_padded >= vocab_size and saved_padded % tp == 0


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
    validate_local_tier(args)
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


def validate_local_tier(args) -> None:
    """The local checkpoint tier's flags (the own loop's; docs/elastic.md)."""
    local = getattr(args, "local_ckpt_dir", None)
    interval = getattr(args, "local_save_interval", None)
    _need(interval is None or local is not None, "--local-save-interval needs --local-ckpt-dir")
    if local is None:
        return
    _need(interval is not None and interval >= 1,
          f"--local-ckpt-dir needs --local-save-interval >= 1, got {interval}")
    _need(args.local_ckpt_replicas >= 0, f"--local-ckpt-replicas must be >= 0, got {args.local_ckpt_replicas}")
    _need(args.ckpt_format == "universal",
          "--local-ckpt-dir needs --ckpt-format universal (its pieces are universal, so that they reshard)")
    check_tier_apart(getattr(args, "save", None), local)


def check_tier_apart(save, local, flag: str = "--local-ckpt-dir") -> None:
    """The local tier's dir and --save hold nothing of each other: the tier prunes its own
    folders (and its node dirs are named by host), a checkpoint folder is --save's."""
    import os

    if not save or not local:
        return
    a, b = os.path.realpath(save), os.path.realpath(local)
    if os.path.commonpath([a, b]) in (a, b):
        where = "is" if a == b else ("is inside" if os.path.commonpath([a, b]) == b else "holds")
        raise ConfigError(f"--save {save} {where} {flag} {local}: the local tier and the persistent "
                          "checkpoints need folders apart (the tier's is node-local: /dev/shm or a local disk)")


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
