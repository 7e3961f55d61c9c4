"""The S3 backend (s3fs): the fsspec backend plus a compare-and-swap the server checks.

Why: two drivers that both read the lease as "free" must not both win. S3 checks the precondition
itself (``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace), so no client-side lock
is needed, and the object's LastModified against the response's Date dates the lease by the
server's clock, never the reader's.
"""

from __future__ import annotations

from email.utils import parsedate_to_datetime
from typing import Any

from workers.storage_fsspec import FsspecBackend
from workers.storage_protocol import Versioned


def is_s3(fs: Any) -> bool:
    """Whether an fsspec filesystem is s3fs (the one that can make conditional PUTs)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


class S3Backend(FsspecBackend):
    conditional_writes = "s3"

    def read_versioned(self, path: str) -> Versioned | None:
        """One GET: the body, its ETag, and its age as the server's Date minus its LastModified."""
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, dict]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = resp["Body"]
            try:
                return await body.read(), resp
            finally:
                body.close()

        try:
            data, resp = sync(self.fs.loop, get)
        except FileNotFoundError:
            return None
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        modified = resp.get("LastModified")
        age = None
        if date and modified is not None:
            age = max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
        return Versioned(data, str(resp["ETag"]), age)

    def write_if(self, data: bytes, path: str, expect: str | None) -> str | None:
        bucket, key, _ = self.fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except (OSError, FileExistsError) as e:
            if isinstance(e, FileExistsError) or _precondition_failed(e):
                return None
            raise
        finally:
            self.fs.invalidate_cache(path)
        return str(out["ETag"])


def _error_code(e: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore error, wherever s3fs wrapped it."""
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return (str(response.get("Error", {}).get("Code", "")),
                    int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))
        seen = seen.__cause__ or seen.__context__
    return "", 0


def _precondition_failed(e: BaseException) -> bool:
    code, status = _error_code(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)
