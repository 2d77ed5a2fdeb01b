"""Batches of the OpenAI Batch API, as ordinary specfleet batches.

Creating one records its OpenAI fields in Redis (`P:batch:B:api`, listed in
`P:api-batches`) and validates the uploaded file in a thread with spec-submit's own
code (producer.spool with the context check, then producer.submit.enqueue_file), so a
batch made here is one that spec-status, spec-collect and spec-report know. Its status
is producer.status.status mapped onto OpenAI's life cycle; cancelling is spec-cancel's
producer.cancel.cancel; output and error files are the lines spec-collect writes
(producer.collect.stored_lines), streamed out of Redis.

The record's `state` is what the server decided: `validating` (the file is being read
and queued), `failed` (validation refused it), `submitted` (queued: from here on the
batch's own status speaks), `cancelled` (cancelled before it was queued) or `expired`.
A restarted server validates again the batches it left `validating`: submitting is
idempotent per batch id.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
import time
from collections.abc import Iterator

from redis import Redis

from jobstore import config
from jobstore.jobfile import CHAT_URL, COMPLETION_URL, JobFileError, JobLine, LineError
from jobstore.keys import Keys, new_batch_id
from producer.cancel import cancel as cancel_batch
from producer.collect import stored_lines
from producer.spool import spool_file
from producer.status import TERMINAL
from producer.status import status as batch_status
from producer.submit import SubmitError, enqueue_file
from producer.tokencount import ContextChecker
from server.files import FileStore

log = logging.getLogger("specfleet.serve")

ENDPOINTS = {CHAT_URL: "chat", COMPLETION_URL: "completion"}

#: Validation errors kept in a failed batch's `errors.data` (the count says how many more).
MAX_ERRORS = 1000

#: metadata: at most this many pairs, keys and values at most this long (OpenAI's bounds).
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_OUTPUT_ID = re.compile(r"file-(out|err)-([A-Za-z0-9_-]{1,64})")

#: How often the server looks for batches whose completion window has passed (and
#: uploaded files whose result TTL has).
EXPIRY_SWEEP_S = 30.0


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, param, code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def window_seconds(window: str) -> int:
    """Seconds of a completion window such as "24h" (also s, m, d). Raises APIError."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if not match:
        raise APIError(
            400,
            f"completion_window must be a duration such as 24h (s, m, h or d), got {window!r}",
            "completion_window",
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def check_metadata(metadata) -> dict | None:
    """The metadata object if it follows OpenAI's bounds, else APIError."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise APIError(
            400, f"metadata must be an object of at most {METADATA_PAIRS} pairs", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str):
            raise APIError(400, f"metadata.{key}: keys up to 64 chars, values strings", "metadata")
        if len(value) > METADATA_VALUE_CHARS:
            raise APIError(400, f"metadata.{key}: longer than 512 characters", "metadata")
    return metadata


def batch_usage(usage: dict) -> dict:
    """OpenAI's Batch.usage from a batch status's `usage` (prompt, completion and cached
    prompt tokens summed over the batch's answered lines); no reasoning is counted apart."""
    given, made = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": usage.get("cached_prompt_tokens", 0)},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + made,
    }


def _decode(raw: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _int(rec: dict[str, str], field: str) -> int | None:
    return int(float(rec[field])) if rec.get(field) else None


class BatchService:
    """The Batches endpoints over one Redis and one FileStore. `conn` serves requests;
    validation and the expiry sweep run on `background` (default: `conn`), a client
    that may wait for Redis to come back."""

    def __init__(
        self,
        conn: Redis,
        keys: Keys,
        files: FileStore,
        skip_invalid: bool = False,
        background: Redis | None = None,
    ):
        self.conn, self.keys, self.files, self.skip_invalid = conn, keys, files, skip_invalid
        self.background = background or conn
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _behind(self) -> BatchService:
        """This service on the background client (for work that no request waits on)."""
        other = copy.copy(self)
        other.conn = self.background
        return other

    # --- life of the service -----------------------------------------------------------

    def start(self) -> None:
        """Delete what dead uploads left, validate again the batches a previous server
        left `validating`, and start the expiry sweep."""
        self._sweep_partial()
        for raw in self.conn.zrange(self.keys.api_batches, 0, -1):
            batch_id = raw.decode()
            if self.conn.hget(self.keys.api_batch(batch_id), "state") == b"validating":
                log.info("batch %s: validating again after a restart", batch_id)
                self._validate_in_background(batch_id)
        sweep = threading.Thread(target=self._behind()._sweep, name="expiry-sweep", daemon=True)
        sweep.start()
        self._threads.append(sweep)

    def stop(self) -> None:
        self._stop.set()

    def _sweep(self) -> None:
        while not self._stop.wait(EXPIRY_SWEEP_S):
            try:
                self._sweep_partial()
                for file_id in self.files.delete_expired():
                    log.info("file %s: deleted, its result TTL passed", file_id)
                self._align_ttls()
                for raw in self.conn.zrange(self.keys.api_batches, 0, -1):
                    rec = self._record(raw.decode())
                    if rec and rec["state"] in ("validating", "submitted"):
                        self._expire_if_due(raw.decode(), rec)
            except Exception:  # Redis away: the next sweep tries again
                log.warning("expiry sweep failed; trying again in %.0f s", EXPIRY_SWEEP_S)

    def _sweep_partial(self) -> None:
        for name in self.files.sweep_partial():
            log.info("files/%s: deleted, left by an upload that did not finish", name)

    def _align_ttls(self) -> None:
        """Give each API record the TTL its batch has now: workers renew the batch's
        keys as they store lines (jobstore.store), not this one."""
        ids = [raw.decode() for raw in self.conn.zrange(self.keys.api_batches, 0, -1)]
        with self.conn.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.pttl(self.keys.batch(batch_id))
            ttls = pipe.execute()
        with self.conn.pipeline(transaction=False) as pipe:
            for batch_id, ttl in zip(ids, ttls, strict=True):
                if ttl > 0:
                    pipe.pexpire(self.keys.api_batch(batch_id), ttl)
            pipe.execute()

    # --- create ------------------------------------------------------------------------

    def create(self, request: dict) -> dict:
        """POST /v1/batches: record the batch and start validating its file."""
        unknown = sorted(
            set(request) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        )
        if unknown:
            raise APIError(
                400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter"
            )
        input_file_id = request.get("input_file_id")
        if not isinstance(input_file_id, str) or self.files.get(input_file_id) is None:
            raise APIError(400, f"no file with id {input_file_id!r}", "input_file_id")
        endpoint = request.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be {CHAT_URL} or {COMPLETION_URL}, got {endpoint!r}",
                "endpoint",
            )
        window = request.get("completion_window")
        seconds = window_seconds(window)
        metadata = check_metadata(request.get("metadata"))
        batch_id = new_batch_id()
        now = time.time()
        record = {
            "state": "validating",
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": json.dumps(metadata),
            "created_at": f"{now:.3f}",
            "expires_at": f"{now + seconds:.3f}",
        }
        with self.conn.pipeline() as pipe:
            pipe.hset(self.keys.api_batch(batch_id), mapping=record)
            pipe.zadd(self.keys.api_batches, {batch_id: now})
            pipe.execute()
        # The batch as created: read before validation starts, which may finish (a small
        # bad file) before this reply is built (seen in CI: the reply said "failed").
        created = self.retrieve(batch_id)
        self._validate_in_background(batch_id)
        return created

    def _validate_in_background(self, batch_id: str) -> None:
        thread = threading.Thread(
            target=self._behind()._validate,
            args=(batch_id,),
            name=f"validate-{batch_id}",
            daemon=True,
        )
        thread.start()

    def _validate(self, batch_id: str) -> None:
        key = self.keys.api_batch(batch_id)
        try:
            self._validate_and_queue(batch_id)
        except Exception as exc:  # anything unforeseen fails this batch, not the server
            log.exception("batch %s: validation stopped", batch_id)
            self._fail(
                batch_id,
                [
                    {
                        "code": "server_error",
                        "line": None,
                        "param": None,
                        "message": f"validation stopped: {type(exc).__name__}: {exc}",
                    }
                ],
            )
        if self.conn.hget(key, "state") == b"submitted" and self.conn.hget(key, "cancelling_at"):
            cancel_batch(self.conn, self.keys, batch_id)  # cancelled while being queued

    def _validate_and_queue(self, batch_id: str) -> None:
        rec = self._record(batch_id)
        path = self.files.path(rec["input_file_id"])
        if path is None:
            return self._fail(
                batch_id, [_error(None, "input_file_id", "the input file was deleted")]
            )
        want = ENDPOINTS[rec["endpoint"]]
        checker = ContextChecker(self.conn, self.keys, config.DEFAULT_MODEL)
        models: set[str] = set()

        def check(job: JobLine) -> LineError | None:
            models.add(job.model or config.DEFAULT_MODEL)
            if job.endpoint != want:
                field = "url" if job.prefix else job.prompt_field
                return LineError(
                    job.line,
                    field,
                    f"this batch's endpoint is {rec['endpoint']}: every line must be a "
                    f"{want} request, got a {job.endpoint} request",
                    job.custom_id,
                )
            return checker(job)

        errors: list[dict] = []
        count = [0]

        def on_error(e: LineError) -> None:
            count[0] += 1
            if len(errors) < MAX_ERRORS:
                errors.append(_error(e.line, e.field, e.message))

        filename = self.files.get(rec["input_file_id"])["filename"]
        try:
            spool = spool_file(str(path), None, config.DEFAULT_MODEL, check, on_error)
        except JobFileError as exc:
            return self._fail(batch_id, [_error(None, "input_file_id", str(exc))])
        if len(models) == 1:  # the batch object's `model`: the one its lines name
            self.conn.hset(self.keys.api_batch(batch_id), "model", models.pop())
        with spool:
            if spool.lines == 0:
                return self._fail(
                    batch_id, [_error(None, "input_file_id", "the file has no requests")]
                )
            if spool.invalid and not self.skip_invalid:
                if count[0] > len(errors):
                    errors.append(
                        _error(None, None, f"{count[0] - len(errors)} more problem(s) not listed")
                    )
                return self._fail(batch_id, errors)
            if self.conn.hget(self.keys.api_batch(batch_id), "cancelling_at"):
                self._set_state(batch_id, "cancelled", "cancelled_at")
                return None
            try:
                enqueue_file(
                    self.conn,
                    self.keys,
                    spool,
                    filename,
                    batch_id,
                    total_lines=spool.lines,
                    total_rows=spool.rows,
                )
            except SubmitError as exc:
                return self._fail(batch_id, [_error(None, None, str(exc), "server_error")])
        self._set_state(batch_id, "submitted", "in_progress_at")
        return None

    def _fail(self, batch_id: str, errors: list[dict]) -> None:
        self.conn.hset(self.keys.api_batch(batch_id), "errors", json.dumps(errors))
        self._set_state(batch_id, "failed", "failed_at")

    def _set_state(self, batch_id: str, state: str, stamp: str) -> None:
        key = self.keys.api_batch(batch_id)
        with self.conn.pipeline() as pipe:
            pipe.hset(key, "state", state)
            pipe.hsetnx(key, stamp, f"{time.time():.3f}")
            pipe.execute()

    # --- read --------------------------------------------------------------------------

    def _record(self, batch_id: str) -> dict[str, str] | None:
        raw = self.conn.hgetall(self.keys.api_batch(batch_id))
        return _decode(raw) if raw else None

    def _expire_if_due(self, batch_id: str, rec: dict[str, str]) -> dict[str, str]:
        if time.time() < float(rec["expires_at"]):
            return rec
        if rec["state"] == "submitted":
            state = batch_status(self.conn, self.keys, batch_id)
            c = state["request_counts"]
            if c["completed"] + c["failed"] >= c["total"]:
                return rec  # finished in time
            cancel_batch(self.conn, self.keys, batch_id)
        elif rec["state"] != "validating":
            return rec
        self._set_state(batch_id, "expired", "expired_at")
        return self._record(batch_id)

    def retrieve(self, batch_id: str) -> dict:
        """GET /v1/batches/{id}: the OpenAI batch object. Raises APIError 404."""
        rec = self._record(batch_id)
        if rec is None:
            raise APIError(404, f"no batch with id {batch_id!r}", "batch_id")
        if rec["state"] in ("validating", "submitted"):
            rec = self._expire_if_due(batch_id, rec)
        obj = {
            "id": batch_id,
            "object": "batch",
            "endpoint": rec["endpoint"],
            "errors": None,
            "input_file_id": rec["input_file_id"],
            "completion_window": rec["completion_window"],
            "status": rec["state"],
            "output_file_id": None,
            "error_file_id": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": json.loads(rec.get("metadata") or "null"),
            "model": rec.get("model"),
            "usage": batch_usage({}),
        }
        for stamp in (
            "created_at",
            "in_progress_at",
            "expires_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        ):
            obj[stamp] = _int(rec, stamp)
        if rec.get("errors"):
            obj["errors"] = {"object": "list", "data": json.loads(rec["errors"])}
        if rec["state"] in ("submitted", "expired"):
            self._fleet_view(batch_id, rec, obj)
        return obj

    def _fleet_view(self, batch_id: str, rec: dict[str, str], obj: dict) -> None:
        """Fill status, counts and files from the fleet batch's own status."""
        if not self.conn.exists(self.keys.batch(batch_id)):  # expired, or spec-collect --delete
            with self.conn.pipeline() as pipe:
                pipe.delete(self.keys.api_batch(batch_id))
                pipe.zrem(self.keys.api_batches, batch_id)
                pipe.execute()
            raise APIError(
                404, f"no batch with id {batch_id!r} (its result TTL passed)", "batch_id"
            )
        state = batch_status(self.conn, self.keys, batch_id)
        c = state["request_counts"]
        obj["request_counts"] = {k: c[k] for k in ("total", "completed", "failed")}
        obj["usage"] = batch_usage(state["usage"])
        done = c["completed"] + c["failed"] >= c["total"] and state["status"] != "queued"
        key = self.keys.api_batch(batch_id)
        if rec["state"] == "expired":
            obj["status"] = "expired"
        elif state["status"] == "cancelled" or rec.get("cancelling_at"):
            obj["status"] = "cancelled" if done else "cancelling"
            if done:
                self.conn.hsetnx(key, "cancelled_at", f"{time.time():.3f}")
        elif state["status"] in TERMINAL:
            obj["status"] = "completed"
            finished = state["completed_at"] or int(time.time())
            self.conn.hsetnx(key, "finalizing_at", f"{finished:.3f}")
            self.conn.hsetnx(key, "completed_at", f"{finished:.3f}")
        else:
            obj["status"] = "in_progress"
        if obj["status"] in ("cancelled", "completed", "expired"):
            rec = self._record(batch_id)
            for stamp in ("finalizing_at", "completed_at", "cancelled_at"):
                obj[stamp] = _int(rec, stamp)
            if c["completed"] and not rec.get("output_deleted"):
                obj["output_file_id"] = f"file-out-{batch_id}"
            if c["failed"] and not rec.get("errors_deleted"):
                obj["error_file_id"] = f"file-err-{batch_id}"

    def list(self, after: str | None, limit: int) -> dict:
        """GET /v1/batches: newest first, `limit` after the batch `after`."""
        start = 0
        if after is not None:
            rank = self.conn.zrevrank(self.keys.api_batches, after)
            if rank is None:
                raise APIError(400, f"after: no batch with id {after!r}", "after")
            start = rank + 1
        data: list[dict] = []
        while len(data) <= limit:
            ids = self.conn.zrevrange(self.keys.api_batches, start, start + limit)
            if not ids:
                break
            for raw in ids:
                start += 1
                try:
                    data.append(self.retrieve(raw.decode()))
                except APIError:  # its keys expired (result TTL) or were deleted
                    self.conn.zrem(self.keys.api_batches, raw)
                    start -= 1
                if len(data) > limit:
                    break
        page = data[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(data) > limit,
        }

    def cancel(self, batch_id: str) -> dict:
        """POST /v1/batches/{id}/cancel: spec-cancel's cancel; running lines finish."""
        current = self.retrieve(batch_id)  # raises for an unknown batch
        if current["status"] in ("failed", "completed", "expired", "cancelled"):
            raise APIError(409, f"cannot cancel a batch that is {current['status']}", "batch_id")
        rec = self._record(batch_id)
        self.conn.hsetnx(self.keys.api_batch(batch_id), "cancelling_at", f"{time.time():.3f}")
        if rec["state"] == "submitted":
            cancel_batch(self.conn, self.keys, batch_id)
        return self.retrieve(batch_id)

    # --- output files ------------------------------------------------------------------

    def output_file(self, file_id: str) -> tuple[str, str] | None:
        """(batch id, "result" or "error") of an output or error file id, or None."""
        match = _OUTPUT_ID.fullmatch(file_id)
        if not match:
            return None
        batch_id = match.group(2)
        which = "result" if match.group(1) == "out" else "error"
        obj = self.retrieve(batch_id) if self._record(batch_id) else None
        if (
            obj is None
            or obj["output_file_id" if which == "result" else "error_file_id"] != file_id
        ):
            return None
        return batch_id, which

    def output_object(self, file_id: str) -> dict | None:
        """The file object of an output or error file, or None."""
        found = self.output_file(file_id)
        if found is None:
            return None
        batch_id, which = found
        field = f"{which}_bytes"
        size = self.conn.hget(self.keys.api_batch(batch_id), field)
        if size is None:  # counted once: a finished batch's lines no longer change
            size = sum(len(chunk) for chunk in self.output_lines(batch_id, which))
            self.conn.hset(self.keys.api_batch(batch_id), field, size)
        rec = self._record(batch_id)
        return {
            "id": file_id,
            "object": "file",
            "bytes": int(size),
            "created_at": _int(rec, "completed_at")
            or _int(rec, "cancelled_at")
            or _int(rec, "expired_at")
            or 0,
            "filename": f"{batch_id}_{'output' if which == 'result' else 'error'}.jsonl",
            "purpose": "batch_output",
            "status": "processed",
            "status_details": None,
        }

    def output_lines(self, batch_id: str, which: str) -> Iterator[bytes]:
        """The file's content in pieces of up to CHUNK_LINES lines, as spec-collect
        writes them (results, or error lines), in input order."""
        piece: list[str] = []
        for kind, text, _ in stored_lines(self.conn, self.keys, batch_id):
            if kind == which:
                piece.append(text)
                if len(piece) >= config.CHUNK_LINES:
                    yield ("\n".join(piece) + "\n").encode()
                    piece = []
        if piece:
            yield ("\n".join(piece) + "\n").encode()

    def delete_output(self, file_id: str) -> bool:
        """Hide an output or error file; the batch's lines stay in Redis (for
        spec-collect) until its result TTL or `spec-collect --delete`."""
        found = self.output_file(file_id)
        if found is None:
            return False
        batch_id, which = found
        field = "output_deleted" if which == "result" else "errors_deleted"
        self.conn.hset(self.keys.api_batch(batch_id), field, 1)
        return True

    # --- models ------------------------------------------------------------------------

    def models(self) -> list[dict]:
        """The aliases that workers heard from within a heartbeat TTL serve."""
        now, ttl = time.time(), config.heartbeat_ttl_s()
        served: dict[str, float] = {}
        names = list(self.conn.scan_iter(match=self.keys.worker("*"), count=500))
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hmget(name, "model", "last_seen", "started_at", "stopped_at")
            facts = pipe.execute()
        for model, seen, started, stopped in facts:
            if model is None or stopped is not None or seen is None:
                continue
            if now - float(seen) <= ttl:
                alias = model.decode()
                served[alias] = min(served.get(alias, now), float(started or seen))
        return [
            {"id": alias, "object": "model", "created": int(t), "owned_by": "specfleet"}
            for alias, t in sorted(served.items())
        ]


def _error(
    line: int | None, param: str | None, message: str, code: str = "invalid_request"
) -> dict:
    return {"code": code, "line": line, "message": message, "param": param}
