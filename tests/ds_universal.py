"""A DeepSpeed universal checkpoint written by hand, as ds_to_universal writes one, of a
tests/ds_gpt.py model: for import tests that need no DeepSpeed run (hostile values, layouts a
CPU DeepSpeed run does not make).

What is written follows DeepSpeed 0.19's deepspeed/checkpoint/ds_to_universal.py and
runtime/engine.py, and Megatron-DeepSpeed's checkpointing and scheduler:
- zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt: {"param": the TP-merged tensor, "cat_dim": 0 or 1
  (1 for row-parallel parameters), "param_n_sub_params": 2 (SwiGLU's dense_h_to_4h),
  "vocab_tensor": True (vocabulary rows cut to original_vocab_size)}; replicated parameters
  (the norms) carry no cat_dim under TP; zero/<param>/step.pt: Adam's step as a tensor;
- zero/optimizer_state.pt: the optimizer's other state with torch's `param_groups`;
- mp_rank_00_model_states.pt: DeepSpeed's common state (`_common_checkpoint_state`: param_shapes
  per group, lr_scheduler, skipped_steps, global_steps, global_samples, dp_world_size,
  checkpoint_parallel_dimensions, ds_config, ds_version) and Megatron-DeepSpeed's client state
  (args, iteration, checkpoint_version, universal_checkpoint_info).
"""

import argparse
import collections
import os

import torch

from ds_gpt import GPT, UC_INFO, config, mds_args

STEP = 5
GBS = 8


def megatron_deepspeed_scheduler(steps: int) -> dict:
    """Megatron-DeepSpeed's OptimizerParamScheduler.state_dict() of a constant step-based schedule."""
    return {"max_lr": 5e-3, "lr_warmup_steps": 0, "lr_warmup_tokens": None, "num_steps": steps * GBS,
            "num_tokens": steps * GBS * 16, "lr_decay_style": "constant", "lr_decay_steps": 10 * GBS,
            "lr_decay_tokens": None, "min_lr": 0.0, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
            "wd_incr_steps": 10 * GBS}


def model(variant: dict, seed: int = 3) -> GPT:
    """A ds_gpt GPT (one process) with random weights: `variant` as ds_gpt's (tied, groups,
    qkv_layout, qkv_ranks: the saving TP degree its query_key_value rows are split by)."""
    torch.manual_seed(seed)
    return GPT(config(dict(variant)))


def args_of(gpt: GPT, variant: dict, **changes) -> argparse.Namespace:
    args = mds_args(gpt.c, dict(variant, mbs=2, gbs=GBS, iters=10, lr=5e-3, bf16=False, save_at=STEP), STEP * GBS)
    args.tensor_model_parallel_size = variant.get("qkv_ranks", 1)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def replicated(name: str) -> bool:
    """Whole on every TP rank (Megatron-DeepSpeed's _get_tp_replicated_param_patterns): the norms,
    the learned positions, the row-parallel layers' biases."""
    return "layernorm" in name or name.endswith(("dense.bias", "dense_4h_to_h.bias", "position_embeddings.weight"))


class Tensors:
    """Random tensors under Megatron-DeepSpeed's names for the model variants ds_gpt does not
    build (LayerNorm, GELU, linear biases, learned positions; GPTModelPipe's names): what write()
    takes as `gpt` (`c` and `state_dict()`). Only their names and shapes follow the model; what
    they compute is deepspeed_proof's reference and megatron-core's to agree on."""

    def __init__(self, c, seed: int = 5, pipe: bool = False):
        self.c, self.pipe = c, pipe
        g = torch.Generator().manual_seed(seed)
        h, f, hn = c.hidden, c.ffn, c.kv_channels
        qkv, fc1 = (c.heads + 2 * c.groups) * hn, 2 * f if c.swiglu else f

        def rand(*shape, mean=0.0, std=0.02):
            return mean + std * torch.randn(*shape, generator=g)
        out = {"language_model.embedding.word_embeddings.weight": rand(c.padded_vocab, h)}
        if c.learned:
            out["language_model.embedding.position_embeddings.weight"] = rand(c.seq, h)
        norms = ["input_layernorm", "post_attention_layernorm"]
        for i in range(c.layers):
            p = f"language_model.encoder.layers.{i}."
            for n in norms:
                out[p + n + ".weight"] = rand(h, mean=1.0, std=0.1)
                if c.layernorm:
                    out[p + n + ".bias"] = rand(h, std=0.1)
            out.update({p + "self_attention.query_key_value.weight": rand(qkv, h),
                        p + "self_attention.dense.weight": rand(h, c.heads * hn),
                        p + "mlp.dense_h_to_4h.weight": rand(fc1, h), p + "mlp.dense_4h_to_h.weight": rand(h, f)})
            if c.bias:
                out.update({p + "self_attention.query_key_value.bias": rand(qkv),
                            p + "self_attention.dense.bias": rand(h),
                            p + "mlp.dense_h_to_4h.bias": rand(fc1), p + "mlp.dense_4h_to_h.bias": rand(h)})
        out["language_model.encoder.final_layernorm.weight"] = rand(h, mean=1.0, std=0.1)
        if c.layernorm:
            out["language_model.encoder.final_layernorm.bias"] = rand(h, std=0.1)
        if not c.tied:
            out["language_model.output_layer.weight"] = rand(c.padded_vocab, h)
        self.tensors = {self._pipe_name(k) if pipe else k: v for k, v in out.items()}

    def _pipe_name(self, name: str) -> str:
        """GPTModelPipe's: the tied embedding, layer specs from 2, the final norm's spec after them."""
        if name.startswith("language_model.embedding."):
            return "tied_modules.embed." + name.split(".", 2)[2]
        if name.startswith("language_model.encoder.layers."):
            i, rest = name.split(".", 4)[3:]
            return f"{int(i) + 2}.{rest}"
        return f"{self.c.layers + 2}.{name.rsplit('.', 1)[1]}"  # the final norm (pipe names: tied only)

    def state_dict(self) -> dict:
        return dict(self.tensors)


def write(folder, gpt: GPT, args, tp: int = 1, states: dict = None, seed: int = 4) -> str:
    """`gpt`'s weights (and random Adam moments) as ds_to_universal writes them from a run on
    `tp` TP ranks; `states`: top-level entries of the model states to replace."""
    folder = str(folder)
    c = gpt.c
    info = dict(UC_INFO, original_vocab_size=c.vocab, padded_vocab_size=c.padded_vocab)
    if c.tied:
        info["vocabulary_parameter_patterns"] = info["vocabulary_parameter_patterns"][:1]
    generator = torch.Generator().manual_seed(seed)
    shapes = collections.OrderedDict()
    for name, full in gpt.state_dict().items():
        vocab = name.endswith(("word_embeddings.weight", "output_layer.weight"))
        record = {}
        if tp > 1 and not replicated(name):
            record["cat_dim"] = 1 if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")) else 0
        elif tp == 1:
            record["cat_dim"] = 0
        if name.endswith("dense_h_to_4h.weight") and getattr(c, "swiglu", True):
            record.update(cat_dim=0, param_n_sub_params=2)
        if vocab:
            record["vocab_tensor"] = True
        local = list(full.shape)
        local[1 if record.get("cat_dim") == 1 else 0] //= tp if "cat_dim" in record and tp > 1 else 1
        shapes[name] = torch.Size(local)
        kept = full[:c.vocab] if vocab else full
        os.makedirs(os.path.join(folder, "zero", name), exist_ok=True)
        moments = {"fp32": kept.detach().clone(), "exp_avg": torch.randn(kept.shape, generator=generator) * 1e-3,
                   "exp_avg_sq": torch.rand(kept.shape, generator=generator) * 1e-6}
        for state, tensor in moments.items():
            torch.save(dict(record, param=tensor.float()), os.path.join(folder, "zero", name, f"{state}.pt"))
        torch.save(torch.tensor(float(STEP)), os.path.join(folder, "zero", name, "step.pt"))
    groups = [{"lr": 5e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
               "wd_mult": 1.0, "lr_mult": 1.0, "params": list(range(len(shapes)))}]
    torch.save({"param_groups": groups, "zero_stage": 1, "loss_scaler": None, "dynamic_loss_scale": False,
                "overflow": False, "clip_grad": 0.0},
               os.path.join(folder, "zero", "optimizer_state.pt"))
    model_states = {
        "module": None, "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": megatron_deepspeed_scheduler(STEP), "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": STEP, "global_samples": STEP * GBS, "dp_world_size": 1,
        "mp_world_size": tp, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": tp},
        "ds_config": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                      "zero_optimization": {"stage": 1}},
        "ds_version": "0.19.8", "args": args, "iteration": STEP, "checkpoint_version": 3.0,
        "universal_checkpoint_info": info}
    model_states.update(states or {})
    torch.save(model_states, os.path.join(folder, "mp_rank_00_model_states.pt"))
    return folder
