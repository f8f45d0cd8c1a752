"""Convert Megatron-LM's legacy per-rank `torch` checkpoint into a universal one, streaming.

No GPU and no process group: each `mp_rank_TT[_PPP]/model_optim_rng.pt` holds whole TP-local
tensors (and `distrib_optim.pt` the distributed optimizer's state gathered over data
parallelism), so every atomic tensor is assembled from the TP ranks' files of one pipeline stage
and written once. Its name, packed halves and vocabulary rows are megatron's description of the
model (model_map, on a meta-device model built from the stored arguments); how the source split
it over TP follows from the saved local shapes (`layout.infer_rule`). Files are opened
with `torch.load(mmap=True)` for each atomic tensor and closed after it, so memory holds a few
atomic tensors, not the checkpoint. `workers` processes convert tensors in parallel.

What megatron keeps implicit is derived here by pure functions, each checked against what the
checkpoint records: the parameter order of megatron's optimizer groups (checked against the
stored groups' sizes and every moment's shape) and the distributed optimizer's buffer layout
(checked against the stored `numel_unpadded` of every buffer).

Its parts: legacy_files.py (the folder's names; its files opened mmap'ed, once per process),
legacy_plan.py (every atomic tensor mapped to its sources, from the small parts of the files),
legacy_optimizer.py (where each parameter's optimizer state lies), buffer_layout.py (the
distributed optimizer's buffer layout, shared with the torch_dist converter); here, each atomic
tensor assembled one state at a time and written once by writer.py.
"""

import os
import time

import numpy as np

from megatron_ucp.convert import writer as stream_write
from megatron_ucp.convert.legacy_files import MODEL_FILE, OPTIM_FILE, forget_loaded, release, torch_load
from megatron_ucp.convert.legacy_plan import Atomic, Plan, Source, plan_conversion
from megatron_ucp.errors import FormatError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import PADDING, pieces
from megatron_ucp.format.tensor_entry import STATES, TensorEntry


def _local_states(source: Source, plan: Plan, states) -> dict:
    """The TP-local flat tensors of one source: views of the mmap'ed files, nothing read yet."""
    out = {}
    if plan.dist_opt and "exp_avg" in states:
        buffers = torch_load(os.path.join(source.rank_dir, OPTIM_FILE))
        b, offset, numel = source.flat
        (saved,) = buffers[b].values()
        for s in states:
            out[s] = saved[s][offset:offset + numel]
    else:
        sd = torch_load(os.path.join(source.rank_dir, MODEL_FILE))
        out["param"] = sd[source.chunk_key][source.local_name].reshape(-1)
        if "exp_avg" in states:
            st = sd["optimizer"]["state"][source.opt_index]
            out["exp_avg"], out["exp_avg_sq"] = st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)
    return out


def _state_parts(entry: Atomic, plan: Plan, sources: dict, state: str) -> dict:
    """One state of one atomic tensor: {part: array}, pages of the sources released after use."""
    import torch

    parts = {"": np.empty(entry.shape, dtype=np.float32)}
    if entry.padding_rows:
        parts[PADDING] = np.empty((entry.padding_rows,) + tuple(entry.shape[1:]), dtype=np.float32)
    padded = entry.shape[0] + entry.padding_rows if entry.rule.kind == "vocab" else None
    for source in entry.sources:
        local = sources[id(source)][state]
        if local.dtype != torch.float32:
            raise FormatError(f"{source.rank_dir}: {source.local_name} {state} is {local.dtype}; "
                              "the converter reads fp32 state only")
        flat = local.numpy()
        for p in pieces(entry.rule, entry.shape, plan.tp, source.tp_rank, padded):
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))
            parts[p.part][box] = flat[p.local_start:p.local_start + p.numel].reshape(p.shape)
        release(local)
    return parts


def convert(iter_dir: str, output_dir: str, overrides: dict | None = None, workers: int = 1,
            progress: bool = True) -> dict:
    """Convert one legacy `iter_XXXXXXX` folder into `output_dir`; returns the summary."""
    started = time.perf_counter()
    plan = plan_conversion(iter_dir, overrides)
    metas = {n: TensorEntry.new(n, e.shape, e.rule.kind == "vocab", e.padding_rows, STATES)
             for n, e in plan.atomics.items()}

    def opener(name):
        entry = plan.atomics[name]
        sources = {id(s): _local_states(s, plan, STATES) for s in entry.sources}
        return lambda state: _state_parts(entry, plan, sources, state)

    try:
        return stream_write.write_checkpoint(output_dir, plan.iteration, metas, opener, _manifest(plan, metas),
                                             plan.rng, workers, progress, started)
    finally:
        forget_loaded()


def _manifest(plan: Plan, entries: dict) -> mf.Manifest:
    """Everything in the manifest but the tensors' entries."""
    layout = mf.Layout(
        # Without RNG files the saving layout is recorded as unknown, so a loader reseeds.
        world_size=plan.tp * plan.pp * plan.dp if plan.rng and plan.dp else None, tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp, virtual_pipeline_model_parallel_size=plan.vpp,
        data_parallel_size=plan.dp, expert_model_parallel_size=1, expert_tensor_parallel_size=plan.tp,
        use_distributed_optimizer=plan.dist_opt, padded_vocab_size=mf.padded_vocab_size(entries))
    return mf.head(iteration=plan.iteration, consumed_samples=plan.consumed, architecture=plan.architecture,
                   layout=layout, optimizer={"type": "adam", "step": plan.step, "param_groups": plan.param_groups},
                   scheduler=plan.scheduler, args=plan.args)
