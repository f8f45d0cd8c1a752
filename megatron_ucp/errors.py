"""The exceptions megatron-ucp raises.

Every message names the file or key at fault and what was expected, so that a user can act on
it without reading our code. In a distributed job the same error is raised on every rank.
"""


class UCPError(Exception):
    """Base class of every error megatron-ucp raises on purpose."""


class FormatError(UCPError):
    """A checkpoint file is not in the format we expect (bad manifest, bad header, bad version)."""


class IntegrityError(UCPError):
    """A checkpoint's bytes do not match their recorded checksums or sizes."""


class IncompleteCheckpointError(UCPError):
    """A checkpoint lacks a file or tensor that it should hold."""


class LayoutError(UCPError):
    """A parallel layout cannot hold the model, or a checkpoint does not fit the model."""


class ConfigError(UCPError):
    """A bad combination of command-line arguments or configuration values."""


class StorageError(UCPError):
    """An object store refused or failed a request after its client's retries (throttling,
    resets, timeouts); the message names the object."""


class SaveError(UCPError):
    """A save failed (disk full, I/O error, another job owns the folder); nothing was committed."""


def report(prog: str, error: UCPError, stream=None) -> int:
    """Print `<prog>: error: <message>` once per job, not a traceback per rank; returns exit code 2.

    An error agreed across ranks (collective.agree marks it) is raised on every rank: rank 0
    prints it. Any other is printed by rank 0 and by each rank that has one unagreed (a rank's
    own failure outside a collective; torchrun then stops the others). A ConfigError comes
    from the same arguments on every rank: rank 0 prints it.
    """
    import os
    import sys
    import time

    rank = int(os.environ.get("RANK", "0") or 0)
    quiet = getattr(error, "agreed", False) or isinstance(error, ConfigError)
    if rank == 0 or not quiet:
        message = " ".join(str(error).split("\n"))
        print(f"{prog}: error: {message}", file=stream or sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(2)  # torchrun stops the other workers when one exits: let rank 0 print first
    return 2


def run_command(main, prog: str) -> None:
    """A command's `if __name__ == "__main__"`: exit with main()'s code, a UCPError reported
    once per job as `<prog>: error: ...` (report) instead of a traceback per rank."""
    import sys

    try:
        code = main()
    except UCPError as e:
        code = report(prog, e)
    sys.exit(code)
