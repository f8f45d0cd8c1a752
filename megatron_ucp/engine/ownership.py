"""One job at a time per save folder, and housekeeping that is only safe under that rule.

The owner record `<save>/.ucp_owner.json` names the job that owns the folder: its job id, and
the host, pid and process start time of its rank 0. A job takes it when it starts (train/loop.py)
and at every save (save_universal checks it for library users, and refreshes its date). The
check-and-replace of the record runs under an exclusive `fcntl.flock` of `<save>/.ucp_owner.lock`,
so of jobs claiming a folder at once exactly one wins. The job id is torchrun's
TORCHELASTIC_RUN_ID (but not its default "none") or SLURM's job id when set, so restarted
workers of the same job keep ownership.

A live rank 0 on this host (pid alive, same start time) is refused whatever job id the second
launch carries: two launches with one `--rdzv-id`, or two torchrun steps of one SLURM
allocation, share an id but are two jobs.

A record is stale, and is taken over with a message, when its process is gone (same host),
its pid now belongs to a process started at another time (same host), or it was last written
more than `stale_after` seconds ago (another host: its processes cannot be seen from here).
A clean end of training releases the folder (`release`); a job that died leaves a stale record.
"""

import contextlib
import errno
import json
import os
import shutil
import socket
import time
import uuid

import psutil

from megatron_ucp.errors import SaveError
from megatron_ucp.format import durability
from megatron_ucp.format.folder import OLD_MARK, TMP_PREFIX, iteration_dir, iteration_of

OWNER = ".ucp_owner.json"
LOCK = ".ucp_owner.lock"
_JOB_ID = next((v for v in (os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("SLURM_JOB_ID"))
                if v and v != "none"), None) or uuid.uuid4().hex  # torchrun's default --rdzv-id is "none"
_UNKNOWN = -1.0  # the start time of a process we may not inspect


def job_id() -> str:
    return _JOB_ID


def process_start(pid: int):
    """When live process `pid` started (seconds since the epoch), or None when there is none
    (gone, or a zombie); _UNKNOWN when we may not look."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return _UNKNOWN


def me() -> dict:
    """This process's owner record."""
    return {"job": _JOB_ID, "host": socket.gethostname(), "pid": os.getpid(),
            "start": process_start(os.getpid())}


def stale_reason(owner, age: float, host: str, stale_after: float):
    """Why the owner record `owner` (last written `age` seconds ago) no longer holds the folder,
    seen from `host`; None while its job may still run."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or owner["pid"] <= 0:
        return "the record is unreadable"
    if owner.get("host") != host:
        if age > stale_after:
            return f"it was last written {age:.0f} s ago, on another host (stale after {stale_after:.0f} s)"
        return None
    started = process_start(owner["pid"])
    if started is None:
        return f"process {owner['pid']} is gone"
    recorded = owner.get("start")
    if isinstance(recorded, (int, float)) and started != _UNKNOWN and abs(started - recorded) > 0.5:
        return f"pid {owner['pid']} now belongs to another process"
    return None


@contextlib.contextmanager
def _locked(save_dir: str):
    """An exclusive flock of `<save>/.ucp_owner.lock` around a check-and-replace of the record.

    File systems without locks (some parallel file systems mounted without them) get no mutual
    exclusion: the check still runs, unlocked, as it did before locks."""
    fd = os.open(os.path.join(save_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # releases the flock


def _read(path: str):
    """(record, seconds since it was written), (None, 0) when there is none; an unreadable
    record is returned as a string (stale)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return None, 0.0
    try:
        return json.loads(raw.decode("utf-8")), age
    except (UnicodeDecodeError, ValueError):
        return "unreadable", age


def claim(save_dir: str, stale_after: float = 3600.0, announce=print, launcher: bool = False,
          what: str = "--save") -> None:
    """Make this job the folder's owner (taking a stale record over, with a message through
    `announce`), or raise SaveError naming the owner and the record to delete once it stopped.
    `launcher`: a converter whose worker processes (its descendants) save under this claim;
    `what`: the flag that named the folder (the local tier's node dirs are claimed too)."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, OWNER)
    mine = dict(me(), launcher=True) if launcher else me()
    with _locked(save_dir):
        owner, age = _read(path)
        if _my_launcher(owner, mine):
            return  # a converter's workers write under the converter's own claim
        if _another_live_process(owner, mine, stale_after):
            raise SaveError(
                f"{save_dir} is being written by a live process of a job with the same id ({owner['job']}, "
                f"pid {owner['pid']} on {owner['host']}; lock {path}): two launches with one --rdzv-id "
                f"(or two torchrun steps of one SLURM allocation) are two jobs; use another {what} folder, "
                f"or stop that process; if it has stopped, delete {path}")
        if owner is not None and (not isinstance(owner, dict) or owner.get("job") != mine["job"]):
            reason = stale_reason(owner, age, mine["host"], stale_after)
            if reason is None:
                raise SaveError(
                    f"{save_dir} is being written by another job ({owner.get('job')}, pid {owner.get('pid')} "
                    f"on {owner.get('host')}; lock {path}): use another {what} folder, or stop that job; "
                    f"if it has stopped, delete {path}")
            who = owner.get("job") if isinstance(owner, dict) else "?"
            announce(f" taking over {save_dir} from job {who}: {reason} ({path})", flush=True)
        durability.atomic_write_json(path, mine)


def _my_launcher(owner, mine: dict) -> bool:
    """The record is a converter's (`launcher`) and of a live ancestor of this process: the
    torchrun it started started this one."""
    if not (isinstance(owner, dict) and owner.get("launcher") is True and owner.get("host") == mine["host"]
            and isinstance(owner.get("pid"), int)):
        return False
    try:
        ancestors = psutil.Process().parents()
    except psutil.Error:
        return False
    return any(p.pid == owner["pid"] and abs(p.create_time() - (owner.get("start") or 0)) <= 0.5 for p in ancestors)


def _another_live_process(owner, mine: dict, stale_after: float) -> bool:
    """A record of this job id whose process is alive on this host and is not this one: a job id
    is only a name (two launches may share one), a live process with its start time is a fact.
    A restarted worker of this job finds its predecessor gone and keeps the folder."""
    return (isinstance(owner, dict) and owner.get("job") == mine["job"] and owner.get("host") == mine["host"]
            and owner.get("pid") != mine["pid"] and stale_reason(owner, 0.0, mine["host"], stale_after) is None)


def release(save_dir: str) -> None:
    """Give the folder up at a clean end of training: the next job need not wait for staleness."""
    path = os.path.join(save_dir, OWNER)
    if not os.path.isdir(save_dir):
        return
    with _locked(save_dir):
        owner, _ = _read(path)
        if isinstance(owner, dict) and owner.get("job") == _JOB_ID:
            os.unlink(path)


def remove_leftovers(save_dir: str) -> None:
    """Clear what saves that died left behind (safe once this job owns the folder).

    Temporary folders go. An `iter_N.old_*` folder is a checkpoint being replaced by a re-save
    of iteration N: it goes if `iter_N` exists, else it is put back (the save died in between).
    """
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("iter_") and OLD_MARK in name:
            base = os.path.join(save_dir, name.split(OLD_MARK)[0])
            if os.path.exists(base):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, base)


def prune(save_dir: str, keep_last: int, newest: int) -> list:
    """Delete complete checkpoints beyond the newest `keep_last`; never the tracker's `newest`."""
    if keep_last is None or keep_last < 1:
        return []
    found = sorted(i for i in map(iteration_of, os.listdir(save_dir)) if i is not None)
    doomed = [i for i in found[:-keep_last] if i != newest]
    for i in doomed:
        shutil.rmtree(iteration_dir(save_dir, i), ignore_errors=True)
    return doomed
