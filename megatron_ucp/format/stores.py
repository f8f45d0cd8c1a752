"""The store that holds a path (storage.py's interface): a folder, or an object store chosen by
the path's scheme, one client per bucket or profile per process."""

from __future__ import annotations

import os
import threading

from megatron_ucp.format.storage import PosixStore, Store, is_remote, scheme_of, split


def exists(path) -> bool:
    """Whether a file (os.path.lexists) or an object is at `path`."""
    return store_for(path).exists(path) if is_remote(path) else os.path.lexists(path)


_STORES: dict = {}
_LOCK = threading.Lock()


def store_for(path) -> Store:
    """The store that holds `path`: one client per scheme and bucket (or profile), shared by
    the threads of this process."""
    scheme = scheme_of(path) if isinstance(path, str) else None
    if scheme is None:
        return PosixStore()
    _, bucket, _ = split(path)
    with _LOCK:
        store = _STORES.get((scheme, bucket))
        if store is None:
            if scheme == "s3":
                from megatron_ucp.format.s3_store import S3Store
                store = S3Store(bucket)
            else:
                from megatron_ucp.format.msc_store import MscStore
                store = MscStore(bucket)
            _STORES[(scheme, bucket)] = store
        return store
