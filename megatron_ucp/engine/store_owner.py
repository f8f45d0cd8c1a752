"""One job at a time per save prefix in an object store: ownership.py's owner record, written
with the store's conditional writes instead of under a flock.

The record `<save>/.ucp_owner.json` is read with its version (ETag) and age (Last-Modified);
the same rules as for a folder decide whether its job may still run (ownership.stale_reason);
it is then replaced only if it is still the version read (If-Match), or created only if there
is none (If-None-Match: *): of jobs claiming a prefix at once exactly one wins, on stores with
conditional writes (S3 since 2024). Where a store has none (msc:// profiles), the record is
written unconditionally: the check still runs, without mutual exclusion.
"""

import json

from megatron_ucp.engine import ownership
from megatron_ucp.errors import SaveError
from megatron_ucp.format import storage, stores


def _record(found):
    """(record, version, age) of read_meta's answer; an unreadable record as a string (stale)."""
    if found is None:
        return None, None, 0.0
    raw, tag, age = found
    try:
        return json.loads(raw.decode("utf-8")), tag, age
    except (UnicodeDecodeError, ValueError):
        return "unreadable", tag, age


def claim(save_dir: str, stale_after: float = 3600.0, announce=print, what: str = "--save") -> None:
    """Make this job the prefix's owner (taking a stale record over, with a message), or raise
    SaveError naming the owner and the record to delete once it stopped."""
    store, path, mine = stores.store_for(save_dir), storage.join(save_dir, ownership.OWNER), ownership.me()
    for _ in range(3):  # a lost race reads the winner's record and judges it
        owner, tag, age = _record(store.read_meta(path, 1 << 16))
        if ownership._another_live_process(owner, mine, stale_after):
            raise SaveError(f"{save_dir} is being written by a live process of a job with the same id "
                            f"({owner['job']}, pid {owner['pid']} on {owner['host']}; owner record {path}): "
                            f"use another {what} prefix, or stop that process; if it has stopped, delete {path}")
        if owner is not None and (not isinstance(owner, dict) or owner.get("job") != mine["job"]):
            reason = ownership.stale_reason(owner, age, mine["host"], stale_after)
            if reason is None:
                raise SaveError(f"{save_dir} is being written by another job ({owner.get('job')}, pid "
                                f"{owner.get('pid')} on {owner.get('host')}; owner record {path}): use another "
                                f"{what} prefix, or stop that job; if it has stopped, delete {path}")
            who = owner.get("job") if isinstance(owner, dict) else "?"
            announce(f" taking over {save_dir} from job {who}: {reason} ({path})", flush=True)
        if store.write_if(path, json.dumps(mine).encode(), tag):
            return
    raise SaveError(f"{save_dir}: other jobs keep claiming it at the same time ({path}); use another {what} prefix")


def release(save_dir: str) -> None:
    """Give the prefix up at a clean end of training, if this job still owns it."""
    store, path = stores.store_for(save_dir), storage.join(save_dir, ownership.OWNER)
    owner, _, _ = _record(store.read_meta(path, 1 << 16))
    mine = ownership.me()
    if isinstance(owner, dict) and all(owner.get(k) == mine[k] for k in ("job", "host", "pid")):
        store.delete([path])
