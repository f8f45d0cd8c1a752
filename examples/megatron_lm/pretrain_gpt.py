"""A GPT pretraining script of the shape of Megatron-LM's `pretrain_gpt.py`, for the plug-in.

It only calls Megatron-LM's trainer (`megatron.training.pretrain`, shipped in megatron-core
>= 0.17); nothing in it knows about universal checkpoints. Run it through the plug-in:

    torchrun --nproc-per-node 2 -m megatron_ucp.megatron_lm [--cpu] examples/megatron_lm/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 20 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
        --save ckpt --save-interval 10 --ckpt-format universal

The model is megatron-core's GPTModel with transformer-engine's layer spec where TE is installed
(`--transformer-impl transformer_engine`, Megatron-LM's default), else the local spec; MoE
layers come from megatron's decoder block spec. Data: megatron-core's GPTDataset, or its mock
dataset with `--mock-data`.
"""

import inspect
import json
import os
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
try:
    from megatron.training.utils import get_blend_and_blend_per_split
except ImportError:
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split


def _transformer_config(args):
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """megatron-core's GPTModel for this rank's pipeline stage (and virtual stage)."""
    args = get_args()
    config = config or _transformer_config(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
            normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )


# Tests and demos: every training (not validation) micro-batch's summed loss and token count, one
# JSON line each, in UCP_LOSS_LOG.rank<N>. An iteration's loss is their sums' ratio: the value
# Megatron-LM logs, whose first logged iteration after a start is not reset (the second logged
# then averages two iterations).
LOSS_LOG = os.environ.get("UCP_LOSS_LOG")


def loss_func(loss_mask, output_tensor):
    """Summed token losses and the token count, as Megatron-LM's GPT loss reports them."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if LOSS_LOG and torch.is_grad_enabled() and parallel_state.get_tensor_model_parallel_rank() == 0:
        record = {"iteration": get_args().curr_iteration + 1, "loss": float(loss), "tokens": int(num_tokens)}
        with open(f"{LOSS_LOG}.rank{torch.distributed.get_rank()}", "a") as f:
            f.write(json.dumps(record) + "\n")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def get_batch(data_iterator, vp_stage=None):
    """This micro-batch on the stages that use it: read on tensor-parallel rank 0, broadcast over
    the tensor-parallel group (megatron's broadcast_data, the same in every release)."""
    if not (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)):
        return None, None, None, None, None
    args = get_args()
    data = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    ints = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids"], data, torch.int64)
    mask = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)["loss_mask"]
    attention_mask = None
    if args.create_attention_mask_in_dataloader:
        attention_mask = tensor_parallel.broadcast_data(["attention_mask"], data, torch.bool)["attention_mask"]
    return ints["tokens"], ints["labels"], mask, attention_mask, ints["position_ids"]


def forward_step(data_iterator, model, return_schedule_plan=False):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, getattr(model, "vp_stage", None))
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _dataset_config(args):
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()

    def built_here():
        return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)) \
            and parallel_state.get_tensor_model_parallel_rank() == 0

    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here,
                                         _dataset_config(args)).build()


train_valid_test_datasets_provider.is_distributed = True


def main():
    """Megatron-LM's pretrain; 0.18 and 0.19 take a config container built from the parsed
    flags, 0.17 parses the flags inside pretrain()."""
    if "cfg_container" in inspect.signature(pretrain).parameters:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        pretrain(pretrain_cfg_container_from_args(args),  # 0.18 and 0.19 order the rest differently
                 train_valid_test_dataset_provider=train_valid_test_datasets_provider,
                 model_provider=model_provider, model_type=ModelType.encoder_or_decoder,
                 forward_step_func=forward_step)
    else:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


if __name__ == "__main__":
    main()
