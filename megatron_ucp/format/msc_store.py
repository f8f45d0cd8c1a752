"""`msc://PROFILE/path` through NVIDIA's Multi-Storage Client (`multi-storage-client` on PyPI):
the profiles and config file (MSC_CONFIG, ~/.msc_config.yaml) that Megatron-LM's `--enable-msc`
reads, so one profile names the bucket, endpoint, credentials and retries for both. The client
retries per its profile's `retry` block; multipart uploads are its own. It exposes no listing
of unfinished multipart uploads: abort_uploads finds none here (a bucket lifecycle rule
aborts them; docs/object_storage.md)."""

from __future__ import annotations

from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError, StorageError
from megatron_ucp.format.storage import Store, need, split, whole_object


class MscStore(Store):
    def __init__(self, profile: str):
        self.profile = profile
        url = f"msc://{profile}/"
        msc = need("multistorageclient", url)
        from multistorageclient.types import Range

        self.Range = Range
        try:
            self.client, _ = msc.resolve_storage_client(url)
        except Exception as e:  # noqa: BLE001 (an unknown profile, a bad config file: the client's words)
            raise StorageError(f"{url}: Multi-Storage Client profile {profile!r}: {type(e).__name__}: {e}") from None
        self.threads = 8

    def _key(self, path: str) -> str:
        return split(path)[2]

    def _do(self, path: str, doing: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{path}: object is missing from the store ({doing})") from None
        except Exception as e:  # noqa: BLE001 (RetryableError after the profile's retries, and the rest)
            message = " ".join(str(e).split())
            raise StorageError(f"{path}: {doing} failed: {type(e).__name__}: {message}") from None

    def read(self, path, max_bytes, what):
        return whole_object(path, self.size(path), max_bytes, what,
                            lambda: self._do(path, f"reading the {what}", self.client.read, self._key(path)))

    def read_ranges(self, path, spans):
        out = []
        for lo, hi in spans:
            data = b"" if hi <= lo else self._do(
                path, f"a ranged read of bytes {lo}..{hi}", self.client.read, self._key(path),
                byte_range=self.Range(offset=lo, size=hi - lo))
            if len(data) != max(hi - lo, 0):
                raise IntegrityError(f"{path}: object ends at byte offset {lo + len(data)}, inside the "
                                     f"bytes {lo}..{hi} read (truncated)")
            out.append(data)
        return out

    def size(self, path):
        try:
            return int(self._do(path, "looking the object up", self.client.info, self._key(path)).content_length)
        except IncompleteCheckpointError:
            return None

    def read_meta(self, path, max_bytes):
        """The object, its ETag and age from the client's own metadata (Last-Modified)."""
        import time

        try:
            info = self._do(path, "looking the object up", self.client.info, self._key(path))
        except IncompleteCheckpointError:
            return None
        data = self.read(path, max_bytes, "object")
        modified = info.last_modified.timestamp() if info.last_modified is not None else time.time()
        return data, info.etag, time.time() - modified

    def write(self, path, data):
        self._do(path, "writing it", self.client.write, self._key(path), data)

    def upload(self, path, local_file):
        self._do(path, "uploading it", self.client.upload_file, self._key(path), local_file)

    def list(self, prefix):
        key = self._key(prefix)
        found = self._do(prefix, "listing it", lambda: list(self.client.list(key + "/" if key else "")))
        return sorted((f"msc://{self.profile}/{m.key}", int(m.content_length)) for m in found)

    def delete(self, paths):
        for p in paths:
            try:
                self._do(p, "deleting it", self.client.delete, self._key(p))
            except IncompleteCheckpointError:
                pass
