"""A Megatron-DeepSpeed-style GPT trained by DeepSpeed on CPU, for tests/test_deepspeed.py.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/ds_gpt.py SPEC.json

The model is plain torch with Megatron-DeepSpeed's parameter names and layouts and megatron-core
GPT's math (local spec, no dropout): word embeddings of the padded vocabulary, per layer
RMSNorm -> fused QKV (rows per query group: its query heads, its key head, its value head) ->
non-interleaved RoPE -> causal attention -> dense, RMSNorm -> SwiGLU `dense_h_to_4h` ([gate; up])
-> `dense_4h_to_h`, a final RMSNorm and the output layer (or the tied embedding), cross-entropy
over the padded vocabulary averaged over tokens. Batches are megatron_ucp's mock samples split
as Megatron's sampler splits them, so megatron-core trains on the same tokens after a resume.
A variant with `tp: 2` splits the model as Megatron-DeepSpeed does (each rank: whole query
groups, its [gate_r; up_r] rows, its vocabulary rows; row-parallel `dense`/`dense_4h_to_h`) and
gives DeepSpeed the groups through an `mpu`, so the save has one model-states file per TP rank
and ds_to_universal merges them by `universal_checkpoint_info`.

For each variant of SPEC it trains to `iters`, saving at `save_at` with Megatron-DeepSpeed's
client state (`args`, `iteration`, `universal_checkpoint_info`), converts that save with
`ds_to_universal`, then resumes a fresh model from the universal folder
(`checkpoint.load_universal`) and trains on: the DeepSpeed continuation megatron-core is compared
with. DeepSpeed's universal format drops the vocabulary padding rows and its loader pads with
zeros, so the continuation, not the uninterrupted run, is what an import can match.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_ucp.train.data import build_dataset, microbatches


# ---- tensor parallelism as Megatron-DeepSpeed's (tp > 1): whole query groups, [gate_r; up_r],
# vocabulary rows split over the ranks of `c.group` -----------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All ranks' last-dim slices, concatenated; a rank's gradient is its own slice's."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.rank, ctx.tp = rank, tp
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp, dim=-1)[ctx.rank].contiguous(), None, None, None


def copy_to_tp(x, c):
    return _CopyToTP.apply(x, c.group) if c.tp > 1 else x


def reduce_from_tp(x, c):
    return _ReduceFromTP.apply(x, c.group) if c.tp > 1 else x


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        rows = (c.heads + 2 * c.groups) * c.kv_channels // c.tp
        self.query_key_value = nn.Linear(c.hidden, rows, bias=False)
        self.dense = nn.Linear(c.heads * c.kv_channels // c.tp, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        c = self.c
        b, s, _ = x.shape
        per, heads, groups = c.heads // c.groups, c.heads // c.tp, c.groups // c.tp
        out = self.query_key_value(copy_to_tp(x, c))
        if c.qkv_layout == "thirds":  # Megatron-DeepSpeed since 676a482c: each TP rank's rows [Q; K; V] (MHA)
            # (qkv_ranks: the saving TP degree, where one process computes a TP run's merged weights)
            t = out.view(b, s, c.qkv_ranks, 3, heads // c.qkv_ranks, c.kv_channels)
            q, k, v = (t[:, :, :, i].reshape(b, s, heads, c.kv_channels) for i in range(3))
        else:  # per query group: its query heads, its key head, its value head
            qkv = out.view(b, s, groups, per + 2, c.kv_channels)
            q = qkv[:, :, :, :per].reshape(b, s, heads, c.kv_channels)
            k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, kv_channels]
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.kv_channels)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.float().masked_fill(mask, -10000.0), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, heads * c.kv_channels)
        return reduce_from_tp(self.dense(out), c)


def rope(t, cos, sin):
    """megatron-core's non-interleaved rotary embedding on [b, s, heads, dim]."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos.to(t.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(t.dtype)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.dense_h_to_4h = nn.Linear(c.hidden, 2 * c.ffn // c.tp, bias=False)
        self.dense_4h_to_h = nn.Linear(c.ffn // c.tp, c.hidden, bias=False)

    def forward(self, x):
        gate, up = torch.chunk(self.dense_h_to_4h(copy_to_tp(x, self.c)), 2, dim=-1)
        return reduce_from_tp(self.dense_4h_to_h(F.silu(gate) * up), self.c)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.self_attention = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Encoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.final_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)


class Embedding(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.padded_vocab // c.tp, c.hidden)


class LanguageModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embedding = Embedding(c)
        self.encoder = Encoder(c)
        if not c.tied:
            self.output_layer = nn.Linear(c.hidden, c.padded_vocab // c.tp, bias=False)


class GPT(nn.Module):
    """Parameter names as Megatron-DeepSpeed's GPTModel (no pipeline) names them."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.language_model = LanguageModel(c)
        dim = c.kv_channels
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(c.seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # [1, s, 1, dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.02)

    def forward(self, tokens, labels):
        logits = self.logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    def logits(self, tokens):
        """[batch, seq, padded vocabulary] logits (gathered over TP)."""
        c, lm = self.c, self.language_model
        rows = c.padded_vocab // c.tp
        first = c.rank * rows
        mine = (tokens >= first) & (tokens < first + rows)
        x = lm.embedding.word_embeddings(torch.where(mine, tokens - first, 0)) * mine.unsqueeze(-1)
        x = reduce_from_tp(x, c)
        for layer in lm.encoder.layers:
            x = layer(x, self.cos, self.sin)
        x = copy_to_tp(lm.encoder.final_layernorm(x), c)
        weight = lm.embedding.word_embeddings.weight if c.tied else lm.output_layer.weight
        logits = (x @ weight.t()).float()
        if c.tp > 1:
            logits = _GatherFromTP.apply(logits, c.group, c.rank, c.tp)
        return logits


def tp_slice(name: str, full: torch.Tensor, c) -> torch.Tensor:
    """The TP rank's part of a full parameter, as Megatron-DeepSpeed splits it."""
    if c.tp == 1 or full.dim() == 1:
        return full
    if name.endswith("dense_h_to_4h.weight"):  # each rank: its gate rows, then its up rows
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(c.tp, dim=0)[c.rank], up.chunk(c.tp, dim=0)[c.rank]])
    dim = 1 if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")) else 0
    return full.chunk(c.tp, dim=dim)[c.rank]


class MPU:
    """The model-parallel groups DeepSpeed asks for: TP over consecutive ranks, DP across them."""

    def __init__(self, tp):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.rank, self.world = tp, rank, world
        tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
        dp_groups = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
        self.tp_group, self.dp_group = tp_groups[rank // tp], dp_groups[rank % tp]

    def get_model_parallel_rank(self):
        return self.rank % self.tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.rank - self.rank % self.tp

    def get_data_parallel_rank(self):
        return self.rank // self.tp

    def get_data_parallel_world_size(self):
        return self.world // self.tp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return list(range(self.rank % self.tp, self.world, self.tp))


UC_INFO = {  # what Megatron-DeepSpeed's GPTModel.universal_checkpoint_info() lists, for TP1
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"language_model\.encoder\.final_layernorm\.weight",
                                         r"language_model\.encoder\.layers\.\d+\.input_layernorm\.weight",
                                         r"language_model\.encoder\.layers\.\d+\.post_attention_layernorm\.weight"],
    "parameter_with_row_parallelism_patterns": [r"language_model\.encoder\.layers\.\d+\.self_attention\.dense\.weight",
                                                r"language_model\.encoder\.layers\.\d+\.mlp\.dense_4h_to_h\.weight"],
    "vocabulary_parameter_patterns": [r"language_model\.embedding\.word_embeddings\.weight",
                                      r"language_model\.output_layer\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"language_model\.encoder\.layers\.\d+\.mlp\.dense_h_to_4h\.weight"],
}


def config(v, mpu=None):
    tp = mpu.tp if mpu else 1
    return argparse.Namespace(layers=2, hidden=32, heads=4, groups=v.get("groups", 2), kv_channels=8, ffn=48,
                              vocab=250, padded_vocab=256, seq=16, eps=1e-5, rope_theta=10000, tied=v["tied"], tp=tp,
                              qkv_layout=v.get("qkv_layout", "grouped"), qkv_ranks=v.get("qkv_ranks", 1),
                              rank=mpu.get_model_parallel_rank() if mpu else 0, group=mpu.tp_group if mpu else None)


def mds_args(c, v, consumed):
    """The training arguments Megatron-DeepSpeed saves (its names), for this model; `model_type`
    as its get_model() sets it: megatron.core.enums.ModelType (Megatron-DeepSpeed's own copy of
    that enum has the same module path; megatron-core's is used here), pickled by reference."""
    from megatron.core.enums import ModelType

    return argparse.Namespace(model_type=ModelType.encoder_or_decoder,
        num_layers=c.layers, hidden_size=c.hidden, ffn_hidden_size=c.ffn, num_attention_heads=c.heads,
        num_key_value_heads=c.groups, kv_channels=c.kv_channels, seq_length=c.seq,
        max_position_embeddings=c.seq, padded_vocab_size=c.padded_vocab, make_vocab_size_divisible_by=128,
        swiglu=True, normalization="rmsnorm", layernorm_epsilon=c.eps, use_rotary_position_embeddings=True,
        rope_theta=c.rope_theta, untie_embeddings_and_output_weights=not c.tied, add_bias_linear=False,
        apply_layernorm_1p=False, apply_residual_connection_post_layernorm=False, rotary_percent=1.0,
        tensor_model_parallel_size=c.tp, pipeline_model_parallel_size=1, micro_batch_size=v["mbs"],
        global_batch_size=v["gbs"], consumed_train_samples=consumed, train_iters=v["iters"], lr=v["lr"],
        min_lr=0.0, lr_decay_style="constant", weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=0.0, bf16=v["bf16"], fp16=False, seed=7, iteration=v["save_at"])


def engine_for(c, v, mpu, load_universal=False):
    import deepspeed
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(1 if not load_universal else 99)  # the resumed model starts elsewhere
    model = GPT(config(v))  # one initialisation, each TP rank keeping its part
    if c.tp > 1:
        full = model.state_dict()
        model = GPT(c)
        model.load_state_dict({k: tp_slice(k, t, c) for k, t in full.items()})
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    optimizer = torch.optim.AdamW(groups, lr=v["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    steps = v["iters"] * v["gbs"]
    scheduler = OptimizerParamScheduler(optimizer, init_lr=v["lr"], max_lr=v["lr"], min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=steps, lr_decay_style="constant", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=steps, wd_incr_style="constant")
    cfg = {"train_micro_batch_size_per_gpu": v["mbs"], "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "gradient_accumulation_steps": v["gbs"] // (v["mbs"] * dist.get_world_size() // c.tp),
           "zero_optimization": {"stage": 1}}
    if v["bf16"]:  # Megatron-DeepSpeed's set-up: BF16_Optimizer, fp32 gradient accumulation
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg,
                                           mpu=mpu)
    return engine


def train(engine, v, first, last, tp):
    """Iterations first..last; returns {iteration: loss averaged over the global batch}."""
    dataset = build_dataset(None, True, v["vocab"], v["seq"], 7)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = {}
    for it in range(first, last + 1):
        total = torch.zeros(1, dtype=torch.float64)  # TP ranks hold the same loss: averaged too
        batches = microbatches(dataset, (it - 1) * v["gbs"], v["gbs"], v["mbs"], rank // tp, world // tp)
        for batch in batches:
            loss = engine(batch["tokens"], batch["labels"])
            engine.backward(loss)
            engine.step(lr_kwargs={"increment": v["gbs"]})
            total += loss.detach().double() / (len(batches) * world)
        dist.all_reduce(total)
        losses[it] = float(total.item())
    return losses


def run_variant(v, root):
    mpu = MPU(v["tp"]) if v.get("tp", 1) > 1 else None
    c = config(v, mpu)
    save = os.path.join(root, v["name"])
    engine = engine_for(c, v, mpu)
    losses = train(engine, v, 1, v["save_at"], c.tp)
    tag = f"global_step{v['save_at']}"
    info = dict(UC_INFO, original_vocab_size=c.vocab, padded_vocab_size=c.padded_vocab)
    if c.tied:  # ds_to_universal refuses a pattern no parameter matches
        info["vocabulary_parameter_patterns"] = info["vocabulary_parameter_patterns"][:1]
    state = {"args": mds_args(c, v, v["save_at"] * v["gbs"]), "iteration": v["save_at"],
             "checkpoint_version": 3.0, "universal_checkpoint_info": info}
    engine.save_checkpoint(save, tag=tag, client_state=state)
    losses.update(train(engine, v, v["save_at"] + 1, v["iters"], c.tp))
    universal = os.path.join(save, tag + "_universal")
    if dist.get_rank() == 0:
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(save, tag), "--output_folder", universal], check=True,
                       stdout=subprocess.DEVNULL)
    dist.barrier()
    del engine
    resumed = engine_for(c, v, mpu, load_universal=True)
    _, client = resumed.load_checkpoint(save, tag=tag + "_universal")
    assert client["iteration"] == v["save_at"], client.get("iteration")
    continued = train(resumed, v, v["save_at"] + 1, v["iters"], c.tp)
    return {"losses": losses, "continued": continued, "universal": universal}


def main():
    import deepspeed

    spec = json.load(open(sys.argv[1]))
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for v in spec["variants"]:
        results[v["name"]] = run_variant(v, spec["root"])
    if dist.get_rank() == 0:
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(spec["result"] + ".tmp", spec["result"])


if __name__ == "__main__":
    main()
