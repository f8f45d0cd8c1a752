"""S3 and S3-compatible stores through boto3 (`s3://bucket/prefix`).

boto3 rather than another client: it is what S3-compatible stores test against, its "standard"
retry mode retries what S3 asks clients to retry (503 SlowDown, 500, throttling, resets,
timeouts) with backoff, and its transfer manager uploads large files in parallel parts. The
endpoint, region and credentials come from the usual AWS settings (AWS_ENDPOINT_URL,
AWS_REGION, AWS_ACCESS_KEY_ID, profiles); UCP_S3_MAX_ATTEMPTS (default 8) bounds the attempts
per request, UCP_S3_PART_BYTES (default 64 MiB) the part size of multipart uploads,
UCP_S3_THREADS (default 8) the parts in flight per file.
"""

from __future__ import annotations

import os

from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError, StorageError
from megatron_ucp.format.storage import Store, need, split, whole_object


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip().isdigit() and int(raw) > 0 else default


_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store(Store):
    def __init__(self, bucket: str):
        self.bucket = bucket
        url = f"s3://{bucket}"
        boto3 = need("boto3", url)
        from botocore.config import Config

        self.attempts = _int_env("UCP_S3_MAX_ATTEMPTS", 8)
        threads = _int_env("UCP_S3_THREADS", 8)
        self.client = boto3.session.Session().client("s3", config=Config(
            retries={"max_attempts": self.attempts, "mode": "standard"},
            max_pool_connections=max(32, 4 * threads)))
        self.part_bytes = max(5 * 2**20, _int_env("UCP_S3_PART_BYTES", 64 * 2**20))
        self.threads = threads

    def _key(self, path: str) -> str:
        return split(path)[2]

    def _fail(self, path: str, error: Exception, doing: str):
        """One line naming the object for whatever the client raised after its retries."""
        from botocore.exceptions import ClientError

        if isinstance(error, ClientError):
            info = error.response.get("Error", {})
            code = str(info.get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _MISSING or status == 404:
                return IncompleteCheckpointError(f"{path}: object is missing from the store ({doing})")
            if code == "InvalidRange" or status == 416:
                return IntegrityError(f"{path}: object is shorter than the bytes {doing} needs (truncated)")
            if code == "PreconditionFailed" or status == 412:
                return IntegrityError(f"{path}: object changed while it was read ({doing}: ETag differs)")
            return StorageError(f"{path}: the store answered {status} {code or ''} "
                                f"({info.get('Message', '')}) to {doing}, after {self.attempts} attempts".replace("  ", " "))
        return StorageError(f"{path}: {doing} failed after {self.attempts} attempts: "
                            f"{type(error).__name__}: {error}")

    def _call(self, path: str, doing: str, fn, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(path, e, doing) from None

    def _get(self, path: str, doing: str, **kwargs) -> tuple:
        """(body bytes, ETag) of one GET; a body cut short is retried as the client retries
        requests (a reset mid-object), then one line naming the object."""
        from botocore.exceptions import BotoCoreError, ClientError

        last = None
        for _ in range(self.attempts):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(path), **kwargs)
                return r["Body"].read(), r.get("ETag")
            except ClientError as e:
                raise self._fail(path, e, doing) from None
            except BotoCoreError as e:  # the body's stream cut short (IncompleteRead), reset
                last = e
        raise self._fail(path, last, doing)

    def read(self, path, max_bytes, what):
        return whole_object(path, self.size(path), max_bytes, what,
                            lambda: self._get(path, f"reading the {what}")[0])

    def read_ranges(self, path, spans):
        """One ranged GET per span; every GET after the first insists on the first one's ETag,
        so that all the bytes come from one version of the object."""
        return list(self.iter_ranges(path, spans))

    def iter_ranges(self, path, spans):
        etag = None
        for lo, hi in spans:
            if hi <= lo:
                yield b""
                continue
            extra = {"IfMatch": etag} if etag else {}
            data, found = self._get(path, f"a ranged read of bytes {lo}..{hi}", Range=f"bytes={lo}-{hi - 1}", **extra)
            etag = etag or found
            if len(data) != hi - lo:
                raise IntegrityError(f"{path}: object ends at byte offset {lo + len(data)}, inside the "
                                     f"bytes {lo}..{hi} read (truncated)")
            yield data

    def head(self, path, nbytes):
        """One ranged GET: the bytes, and the size from its Content-Range ("bytes 0-N/SIZE")."""
        from botocore.exceptions import BotoCoreError, ClientError

        for _ in range(self.attempts):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(path), Range=f"bytes=0-{max(nbytes, 1) - 1}")
                data = r["Body"].read()
                break
            except ClientError as e:
                error = self._fail(path, e, "reading its header")
                if isinstance(error, IncompleteCheckpointError):
                    return None
                if isinstance(error, IntegrityError):  # an empty object: no range to serve
                    return b"", self.size(path)
                raise error from None
            except BotoCoreError as e:
                last = e
        else:
            raise self._fail(path, last, "reading its header")
        total = str(r.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else int(r.get("ContentLength", len(data)))
        return data[:nbytes], size

    def size(self, path):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])
        except ClientError as e:
            error = self._fail(path, e, "looking the object up")
            if isinstance(error, IncompleteCheckpointError):
                return None
            raise error from None
        except BotoCoreError as e:
            raise self._fail(path, e, "looking the object up") from None

    def write(self, path, data):
        self._call(path, "writing it", self.client.put_object, Key=self._key(path), Body=data)

    def upload(self, path, local_file):
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.part_bytes, multipart_chunksize=self.part_bytes,
                                max_concurrency=self.threads)
        from botocore.exceptions import BotoCoreError, ClientError
        from boto3.exceptions import S3UploadFailedError

        try:
            self.client.upload_file(local_file, self.bucket, self._key(path), Config=config)
        except (ClientError, BotoCoreError, S3UploadFailedError) as e:
            raise StorageError(f"{path}: upload failed after {self.attempts} attempts: {e}") from None

    def read_meta(self, path, max_bytes):
        import time

        size = self.size(path)
        if size is None:
            return None
        if size > max_bytes:
            raise IntegrityError(f"{path}: has {size} bytes, more than the {max_bytes} it may have")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(path))
            data = r["Body"].read()
        except ClientError as e:
            error = self._fail(path, e, "reading it")
            if isinstance(error, IncompleteCheckpointError):
                return None
            raise error from None
        except BotoCoreError as e:
            raise self._fail(path, e, "reading it") from None
        return data, r.get("ETag"), time.time() - r["LastModified"].timestamp()

    def write_if(self, path, data, tag):
        """S3's conditional writes (If-None-Match: *, If-Match: ETag): of writers racing, one wins."""
        from botocore.exceptions import BotoCoreError, ClientError

        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data, **condition)
            return True
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                return False  # PreconditionFailed, ConditionalRequestConflict: another writer won
            raise self._fail(path, e, "writing it") from None
        except BotoCoreError as e:
            raise self._fail(path, e, "writing it") from None

    def list(self, prefix):
        key = self._key(prefix)
        key = key + "/" if key else ""
        out = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=key)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in pages:
                out += [(f"s3://{self.bucket}/{o['Key']}", int(o["Size"])) for o in page.get("Contents", ())]
        except (ClientError, BotoCoreError) as e:
            raise self._fail(prefix, e, "listing it") from None
        return sorted(out)

    def delete(self, paths):
        keys = [self._key(p) for p in paths]
        for i in range(0, len(keys), 1000):  # S3's most per request
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            self._call(f"s3://{self.bucket}/{keys[i]}", "deleting it", self.client.delete_objects,
                       Delete={"Objects": batch, "Quiet": True})

    def abort_uploads(self, prefix):
        key = self._key(prefix)
        found = self._call(prefix, "listing its unfinished uploads", self.client.list_multipart_uploads,
                           Prefix=key + "/" if key else "")
        uploads = found.get("Uploads", ())
        for u in uploads:
            self._call(f"s3://{self.bucket}/{u['Key']}", "aborting its unfinished upload",
                       self.client.abort_multipart_upload, Key=u["Key"], UploadId=u["UploadId"])
        return len(uploads)
