"""Build a megatron-core GPT (model chunks, DDP, optimizer, scheduler) from parsed arguments.

Everything here is plain megatron-core; the only choices are Megatron-LM's defaults and the
local (non-TE) layer spec when transformer-engine is absent.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                      get_gpt_mtp_block_spec)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.compat import core_version


def _have_legacy_grouped_gemm() -> bool:
    """megatron's legacy GroupedMLP with the grouped_gemm package (gone in megatron-core 0.19)."""
    if core_version() >= (0, 19):
        return False
    from megatron.core.transformer.moe import grouped_gemm_util

    return grouped_gemm_util.grouped_gemm_is_available()


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


# Megatron-LM flags that are TransformerConfig fields of the same name.
_MOE_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
              "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_layer_freq",
              "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate")
_MLA_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_base", "rotary_scaling_factor")


def transformer_config(args) -> TransformerConfig:
    dtype = params_dtype(args)
    moe = {}
    if args.num_experts is not None:
        moe = dict(num_moe_experts=args.num_experts, moe_router_dtype="fp32",
                   **{name: getattr(args, name) for name in _MOE_FLAGS})
    config_class, mla = TransformerConfig, {}
    if args.multi_latent_attention:
        config_class = MLATransformerConfig
        mla = {name: getattr(args, name) for name in _MLA_FLAGS}
        if args.rope_type:
            mla["rope_type"] = args.rope_type
    return config_class(
        num_layers=args.num_layers,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        qk_layernorm=args.qk_layernorm,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        deterministic_mode=False,
        # gloo matches batched isend/irecv between the same two ranks in posting order, which
        # swaps activations and gradients when PP=2 sends both ways at once; megatron's
        # unbatched path separates the two directions.
        batch_p2p_comm=not args.cpu,
        **moe,
        **mla,
    )


def layer_spec(args, config: TransformerConfig, vp_stage: Optional[int]):
    """The layer spec of one model chunk. MoE models take megatron's per-layer block spec, which
    places MoE and dense layers by `moe_layer_freq` and picks sequential or grouped experts.
    On CPU, MLA's core attention is cpu_mode's: the local spec asks cpu_mode for it
    (LocalOrContextParallelAttention; megatron's local one has one head size)."""
    return _megatron_layer_spec(args, config, vp_stage)


def _megatron_layer_spec(args, config: TransformerConfig, vp_stage: Optional[int]):
    te = _have_te() and not args.cpu
    if te and getattr(args, "reset_attention_mask", False):
        # megatron's TE layers attend with mask type "causal", for which transformer-engine
        # ignores a given mask: the documents would see each other without a word.
        raise ConfigError("--reset-attention-mask needs the local attention (--cpu here): megatron's "
                          "transformer-engine layer spec is causal and TE ignores the document mask")
    if (args.multi_latent_attention and args.qk_layernorm and args.q_lora_rank is None and not te
            and core_version() >= (0, 19)):
        # 0.19 norms MLA's uncompressed query input inside a fused norm+linear projection that only
        # transformer-engine has (mla_qk_norm_config.py, _resolve_mla_qk_layernorm); 0.16 had no
        # query norm there, and its local spec cannot build 0.19's.
        raise ConfigError("--multi-latent-attention --qk-layernorm without --q-lora-rank needs "
                          "transformer-engine on megatron-core 0.19 (it norms the query input in a fused "
                          "TE projection); add --q-lora-rank, drop --qk-layernorm, or use megatron-core 0.16")
    if args.num_experts is not None:
        if args.moe_grouped_gemm and not te and not _have_legacy_grouped_gemm():
            raise ConfigError(
                "--moe-grouped-gemm needs GPU kernels (transformer-engine, or the grouped_gemm "
                "package for megatron's legacy GroupedMLP, before megatron-core 0.19); without them "
                "train sequential experts: universal checkpoints move between the two expert layouts")
        return get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                          normalization=args.normalization, vp_stage=vp_stage)
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention)
    return get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                    multi_latent_attention=args.multi_latent_attention)


def mtp_spec(args, config: TransformerConfig, spec, vp_stage: Optional[int]):
    """megatron's MTP block for the chunk that holds it (the last stage's last), else None."""
    if not args.mtp_num_layers:
        return None
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=_have_te() and not args.cpu,
                                  vp_stage=vp_stage)


@dataclass
class TrainState:
    """What training owns: model chunks (DDP-wrapped), optimizer, scheduler, config."""

    model: List[torch.nn.Module]
    optimizer: object
    scheduler: OptimizerParamScheduler
    config: TransformerConfig
    pending_save: object = None  # an AsyncSave still writing, if any
    # Megatron-LM's bookkeeping: num_floating_point_operations_so_far, skipped_iterations.
    progress: dict = field(default_factory=dict)


def build_model(args, config: TransformerConfig) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank, wrapped in megatron's DDP."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        spec = layer_spec(args, config, stage)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            mtp_block_spec=mtp_spec(args, config, spec, stage),
            vp_stage=stage,
        )
        if args.bf16 or args.fp16:
            from megatron.core.transformer.module import Float16Module

            gpt = Float16Module(config, gpt)
        chunks.append(gpt)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]


def optimizer_config(args) -> OptimizerConfig:
    """Megatron-LM's optimizer settings. With the CPU stand-in for TE's FusedAdam, the
    precision-aware optimizer is switched on after megatron's check for TE (fused_adam_standin)."""
    aware = args.use_precision_aware_optimizer and not args.fused_adam_standin
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=aware,
        **({"main_params_dtype": _DTYPES[args.main_params_dtype],
            "exp_avg_dtype": _DTYPES[args.exp_avg_dtype],
            "exp_avg_sq_dtype": _DTYPES[args.exp_avg_sq_dtype],
            "store_param_remainders": args.store_param_remainders} if aware else {}),
    )
    if args.use_precision_aware_optimizer and args.fused_adam_standin:
        from megatron_ucp.mcore import fused_adam_standin

        fused_adam_standin.precision_aware(config, _DTYPES[args.exp_avg_dtype],
                                           _DTYPES[args.exp_avg_sq_dtype],
                                           _DTYPES[args.main_params_dtype])
    return config


def _finalize_model_grads(args, model):
    """megatron's finalize_model_grads, after dividing by TP the grads of MLA's query-latent norm
    in the local spec without sequence parallelism.

    megatron-core sums every `q_layernorm` grad over TP: right for per-head norms, but MLA's
    local spec normalizes the gathered query latent, whose grad each TP rank already holds whole
    (linear_q_up_proj all-reduces its input grad), so the sum would count it TP times. (With
    sequence parallelism each rank norms its own rows: the sum is right.) Transformer-engine's
    spec fuses that norm into linear_q_up_proj, out of the name's reach.
    """
    tp = args.tensor_model_parallel_size
    local_spec = args.cpu or not _have_te()
    if not (args.multi_latent_attention and args.q_lora_rank and args.qk_layernorm and local_spec
            and tp > 1 and not args.sequence_parallel):
        return finalize_model_grads
    norms = [p for chunk in model for name, p in chunk.named_parameters()
             if "self_attention.q_layernorm." in name]

    def finalize(*call_args, **call_kwargs):
        for param in norms:
            param.main_grad.div_(tp)
        return finalize_model_grads(*call_args, **call_kwargs)

    return finalize


def build_train_state(args) -> TrainState:
    config = transformer_config(args)
    model = build_model(args, config)
    optimizer = get_megatron_optimizer(optimizer_config(args), model)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        # The scheduler counts samples (it is stepped by the global batch), as in Megatron-LM.
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
        # A resume keeps the checkpoint's schedule (megatron-core's default; Megatron-LM's
        # --use-checkpoint-opt_param-scheduler) unless the command line's is asked for.
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    # Wire DDP into the schedules: grad sync after the last micro-batch, none before.
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = _finalize_model_grads(args, model)
    config.grad_scale_func = optimizer.scale_loss
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, config=config)


def release_train_state(state: TrainState) -> None:
    """Let the garbage collector free a finished session's model, optimizer and process groups.

    megatron's DDP hooks each parameter's gradient accumulator (an autograd node, C++) with a
    closure over the DDP module (distributed_data_parallel.py:344, 0.19.2 :388); the distributed
    optimizer's fp32 shards are views of the parameters (distrib_optimizer.py:421, 0.19.2 :467),
    whose autograd nodes lead back to those accumulators. The collector cannot see through C++
    nodes, so that cycle is never collected: each session's model, optimizer and process groups
    (their gloo threads, sockets and polling) outlive it. Measured on CPU: 51 threads and 86
    file descriptors more per 4-rank session, and a group's 25th session 10x slower than its
    first. The hooks are removed here; the session is over.
    """
    for chunk in state.model:
        accumulators = getattr(chunk, "grad_accs", [])
        for accumulator in accumulators:
            # the node's hooks live in one dict; a new hook's handle is the only way to it
            hooks = accumulator.register_hook(_no_hook).hooks_dict_ref()
            if hooks is not None:
                hooks.clear()
        accumulators.clear()


def _no_hook(*_):
    return None
