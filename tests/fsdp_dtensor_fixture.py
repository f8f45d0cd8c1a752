"""Hand-built Megatron-FSDP `fsdp_dtensor` checkpoints, small and without a trainer: the keys,
shapes and objects Megatron-LM's `preprocess_fsdp_dtensor_state_dict` saves (see
convert/fsdp_dtensor_keys.py), for a dense GPT built from the stored arguments on the meta
device, written with torch DCP in one process. Hostile tests edit the arguments and objects.
"""

import argparse
import functools
from pathlib import Path

import torch

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "250", "--make-vocab-size-divisible-by", "32", "--untie-embeddings-and-output-weights"]
PADDED = 256
ITERATION = 4
GROUP = {"step": 4, "lr": 5e-3, "min_lr": 0.0, "max_lr": 5e-3, "weight_decay": 0.01, "wd_mult": 1.0,
         "lr_mult": 1.0, "betas": (0.9, 0.999), "eps": 1e-8, "bias_correction": True}
SCHEDULER = {"max_lr": 5e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 80,
             "lr_decay_style": "constant", "num_steps": 32, "start_wd": 0.01, "end_wd": 0.01,
             "wd_incr_steps": 80, "wd_incr_style": "constant"}


def stored_args(**changes) -> dict:
    from megatron_ucp.mcore.flags import build_parser

    args = vars(build_parser().parse_args(ARGV))
    args.update(world_size=2, data_parallel_size=2, tokenizer_type="NullTokenizer", null_tokenizer_eod_id=249,
                consumed_train_samples=32, transformer_impl="local", use_megatron_fsdp=True,
                ckpt_format="fsdp_dtensor")
    args.update(changes)
    return args


@functools.lru_cache(maxsize=None)
def _shapes() -> tuple:
    from megatron_ucp.convert.source_model import meta_model, single_process_megatron, source_args

    source = source_args(ARGV + ["--cpu", "--mock-data"], 2)
    with single_process_megatron():
        gpt = meta_model(source, PADDED)
        return tuple((path, tuple(p.shape)) for path, p in gpt.named_parameters())


def parameter_shapes() -> dict:
    """Module path -> shape of every parameter of the model ARGV describes (megatron's own)."""
    return dict(_shapes())


def replace_object(folder: Path, fqn: str, blob: bytes) -> None:
    """Point the sharded object `fqn` at `blob` (a torch.save file's bytes), appended to its
    .distcp file."""
    import dataclasses
    import pickle

    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own fresh save: trusted
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data[index]
    data_file = folder / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def write(root: Path, args=None, group=None, scheduler=None, objects=None, shapes=None) -> Path:
    """An `iter_0000004` folder under root; returns it. `args`: the stored arguments (a dict,
    saved as Megatron-LM saves them: a Namespace); `group`: every parameter's group settings;
    `objects`: further sharded objects by key (their values as given)."""
    import torch.distributed.checkpoint as dcp

    shapes = parameter_shapes() if shapes is None else shapes
    sd = {"iteration": ITERATION, "args": argparse.Namespace(**(stored_args() if args is None else args))}
    gen = torch.Generator().manual_seed(0)
    for path, shape in shapes.items():
        sd[f"model.module.{path}"] = torch.randn(shape, generator=gen)
        for moment in ("exp_avg", "exp_avg_sq"):
            sd[f"optimizer.state.module.{path}.{moment}"] = torch.rand(shape, generator=gen)
        for field, value in (GROUP if group is None else group).items():
            sd[f"optimizer.param_to_group_meta.module.{path}.{field}"] = value
    for field, value in (SCHEDULER if scheduler is None else scheduler).items():
        sd[f"opt_param_scheduler.{field}"] = value
    sd.update(objects or {})
    folder = root / f"iter_{ITERATION:07d}"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder
