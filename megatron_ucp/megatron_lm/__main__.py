"""`python -m megatron_ucp.megatron_lm [--cpu] SCRIPT [SCRIPT ARGS]`: run an unchanged
Megatron-LM training script (one that calls `megatron.training.pretrain`) with universal
checkpointing installed; under torchrun: `torchrun ... -m megatron_ucp.megatron_lm SCRIPT ...`.
`--cpu` may also come among SCRIPT's arguments, where the trainer's parser takes it too."""

import os
import runpy
import sys

USAGE = ("usage: python -m megatron_ucp.megatron_lm [--cpu] SCRIPT [SCRIPT ARGS]\n"
         "  runs SCRIPT (e.g. Megatron-LM's pretrain_gpt.py) with universal checkpoints installed "
         "into megatron.training;\n  --cpu: CPU processes over gloo (tests, demos)")


PROG = "megatron_ucp.megatron_lm"


def main(argv=None) -> int:
    from megatron_ucp.errors import ConfigError, report, run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = False
    while argv and argv[0].startswith("-"):
        flag = argv.pop(0)
        if flag == "--cpu":
            cpu = True
        elif flag in ("-h", "--help"):
            print(USAGE)
            return 0
        else:
            return report(PROG, ConfigError(f"unknown option {flag!r} before SCRIPT ({USAGE.splitlines()[0]})"))
    if not argv:
        return report(PROG, ConfigError(f"no SCRIPT given ({USAGE.splitlines()[0]})"))
    script = argv[0]
    if not os.path.isfile(script):
        return report(PROG, ConfigError(f"{script}: no such script (expected a Megatron-LM training "
                                        "script such as pretrain_gpt.py)"))
    run_command(lambda: run(script, argv, cpu or "--cpu" in argv[1:]), PROG)


def run(script: str, argv: list, cpu: bool, module: str | None = None) -> None:
    """Install, then run `script` as `python SCRIPT ARGS` would (its own argv, its folder first
    on sys.path), or `module` as `python -m MODULE ARGS` would; the process group is closed
    before the interpreter exits (engine/collective.close_distributed says why)."""
    from megatron_ucp.megatron_lm import install
    from megatron_ucp.engine.collective import close_distributed

    install(cpu=cpu)
    sys.argv = argv
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__")  # sys.argv[0] stays the entry point's
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
