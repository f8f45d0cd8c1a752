"""Export a universal checkpoint as megatron-core's own `torch_dist` checkpoint, for any layout.

For users who go back to a training stack that reads only megatron's format. CPU processes of
the requested layout (torchrun, gloo) build the model and optimizer with this project's own
code, load the universal checkpoint into them (`load_universal`) and save them with the
project's torch_dist writer (`train/native.py`, megatron's `dist_checkpointing.save`), so that
what is written is exactly what `pretrain_gpt_ucp.py --ckpt-format torch_dist` saves on that
layout. The whole state is held once, spread over those processes.

    python -m megatron_ucp.convert.export_torch_dist CKPT OUT [--iteration N] [--nproc P] \\
        [--dist-ckpt-optim-format dp_reshardable|fully_reshardable] -- LAYOUT AND MODEL FLAGS

The model's arguments come from the checkpoint's manifest; the flags after `--` give the
layout (they are not taken from the checkpoint: the point is a new one) and may override the
rest. RNG: each rank saves the state a universal resume on that layout would have: the
checkpoint's own on the layout that saved it, else reseeded from --seed + iteration.
"""

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass

from megatron_ucp.errors import (ConfigError, FormatError, IncompleteCheckpointError, SaveError, UCPError,
                                 run_command)

# Argument groups of pretrain_gpt_ucp.py taken from the checkpoint: what the model is and how it
# trains. Parallelism, checkpointing and data flags are this export's (or not needed).
_CARRIED_GROUPS = ("model", "multi-latent attention", "multi-token prediction", "mixture of experts",
                   "training", "mixed precision and optimizer state")


@dataclass(frozen=True)
class Plan:
    """One export, checked before any process starts."""

    root: str  # the universal save folder
    iteration: int
    output: str  # the torch_dist save folder
    nproc: int
    argv: list  # the workers' pretrain_gpt_ucp.py arguments
    layout: str  # for the messages: "TP1 PP1 DP4, distributed optimizer (dp_reshardable)"
    store: str = None  # an s3:// or msc:// OUT: `output` is then a staging folder, uploaded after


def resolve(ckpt: str, iteration=None):
    """(save folder, iteration) of a universal checkpoint given as a save folder or an iter_ folder."""
    from megatron_ucp.format import storage, stores
    from megatron_ucp.format.folder import designated_format, found_format
    from megatron_ucp.format.folder import iteration_dir, iteration_of, read_tracker
    from megatron_ucp.format.manifest import MANIFEST

    if storage.is_remote(ckpt):  # universal checkpoints only there; the workers load them by ranged GETs
        if stores.exists(storage.join(ckpt.rstrip("/"), MANIFEST)):
            root, _, name = ckpt.rstrip("/").rpartition("/")
            if iteration_of(name) is None:
                raise FormatError(f"{ckpt}: an iteration prefix is named iter_NNNNNNN; give its parent prefix")
            if iteration is not None and iteration != iteration_of(name):
                raise ConfigError(f"--iteration {iteration} contradicts the iteration prefix {ckpt}")
            return root, iteration_of(name)
        it = iteration if iteration is not None else read_tracker(ckpt)
        designated_format(iteration_dir(ckpt, it))  # IncompleteCheckpointError without a manifest
        return ckpt, it
    if not os.path.isdir(ckpt):
        raise IncompleteCheckpointError(f"{ckpt}: no such checkpoint folder")
    if os.path.lexists(os.path.join(ckpt, MANIFEST)):  # an iter_ folder
        root, name = os.path.split(os.path.normpath(ckpt))
        number = iteration_of(name)
        if number is None:
            raise FormatError(f"{ckpt}: an iteration folder is named iter_NNNNNNN; give its parent folder")
        if iteration is not None and iteration != number:
            raise ConfigError(f"--iteration {iteration} contradicts the iteration folder {ckpt}")
        return root, number
    it = iteration if iteration is not None else read_tracker(ckpt)
    directory = iteration_dir(ckpt, it)
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: no such checkpoint (--iteration {it})")
    found, evidence = found_format(directory)
    if found != "universal":
        what = f"a {found} checkpoint ({evidence})" if found else "no checkpoint"
        raise FormatError(f"{directory}: holds {what}, not a universal one ({MANIFEST}); "
                          "megatron-core loads a torch_dist checkpoint on other layouts itself, or "
                          "convert it with `megatron-ucp convert` first")
    return ckpt, it


def carried_names() -> set:
    """The argument names taken from the checkpoint: its model and training flags."""
    from megatron_ucp.mcore.flags import build_parser

    groups = [g for g in build_parser()._action_groups if g.title in _CARRIED_GROUPS]
    return {a.dest for g in groups for a in g._group_actions} | {"tokenizer_type"}


def carried_argv(saved_args: dict) -> list:
    """The checkpoint's model and training flags, as pretrain_gpt_ucp.py arguments."""
    from megatron_ucp.convert.source_model import argv_from_args

    return argv_from_args(saved_args, only=carried_names())


def _refuse_checkpoint_flags(extra) -> None:
    """Where to load and save is this command's own business: such flags after '--' would be
    silently overridden (or, for --load, read by the workers' start-up)."""
    from megatron_ucp.mcore.flags import build_parser

    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    given = vars(p.parse_known_args(list(extra))[0])
    flags = [a.option_strings[0] for g in p._action_groups if g.title in ("checkpointing", "elastic training")
             for a in g._group_actions if a.dest in given and a.dest != "distributed_timeout_minutes"]
    if flags:
        raise ConfigError(f"{', '.join(flags)} after '--': the export loads CKPT and saves OUT itself; "
                          "give --iteration and --dist-ckpt-optim-format before '--'")


def _layout_words(args, optim_format: str) -> str:
    words = (f"TP{args.tensor_model_parallel_size} PP{args.pipeline_model_parallel_size} "
             f"DP{args.data_parallel_size}")
    if args.num_layers_per_virtual_pipeline_stage:
        words += f" VPP({args.num_layers_per_virtual_pipeline_stage} layers per stage)"
    if args.num_experts:
        words += f" EP{args.expert_model_parallel_size}"
    if args.use_distributed_optimizer:
        return f"{words}, distributed optimizer ({optim_format})"
    return f"{words}, plain optimizer"


def plan(ckpt: str, output: str, iteration=None, extra=(), nproc=None, optim_format=None, staging_dir=None) -> Plan:
    """Check the checkpoint, the output folder and the layout flags; no process is started. An
    object-store `output` is written into a staging folder under `staging_dir` (default TMPDIR),
    then uploaded, the tracker last (store_staging.py)."""
    from megatron_ucp.format import storage
    from megatron_ucp.format.folder import iteration_dir
    from megatron_ucp.convert.output_folder import check_save_folder
    from megatron_ucp.format.manifest import MANIFEST, read_manifest
    from megatron_ucp.mcore import saved_args
    from megatron_ucp.mcore.flag_validation import validate
    from megatron_ucp.mcore.flags import build_parser

    store = None
    if storage.is_remote(output):  # megatron's torch_dist writer writes files: staged, then uploaded
        import tempfile
        import uuid

        from megatron_ucp.convert import store_staging

        if staging_dir is not None and not os.path.isdir(staging_dir):
            raise ConfigError(f"--staging-dir {staging_dir}: no such folder")
        store, output = output, os.path.join(staging_dir or tempfile.gettempdir(),
                                             f"ucp-staging-{uuid.uuid4().hex}", "out")
    root, it = resolve(ckpt, iteration)
    if store:
        store_staging.check_output(store, it)
    m = read_manifest(iteration_dir(root, it))
    saved = m.args if isinstance(m.args, dict) else {}
    if not saved and not extra:
        raise ConfigError(f"{iteration_dir(root, it)}: the manifest stores no training arguments; "
                          "give the model's flags after '--' (--num-layers ... --hidden-size ...)")
    saved_args.check(saved, carried_names(), m, os.path.join(iteration_dir(root, it), MANIFEST))
    argv = carried_argv(saved) + list(extra) + ["--cpu", "--mock-data", "--ckpt-format", "torch_dist"]
    try:
        _refuse_checkpoint_flags(extra)
        args = build_parser().parse_args(argv)
    except SystemExit:  # argparse has printed which flag it could not read
        raise ConfigError(f"bad flags after '--': {' '.join(extra)}") from None
    if optim_format is not None and not args.use_distributed_optimizer:
        raise ConfigError("--dist-ckpt-optim-format shards the distributed optimizer's state: give "
                          "--use-distributed-optimizer after '--' (or drop the option)")
    optim_format = optim_format or "dp_reshardable"
    argv += ["--dist-ckpt-optim-format", optim_format]
    args.dist_ckpt_optim_format = optim_format
    nproc = nproc if nproc is not None else args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    validate(args, nproc)  # ConfigError naming the flag that does not fit the model or --nproc
    out_dir = iteration_dir(output, it)
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"{output}: exists and is not a folder")
    check_save_folder(output, it, "torch_dist", "OUT")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir}: already exists and is not empty; remove it or choose another OUT")
    padded = m.layout.get("padded_vocab_size")
    if padded and padded != args.padded_vocab_size:  # a torch_dist resume recomputes its padding
        print(f" note: the checkpoint pads the vocabulary to {padded} rows, this layout to "
              f"{args.padded_vocab_size} (--make-vocab-size-divisible-by "
              f"{args.make_vocab_size_divisible_by} x TP{args.tensor_model_parallel_size}); the "
              f"padding rows change and with them the loss, slightly; a --make-vocab-size-divisible-by "
              f"that gives {padded} keeps it", flush=True)
    return Plan(root, it, output, nproc, argv, _layout_words(args, optim_format), store)


def export(p: Plan) -> dict:
    """Run the export's worker processes (and upload an object-store OUT's checkpoint from its
    staging folder, removed in any case); returns a summary (files, bytes, seconds)."""
    if p.store is None:
        return _export(p)
    from megatron_ucp.convert import store_staging
    from megatron_ucp.format.folder import iteration_dir

    try:
        summary = _export(p)
        store_staging.upload(p.output, p.store, p.iteration)
    finally:
        shutil.rmtree(os.path.dirname(p.output), ignore_errors=True)
    return dict(summary, output=iteration_dir(p.store.rstrip("/"), p.iteration))


def _export(p: Plan) -> dict:
    from megatron_ucp.convert.launch import run_workers
    from megatron_ucp.convert.output_folder import owned
    from megatron_ucp.format.folder import iteration_dir

    start = time.perf_counter()
    out = iteration_dir(p.output, p.iteration)
    with owned(p.output, p.iteration, "torch_dist", "OUT"):
        code = run_workers(p.nproc, "megatron_ucp.train.workers", [
            "export", p.root, p.output, "--iteration", str(p.iteration), "--", *p.argv])
        if code != 0:  # plan() saw no such folder, or an empty one: what is there now is this run's
            shutil.rmtree(out, ignore_errors=True)
            raise SaveError(f"export of {iteration_dir(p.root, p.iteration)} to {p.output} failed "
                            f"(exit code {code}; the workers' message is above){_space_note(p)}; "
                            f"the partial {out} is removed, a rerun starts clean")
    files = [os.path.join(out, f) for f in os.listdir(out)]
    return {"output": out, "files": len(files), "bytes": sum(os.path.getsize(f) for f in files),
            "seconds": time.perf_counter() - start}


def _space_note(p: Plan) -> str:
    """', disk full: ...' when OUT's file system has less room left than the checkpoint's tensors
    take (megatron's torch_dist writer reports a full disk as 'unexpected pos 704 vs 598')."""
    from megatron_ucp.format.folder import iteration_dir
    from megatron_ucp.format.manifest import read_manifest

    try:
        st = os.statvfs(p.output)
        free = st.f_bavail * st.f_frsize
        needed = sum(e.file_size or 0 for e in read_manifest(iteration_dir(p.root, p.iteration)).tensors.values())
    except (OSError, UCPError):
        return ""
    if free >= needed:
        return ""
    return f", disk full: {free / 1e9:.3f} GB free on the file system of {p.output}, the checkpoint takes about {needed / 1e9:.3f} GB"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="export_torch_dist", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="universal save folder (or one of its iter_ folders), or an s3:// / msc:// prefix")
    p.add_argument("out", help="where the torch_dist checkpoint goes (its iter_ folder and tracker): a folder, "
                               "or an s3:// / msc:// prefix")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes of the target layout (default: TP x PP, data-parallel size 1)")
    p.add_argument("--staging-dir", default=None,
                   help="an object-store OUT (s3://, msc://) is written here first, then uploaded "
                        "(default: TMPDIR); it needs room for the whole checkpoint")
    p.add_argument("--dist-ckpt-optim-format", choices=["dp_reshardable", "fully_reshardable"],
                   default=None, help="how the distributed optimizer's state is sharded "
                                      "(default dp_reshardable, megatron's)")
    a = p.parse_args(own)
    job = plan(a.ckpt, a.out, a.iteration, extra, a.nproc, a.dist_ckpt_optim_format, a.staging_dir)
    print(f"exporting iteration {job.iteration} of {job.root} to torch_dist on {job.nproc} CPU "
          f"processes: {job.layout}", flush=True)
    s = export(job)
    print(f"exported iteration {job.iteration} to {s['output']} (torch_dist, {job.layout}): "
          f"{s['files']} files, {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    run_command(main, "export_torch_dist")
