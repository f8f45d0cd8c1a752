"""A tiny GPT trained with Megatron-Bridge's own `pretrain()`, checkpointed universally through
its `custom_manager_class` hook (README "Megatron-Bridge"; tests/test_bridge.py runs it):

    PYTHONPATH=$PWD:$PWD/.bridge-libs python -m torch.distributed.run --nproc-per-node 2 \
        examples/bridge_gpt.py --cpu --tp 1 --iters 4 --save /tmp/ckpt
    # the same run on another layout, resumed from it and trained on to iteration 6
    PYTHONPATH=$PWD:$PWD/.bridge-libs python -m torch.distributed.run --nproc-per-node 2 \
        examples/bridge_gpt.py --cpu --tp 2 --iters 6 --save /tmp/ckpt --load /tmp/ckpt

`--format torch_dist` leaves Bridge's default manager in place (Bridge's own checkpoints);
`--loss-log` writes one JSON line per iteration (the last rank's reduced loss).
"""

import argparse
import json
import os

import megatron_ucp.bridge  # noqa: F401  (before megatron.bridge: the manager's prefix, stand-ins)

MANAGER = "megatron_ucp.bridge.UniversalCheckpointManager"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU processes over gloo")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--exit-interval", type=int, help="save and stop at this iteration (of the same schedule)")
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--ckpt-step", type=int, help="the iteration to load (default: the tracker's)")
    p.add_argument("--format", choices=["universal", "torch_dist"], default="universal")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=32)
    p.add_argument("--loss-log")
    return p.parse_args()


def config(a):
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig,
                                                 SchedulerConfig, TrainingConfig)
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    model = GPTModelProvider(
        num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, seq_length=16,
        vocab_size=None, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,  # the tokenizer's, padded as Megatron-LM pads
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        expert_model_parallel_size=a.ep, num_moe_experts=a.num_experts,
        moe_router_topk=2 if a.num_experts else 2, moe_ffn_hidden_size=32 if a.num_experts else None,
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", transformer_layer_spec=local_layer_spec, bf16=False, fp16=False,
        params_dtype=__import__("torch").float32, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, cross_entropy_loss_fusion=False,
        sequence_parallel=False)
    distributed = not a.no_distributed_optimizer
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=a.iters, exit_interval=a.exit_interval, micro_batch_size=2, global_batch_size=8, eval_interval=1000,
                             eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=5e-3, min_lr=0.0, weight_decay=0.01, bf16=False,
                                  fp16=False, use_distributed_optimizer=distributed, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True),
        dataset=MockGPTDatasetConfig(seq_length=16, random_seed=7, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="1,1,1", dataloader_type="single", num_workers=0,
                                     skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=250),
        checkpoint=CheckpointConfig(
            save=a.save, load=a.load, ckpt_step=a.ckpt_step, save_interval=a.save_interval if a.save else None, ckpt_format="torch_dist",
            async_save=a.async_save, async_strategy="mcore",  # nvrx: nvidia-resiliency-ext
            custom_manager_class=MANAGER if a.format == "universal" else None),
        rng=RNGConfig(seed=7),
    )


def loss_logger(path):
    """A Bridge callback writing {iteration, loss} per step from the rank that holds the reduced
    loss (the last pipeline stage's first tensor-parallel rank; the loss is DP-averaged)."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.core import parallel_state as ps

    class LossLog(Callback):
        def on_train_step_end(self, context):
            if not context.loss_dict or not (ps.is_pipeline_last_stage(ignore_virtual=True)
                                             and ps.get_tensor_model_parallel_rank() == 0
                                             and ps.get_data_parallel_rank() == 0):
                return
            with open(path, "a") as f:
                line = {"iteration": context.state.train_state.step + 1,  # counted after the step
                        "loss": float(context.loss_dict["lm loss"])}
                f.write(json.dumps(line) + "\n")

    return [LossLog()]


def main():
    a = parse()
    megatron_ucp.bridge.install(cpu=a.cpu)
    if a.cpu:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = config(a)
    if a.cpu:
        cfg.dist.distributed_backend = "gloo"
    pretrain(cfg, forward_step, callbacks=loss_logger(a.loss_log) if a.loss_log else None)


if __name__ == "__main__":
    main()
