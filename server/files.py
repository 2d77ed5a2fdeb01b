"""Uploaded files of spec-serve: streamed to the data directory, described beside it.

An upload is written to `<data dir>/files/<id>.jsonl` as its bytes arrive (a multipart
body parsed as a stream, never held whole), under a temporary name until it is
complete, then its description (`<id>.json`: the OpenAI file object) is written, so a
restarted server lists it. The directory is the server's alone (0700, files 0600): the
uploads are users' prompts. An upload cut off by a crash leaves its temporary file;
`sweep_partial` deletes those not written to for STALE_PARTIAL_S (at start-up and in the
expiry sweep: by age, not all at start-up, because a second server may share the data
directory and be receiving an upload). Files expire with the batches' result TTL
(SPEC_RESULT_TTL_S after the upload), else stay until deleted. A file id maps to a path only when it has the shape this
module hands out (`file-` and 24 hex digits): no id reaches outside the directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header

from jobstore import config

#: The ids this module hands out; nothing else is ever turned into a path.
FILE_ID = re.compile(r"file-[0-9a-f]{24}")

#: Largest non-file form field (purpose) read from an upload.
_MAX_FIELD_BYTES = 1024

#: Everything of an upload but the file's bytes (part headers, other fields, the
#: boundaries, an epilogue) may be at most this long, in at most MAX_PARTS parts: a
#: stream of small fields is refused as it arrives, not read to its end.
ENVELOPE_BYTES = 64 * 1024
MAX_PARTS = 16

#: A temporary upload file not written to for this long is left by a dead upload.
STALE_PARTIAL_S = 600.0

#: Private: uploaded prompts are readable by the server's user only.
DIR_MODE, FILE_MODE = 0o700, 0o600

PURPOSES = ("batch",)


class UploadError(Exception):
    """The upload cannot be accepted; `param` names the form field, `status` the HTTP
    code, `code` OpenAI's error code."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass
class _Part:
    name: str | None = None
    filename: str | None = None
    size: int = 0


class FileStore:
    """The data directory's `files/`: create (from a multipart stream), describe, list,
    open and delete uploaded files."""

    def __init__(self, data_dir: Path, max_bytes: int):
        self.root = Path(data_dir) / "files"
        Path(data_dir).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self.root.mkdir(mode=DIR_MODE, exist_ok=True)
        self.root.chmod(DIR_MODE)  # made by an older version: 0755
        self.max_bytes = max_bytes

    def sweep_partial(self, older_than_s: float = STALE_PARTIAL_S) -> list[str]:
        """Delete what dead uploads left (temporary files, and content whose description
        was never written) not modified for `older_than_s`; returns their names."""
        cutoff = time.time() - older_than_s
        gone = []
        for path in [*self.root.glob(".file-*.part"), *self.root.glob("file-*.jsonl")]:
            if path.suffix == ".jsonl" and path.with_suffix(".json").exists():
                continue  # a stored upload
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    gone.append(path.name)
            except FileNotFoundError:
                continue  # finished or swept meanwhile
        return gone

    def path(self, file_id: str) -> Path | None:
        """The stored content of an uploaded file id, or None (not one of ours, or gone)."""
        if not FILE_ID.fullmatch(file_id):
            return None
        path = self.root / f"{file_id}.jsonl"
        return path if (self.root / f"{file_id}.json").is_file() and path.is_file() else None

    def get(self, file_id: str) -> dict | None:
        """The file object of an uploaded file, or None."""
        if self.path(file_id) is None:
            return None
        return json.loads((self.root / f"{file_id}.json").read_text())

    def list(self) -> list[dict]:
        """Every uploaded file's object, newest first."""
        found = []
        for meta in self.root.glob("file-*.json"):
            try:
                found.append(json.loads(meta.read_text()))
            except (OSError, ValueError):
                continue  # being deleted, or half-written by a crash: not a file
        return sorted(found, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete(self, file_id: str) -> bool:
        """Remove an uploaded file; False when there is none with this id."""
        if self.path(file_id) is None:
            return False
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        (self.root / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True

    def delete_expired(self, now: float | None = None) -> list[str]:
        """Delete the files whose `expires_at` (upload time + SPEC_RESULT_TTL_S) has
        passed; returns their ids."""
        now = time.time() if now is None else now
        gone = []
        for obj in self.list():
            if obj.get("expires_at") and obj["expires_at"] <= now and self.delete(obj["id"]):
                gone.append(obj["id"])
        return gone

    async def create(self, content_type: str, body: AsyncIterator[bytes]) -> dict:
        """Store the `file` part of a multipart upload with `purpose=batch` as it
        arrives; returns its file object. Raises UploadError (nothing is kept then)."""
        kind, options = parse_options_header(content_type or "")
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise UploadError("the upload must be multipart/form-data with a boundary")
        file_id = f"file-{secrets.token_hex(12)}"
        partial = self.root / f".{file_id}.part"
        upload = _Upload(partial, self.max_bytes)
        parser = MultipartParser(boundary, upload.callbacks())
        limit, read = self.max_bytes + ENVELOPE_BYTES, 0
        try:
            async for chunk in body:
                read += len(chunk)
                if read > limit:  # the parser drops an epilogue unseen: count it here
                    raise UploadError(
                        f"the request body is larger than {limit} bytes",
                        None,
                        413,
                        "request_too_large",
                    )
                parser.write(chunk)
                upload.check()
            parser.finalize()
            upload.check()
            purpose, part = upload.finish()
            if part is None:
                raise UploadError("no file in the upload (form field `file`)", "file")
            if purpose not in PURPOSES:
                raise UploadError(
                    f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", "purpose"
                )
            os.replace(partial, self.root / f"{file_id}.jsonl")
        except BaseException as exc:
            upload.close()
            partial.unlink(missing_ok=True)
            if isinstance(exc, ValueError) and not isinstance(exc, UploadError):
                raise UploadError(f"the multipart body is malformed: {exc}") from exc
            raise
        now, ttl = int(time.time()), config.result_ttl_s()
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": part.size,
            "created_at": now,
            "expires_at": now + ttl if ttl > 0 else None,
            "filename": os.path.basename(part.filename or "upload.jsonl"),
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        meta = self.root / f".{file_id}.json.part"
        with _private(meta) as out:
            out.write(json.dumps(obj).encode())
        os.replace(meta, self.root / f"{file_id}.json")
        return obj


def _private(path: Path):
    """`path` opened for writing, created 0600 (whatever the umask lets through less)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb")


class _Upload:
    """Callbacks of python-multipart's streaming parser: the `file` part's bytes go
    straight to disk, counted against the limit; `purpose` is kept (a few bytes)."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.out = None
        self.part = _Part()
        self.file_part: _Part | None = None
        self.fields: dict[str, bytearray] = {}
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.envelope = 0  # bytes of headers and non-file fields so far
        self.parts = 0
        self.error: UploadError | None = None

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._header_bytes(self.header_field, d[s:e]),
            "on_header_value": lambda d, s, e: self._header_bytes(self.header_value, d[s:e]),
            "on_header_end": self._header,
            "on_part_data": self._data,
        }

    def _begin(self) -> None:
        self.part = _Part()
        self.parts += 1
        if self.parts > MAX_PARTS:
            self.error = self.error or UploadError(
                f"the upload has more than {MAX_PARTS} parts (it needs two: file and purpose)"
            )

    def _header_bytes(self, into: bytearray, data: bytes) -> None:
        self._count(len(data))
        if not self.error:
            into.extend(data)

    def _count(self, size: int) -> None:
        """Count envelope bytes; past ENVELOPE_BYTES the upload is refused."""
        self.envelope += size
        if self.envelope > ENVELOPE_BYTES:
            self.error = self.error or UploadError(
                f"the upload's form fields and part headers are larger than {ENVELOPE_BYTES} bytes",
                None,
                413,
                "request_too_large",
            )

    def _header(self) -> None:
        if bytes(self.header_field).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self.header_value))
            name, filename = options.get(b"name"), options.get(b"filename")
            self.part.name = name.decode(errors="replace") if name else None
            self.part.filename = filename.decode(errors="replace") if filename else None
            if self.part.name == "file":
                if self.file_part is not None:
                    self.error = self.error or UploadError("more than one file", "file")
                else:
                    self.file_part = self.part
                    self.out = _private(self.path)  # closed in finish/close
        self.header_field.clear()
        self.header_value.clear()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.error:
            return
        part = self.part
        if part is self.file_part:
            part.size += end - start
            if part.size > self.max_bytes:
                self.error = UploadError(
                    f"the file is larger than this server's limit of {self.max_bytes} bytes",
                    "file",
                    413,
                    "file_too_large",
                )
                return
            self.out.write(data[start:end])
        else:
            self._count(end - start)
            if self.error or part.name is None or part.name == "file":
                return
            value = self.fields.setdefault(part.name, bytearray())
            value.extend(data[start:end])
            if len(value) > _MAX_FIELD_BYTES:
                self.error = UploadError(f"form field {part.name} is too long", part.name)

    def check(self) -> None:
        if self.error:
            raise self.error

    def finish(self) -> tuple[str | None, _Part | None]:
        """(purpose, the file part or None), the file closed and synced."""
        if self.out is not None:
            self.out.flush()
            os.fsync(self.out.fileno())
            self.out.close()
        purpose = self.fields.get("purpose")
        return (purpose.decode(errors="replace") if purpose is not None else None), self.file_part

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
