"""Convert a megatron-core `torch_dist`, Megatron-FSDP `fsdp_dtensor` or Megatron-LM legacy `torch` checkpoint into a universal one.

Each is streamed one atomic tensor at a time in this process, with no GPU, no process group
and no process of the source layout: legacy per-rank `torch` checkpoints (`mp_rank_*` folders)
by megatron_ucp/convert/legacy.py, `torch_dist` ones by megatron_ucp/convert/torch_dist.py,
`fsdp_dtensor` ones by megatron_ucp/convert/fsdp_dtensor.py.

`--via-megatron` (torch_dist only) takes the other road: it starts CPU processes in the
checkpoint's layout, loads it with megatron's own loader and saves universally. It reads every
optimizer sharding megatron-core writes, at the cost of holding the whole state once, spread
over those processes; the streaming converter names this flag where it refuses a checkpoint.

    python -m megatron_ucp.convert.to_universal --input SAVE_DIR --output OUT [--iteration N] [-- FLAGS...]
"""

import argparse
import os
import sys
import time

from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, run_command


def stored_args(iteration_dir: str) -> dict:
    """The training arguments a torch_dist checkpoint of pretrain_gpt_ucp.py stores in its common
    state (common.pt, or inside the DCP files since megatron-core 0.19)."""
    from megatron_ucp.convert.dcp_reader import read_common

    common = read_common(iteration_dir)
    args = common.get("args") if isinstance(common, dict) else None
    return dict(args) if isinstance(args, dict) else {}


def _resolve(input_dir: str, iteration):
    from megatron_ucp.convert.legacy_files import is_legacy
    from megatron_ucp.format.folder import iteration_dir, read_tracker

    if any(os.path.exists(os.path.join(input_dir, f)) for f in ("common.pt", ".metadata")) \
            or is_legacy(input_dir):  # an iter_ folder (torch_dist of megatron-core 0.16 or 0.19, legacy)
        name = os.path.basename(os.path.normpath(input_dir))
        return os.path.dirname(os.path.normpath(input_dir)), int(name.split("_")[-1])
    it = iteration if iteration is not None else read_tracker(input_dir)
    if not os.path.isdir(iteration_dir(input_dir, it)):
        raise IncompleteCheckpointError(f"{iteration_dir(input_dir, it)}: no such checkpoint")
    return input_dir, it


def _refuse_universal(directory: str):
    raise ConfigError(f"--input {directory} holds a universal checkpoint (ucp.json) already: nothing to convert; "
                      "load it with --load, or export it with tools/export_torch_dist.py or tools/export_hf.py")


def convert(input_dir: str, output_dir: str, iteration=None, extra_argv=(), nproc=None, workers=1,
            progress=True, via_megatron=False, prove=True, staging_dir=None, origin=None) -> dict:
    """Convert; returns a summary (iteration, tensors, bytes, seconds, and how the resume proof
    went). `prove`: record the proof of megatron's own load of a streamed torch_dist, legacy or
    fsdp_dtensor source (--via-megatron's save records it from the same load). An object-store
    `output_dir` is written in a local staging folder, then uploaded (store_output.py); an
    `input_dir` in a store is downloaded into one first (store_staging.py; `origin`: its URL)."""
    from megatron_ucp.convert import store_output
    from megatron_ucp.convert.legacy_files import is_legacy
    from megatron_ucp.convert.source_model import argv_from_args, legacy_overrides
    from megatron_ucp.format import storage
    from megatron_ucp.format.folder import MANIFEST, found_format, iteration_dir

    if storage.is_remote(input_dir):  # downloaded for the readers of POSIX files (store_staging.py)
        from megatron_ucp.convert import store_staging
        from megatron_ucp.format import stores

        it, keep = store_staging.save_prefix_keep(input_dir, iteration)
        for where in [input_dir.rstrip("/")] + ([iteration_dir(input_dir.rstrip("/"), it)] if keep else []):
            if stores.exists(storage.join(where, MANIFEST)):
                _refuse_universal(where)
        with store_staging.local_input(input_dir, staging_dir, keep) as local:
            return convert(local, output_dir, iteration, extra_argv, nproc, workers, progress, via_megatron,
                           prove, staging_dir, origin=iteration_dir(input_dir.rstrip("/"), it) if keep
                           else input_dir.rstrip("/"))
    if os.path.lexists(os.path.join(input_dir, MANIFEST)):
        _refuse_universal(input_dir)
    root, it = _resolve(input_dir, iteration)
    if storage.is_remote(output_dir):
        return store_output.write_to(output_dir, lambda local: convert(
            input_dir, local, iteration, extra_argv, nproc, workers, progress, via_megatron, prove, origin=origin),
            "--output", staging_dir)
    found = found_format(iteration_dir(root, it))[0]
    if found == "universal":
        _refuse_universal(iteration_dir(root, it))
    if found is None:
        raise IncompleteCheckpointError(f"{iteration_dir(root, it)}: holds no checkpoint (no .metadata, "
                                        "*.distcp, common.pt or mp_rank_* folders); expected a torch_dist, "
                                        "fsdp_dtensor or legacy torch checkpoint")
    if found == "fsdp_dtensor":
        if via_megatron:
            raise ConfigError("--via-megatron reads torch_dist checkpoints; an fsdp_dtensor one is streamed")
        from megatron_ucp.convert import fsdp_dtensor

        summary = fsdp_dtensor.convert(iteration_dir(root, it), output_dir, extra_argv, workers, progress, origin)
        if prove:
            summary["proof"] = _proof_from_fsdp_dtensor(root, it, output_dir, extra_argv)
        return summary
    if is_legacy(iteration_dir(root, it)):
        from megatron_ucp.convert import legacy as legacy_convert

        summary = legacy_convert.convert(iteration_dir(root, it), output_dir, legacy_overrides(extra_argv),
                                         workers=workers, progress=progress)
        if prove:
            summary["proof"] = _proof_from_legacy(root, it, output_dir, extra_argv)
        return summary
    if not via_megatron:
        from megatron_ucp.convert import torch_dist as dist_convert

        summary = dist_convert.convert(iteration_dir(root, it), output_dir, extra_argv, nproc, workers, progress)
        if prove:
            summary["proof"] = _proof_from_source(root, it, output_dir, extra_argv)
        return summary
    args = stored_args(iteration_dir(root, it))
    argv = argv_from_args(args) + list(extra_argv)
    if not args and not extra_argv:
        raise ConfigError(f"{iteration_dir(root, it)}: stores no training arguments; pass the model "
                          "and layout flags after '--' (e.g. --num-layers ... --tensor-model-parallel-size ...)")
    world = nproc or int(args.get("world_size") or 0)
    if world < 1:
        raise ConfigError("the checkpoint does not store its world size: pass --nproc")
    from megatron_ucp.convert.launch import run_workers

    start = time.perf_counter()
    from megatron_ucp.convert.output_folder import owned

    with owned(output_dir, it, "universal", "--output"):  # the workers save under this claim
        code = run_workers(world, "megatron_ucp.train.workers", [
            "convert", "--output", output_dir, "--", *argv,
            "--cpu", "--ckpt-format", "torch_dist", "--load", root, "--ckpt-step", str(it)])
    if code != 0:
        raise FormatError(f"conversion of {iteration_dir(root, it)} failed (exit code {code})")
    seconds = time.perf_counter() - start
    out = iteration_dir(output_dir, it)
    from megatron_ucp.format.manifest import read_manifest

    tensors = read_manifest(out).tensors
    nbytes = sum(e.file_size for e in tensors.values())
    return {"iteration": it, "output": out, "tensors": len(tensors), "bytes": nbytes,
            "seconds": seconds, "GB/s": nbytes / seconds / 1e9}


def _proof_from_source(root: str, iteration: int, output_dir: str, extra_argv) -> str:
    """convert/prove.py: the source loaded by megatron in one process; a model that does not fit
    leaves the converted checkpoint without a proof, said in the summary."""
    from megatron_ucp.convert import prove
    from megatron_ucp.convert.export_torch_dist import carried_argv
    from megatron_ucp.format.folder import iteration_dir

    # the model's flags, not the source's layout: one process, megatron reshards on load
    argv = carried_argv(stored_args(iteration_dir(root, iteration))) + list(extra_argv)
    try:
        return prove.record_from_source(root, iteration, output_dir, argv)
    except (ConfigError, FormatError) as e:
        return f"resume proof not recorded ({e})"


def _proof_from_legacy(root: str, iteration: int, output_dir: str, extra_argv) -> str:
    """The legacy source loaded by megatron in processes of its own layout (its per-rank files
    load nowhere else), the arguments as the converted manifest keeps them."""
    from megatron_ucp.convert import prove
    from megatron_ucp.convert.export_torch_dist import carried_argv
    from megatron_ucp.format.folder import iteration_dir
    from megatron_ucp.format.manifest import read_manifest

    try:
        m = read_manifest(iteration_dir(output_dir, iteration))
        layout, args = m.layout, m.args if isinstance(m.args, dict) else {}
        argv = (carried_argv(args) + list(extra_argv) + prove.layout_argv(layout, m.architecture["num_layers"])
                + ["--ckpt-format", "torch"])
        tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
        return prove.record_from_source(root, iteration, output_dir, argv, "torch", tp * pp, tp)
    except (ConfigError, FormatError) as e:
        return f"resume proof not recorded ({e})"


# One process: megatron's DCP load of the global tensors reshards to it.
_ONE_PROCESS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                "--expert-tensor-parallel-size", "1"]


def _proof_from_fsdp_dtensor(root: str, iteration: int, output_dir: str, extra_argv) -> str:
    """The fsdp_dtensor source loaded by Megatron-LM's trainer with Megatron-FSDP, as a resume
    loads it (weights and optimizer state: a 16-bit run's weights load only so), in one CPU
    process of a megatron-core that ships the trainer (this interpreter's, else
    UCP_OTHER_PYTHON's); where there is none, the summary says so."""
    from megatron_ucp.convert import prove
    from megatron_ucp.convert.fsdp_dtensor_plan import source_argv
    from megatron_ucp.format.folder import iteration_dir

    try:
        python = prove.trainer_python()
        argv = (source_argv(iteration_dir(root, iteration), extra_argv) + _ONE_PROCESS
                + ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(iteration + 1),
                   "--lr", "0", "--override-opt_param-scheduler",  # the saved schedule is not checked here
                   "--ckpt-format", "fsdp_dtensor", "--load", root, "--ckpt-step", str(iteration)])
        return prove.record_from_source(root, iteration, output_dir, argv, "fsdp_dtensor", python=python,
                                        load_optim=True)
    except (ConfigError, FormatError) as e:
        return f"resume proof not recorded ({e})"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="convert_to_universal", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="torch_dist, fsdp_dtensor or legacy torch save folder (or one iter_ folder), or an "
                                                         "s3:// / msc:// prefix of one")
    p.add_argument("--output", required=True, help="where the universal checkpoint goes")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--nproc", type=int, default=None, help="default: the checkpoint's world size")
    p.add_argument("--workers", type=int, default=1, help="convert this many atomic tensors in parallel processes")
    p.add_argument("--via-megatron", action="store_true",
                   help="torch_dist: load with megatron in CPU processes of the source layout instead of streaming")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--staging-dir", default=None,
                   help="an object-store --input (s3://, msc://) is downloaded here first (the iteration "
                        "converted), an object-store --output written here, then uploaded (default: TMPDIR)")
    p.add_argument("--no-proof", action="store_true",
                   help="skip recording the resume proof (megatron's own load of the source in "
                        "one CPU process, whose losses and weights the first resume compares)")
    a = p.parse_args(own)
    if a.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {a.workers}")
    summary = convert(a.input, a.output, a.iteration, extra, a.nproc, a.workers, not a.no_progress,
                      a.via_megatron, not a.no_proof, a.staging_dir)
    print(f"converted {summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB in "
          f"{summary['seconds']:.1f} s ({summary['GB/s']:.3f} GB/s) into {summary['output']}")
    if summary.get("proof"):
        print(f" {summary['proof']}")
    return 0


if __name__ == "__main__":
    run_command(main, "convert_to_universal")
