"""Universal load: each rank reads only the bytes of the slices it owns in the new layout.

For every local parameter: the whole TP-local slice of the fp32 master weight (the model needs
all of it), and only the distributed-optimizer fragment of the Adam moments. The step count,
scheduler, iteration and consumed samples are global; RNG is restored on the same layout and
reseeded deterministically on a different one.
"""

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_ucp import manifest as mf
from megatron_ucp import host_memory, rng, storage
from megatron_ucp.collective import run_everywhere
from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError, LayoutError
from megatron_ucp.layout import fragment_regions, padding_shape, pieces, region_runs
from megatron_ucp.model_map import local_tensors


@dataclass
class LoadResult:
    iteration: int
    consumed_samples: int
    layout_changed: bool
    bytes_read: int
    manifest: dict


def _host_view(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """A flat fp32 numpy view sharing `tensor`'s memory, so reads land in place (CPU only)."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        return None
    return tensor.detach().view(-1).numpy()


def _read_range(path, entry, layout, t, state, start, stop, counter, out=None) -> np.ndarray:
    """Local flat elements [start, stop) of `state`, zero where the checkpoint holds nothing.

    Reads into `out` (stop - start fp32 elements) when given, else into a new array (on huge
    pages: it is filled at once).
    """
    held = pieces(t.rule, t.atomic_shape, t.tp, t.tp_rank, t.padded_rows,
                  entry["padding_rows"] if t.rule.kind == "vocab" else None)
    regions = fragment_regions(held, start, stop)
    if out is None:
        out = host_memory.empty_fp32(stop - start)
    if sum(r.numel for _, r in regions) != stop - start:
        out[:] = 0  # rows the checkpoint does not hold (new vocabulary padding) start at zero
    part_shapes = {"": tuple(entry["shape"]), "padding": padding_shape(entry["shape"], entry["padding_rows"])}
    for local_start, region in regions:
        runs = region_runs(part_shapes[region.part], region)
        # read_runs wants (file element, out element, length)
        file_runs = np.stack([runs[:, 1], runs[:, 0] + (local_start - start), runs[:, 2]], axis=1)
        storage.read_runs(path, layout, mf.file_tensor_name(state, region.part), file_runs, out,
                          counter)
    return out


def _check_tensors(m: dict, tensors, path: str, strict: bool) -> None:
    saved = m["tensors"]
    wanted = {t.name for t in tensors}
    missing = sorted(wanted - saved.keys())
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: {len(missing)} tensors of the model are not in the checkpoint: {missing[:5]}")
    for t in tensors:
        shape = tuple(saved[t.name]["shape"])
        if shape != tuple(t.atomic_shape):
            raise LayoutError(
                f"{path}: tensor {t.name!r} has shape {list(shape)} in the checkpoint, the model "
                f"expects {list(t.atomic_shape)}")
    if strict:
        # Each rank sees only its own tensors: the union over ranks must cover the checkpoint.
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, sorted(wanted))
        unexpected = sorted(saved.keys() - set().union(*map(set, seen)))
        if unexpected:
            raise LayoutError(
                f"{path}: {len(unexpected)} checkpoint tensors have no place in the model: "
                f"{unexpected[:5]} (pass strict=False to ignore them)")


def _same_layout(saved: dict, current: dict) -> bool:
    keys = [k for k in current if k != "use_distributed_optimizer"]
    return all(saved.get(k) == current[k] for k in keys)


def _prepare(root, model, optimizer, vocab_size, load_optim):
    m = mf.read_manifest(root)
    from megatron_ucp.train.model import unwrap

    mf.check_architecture(m["architecture"], mf.architecture(unwrap(model[0]), vocab_size), root)
    with_optim = optimizer is not None and load_optim
    if with_optim and any("exp_avg" not in e["states"] for e in m["tensors"].values()
                          if not e.get("buffer")):
        raise IncompleteCheckpointError(
            f"{root}: checkpoint holds no optimizer state; load with load_optim=False (--no-load-optim)")
    tensors = local_tensors(model, optimizer if with_optim else None, vocab_size, for_load=True)
    _check_tensors(m, tensors, root, strict=False)
    return m, tensors, with_optim


def _verify(root: str, m: dict) -> None:
    """Check this rank's share of the tensor files (sizes, headers, every block checksum).

    Files are spread over ranks by size, so the whole checkpoint is read once in total.
    """
    from megatron_ucp.inspection import verify_tensor
    from megatron_ucp.plan import assign_files

    sizes = {name: int(e.get("file_size", 0)) for name, e in m["tensors"].items()}
    mine = assign_files(sizes, dist.get_world_size())[dist.get_rank()]
    problems = [p for name in mine for p in verify_tensor(root, name, m["tensors"][name])]
    if problems:
        raise IntegrityError(f"{root}: checkpoint failed verification: " + "; ".join(problems[:5]))


def load_universal(load_dir: str, model, optimizer=None, scheduler=None, *, vocab_size: int,
                   iteration: Optional[int] = None, load_optim: bool = True,
                   load_rng: bool = True, strict: bool = True, verify: bool = True, reseed=None,
                   counter: Optional[storage.ReadCounter] = None) -> LoadResult:
    """Load a universal checkpoint into model chunks (and optimizer, scheduler) of any layout.

    Collective; a failure on any rank raises on every rank, and leaves the model and optimizer
    partially loaded (values are read in place): resume from another checkpoint or restart. `verify` checks every block
    checksum first (the work spread over ranks). `strict` refuses checkpoint tensors that have
    no place in the model. `reseed(iteration)` is called when the layout changed (or RNG is not
    loaded), to reseed deterministically.
    """
    from megatron_ucp.save import current_layout
    from megatron_ucp.train.checkpointing import iteration_dir, read_tracker

    if iteration is None:
        iteration = run_everywhere(read_tracker, load_dir)
    root = iteration_dir(load_dir, iteration)
    counter = counter if counter is not None else storage.ReadCounter()
    m, tensors, with_optim = run_everywhere(_prepare, root, model, optimizer, vocab_size, load_optim)
    if strict:
        _check_tensors(m, tensors, root, strict=True)
    if verify:
        run_everywhere(_verify, root, m)

    def restore():
        _load_tensors(root, m, tensors, counter)
        if with_optim:
            _set_adam_step(tensors, int((m.get("optimizer") or {}).get("step", 0)))
            if scheduler is not None and m.get("scheduler") is not None:
                scheduler.load_state_dict(m["scheduler"])

    run_everywhere(restore)
    changed = not _same_layout(m["layout"], current_layout(optimizer))
    if load_rng and not changed:
        run_everywhere(rng.load, os.path.join(root, "rng"), dist.get_rank())
    elif reseed is not None:
        reseed(int(m["iteration"]))
    return LoadResult(int(m["iteration"]), int(m["consumed_samples"]), changed, counter.bytes, m)


def _load_tensors(root, m, tensors, counter) -> None:
    """Each local tensor's weights and moments, read in place; several files in flight where
    this node has cores to spare (storage.read_threads), each thread counting its own bytes."""
    layouts = {name: mf.file_layout(m["tensors"][name]) for name in {t.name for t in tensors}}

    def load_one(t) -> storage.ReadCounter:
        mine = storage.ReadCounter()
        entry, layout = m["tensors"][t.name], layouts[t.name]
        path = storage.safe_join(root, entry["file"])  # refuses names that escape the checkpoint
        in_place = _host_view(t.param.data)
        weight = _read_range(path, entry, layout, t, "param", 0, t.param.numel(), mine, in_place)
        with torch.no_grad():
            if in_place is None:
                t.param.data.copy_(torch.from_numpy(weight).view(t.param.shape))
            f = t.fragment
            if f is not None:
                if not f.main_is_model:
                    f.main.copy_(torch.from_numpy(weight[f.start:f.stop]))
                for state in ("exp_avg", "exp_avg_sq"):
                    target = getattr(f, state)
                    in_place = _host_view(target)
                    data = _read_range(path, entry, layout, t, state, f.start, f.stop, mine, in_place)
                    if in_place is None:
                        target.copy_(torch.from_numpy(data).view(target.shape))
        t.apply_write_back()
        return mine

    # Largest first, so that the threads' tails are short.
    order = sorted(tensors, key=lambda t: -t.param.numel())
    for done in storage.in_parallel(load_one, order, storage.read_threads()):
        counter.bytes += done.bytes
        counter.calls += done.calls


def _set_adam_step(tensors, step: int) -> None:
    for t in tensors:
        if t.fragment is not None:
            state = t.fragment.inner.state[t.fragment.key]
            state["step"] = torch.tensor(float(step))
