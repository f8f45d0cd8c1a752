"""Import a DeepSpeed universal checkpoint of a Megatron-DeepSpeed GPT as one of ours.

    python -m megatron_ucp.convert.deepspeed DS_UNIVERSAL_DIR OUT [--workers N] [--no-progress]
        [--qkv-layout thirds|grouped] [--no-proof]

DS_UNIVERSAL_DIR is what `python -m deepspeed.checkpoint.ds_to_universal` wrote: `zero/<param>/
{fp32,exp_avg,exp_avg_sq,step}.pt` (full, TP-merged tensors), `zero/optimizer_state.pt` and the
copied `mp_rank_*_model_states.pt` (Megatron-DeepSpeed's client state: `args`, `iteration`,
`universal_checkpoint_info`; DeepSpeed's `lr_scheduler`, `global_steps`, `global_samples`). The
result is a universal checkpoint at the same iteration with the fp32 master weights, Adam's
moments and step, the scheduler, the consumed samples and the architecture, and the flags to
continue with (also stored in the manifest for `--use-checkpoint-args`).

Names, shapes and merge records are checked by deepspeed_map.py, query_key_value's row order
(Megatron-DeepSpeed's per-group one, or its thirds since commit 676a482c) by deepspeed_qkv.py,
every stored value's type and range by deepspeed_values.py. Every file is input from strangers:
only regular files inside the folder are opened, each bounded in size, unpickled with
`weights_only` (safe_pickle); the few DeepSpeed classes `optimizer_state.pt` names, and the
enums Megatron-DeepSpeed's args hold (`model_type`: megatron.core.enums.ModelType), are read
into inert stand-ins. One parameter's tensors are in memory at a time (writer.py streams them).

DeepSpeed's universal format drops the vocabulary padding rows (ds_to_universal keeps
`original_vocab_size` rows) and its own loader pads with zeros; the import records zero padding
rows up to the saving run's padded vocabulary, so a resume computes what DeepSpeed's resume from
the same folder computes.
"""

import argparse
import math
import os
import time

import numpy as np

from megatron_ucp.convert import deepspeed_map as dsm, deepspeed_qkv as qkv, deepspeed_values as dv, megatron_args
from megatron_ucp.convert import output_folder, safe_pickle, store_output, writer as stream_write
from megatron_ucp.convert.source_model import given_args
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, run_command
from megatron_ucp.format import manifest as mf, safe_files, storage, zip_bounds
from megatron_ucp.format.layout import PADDING
from megatron_ucp.format.tensor_entry import STATES, TensorEntry

STATE_FILES = {"param": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}
RECORD_KEYS = {"param", "cat_dim", "vocab_tensor", "param_n_sub_params", "sub_param_shape"}
MAX_SMALL_BYTES = 64 * 2**20  # step.pt, optimizer_state.pt: scalars and a few records
MAX_PICKLE_BYTES = 256 * 2**20  # a model-states file's pickle (its tensors are mmap'ed, not in it)


class Opaque:
    """An inert stand-in for a class DeepSpeed pickles into its records (a loss scaler, an
    enum): the pickle's arguments and state kept as data, nothing of DeepSpeed run."""

    def __init__(self, *args):
        self.args = args
        self.state = None

    def __setstate__(self, state):
        self.state = state


class PositionEmbeddingType(Opaque):
    """Megatron-DeepSpeed's `args.position_embedding_type` enum (its forks' `enums.py`:
    rotary = 1, absolute = 2, alibi = 3), read as its member's name."""

    NAMES = {1: "rotary", 2: "absolute", 3: "alibi"}

    def name(self):
        return self.NAMES.get(self.args[0] if len(self.args) == 1 else None, f"unknown {self.args!r}")


# What `zero/optimizer_state.pt` names besides torch's own types (DeepSpeed 0.19: ZeRO-1/2 and
# BF16_Optimizer saves), and the position embedding enum of Megatron-DeepSpeed's args.
# Megatron-DeepSpeed's get_model() stores `args.model_type` as megatron.core.enums.ModelType (its
# own copy of megatron-core's enum, same module path): read as Megatron-LM's args are
# (megatron_args.STAND_INS), without megatron imported.
STAND_INS = [(Opaque, name) for name in (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",  # an fp32.pt's record, refused by name
)] + [(PositionEmbeddingType, f"{module}.PositionEmbeddingType")
      for module in ("megatron.enums", "megatron.model.enums")] + megatron_args.STAND_INS


def _pickle_size(path: str, what: str) -> int:
    """The bytes of a torch.save zip file's pickle (what torch.load reads into memory), from its
    zip directory, read within zip_bounds' limits."""
    infos = zip_bounds.entries(path, f"{what} {path}")
    return max((i.file_size for i in infos if i.filename.endswith("/data.pkl")), default=0)


def _load(path: str, what: str, root: str, max_bytes: int, mmap: bool = False):
    if mmap:  # a large file: its tensors stay on disk, its pickle is bounded
        os.close(safe_files.open_regular(path, what, root))
        if _pickle_size(path, what) > MAX_PICKLE_BYTES:
            raise FormatError(f"{what} {path}: its pickle is over {MAX_PICKLE_BYTES} bytes; refused")
        return safe_pickle.load_file(path, what, root, mmap=True, stand_ins=STAND_INS)
    raw = safe_files.read_bounded(path, what, max_bytes, root)
    return safe_pickle.torch_load(raw, f"{what} {path}", stand_ins=STAND_INS)


def _named(value):
    """A DeepSpeed stand-in's text for deepspeed_values.plain (None: not one of ours)."""
    if isinstance(value, PositionEmbeddingType):
        return value.name()
    if isinstance(value, Opaque):
        return f"<{type(value).__name__}>"
    return None


def plain_args(stored, path: str) -> dict:
    """Megatron-DeepSpeed's `args` (a Namespace, or a dict) as JSON-able data: stand-ins as
    their text, non-finite numbers as text, nesting bounded (deepspeed_values.plain)."""
    if isinstance(stored, argparse.Namespace):
        stored = vars(stored)
    if not isinstance(stored, dict):
        raise ConfigError(f"{path}: no Megatron-DeepSpeed 'args' (the model's description); only "
                          "Megatron-DeepSpeed GPT checkpoints are imported")
    return {str(k): dv.plain(v, f"{path}: args.{k}", named=_named) for k, v in stored.items()}


def model_states(folder: str) -> tuple:
    """(path, dict) of the first `mp_rank_*_model_states.pt` (every TP rank's copy holds the same
    client state; DeepSpeed's records there are global)."""
    if not os.path.isdir(folder):
        raise IncompleteCheckpointError(f"{folder}: no such folder (expected the folder "
                                        "ds_to_universal wrote)")
    files = sorted(f for f in os.listdir(folder) if f.startswith("mp_rank_") and f.endswith("_model_states.pt"))
    if not files:
        raise IncompleteCheckpointError(f"{folder}: no mp_rank_*_model_states.pt (not a folder "
                                        "ds_to_universal wrote?)")
    path = os.path.join(folder, files[0])
    states = _load(path, "DeepSpeed model states", folder, 0, mmap=True)
    if not isinstance(states, dict):
        raise FormatError(f"{path}: holds a {type(states).__name__}, expected DeepSpeed's model states dict")
    return path, states


def param_names(folder: str) -> list:
    """The parameter folders of `zero/`, each a real directory."""
    zero = os.path.join(folder, "zero")
    if not os.path.isdir(zero) or os.path.islink(zero):
        hint = (": a ZeRO checkpoint; convert it first with python -m deepspeed.checkpoint.ds_to_universal"
                if any("zero_pp_rank_" in f for f in os.listdir(folder)) else
                " (not a folder ds_to_universal wrote)")
        raise IncompleteCheckpointError(f"{zero} is missing{hint}")
    names = []
    with os.scandir(zero) as it:
        for e in it:
            if e.name == "optimizer_state.pt":
                continue
            if not e.is_dir(follow_symlinks=False):
                raise FormatError(f"{e.path}: expected a parameter folder (a directory), found something else")
            names.append(e.name)
    return sorted(names)


def adam_groups(folder: str) -> list:
    """`zero/optimizer_state.pt`'s param groups, checked to be AdamW's as megatron-core runs it."""
    path = os.path.join(folder, "zero", "optimizer_state.pt")
    state = _load(path, "DeepSpeed optimizer state", folder, MAX_SMALL_BYTES)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise FormatError(f"{path}: no 'param_groups' list")
    for g in groups:
        if not ("betas" in g and "eps" in g):
            raise ConfigError(f"{path}: a param group without betas and eps ({sorted(map(str, g))}): "
                              "not an Adam optimizer")
        if g.get("amsgrad"):
            raise ConfigError(f"{path}: AMSGrad (megatron-core's Adam has none)")
        if g.get("decoupled_weight_decay") is False and g.get("weight_decay"):
            raise ConfigError(f"{path}: Adam with L2 weight decay (torch Adam); megatron-core runs AdamW")
    return [dv.adam_group(g, path, i) for i, g in enumerate(groups)]


def read_tensor(path: str, folder: str, numel_bound: int):
    """A `zero/<param>/<state>.pt` file: its record dict (tensor as fp32 numpy)."""
    import torch

    record = _load(path, "DeepSpeed state file", folder, 8 * numel_bound + 2**20)
    if isinstance(record, torch.Tensor):
        record = {"param": record}
    if not isinstance(record, dict) or not isinstance(record.get("param"), torch.Tensor):
        raise FormatError(f"{path}: expected a dict with a 'param' tensor")
    extra = set(record) - RECORD_KEYS
    if extra:
        raise FormatError(f"{path}: unknown keys {sorted(extra)} (a record of a newer DeepSpeed?)")
    if record["param"].dtype != torch.float32:
        raise FormatError(f"{path}: 'param' is {record['param'].dtype}, expected torch.float32")
    return record


def read_step(path: str, folder: str) -> int:
    import torch

    step = _load(path, "DeepSpeed step file", folder, MAX_SMALL_BYTES)
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    return dv.step_count(value, path)


def _steps_of(samples, gbs: int, key: str, path: str) -> int:
    if samples % gbs:
        raise ConfigError(f"{path}: lr_scheduler.{key} {samples} samples is not a whole number of "
                          f"global batches of {gbs}")
    return samples // gbs


def training_flags(scheduler, groups: list, args: dict, path: str) -> list:
    """Flags that make pretrain_gpt_ucp.py's scheduler and AdamW the saved ones (megatron-core's
    scheduler refuses a checkpoint whose schedule differs from the one its flags give).
    `scheduler` and `groups` are checked already (deepspeed_values)."""
    gbs = dv.whole(args.get("global_batch_size"), f"{path}: args.global_batch_size", 1)
    decays = {g.get("weight_decay", 0.0) for g in groups} - {0.0}
    if len(decays) > 1:
        raise ConfigError(f"{path}: param groups with weight decays {sorted(decays)}; megatron-core has one")
    betas = groups[0]["betas"]
    argv = ["--global-batch-size", str(gbs), "--adam-beta1", repr(betas[0]), "--adam-beta2", repr(betas[1]),
            "--adam-eps", repr(groups[0]["eps"]), "--weight-decay", repr(decays.pop() if decays else 0.0)]
    if scheduler is None:
        return argv
    s = scheduler
    if s.get("start_wd", None) != s.get("end_wd", None):
        raise ConfigError(f"{path}: lr_scheduler weight decay goes from {s.get('start_wd')} to {s.get('end_wd')}; "
                          "pretrain_gpt_ucp.py keeps it constant")
    argv += ["--lr", repr(s["max_lr"]), "--min-lr", repr(s["min_lr"]), "--lr-decay-style", s["lr_decay_style"],
             "--lr-warmup-iters", str(_steps_of(s["lr_warmup_steps"], gbs, "lr_warmup_steps", path)),
             "--lr-decay-iters", str(_steps_of(s["lr_decay_steps"], gbs, "lr_decay_steps", path))]
    if "wd_incr_steps" in s:  # pretrain_gpt_ucp.py's is train_iters * global_batch_size
        argv += ["--train-iters", str(_steps_of(s["wd_incr_steps"], gbs, "wd_incr_steps", path))]
    return argv


def _record(states: dict, path: str, args: dict) -> dict:
    """Iteration, consumed samples, skipped steps and the scheduler of the model states, checked."""
    scheduler = states.get("lr_scheduler")
    iteration = states.get("iteration", states.get("global_steps"))
    consumed = args.get("consumed_train_samples", states.get("global_samples"))
    skipped = states.get("skipped_steps")
    return {"scheduler": None if scheduler is None else dv.scheduler(scheduler, path),
            "iteration": dv.whole(iteration, f"{path}: iteration"),
            "consumed": dv.whole(consumed, f"{path}: consumed samples (args.consumed_train_samples)"),
            "progress": None if skipped is None else
            {"skipped_iterations": dv.whole(skipped, f"{path}: skipped_steps")}}


def import_(folder: str, output: str, progress: bool = True, workers: int = 1, qkv_layout: str = None,
            prove: bool = True, staging_dir=None, origin=None) -> dict:
    """Write the DeepSpeed universal checkpoint `folder` as a universal checkpoint of ours.
    `qkv_layout`: 'thirds' or 'grouped' where the args do not tell (deepspeed_qkv); `prove`:
    with the resume proof of Megatron-DeepSpeed's forward of the source (deepspeed_proof.py).
    An object-store `output` is written in a local staging folder, then uploaded (store_output.py);
    a `folder` in a store is downloaded whole into one first (store_staging.py; `origin`: its URL,
    which the manifest records)."""
    if storage.is_remote(folder):
        from megatron_ucp.convert import store_staging

        with store_staging.local_input(folder, staging_dir) as local:
            return import_(local, output, progress, workers, qkv_layout, prove, staging_dir, origin=folder)
    if storage.is_remote(output):
        return store_output.write_to(output, lambda local: import_(
            folder, local, progress, workers, qkv_layout, prove, origin=origin), "output", staging_dir)
    start = time.perf_counter()
    folder = os.path.abspath(folder)
    output_folder.refuse_inside_input(output, folder, "output")
    path, states = model_states(folder)
    args = plain_args(states.get("args"), path)
    uc_info = states.get("universal_checkpoint_info")
    if not isinstance(uc_info, dict):
        raise ConfigError(f"{path}: no 'universal_checkpoint_info' (ds_to_universal needs it too)")
    names = param_names(folder)
    mapping = dsm.megatron_names(names)
    model = dsm.from_args(args, uc_info, names, path)
    dsm.check_names(model, mapping, path)
    tp, pp, dp = dv.parallel_degrees(states, args, path)
    divisible = args.get("make_vocab_size_divisible_by")
    divisible = None if divisible is None else dv.whole(divisible, f"{path}: args.make_vocab_size_divisible_by",
                                                         1, dv.MAX_PARALLEL)
    dv.padded_vocab(model.vocab_size, model.padded_vocab_size, divisible, tp, path)
    layout_of_qkv = qkv.qkv_layout(args, model, qkv_layout, path)
    qkv_order = qkv.qkv_rows(layout_of_qkv, model, tp, path)
    shapes = dsm.expected(model)
    by_mc = {mc: ds for ds, mc in mapping.items()}
    vocab_names = {ds for ds, mc in mapping.items() if mc in dsm.VOCAB}
    for ds, rows in dv.vocab_rows(states.get("param_shapes"), vocab_names, path).items():
        if rows * tp != model.padded_vocab_size:  # the saving ranks' shapes: padded vocabulary rows
            raise FormatError(f"{path}: {ds} has {rows} rows on each of {tp} TP ranks, "
                              f"universal_checkpoint_info says the padded vocabulary is {model.padded_vocab_size}")

    steps = {read_step(os.path.join(folder, "zero", ds, "step.pt"), folder) for ds in names}
    if len(steps) != 1:
        raise FormatError(f"{folder}/zero: parameters at Adam steps {sorted(steps)}, one expected")
    step = steps.pop()
    groups = adam_groups(folder)
    record = _record(states, path, args)

    pad = model.padded_vocab_size - model.vocab_size
    metas = {mc: TensorEntry.new(mc, shape, mc in dsm.VOCAB, pad if mc in dsm.VOCAB else 0, STATES)
             for mc, shape in shapes.items()}

    def opener(mc, read=read_tensor):
        ds = by_mc[mc]
        bound = model.padded_vocab_size * model.hidden_size if mc in dsm.VOCAB else math.prod(shapes[mc])
        reorder = qkv_order is not None and mc.endswith(("self_attention.linear_qkv.weight",
                                                         "self_attention.linear_qkv.bias"))

        def assemble(state):
            file = os.path.join(folder, "zero", ds, STATE_FILES[state])
            record = read(file, folder, bound)
            tensor = record["param"]
            if state == "param":
                dsm.check_record(ds, mc, record, tensor.shape, model, tp)
            elif tuple(tensor.shape) != shapes[mc]:
                raise FormatError(f"{file}: shape {list(tensor.shape)}, its fp32.pt's is {list(shapes[mc])}")
            array = tensor.detach().numpy()
            if reorder:  # [Q_r; K_r; V_r] per saving TP rank -> per group [q; k; v]
                array = np.take(array, qkv_order, axis=0)
            parts = {"": np.ascontiguousarray(array, np.float32)}
            if mc in dsm.VOCAB and pad:  # dropped by ds_to_universal; DeepSpeed's loader pads with zeros
                parts[PADDING] = np.zeros((pad,) + shapes[mc][1:], np.float32)
            return parts
        return assemble

    bound = max(model.padded_vocab_size * model.hidden_size, *map(math.prod, shapes.values()))
    proof_record, proof_line = None, "resume proof not recorded (--no-proof)"
    if prove:
        proof_record, proof_line = _proof(folder, names, args, uc_info, (tp, layout_of_qkv, bound), path,
                                          lambda mc, read: opener(mc, read)("param"), list(shapes))
    model_argv = dsm.megatron_args(model, divisible)
    training_argv = training_flags(record["scheduler"], groups, args, path)
    argv = model_argv + training_argv
    zero_stage = dv.zero_stage(states.get("ds_config"), path)
    layout = mf.Layout(world_size=None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       virtual_pipeline_model_parallel_size=None, data_parallel_size=dp,
                       expert_model_parallel_size=1, expert_tensor_parallel_size=tp,
                       use_distributed_optimizer=bool(zero_stage), padded_vocab_size=model.padded_vocab_size)
    head = mf.head(iteration=record["iteration"], consumed_samples=record["consumed"],
                   architecture=dsm.architecture(model), layout=layout,
                   optimizer={"type": "adam", "step": step, "param_groups": groups},
                   scheduler=record["scheduler"], args=given_args(argv), rng_saved=False, progress=record["progress"],
                   proof=proof_record,
                   source={"deepspeed": origin or folder, "ds_version": dv.version_text(states.get("ds_version"), path),
                           "zero_stage": zero_stage, "qkv_layout": layout_of_qkv, "megatron_deepspeed_args": args})
    fresh = not os.path.exists(output)
    try:
        summary = stream_write.write_checkpoint(output, record["iteration"], metas, opener, head, {}, workers,
                                                progress, start)
    except BaseException:
        if fresh and os.path.isdir(output) and not os.listdir(output):
            os.rmdir(output)  # made for this import, left empty by the failed write
        raise
    summary["megatron_args"] = argv
    summary["training_args"] = training_argv  # the rest, model flags aside (--use-checkpoint-args)
    summary["step"] = step
    summary["consumed_samples"] = record["consumed"]
    summary["qkv_layout"] = layout_of_qkv
    summary["proof"] = proof_line
    return summary


def _proof(folder: str, names: list, args: dict, uc_info: dict, saved: tuple, path: str, written, atomic: list):
    """(the proof record or None, the line that says so): Megatron-DeepSpeed's losses of the
    probe from the source's own tensors (deepspeed_proof), the digests of the weights written
    (`written(atomic name, reader)`: its parts). `saved`: (TP degree, QKV order, a tensor's elements
    at most). Each fp32.pt is read once for both (the memory check allows for the weights)."""
    from megatron_ucp.convert import deepspeed_proof as dp

    why = dp.unavailable(folder, names)
    if why:
        return None, f"resume proof not recorded ({why})"
    tp, qkv_layout, bound = saved
    start = time.perf_counter()
    try:
        source = dp.source_of(args, uc_info, tp, qkv_layout, path)
        structure = dp.names_of(names)
        records = {}

        def read(file, root, numel_bound):
            if file not in records:
                records[file] = read_tensor(file, root, numel_bound)
            return records[file]
        digests = dp.param_digests(lambda mc: written(mc, read), atomic)
        proof = dp.record(source, structure, lambda ds: read(os.path.join(folder, "zero", ds, "fp32.pt"), folder,
                                                             bound), digests)
    except ConfigError as e:
        return None, f"resume proof not recorded ({e})"
    except (RuntimeError, ValueError, IndexError) as e:  # tensors the reference cannot compute with
        return None, f"resume proof not recorded (the reference forward failed: {str(e).splitlines()[0]:.200})"
    return proof, (f"resume proof recorded from Megatron-DeepSpeed's forward of the source: {proof['probe']['tokens']} "
                   f"probe tokens, {len(digests)} weight digests ({time.perf_counter() - start:.2f} s)")


def main(argv=None) -> int:
    from megatron_ucp.convert.import_args import import_parser, parse_import_args

    p = import_parser("import_deepspeed", __doc__.splitlines()[0], "input",
                      "the folder ds_to_universal wrote (zero/ and mp_rank_*_model_states.pt)")
    p.add_argument("--qkv-layout", choices=qkv.QKV_LAYOUTS, default=None,
                   help="query_key_value's row order where the args do not tell it: 'thirds' ([Q; K; V] per "
                        "TP rank: Megatron-DeepSpeed since its commit 676a482c) or 'grouped' (per key-value "
                        "group [q; k; v]: older ones)")
    p.add_argument("--no-proof", action="store_true",
                   help="record no resume proof (Megatron-DeepSpeed's forward of the source, run here on CPU)")
    a = parse_import_args(p, argv)
    s = import_(a.input, a.output, not a.no_progress, a.workers, a.qkv_layout, not a.no_proof, a.staging_dir)
    print(f"imported iteration {s['iteration']} (Adam step {s['step']}, {s['consumed_samples']} samples consumed): "
          f"{s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s into {s['output']}")
    print(s["proof"])
    print("flags: " + " ".join(s["megatron_args"]))
    return 0


if __name__ == "__main__":
    run_command(main, "import_deepspeed")
