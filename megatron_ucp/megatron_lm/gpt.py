"""The project's GPT pretraining script for Megatron-LM's trainer, of the shape of Megatron-LM's
`pretrain_gpt.py`: model, forward step and dataset providers handed to `megatron.training.pretrain`.

It knows nothing of universal checkpoints: `pretrain_gpt_ucp.py` (megatron-core >= 0.17) runs
it through the plug-in, as `python -m megatron_ucp.megatron_lm` runs any such script:

    torchrun --nproc-per-node 2 pretrain_gpt_ucp.py --cpu --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 \\
        --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \\
        --save ckpt --save-interval 10 --ckpt-format universal

The model is megatron-core's GPTModel: transformer-engine's layer spec where TE is installed
(`--transformer-impl transformer_engine`, Megatron-LM's default), else the local one; MoE layers
from megatron's decoder block spec; MLA (`--multi-latent-attention`) and MTP (`--mtp-num-layers`)
as Megatron-LM builds them. Data: megatron-core's GPTDataset, or its mock dataset (`--mock-data`,
with a NullTokenizer of the own loop's vocabulary unless --tokenizer-type is given).
"""

import inspect
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec,
                                                      get_gpt_mtp_block_spec)
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
try:
    from megatron.training.utils import get_blend_and_blend_per_split
except ImportError:  # 0.19 moved it
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split


def _layer_spec(args, config, use_te, vp_stage):
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization=args.normalization, vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention)
    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, normalization=args.normalization)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """megatron-core's GPTModel for this rank's pipeline stage (and virtual stage)."""
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec = _layer_spec(args, config, use_te, vp_stage)
    mtp_spec = None
    if args.mtp_num_layers:
        layer = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
        mtp_spec = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=use_te, vp_stage=vp_stage)
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
        rope_scaling=getattr(args, "use_rope_scaling", False),
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )


def loss_func(loss_mask, output_tensor):
    """Summed token losses and the token count, as Megatron-LM's GPT loss reports them (the
    trainer divides their sums over the global batch)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
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
    batch = {"tokens": ints["tokens"], "labels": ints["labels"], "loss_mask": mask,
             "attention_mask": attention_mask, "position_ids": ints["position_ids"]}
    if args.context_parallel_size > 1:
        batch = _on_this_context_parallel_rank(batch)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def _on_this_context_parallel_rank(batch):
    """This rank's two load-balanced chunks of every sequence (megatron's own split); 0.19's
    get_batch_on_this_cp_rank takes is_hybrid_cp and the group; earlier releases (0.16.1's, seen)
    the batch and an optional group, which defaults to megatron's CP group."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                         cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def forward_step(data_iterator, model, return_schedule_plan=False):
    # the model arrives wrapped (DDP, Float16Module); its virtual stage is the GPTModel's
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
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


def mock_data_tokenizer(args) -> None:
    """--mock-data without --tokenizer-type: megatron's NullTokenizer with the vocabulary the
    project's own loop gives the same command line (--vocab-size, else its default), EOD the
    last entry; nothing is downloaded (the GPT2BPETokenizer default fetches a vocabulary), and
    one command line trains the same model on either trainer."""
    if not (getattr(args, "mock_data", False) and args.tokenizer_type is None):
        return
    from megatron_ucp.mcore.flags import build_parser
    from megatron_ucp.megatron_lm.vocab import null_tokenizer_extra

    entries = args.vocab_size or build_parser().get_default("vocab_size")
    args.tokenizer_type = "NullTokenizer"
    args.vocab_size = entries - null_tokenizer_extra(args)


def _parsed_with_mock_tokenizer(parser, defaults):
    """An extra-arguments provider that adds no flag: it applies `mock_data_tokenizer` to what
    the parser returns, before --use-checkpoint-args and validate_args (which applies
    `defaults`, the script's args_defaults: a tokenizer chosen here is not one to override)."""
    original = parser.parse_known_args

    def parse_known_args(*args, **kwargs):
        parsed, rest = original(*args, **kwargs)
        if parsed.tokenizer_type is None:
            mock_data_tokenizer(parsed)
            if parsed.tokenizer_type is not None:
                defaults.pop("tokenizer_type", None)
        return parsed, rest

    parser.parse_known_args = parse_known_args  # argparse's parse_args calls it too
    return parser


def main():
    """Megatron-LM's pretrain; 0.18 and 0.19 take a config container built from the parsed
    flags, 0.16 (a clone's trainer) and 0.17 parse the flags inside pretrain()."""
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}  # Megatron-LM's pretrain_gpt.py's
    if "cfg_container" in inspect.signature(pretrain).parameters:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(extra_args_provider=partial(_parsed_with_mock_tokenizer, defaults=defaults),
                                       args_defaults=defaults)
        pretrain(pretrain_cfg_container_from_args(args),  # 0.18 and 0.19 order the rest differently
                 train_valid_test_dataset_provider=train_valid_test_datasets_provider,
                 model_provider=model_provider, model_type=ModelType.encoder_or_decoder,
                 forward_step_func=forward_step)
    else:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 forward_step, extra_args_provider=partial(_parsed_with_mock_tokenizer, defaults=defaults),
                 args_defaults=defaults)


if __name__ == "__main__":
    main()
