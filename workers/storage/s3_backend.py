"""The S3 backend (s3fs): the fsspec backend plus a compare-and-swap the server checks, and
parallel multipart transfers of big files.

Why the compare-and-swap: two drivers that both read the lease as "free" must not both win. S3
checks the precondition itself (``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace),
so no client-side lock is needed, and the object's LastModified against the response's Date dates
the lease by the server's clock, never the reader's.

Why parallel transfers: one S3 stream (s3fs's ``S3File``, which uploads its parts one at a time
inside ``write``, and reads ahead one block at a time) is bound by one connection's round trips,
far below what the store and the network give several. Gigabyte shards therefore move as parts
of ``default_block_size`` bytes (s3fs's setting, 50 MiB unless configured), ``max_concurrency``
at a time (s3fs's, 10): uploads of a staged file are s3fs's own ``put_file``, downloads its own
``get_file`` (ranged GETs); only a shard that ``torch.save`` streams straight into storage (a
synchronous save) goes through :class:`ParallelPartWriter`, hand-written because s3fs has no
streaming writer with concurrent parts. Tune both through fsspec's config for ``s3``
(``FSSPEC_S3='{"default_block_size": 67108864, "max_concurrency": 16}'``); the same settings
bound the memory a transfer holds (``max_concurrency`` x ``default_block_size`` per file, and one
part more while a download writes the oldest).
Checksums still cover the exact bytes: computed as the bytes pass (streaming), from the local
file (uploads), and over the bytes written to the local file as they are written (downloads,
before the reader renames it into place; a read back would cost a second pass over every byte,
and only this process writes the file until then).

Why a file download skips botocore's response checksum (``response_checksum_validation:
when_required`` on a second client, unless the user's own s3fs settings say otherwise): every such
file is verified against the checksum its manifest or corpus index names, so botocore's CRC32 of
the same bytes is a second pass that changes no decision, and it cost a third of the download's
client CPU (P11). Small reads (manifests, leases, indexes) keep it: nothing else checks them.

Why reads are hand-written ranged GETs (``_ranged``): every read is bounded (storage may be
hostile: an object listed with size 0 may hold terabytes), and s3fs's ``get_file``/``cat_file``
fetch whatever the object holds. The first GET asks for at most the bound plus one byte and learns
the object's size from its ``Content-Range``; a larger object is refused then, and the rest moves
in ``part_size`` ranges, ``concurrency`` in flight at all times (a window: the next range starts as
soon as the oldest arrives, not when a whole batch has; s3fs's own ``get_file`` waits for each
batch, and a single rank's download then left the server idle between batches, bench P10), each
checked against that size and handed over in file order, so the checksum still streams. Each part
is written from a worker thread (``asyncio.to_thread``): the event loop keeps every other GET of
the process moving meanwhile (a prefetcher's parallel shard downloads share that one loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from typing import Any, TypedDict

from syncpoint.policies.contracts.errors import OversizedEntry, UnsafeEntry
from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import ChecksummingWriter, new_hasher
from syncpoint.workers.storage.fsspec_backend import FsspecBackend, checksum_file, range_target
from syncpoint.workers.storage.protocol import ConditionalWrites, Versioned

S3_MAX_PARTS = 10_000  # an S3 multipart upload has at most this many parts
# A streamed file's first parts are at most this big, so its upload starts while torch.save is still
# serializing it (a 50 MiB part would hold back a 50 MB model file until its close: no overlap at all);
# after STREAM_SMALL_PARTS parts it goes on in the configured part size (S3 parts may differ in size).
STREAM_PART = 8 << 20
STREAM_SMALL_PARTS = 1000


def is_s3(fs: Any) -> bool:
    """Whether an fsspec filesystem is s3fs (the one that can make conditional PUTs)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


class S3Backend(FsspecBackend):
    """S3 through s3fs: bounded ranged reads, parallel transfers, a compare-and-swap the server checks."""

    conditional_writes = ConditionalWrites.S3

    # ---- big files: parallel multipart uploads, parallel ranged downloads (module docstring)
    @property
    def part_size(self) -> int:
        """Bytes per part (and per ranged GET): s3fs's ``default_block_size``."""
        return int(self.fs.default_block_size)

    @property
    def concurrency(self) -> int:
        """Parts in flight per file: s3fs's ``max_concurrency``."""
        return max(1, int(getattr(self.fs, "max_concurrency", 1) or 1))

    @contextlib.contextmanager
    def open_durable(self, path: str, algo: str) -> Iterator[ChecksummingWriter]:
        """Stream into parts uploaded ``concurrency`` at a time while the caller keeps writing; the
        object exists only once the upload completes on a clean exit; on an error the multipart
        upload is aborted (without a manifest a partial state is torn anyway)."""
        writer = ParallelPartWriter(self.fs, path, self.part_size, self.concurrency)
        try:
            yield ChecksummingWriter(writer, algo)
        except BaseException:
            writer.discard()
            raise
        writer.close()

    def upload_file(self, local_path: str, path: str, algo: str, known: ManifestEntry | None) -> tuple[int, str]:
        """s3fs's ``put_file`` (parts of ``part_size``, ``concurrency`` in flight); the checksum, when
        not known from staging, is computed from the local bytes by a second thread meanwhile."""
        put = {"chunksize": self.part_size, "max_concurrency": self.concurrency}
        if known is not None:
            self.fs.put_file(local_path, path, **put)
            return known.size, known.digest
        with ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(checksum_file, local_path, algo)
            self.fs.put_file(local_path, path, **put)
            return digest.result()

    @functools.cached_property
    def verified_fs(self) -> Any:
        """The filesystem for reads the caller verifies itself (module docstring): this one's
        settings, and botocore's response checksum only where S3 requires it."""
        options = dict(self.fs.storage_options)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("response_checksum_validation", "when_required")
        return type(self.fs)(**{**options, "config_kwargs": config})

    def read_bytes(self, path: str, limit: int) -> bytes:
        """Ranged GETs of at most ``limit`` + 1 bytes in all (module docstring)."""
        buf = bytearray()

        def into(offset: int, chunks: list[bytes], total: int) -> None:
            if not buf:
                buf.extend(bytes(total))  # once: the size is checked against the bound first
            for chunk in chunks:
                buf[offset : offset + len(chunk)] = chunk
                offset += len(chunk)

        self._ranged(path, limit, into)
        return bytes(buf)

    def download_file(self, local_path: str, path: str, algo: str, limit: int) -> tuple[int, str]:
        """Ranged GETs (``part_size``, ``concurrency`` at a time, at most ``limit`` + 1 bytes in all,
        written at their offsets as they arrive, never joined) and the checksum of exactly the bytes
        written, hashed in file order as they are written. Parts land in order (``_ranged``); should
        one ever not, the file is read back and hashed instead."""
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        hasher, hashed = new_hasher(algo), [0, True]  # bytes hashed so far, and whether in order
        with open(local_path, "wb") as f:

            def into(offset: int, chunks: list[bytes], total: int) -> None:
                f.seek(offset)
                f.writelines(chunks)
                if offset != hashed[0]:
                    hashed[1] = False
                if hashed[1]:
                    for chunk in chunks:
                        hasher.update(chunk)
                        hashed[0] += len(chunk)

            size = self._ranged(path, limit, into, fs=self.verified_fs)
        if not hashed[1] or hashed[0] != size:
            return checksum_file(local_path, algo)
        return size, hasher.hexdigest()

    def download_range(self, local_path: str, path: str, start: int, end: int, limit: int, at: int) -> None:
        """Ranged GETs of ``[start, end)`` only, as ``download_file``'s, written at ``at`` onwards."""
        with range_target(local_path) as dst:
            if end <= start:
                return

            def into(offset: int, chunks: list[bytes], total: int) -> None:
                for chunk in chunks:
                    os.pwrite(dst, chunk, at + offset - start)
                    offset += len(chunk)

            self._ranged(path, limit, into, fs=self.verified_fs, start=start, end=end)

    def _ranged(self, path: str, limit: int, into: Any, fs: Any = None, start: int = 0, end: int | None = None) -> int:
        """Read an object of at most ``limit`` bytes through ``into(offset, chunks, total)`` (the bytes
        from ``offset`` on, as the response delivered them; called in offset order); returns its
        size. ``OversizedEntry`` for a larger one (having fetched at most one part), ``UnsafeEntry``
        for one whose size changed between the GETs. ``fs``: the client to read with (``self.fs``).
        ``start``, ``end``: only these bytes (``UnsafeEntry`` when the object ends before ``end``)."""
        from fsspec.asyn import sync

        fs = self.fs if fs is None else fs
        bucket, key, _ = fs.split_path(path)
        part = max(1, self.part_size)
        stop = limit + 1 if end is None else end  # the first GET never asks past the bound plus one byte

        async def fetch() -> int:
            chunks, total, _ = await self._get_chunks(bucket, key, start, min(stop, start + part), fs)
            if total > limit:
                raise OversizedEntry(f"{path} is {total} bytes, more than the {limit} it can hold: not read")
            upto = total if end is None else end
            if total < upto:
                raise UnsafeEntry(f"{path} is {total} bytes, shorter than the {upto} its range needs: not read")
            first = start + sum(map(len, chunks))
            ranges = deque((a, min(a + part, upto)) for a in range(first, upto, part))
            window: deque[tuple[int, int, asyncio.Task]] = deque()

            def refill() -> None:
                while ranges and len(window) < self.concurrency:
                    a, b = ranges.popleft()
                    window.append((a, b, asyncio.ensure_future(self._get_chunks(bucket, key, a, b, fs))))

            refill()  # the next parts are in flight while the first is written
            try:
                await asyncio.to_thread(into, start, chunks, total)  # off the event loop: other reads go on meanwhile
                while window:
                    a, b, task = window.popleft()
                    parts, now, _ = await task
                    if now != total or sum(map(len, parts)) != b - a:
                        raise UnsafeEntry(
                            f"{path} changed while it was being read ({total} bytes, then {now}): not read"
                        )
                    refill()
                    await asyncio.to_thread(into, a, parts, total)
            finally:  # a failure stops the ranges still in flight, and collects what they raised
                for _, _, task in window:
                    task.cancel()
                await asyncio.gather(*(task for _, _, task in window), return_exceptions=True)
            return total

        return int(sync(fs.loop, fetch))

    async def _get_range(self, bucket: str, key: str, start: int, end: int) -> tuple[bytes, int, dict]:
        """``_get_chunks`` joined into one ``bytes`` (small reads)."""
        chunks, total, resp = await self._get_chunks(bucket, key, start, end)
        return b"".join(chunks), total, resp

    async def _get_chunks(
        self, bucket: str, key: str, start: int, end: int, fs: Any = None
    ) -> tuple[list[bytes], int, dict]:
        """Bytes ``[start, end)`` of an object (never more, whatever the server sends) as the response
        delivered them (joining a big part would copy every byte once more), the object's whole size
        (its ``Content-Range``) and the response; an empty object is no chunks of size 0."""
        fs = self.fs if fs is None else fs
        try:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except OSError as e:
            if start == 0 and _error_code(e)[0] == "InvalidRange":  # nothing at offset 0: an empty object
                return [], 0, {}
            raise
        body = resp["Body"]
        chunks, got = [], 0
        try:
            while got < end - start and (chunk := await body.read(end - start - got)):  # a read may return less
                chunks.append(chunk)
                got += len(chunk)
        finally:
            body.close()
        return chunks, _object_size(resp, start + got), resp

    def read_versioned(self, path: str, limit: int) -> Versioned | None:
        """One ranged GET: the body (at most ``limit`` bytes), its ETag, and its age as the server's
        Date minus its LastModified."""
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, int, dict]:
            return await self._get_range(bucket, key, 0, limit + 1)

        try:
            data, total, resp = sync(self.fs.loop, get)
        except FileNotFoundError:
            return None
        if total > limit:
            raise OversizedEntry(f"{path} is {total} bytes, more than the {limit} it can hold: not read")
        if not resp:  # an empty object: its metadata from a HEAD
            resp = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        modified = resp.get("LastModified")
        age = None
        if date and modified is not None:
            age = max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
        return Versioned(data, str(resp["ETag"]), age)

    def write_if(self, data: bytes, path: str, expect: str | None, limit: int) -> str | None:
        """The server checks the precondition; nothing is read, so ``limit`` is not needed here."""
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
            return (
                str(response.get("Error", {}).get("Code", "")),
                int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0),
            )
        seen = seen.__cause__ or seen.__context__
    return "", 0


def _object_size(resp: dict, fallback: int) -> int:
    """The whole object's size: ``Content-Range: bytes a-b/SIZE`` of a ranged answer, else (a server
    that answered with the whole object) its ``Content-Length``."""
    content_range = str(resp.get("ContentRange") or "")
    if "/" in content_range and content_range.rsplit("/", 1)[1].isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = resp.get("ContentLength")
    return int(length) if isinstance(length, int) else fallback


def _precondition_failed(e: BaseException) -> bool:
    code, status = _error_code(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


class CompletedPart(TypedDict):
    """One uploaded part, as ``complete_multipart_upload`` takes it (S3's own key names)."""

    PartNumber: int
    ETag: str


class ParallelPartWriter:
    """A write-only file object that uploads an S3 object as a multipart upload, up to
    ``concurrency`` parts in flight on s3fs's event loop while the caller keeps writing.

    Hand-written because s3fs offers no streaming writer with concurrent parts (``S3File`` uploads
    each part synchronously inside ``write``; ``put_file``/``pipe_file`` need the whole object
    first). A synchronous save serializes with ``torch.save`` into this writer, so serialization
    overlaps the upload instead of alternating with it, and at most ``concurrency`` parts plus one
    partial part are held in memory. The first parts are small (``STREAM_PART``) so the overlap
    starts early in each file. A file smaller than one part is a single PUT on ``close``.
    Every request goes through s3fs's ``_call_s3`` (its session, retries and error mapping).
    """

    def __init__(self, fs: Any, path: str, part_size: int, concurrency: int) -> None:
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size, self.concurrency = part_size, max(1, concurrency)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.in_flight: deque[tuple[int, Future]] = deque()
        self.parts: list[CompletedPart] = []
        self.closed = False

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing to flush before ``close``: a part is sent as soon as it is full."""

    def write(self, data: Any) -> int:
        """Copy into the current part (the one copy on this path) and send each part as it fills;
        a full part's buffer is handed to the upload as it is and a new one started."""
        view = memoryview(data).cast("B")
        written = len(view)
        while view:
            room = self._part_target() - len(self.buffer)
            self.buffer += view[:room]
            view = view[room:]
            if len(self.buffer) >= self._part_target():
                part, self.buffer = self.buffer, bytearray()
                self._send(part)
        return written

    def _part_target(self) -> int:
        """The size of the part being filled (``STREAM_PART`` for the first parts, then ``part_size``)."""
        number = len(self.parts) + len(self.in_flight) + 1
        return min(self.part_size, STREAM_PART) if number <= STREAM_SMALL_PARTS else self.part_size

    def _call(self, method: str, **kwargs: Any) -> Future:
        coro = self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def _send(self, part: bytes | bytearray) -> None:
        if self.upload_id is None:
            self.upload_id = str(self._call("create_multipart_upload").result()["UploadId"])
        number = len(self.parts) + len(self.in_flight) + 1
        if number > S3_MAX_PARTS:
            raise OSError(
                f"{self.path}: more than {S3_MAX_PARTS} parts of {self.part_size} bytes; raise s3fs's "
                "default_block_size (fsspec config for s3) for files this large"
            )
        while len(self.in_flight) >= self.concurrency:
            self._collect_oldest()
        self.in_flight.append(
            (number, self._call("upload_part", UploadId=self.upload_id, PartNumber=number, Body=part))
        )

    def _collect_oldest(self) -> None:
        number, future = self.in_flight.popleft()
        self.parts.append({"PartNumber": number, "ETag": future.result()["ETag"]})

    def close(self) -> None:
        """Send the rest and complete the upload (or PUT a small file whole): the object appears
        only now, complete."""
        if self.closed:
            return
        if self.upload_id is None:
            self._call("put_object", Body=self.buffer).result()
        else:
            if self.buffer:
                self._send(self.buffer)
            while self.in_flight:
                self._collect_oldest()
            self._call(
                "complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
            ).result()
        self.buffer = bytearray()
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abort: wait for the parts in flight, then abort the multipart upload (no object appears)."""
        if self.closed:
            return
        self.closed = True
        self.buffer = bytearray()
        for _, future in self.in_flight:
            with contextlib.suppress(Exception):
                future.result()
        self.in_flight.clear()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self.upload_id).result()
