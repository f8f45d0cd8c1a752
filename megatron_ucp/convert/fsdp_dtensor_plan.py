"""The plan of an `fsdp_dtensor` checkpoint's conversion: every atomic tensor mapped to the
checkpoint's keys, with the manifest's head; from the DCP metadata and small objects only.

The checkpoint names tensors by module path (`decoder.layers.0.input_layernorm.weight`), the
universal format by megatron's checkpoint names (`...self_attention.linear_qkv.layer_norm_weight`
under the local spec). What joins them is the parameter itself: the model is built from the
stored arguments on the meta device in one process (torch_dist_plan's way), and each of its
`named_parameters()` is the `.param` of one model_map LocalTensor, which gives the atomic
name, shape, vocabulary padding and SwiGLU halves a direct universal save uses. MoE experts
need nothing more: megatron stores them under global expert ids (`local_experts.<E>`,
`handle_experts_in_state_dict`), which are the meta model's own, built with one expert rank.

Weights: Megatron-FSDP's module parameters are its main weights while it saves
(`_replace_param_with_distributed_if_needed` puts `optimizer_named_parameters` in place, the
fp32 `dist_main_weight` where there is one), so `model.*` holds them and is read as `param`;
16-bit main weights are refused by the reader, naming the key. RNG states are not converted:
they belong to the source ranks, and the loader reseeds (the layout's `world_size` is None).
"""

import os
from dataclasses import dataclass
from typing import Dict

from megatron_ucp.convert import fsdp_dtensor_keys as keys
from megatron_ucp.convert.dcp_reader import DcpReader, unwrap_object
from megatron_ucp.convert.megatron_args import STAND_INS, plain_args
from megatron_ucp.convert.source_model import (argv_from_args, checked_source, meta_model, model_arg_names,
                                               single_process_megatron, source_args, stored_world,
                                               typed_stored_args)
from megatron_ucp.convert.torch_dist_sources import Atomic, Box
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import infer_rule
from megatron_ucp.format.tensor_entry import STATES
from megatron_ucp.mcore.optimizer_state import plain_groups
from megatron_ucp.mcore.saved_args import MAX_INT

EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class Plan:
    iteration: int
    atomics: Dict[str, Atomic]
    prefixes: Dict[str, str]  # state -> key prefix ('model.module.', 'optimizer.state.module.module.')
    head: mf.Manifest


def suffix(state: str) -> str:
    """What follows a parameter's path in the key of `state`."""
    return "" if state == "param" else "." + state


def _model_names() -> set:
    """The model and layout arguments, less the vocabulary (_vocab_argv's)."""
    return model_arg_names() - {"vocab_size"}


def _vocab_argv(stored: dict, extra_argv, where: str) -> list:
    """`--vocab-size` with the tokenizer's true vocabulary (the padding rows are the rest). Only a
    NullTokenizer's is known from the arguments: megatron-core >= 0.17's (its arguments have
    `null_tokenizer_eod_id`) has `--vocab-size` entries with EOD among them, the legacy one
    adds EOD. Any other tokenizer's comes from its files, which the converter does not read."""
    if any(a == "--vocab-size" or a.startswith("--vocab-size=") for a in extra_argv):
        return []
    size = stored.get("vocab_size")
    if stored.get("tokenizer_type") != "NullTokenizer" or not isinstance(size, int):
        raise ConfigError(f"{where}: the true vocabulary of tokenizer {stored.get('tokenizer_type')!r} is not in "
                          "the stored arguments; pass it after '--' (-- --vocab-size N, the tokenizer's "
                          "vocab_size with its special tokens)")
    return ["--vocab-size", str(size if "null_tokenizer_eod_id" in stored else size + 1)]


def _stored_args(reader: DcpReader) -> dict:
    if "args" not in reader.keys():
        return {}
    return plain_args(unwrap_object(reader.read_object("args", STAND_INS)), f"{reader.dir}: 'args'")


def _source(reader: DcpReader, stored: dict, extra_argv, shapes: Dict[str, tuple]):
    """The source run's model and layout arguments (stored, overridden by flags after '--'),
    typed and checked against the checkpoint's tensors (`shapes`, less the model root)."""
    origin = os.path.join(reader.dir, "args")
    if not stored and not extra_argv:
        raise ConfigError(f"{reader.dir}: stores no training arguments; pass the model and layout flags "
                          "after '--' (e.g. --num-layers ... --tensor-model-parallel-size ...)")
    if stored.get("transformer_impl", "local") != "local":
        raise FormatError(f"{reader.dir}: saved with --transformer-impl {stored['transformer_impl']}; only the "
                          "local layer spec's module paths are mapped (transformer-engine's fused layers name "
                          "their parameters differently)")
    world = stored_world(stored, origin)
    if world < 1:
        raise ConfigError(f"{reader.dir}: the stored arguments have no world_size")
    typed_stored_args(stored, origin)
    # --mock-data: the converter reads no data, the validation wants a source of it.
    argv = _model_argv(stored, extra_argv, reader.dir) + ["--cpu", "--mock-data"]
    source = source_args(argv, world, origin)
    checked_source(source, shapes, origin, extra_argv)
    if source.num_experts and source.moe_grouped_gemm:
        raise FormatError(f"{reader.dir}: grouped-GEMM experts (--moe-grouped-gemm); their fsdp_dtensor keys "
                          "(linear_fc1.weight<E>) are not mapped, the sequential experts' are")
    return source, world


def _model_argv(stored: dict, extra_argv, where: str) -> list:
    """The flags that rebuild the source model and layout, the user's after '--' last."""
    return argv_from_args(stored, _model_names()) + _vocab_argv(stored, extra_argv, where) + list(extra_argv)


def source_argv(iter_dir: str, extra_argv=()) -> list:
    """Flags for Megatron-LM's trainer that rebuild the source model, in the source's precision,
    with Megatron-FSDP (the resume proof's load of the source, convert/prove.py)."""
    reader = DcpReader(iter_dir)
    try:
        stored = _stored_args(reader)
    finally:
        reader.close()
    typed_stored_args(stored, os.path.join(iter_dir, "args"))
    precision = [f"--{p}" for p in ("bf16", "fp16") if stored.get(p) is True]
    return _model_argv(stored, extra_argv, iter_dir) + precision + ["--use-megatron-fsdp"]


def _shapes(reader: DcpReader, root: str) -> Dict[str, tuple]:
    return {k[len(root):]: reader.shape(k) for k in reader.keys() if k.startswith(root) and reader.has_tensor(k)}


def _gated(t, shape: tuple, where: str) -> bool:
    """model_map describes SwiGLU's fc1 as two boxes, its halves of rows; any other split of a
    whole (TP = 1) parameter is not one this format stores."""
    if len(t.boxes) == 1:
        return False
    half = shape[0] // 2 if shape else 0
    if [tuple(b.offset)[:1] + tuple(b.shape) for b in t.boxes] != [(0, half) + tuple(shape[1:]),
                                                                (half, half) + tuple(shape[1:])]:
        raise LayoutError(f"{where}: {t.name} is described in {len(t.boxes)} parts {[b.offset for b in t.boxes]}; "
                          "only SwiGLU's two halves of rows are mapped")
    return True


def _atomic(t, path: str, stored: Dict[str, tuple], root: str, where: str) -> Atomic:
    """One parameter's atomic tensor: its boxes in the checkpoint (keys without their root)."""
    rows = t.padded_rows or (t.atomic_shape[0] if t.atomic_shape else None)
    shape = ((rows,) + tuple(t.atomic_shape[1:])) if t.atomic_shape else ()
    gated = _gated(t, shape, where)
    row_numel = 1
    for n in shape[1:]:
        row_numel *= n
    boxes = []
    for key, n_rows, first in keys.box_keys(path, shape, gated, stored, root, where):
        sizes = stored[key]
        boxes.append(Box(key, (0,) * len(sizes), tuple(sizes), first * row_numel,
                         (n_rows or 1) * row_numel))
    # The stored tensors are whole (tensor parallelism concatenated): to this reader the source
    # is one rank.
    rule = infer_rule(tuple(t.atomic_shape), tuple(t.atomic_shape), gated, t.padded_rows is not None)
    return Atomic(t.name, rule, tuple(t.atomic_shape), t.padded_rows, ("param",) if t.stateless else STATES,
                  t.stateless, boxes)


def _check_states(reader: DcpReader, atomics: Dict[str, Atomic], prefixes: Dict[str, str]) -> None:
    """Every state of every box is in the checkpoint with the weights' shape."""
    for a in atomics.values():
        for state in a.states:
            for b in a.boxes:
                key = prefixes[state] + b.key + suffix(state)
                if not reader.has_tensor(key):
                    raise IncompleteCheckpointError(f"{reader.dir}: no tensor {key!r} ({state} of {a.name})")
                if reader.shape(key) != tuple(b.sizes):
                    raise LayoutError(f"{reader.dir}: {key!r} has shape {list(reader.shape(key))}, its weights "
                                      f"{list(b.sizes)}")


def _objects(reader: DcpReader, root: str) -> Dict[str, object]:
    return {k[len(root):]: unwrap_object(reader.read_object(k)) for k in reader.keys()
            if k.startswith(root) and not reader.has_tensor(k)}


def _group_metas(reader: DcpReader, paths) -> Dict[str, dict]:
    """Each parameter's group settings (`param_to_group_meta`), in model order."""
    root = keys.wrapped_root(reader.keys(), keys.GROUP_META, reader.dir)
    if root is None:
        raise FormatError(f"{reader.dir}: no {keys.GROUP_META}* objects (the optimizer's step and settings)")
    fields: Dict[str, dict] = {}
    for k, v in _objects(reader, root).items():
        path, _, field = k.rpartition(".")
        fields.setdefault(path, {})[field] = v
    missing = [p for p in paths if p not in fields]
    if missing:
        raise IncompleteCheckpointError(f"{reader.dir}: no {root}{missing[0]}.* settings "
                                        f"({len(missing)} parameters without them)")
    return {p: fields[p] for p in paths}


def plan_conversion(iter_dir: str, extra_argv=()) -> Plan:
    """Map every atomic tensor to the checkpoint's keys; reads metadata and small objects only."""
    from megatron_ucp.mcore.model_map import local_tensors

    reader = DcpReader(iter_dir)
    try:
        stored = _stored_args(reader)
        model_root = keys.wrapped_root(reader.keys(), keys.MODEL, reader.dir)
        state_root = keys.wrapped_root(reader.keys(), keys.STATE, reader.dir)
        if model_root is None or state_root is None:
            raise FormatError(f"{reader.dir}: no {keys.MODEL}* or {keys.STATE}* tensors; an fsdp_dtensor checkpoint "
                              "with its optimizer state expected (a model-only one cannot resume training)")
        stored_shapes = _shapes(reader, model_root)
        source, world = _source(reader, stored, extra_argv, stored_shapes)
        padded = stored_shapes.get(EMBEDDING, (source.padded_vocab_size,))[0]
        if padded < source.vocab_size:
            raise LayoutError(f"{reader.dir}: {model_root}{EMBEDDING} has {padded} rows, fewer than the "
                              f"vocabulary's {source.vocab_size}")
        with single_process_megatron():
            gpt = meta_model(source, padded)
            by_param = {id(t.param): t for t in local_tensors([gpt], None, source.vocab_size)}
            paths = {}
            for path, p in gpt.named_parameters():
                if id(p) not in by_param:
                    raise FormatError(f"{path}: megatron's model map has no atomic tensor for it")
                paths[path] = by_param[id(p)]
            architecture = mf.architecture(gpt, source.vocab_size)
        atomics = {t.name: _atomic(t, path, stored_shapes, model_root, reader.dir)
                   for path, t in paths.items() if t.writes}
        used = {b.key for a in atomics.values() for b in a.boxes}
        unknown = sorted(set(stored_shapes) - used)
        if unknown:
            raise LayoutError(f"{reader.dir}: tensors the model built from the stored arguments does not have: "
                              f"{[model_root + k for k in unknown[:5]]}{' ...' if len(unknown) > 5 else ''}")
        prefixes = {"param": model_root, **{m: state_root for m in keys.MOMENTS}}
        _check_states(reader, atomics, prefixes)
        step, groups = keys.param_groups(_group_metas(reader, list(paths)), reader.dir)
        head = _head(reader, iter_dir, stored, source, world, padded, architecture, step, groups)
    finally:
        reader.close()
    return Plan(head.iteration, atomics, prefixes, head)


def _head(reader, iter_dir, stored, source, world, padded, architecture, step, groups) -> mf.Manifest:
    """The manifest without its tensors: iteration, samples, scheduler, progress, layout."""
    iteration = unwrap_object(reader.read_object("iteration")) if "iteration" in reader.keys() else None
    named = os.path.basename(os.path.normpath(iter_dir))
    if type(iteration) is not int or iteration < 0 or not named.endswith(f"{iteration:07d}"):
        raise FormatError(f"{reader.dir}: 'iteration' is {iteration!r:.60}, the folder is {named}")
    if "consumed_train_samples" not in stored:
        raise ConfigError(f"{reader.dir}: the stored arguments have no consumed_train_samples")
    origin = os.path.join(reader.dir, "args")
    scheduler = _objects(reader, keys.SCHEDULER) or None
    flops = unwrap_object(reader.read_object("num_floating_point_operations_so_far")) \
        if "num_floating_point_operations_so_far" in reader.keys() else 0
    progress = {"num_floating_point_operations_so_far": flops,
                "skipped_train_samples": _stored_int(stored, "skipped_train_samples", 0, origin),
                "consumed_valid_samples": _stored_int(stored, "consumed_valid_samples", 0, origin)}
    layout = mf.Layout(
        world_size=None, tensor_model_parallel_size=source.tensor_model_parallel_size,
        pipeline_model_parallel_size=source.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=source.virtual_pipeline_model_parallel_size,
        data_parallel_size=(_stored_int(stored, "data_parallel_size", 1, origin)
                            if stored.get("data_parallel_size") is not None
                            else world // source.tensor_model_parallel_size),
        context_parallel_size=_stored_int(stored, "context_parallel_size", 1, origin),
        expert_model_parallel_size=source.expert_model_parallel_size,
        expert_tensor_parallel_size=source.expert_tensor_parallel_size or source.tensor_model_parallel_size,
        use_distributed_optimizer=True, padded_vocab_size=padded)  # Megatron-FSDP shards the optimizer
    return mf.head(iteration=iteration, consumed_samples=_stored_int(stored, "consumed_train_samples", 0, origin),
                   architecture=architecture, layout=layout,
                   optimizer={"type": "adam", "step": step, "param_groups": plain_groups(groups)},
                   scheduler=scheduler, args=stored, rng_saved=False, progress=progress,
                   source={"fsdp_dtensor": os.path.abspath(iter_dir)})


def _stored_int(stored: dict, key: str, least: int, origin: str) -> int:
    """A count of the stored arguments (null: `least`, the count of nothing), an integer >= least."""
    value = stored.get(key)
    if value is None:
        return least
    if type(value) is not int or not least <= value <= MAX_INT:
        raise FormatError(f"{origin}: 'args.{key}' is {value!r:.60}, expected an integer {least}..{MAX_INT}")
    return value
