"""Worker processes of the training application that the converters start by name.

Converting through megatron's own code needs processes of a layout running a training session:
`convert` loads a torch_dist checkpoint with megatron's loader and saves it universally
(`convert_to_universal --via-megatron`); `export` loads a universal checkpoint and saves it
with megatron's torch_dist writer (`export_torch_dist`). The converters start them as
`python -m megatron_ucp.train.workers KIND ...` (launch.run_workers) and never import them, so
the library does not depend on the application.
"""

import argparse
import os
import sys

from megatron_ucp.convert.launch import die_with_parent

if __name__ == "__main__":
    die_with_parent()  # first thing: torchrun puts workers in sessions of their own

import torch.distributed as dist  # noqa: E402

from megatron_ucp.errors import run_command  # noqa: E402
from megatron_ucp.format.folder import iteration_dir  # noqa: E402


def convert(output_dir: str, argv: list) -> None:
    """In each process of the source layout: megatron's torch_dist load, then a universal save."""
    from megatron_ucp.engine.save import save_universal
    from megatron_ucp.train import loop, native

    with loop.session(argv) as (args, state):
        it, consumed = native.load(args, state, iteration_dir(args.load, args.ckpt_step))
        save_universal(output_dir, it, state.model, state.optimizer, state.scheduler,
                       vocab_size=args.vocab_size, consumed_samples=consumed, args=vars(args))
        if dist.get_rank() == 0:
            print(f" converted iteration {it} into {iteration_dir(output_dir, it)}", flush=True)


def export(root: str, iteration: int, output: str, argv: list) -> None:
    """In each process of the target layout: universal load, then megatron's torch_dist save."""
    from megatron_ucp.engine.load import load_universal
    from megatron_ucp.train import checkpointing, loop

    with loop.session(argv) as (args, state):
        result = load_universal(root, state.model, state.optimizer, state.scheduler,
                                vocab_size=args.vocab_size, iteration=iteration,
                                reseed=lambda it: loop.set_seeds(args.seed + it))
        if dist.get_rank() == 0:
            rng = "reseeded (another layout)" if result.layout_changed else "restored (same layout)"
            print(f" loaded universal iteration {result.iteration} from "
                  f"{iteration_dir(root, iteration)}: {result.bytes_read / 1e6:.1f} MB "
                  f"on rank 0, RNG {rng}", flush=True)
        args.save, args.load = output, None  # stored in common.pt: where this checkpoint is
        checkpointing.save(args, state, result.iteration, result.consumed_samples)


def prove(source: str, fmt: str, iteration: int, out: str, argv: list) -> None:
    """Load `source` (universal: its proof is checked by the load; torch_dist or legacy torch:
    megatron's own load, weights only) and write {"ok", "line"} or {"proof"} as JSON to `out`
    (rank 0; the proof is the same on every rank)."""
    import json

    from megatron_ucp.engine import proof
    from megatron_ucp.engine.load import load_universal
    from megatron_ucp.engine.save import owned_regions
    from megatron_ucp.errors import UCPError
    from megatron_ucp.format.durability import atomic_write_json
    from megatron_ucp.mcore.model_map import local_tensors
    from megatron_ucp.train import loop, native

    try:
        with loop.session(argv) as (args, state):
            if fmt == "universal":
                try:
                    result = load_universal(source, state.model, state.optimizer, state.scheduler,
                                            vocab_size=args.vocab_size, iteration=iteration, load_rng=False,
                                            load_optim=not args.no_load_optim,
                                            load_scheduler=not args.no_load_optim, verify=False)
                    record = {"ok": True, "line": result.proof_note}
                except proof.ResumeProofError as e:
                    record = {"ok": False, "line": str(e)}
            else:
                from megatron_ucp.train import legacy

                args.load, args.ckpt_step = source, iteration
                (native if fmt == "torch_dist" else legacy).load(args, state, iteration_dir(source, iteration))
                tensors = local_tensors(state.model, None, args.vocab_size)
                record = {"proof": proof.record(state.model, owned_regions(tensors, False), args.vocab_size)}
    except UCPError as e:
        record = {"ok": False, "line": str(e)}
    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write_json(out, json.loads(json.dumps(record)))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="megatron_ucp.train.workers")
    kinds = p.add_subparsers(dest="kind", required=True)
    c = kinds.add_parser("convert", help="torch_dist load, universal save (--via-megatron)")
    c.add_argument("--output", required=True)
    e = kinds.add_parser("export", help="universal load, torch_dist save (export_torch_dist)")
    e.add_argument("ckpt")
    e.add_argument("out")
    e.add_argument("--iteration", type=int, required=True)
    v = kinds.add_parser("prove", help="one process: a checkpoint's resume proof (convert/prove.py)")
    v.add_argument("--source", required=True)
    v.add_argument("--iteration", type=int, required=True)
    v.add_argument("--format", choices=["universal", "torch_dist", "torch"], required=True)
    v.add_argument("--out", required=True)
    a = p.parse_args(own)
    from megatron_ucp.engine.collective import close_distributed

    if a.kind == "convert":
        convert(a.output, extra)
    elif a.kind == "prove":
        prove(a.source, a.format, a.iteration, a.out, extra)
    else:
        export(a.ckpt, a.iteration, a.out, extra)
    close_distributed()  # before the interpreter's exit, which gloo may abort (engine/collective.py)
    return 0


if __name__ == "__main__":
    run_command(main, "megatron_ucp.train.workers")
