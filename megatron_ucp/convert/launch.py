"""Start CPU worker processes of a given layout under torchrun, for the converters.

Converting through megatron's own code (its loader, its torch_dist writer) needs processes of
the layout on one side of the conversion; both directions (`to_universal.py --via-megatron`,
`export_torch_dist.py`) start the training application's workers (train/workers.py) the same
way: `python -m <module> <argv>` on one node (LOCAL_RENDEZVOUS), one thread per process, gloo.
"""

import os
import subprocess
import sys


# One node, its rendezvous store on a port the kernel gives it when torchrun binds (port 0),
# which the workers then join. A port picked beforehand (bound, closed, handed to torchrun)
# could be taken by any other process of the machine before torchrun bound it again: the
# conversion then failed with EADDRINUSE.
LOCAL_RENDEZVOUS = ("--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0")


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    torchrun starts its workers in sessions of their own, so killing a tool's process group
    (Ctrl-C aside, a job scheduler's SIGKILL) left them running for minutes, 370 MB each."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return
    if os.getppid() == 1:  # the parent died before the request: it would never fire
        os._exit(1)


# torchrun, dying with its parent (a preexec_fn would do it before exec, but is unsafe in a
# process with threads).
_TORCHRUN = ("import runpy, sys; from megatron_ucp.convert.launch import die_with_parent; die_with_parent(); "
             "sys.argv[0] = 'torchrun'; runpy.run_module('torch.distributed.run', run_name='__main__')")


def run_workers(nproc: int, module: str, argv: list, python: str = None) -> int:
    """Run `python -m module argv` in `nproc` local processes (`python`: another interpreter
    than this one); returns torchrun's exit code.

    The workers' output goes to this process's stdout and stderr as it comes. torchrun dies
    with this process and the workers with torchrun (die_with_parent, which the worker module
    calls first thing).
    """
    cmd = [python or sys.executable, "-c", _TORCHRUN, "--nproc-per-node", str(nproc), *LOCAL_RENDEZVOUS,
           "-m", module]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # The workers import this package as the caller does (a tools/ script puts it on sys.path).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return subprocess.run(cmd + list(argv), env=env).returncode
