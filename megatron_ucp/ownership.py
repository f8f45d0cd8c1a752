"""One job at a time per save folder, and housekeeping that is only safe under that rule.

The first save of a job writes `<save>/.ucp_owner.json` (job id, host, pid). A later job may take
the folder over when the owner's process is gone (same host) or its last save is older than
`stale_after` seconds (other hosts); otherwise its save fails with a clear error instead of
mixing two runs' checkpoints. The job id is torchrun's TORCHELASTIC_RUN_ID or SLURM's job id
when set, so restarted workers of the same job keep ownership.
"""

import json
import os
import re
import shutil
import socket
import time
import uuid

from megatron_ucp import storage
from megatron_ucp.errors import SaveError

OWNER = ".ucp_owner.json"
_JOB_ID = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or uuid.uuid4().hex
_ITER = re.compile(r"^iter_(\d{7,})$")


def job_id() -> str:
    return _JOB_ID


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(save_dir: str, stale_after: float = 3600.0) -> None:
    """Make this job the folder's owner, or raise SaveError naming the job that owns it."""
    path = os.path.join(save_dir, OWNER)
    me = {"job": _JOB_ID, "host": socket.gethostname(), "pid": os.getpid()}
    try:
        with open(path) as f:
            owner = json.load(f)
        age = time.time() - os.path.getmtime(path)
    except (FileNotFoundError, ValueError, OSError):
        owner, age = None, 0.0
    if owner and owner.get("job") != me["job"]:
        same_host = owner.get("host") == me["host"]
        live = _alive(int(owner.get("pid", -1))) if same_host else age < stale_after
        if live:
            raise SaveError(
                f"{save_dir} is being written by another job ({owner.get('job')}, pid "
                f"{owner.get('pid')} on {owner.get('host')}); use another --save folder or stop that job")
    storage.atomic_write_json(path, me)


def remove_leftovers(save_dir: str) -> None:
    """Clear what saves that died left behind (safe once this job owns the folder).

    Temporary folders go. An `iter_N.old_*` folder is a checkpoint being replaced by a re-save
    of iteration N: it goes if `iter_N` exists, else it is put back (the save died in between).
    """
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.startswith(".tmp_iter_"):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("iter_") and ".old_" in name:
            base = os.path.join(save_dir, name.split(".old_")[0])
            if os.path.exists(base):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, base)


def prune(save_dir: str, keep_last: int, newest: int) -> list:
    """Delete complete checkpoints beyond the newest `keep_last`; never the tracker's `newest`."""
    if keep_last is None or keep_last < 1:
        return []
    found = sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(save_dir)) if m)
    doomed = [i for i in found[:-keep_last] if i != newest]
    for i in doomed:
        shutil.rmtree(os.path.join(save_dir, f"iter_{i:07d}"), ignore_errors=True)
    return doomed
