"""Convert a megatron-core `torch_dist` checkpoint into a universal one.

Megatron's own loader is the reader: the conversion starts CPU processes in the checkpoint's
layout (from the arguments the checkpoint stores, overridable by flags), loads it natively,
which works for every optimizer sharding megatron-core writes (`dp_reshardable`,
`fully_reshardable`, none), and saves universally. No GPU and no training job is needed. The
cost: the whole state is held once, spread over those processes (not streamed tensor by tensor).

    python -m megatron_ucp.convert --input SAVE_DIR --output OUT [--iteration N] [-- FLAGS...]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError

# Arguments that describe where checkpoints go, not the model or the layout.
_NOT_CARRIED = {"save", "load", "save_interval", "loss_log", "ckpt_step", "load_universal",
                "ckpt_format", "exit_interval", "keep_last", "async_save", "cpu", "world_size",
                "data_parallel_size", "num_microbatches", "padded_vocab_size",
                "virtual_pipeline_model_parallel_size", "no_verify_checkpoint", "no_strict_load"}


def stored_args(iteration_dir: str) -> dict:
    """The training arguments a torch_dist checkpoint of pretrain_gpt_ucp.py stores in common.pt."""
    import torch

    path = os.path.join(iteration_dir, "common.pt")
    if not os.path.exists(path):
        raise IncompleteCheckpointError(f"{path}: missing; is {iteration_dir} a torch_dist checkpoint?")
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise FormatError(f"{path}: cannot be read safely (weights_only): {e}") from None
    args = common.get("args")
    return dict(args) if isinstance(args, dict) else {}


def argv_from_args(args: dict) -> list:
    """Command-line flags that rebuild the model and layout the arguments describe."""
    from megatron_ucp.train.args import build_parser

    argv = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest in _NOT_CARRIED or dest not in args or not action.option_strings:
            continue
        value, flag = args[dest], action.option_strings[0]
        if action.nargs == 0:  # store_true
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _resolve(input_dir: str, iteration):
    from megatron_ucp.train.checkpointing import iteration_dir, read_tracker

    if os.path.exists(os.path.join(input_dir, "common.pt")):  # an iter_ folder itself
        name = os.path.basename(os.path.normpath(input_dir))
        return os.path.dirname(os.path.normpath(input_dir)), int(name.split("_")[-1])
    it = iteration if iteration is not None else read_tracker(input_dir)
    if not os.path.isdir(iteration_dir(input_dir, it)):
        raise IncompleteCheckpointError(f"{iteration_dir(input_dir, it)}: no such checkpoint")
    return input_dir, it


def convert(input_dir: str, output_dir: str, iteration=None, extra_argv=(), nproc=None) -> dict:
    """Convert; returns a summary (iteration, tensors, bytes, seconds)."""
    from megatron_ucp.train.checkpointing import iteration_dir

    root, it = _resolve(input_dir, iteration)
    args = stored_args(iteration_dir(root, it))
    argv = argv_from_args(args) + list(extra_argv)
    if not args and not extra_argv:
        raise ConfigError(f"{iteration_dir(root, it)}: stores no training arguments; pass the model "
                          "and layout flags after '--' (e.g. --num-layers ... --tensor-model-parallel-size ...)")
    world = nproc or int(args.get("world_size") or 0)
    if world < 1:
        raise ConfigError("the checkpoint does not store its world size: pass --nproc")
    start = time.perf_counter()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "megatron_ucp.convert",
           "--worker", "--input", root, "--output", output_dir, "--iteration", str(it), "--"]
    cmd += argv + ["--cpu", "--ckpt-format", "torch_dist", "--load", root, "--ckpt-step", str(it)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise FormatError(f"conversion of {iteration_dir(root, it)} failed (exit code {proc.returncode})")
    seconds = time.perf_counter() - start
    out = iteration_dir(output_dir, it)
    with open(os.path.join(out, "ucp.json")) as f:
        tensors = json.load(f)["tensors"]
    nbytes = sum(e["file_size"] for e in tensors.values())
    return {"iteration": it, "output": out, "tensors": len(tensors), "bytes": nbytes,
            "seconds": seconds, "GB/s": nbytes / seconds / 1e9}


def _worker(output_dir: str, argv: list) -> None:
    import torch.distributed as dist

    from megatron_ucp.save import save_universal
    from megatron_ucp.train import loop, native
    from megatron_ucp.train.checkpointing import iteration_dir

    with loop.session(argv) as (args, state):
        it, consumed = native.load(args, state, iteration_dir(args.load, args.ckpt_step))
        save_universal(output_dir, it, state.model, state.optimizer, state.scheduler,
                       vocab_size=args.vocab_size, consumed_samples=consumed, args=vars(args))
        if dist.get_rank() == 0:
            print(f" converted iteration {it} into {iteration_dir(output_dir, it)}", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="convert_to_universal", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="torch_dist save folder (or one iter_ folder)")
    p.add_argument("--output", required=True, help="where the universal checkpoint goes")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--nproc", type=int, default=None, help="default: the checkpoint's world size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(own)
    if a.worker:
        _worker(a.output, extra)
        return 0
    summary = convert(a.input, a.output, a.iteration, extra, a.nproc)
    print(f"converted {summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB in "
          f"{summary['seconds']:.1f} s ({summary['GB/s']:.3f} GB/s) into {summary['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
