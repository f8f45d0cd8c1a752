"""The resume proof of a checkpoint in Megatron-LM's own format, as Megatron-LM's trainer loads it.

    python -m megatron_ucp.megatron_lm.prove_source --out OUT.json -- TRAINER FLAGS --load DIR --ckpt-step N

`convert` of an `fsdp_dtensor` checkpoint (convert/fsdp_dtensor_proof.py) starts this in a CPU
process of a megatron-core that ships the trainer: the project's GPT script runs under the
plug-in as a training job does, the trainer builds the model and the optimizer and calls its
`load_checkpoint`, which hands the checkpoint to megatron's own loader (Megatron-FSDP's for
fsdp_dtensor); right after that load, before any step, the proof of the state megatron loaded
is recorded with the code a universal save uses (engine/proof.py `record`) and written to OUT
as {"proof": ...}, or {"line": why not}; then the job ends. Nothing of our converter's mapping
takes part: the losses and digests are of the model megatron itself loaded.
"""

import contextlib
import json
import os
import sys

from megatron_ucp.convert.launch import die_with_parent

if __name__ == "__main__":
    die_with_parent()  # first thing: torchrun puts workers in sessions of their own


PROG = "megatron_ucp.megatron_lm.prove_source"
GPT_SCRIPT = "megatron_ucp.megatron_lm.gpt"  # the project's GPT script, as pretrain_gpt_ucp.py runs it


class _Proved(Exception):
    """Raised out of the trainer once the proof is written: the job has nothing more to do."""


def _write(out: str, record: dict) -> None:
    from megatron_ucp.format.durability import atomic_write_json

    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write_json(out, json.loads(json.dumps(record)))


def _proving(load, out: str):
    """The trainer's `load_checkpoint` (the plug-in's), then the proof of what it loaded."""

    def load_then_prove(ddp_model, optimizer, opt_param_scheduler, *rest, **kwargs):
        from megatron.training.global_vars import get_args

        from megatron_ucp.engine import proof
        from megatron_ucp.engine.save import owned_regions
        from megatron_ucp.mcore.model_map import local_tensors
        from megatron_ucp.megatron_lm.checkpoint import true_vocab_size

        iteration, _ = load(ddp_model, optimizer, opt_param_scheduler, *rest, **kwargs)
        args = get_args()
        with_optimizer = optimizer is not None and not args.no_load_optim
        vocab = true_vocab_size(args)
        tensors = local_tensors(ddp_model, optimizer if with_optimizer else None, vocab)
        _write(out, {"iteration": iteration,
                     "proof": proof.record(ddp_model, owned_regions(tensors, with_optimizer), vocab)})
        raise _Proved()

    return load_then_prove


def main(argv=None) -> int:
    from megatron_ucp.errors import ConfigError, UCPError
    from megatron_ucp.megatron_lm import __main__ as plug_in
    from megatron_ucp.megatron_lm import checkpoint, install
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--out" or argv[2] != "--":
        raise ConfigError("usage: python -m megatron_ucp.megatron_lm.prove_source --out OUT -- TRAINER FLAGS")
    out, trainer_argv = argv[1], argv[3:]
    # The trainer's report of its setup goes to a log beside OUT, not into the conversion's output.
    with open(out + ".log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            install(cpu=True)
            replace_everywhere(checkpoint.load_checkpoint, _proving(checkpoint.load_checkpoint, out))
            plug_in.run(None, [PROG] + trainer_argv, cpu=True, module=GPT_SCRIPT)
            _write(out, {"line": "the trainer ended without loading a checkpoint"})
        except _Proved:
            pass
        except UCPError as e:
            _write(out, {"line": str(e)})
        except Exception as e:  # megatron's loader refusing the source: its words, in one line
            _write(out, {"line": f"megatron's load of the source failed: {type(e).__name__}: "
                                 f"{(str(e).splitlines() or [''])[0]:.300}"})
    return 0


if __name__ == "__main__":
    from megatron_ucp.errors import run_command

    run_command(main, PROG)
