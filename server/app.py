"""The HTTP face of spec-serve: OpenAI's Files, Batches and Models endpoints (FastAPI).

Every response that is not a success carries OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Handlers that touch Redis or the disk
are plain functions (FastAPI runs them in its thread pool); the upload is read as a
stream. One log line per request: method, path (never the query or headers; cut to
LOGGED_PATH_CHARS and escaped, so a client cannot write long or forged log lines), status
and milliseconds.

Requests read Redis through a client that fails fast (SERVE_REDIS_TIMEOUT_S, no retry
but one reconnect): while Redis is away they get a 503 with Retry-After at once, not a
wait a client gives up on. Validation and the expiry sweep, which nobody waits on, use
a client that rides out an outage (jobstore.connection).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException

from jobstore import config
from jobstore.connection import connect
from jobstore.keys import Keys
from server.batches import APIError, BatchService
from server.files import ENVELOPE_BYTES, FileStore, UploadError

log = logging.getLogger("specfleet.serve")

#: A logged request path is cut to this many characters (then escaped).
LOGGED_PATH_CHARS = 200

#: Seconds a client is told to wait (Retry-After) while Redis cannot be reached.
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Settings:
    """What one server runs with (spec-serve's options)."""

    redis_url: str | None
    data_dir: Path
    api_key: str | None
    skip_invalid: bool = False
    max_upload_bytes: int = config.SERVE_MAX_UPLOAD_BYTES
    max_body_bytes: int = config.SERVE_MAX_BODY_BYTES


def _error(status: int, message: str, param=None, code=None, type_="invalid_request_error"):
    return JSONResponse(APIError(status, message, param, code, type_).body(), status_code=status)


def create_app(settings: Settings) -> FastAPI:
    """The ASGI application: connects to Redis, opens the data directory, and resumes
    the batches a previous server left validating."""
    conn = connect(settings.redis_url, reconnect=False, timeout_s=config.SERVE_REDIS_TIMEOUT_S)
    background = connect(settings.redis_url, check=False)
    keys = Keys.default()
    files = FileStore(settings.data_dir, settings.max_upload_bytes)
    service = BatchService(conn, keys, files, settings.skip_invalid, background)

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        service.stop()

    app = FastAPI(
        title="specfleet", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )

    @app.middleware("http")
    async def guard(request: Request, call_next):
        started = time.perf_counter()
        response = _refusal(request, settings)
        if response is None:
            response = await call_next(request)
        log.info(
            "%s %s %d %.1f ms",
            request.method,
            loggable(request.url.path),
            response.status_code,
            (time.perf_counter() - started) * 1000,
        )
        return response

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_away(request, exc: Exception):
        log.warning("%s %s: Redis unavailable: %s", request.method, loggable(request.url.path), exc)
        response = _error(
            503,
            f"the fleet's Redis cannot be reached; retry in {RETRY_AFTER_S} s",
            code="service_unavailable",
            type_="server_error",
        )
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("%s %s failed", request.method, loggable(request.url.path))
        return _error(500, f"internal error: {type(exc).__name__}", type_="server_error")

    # --- files -------------------------------------------------------------------------

    @app.post("/v1/files")
    async def upload(request: Request):
        try:
            return await files.create(request.headers.get("content-type", ""), request.stream())
        except UploadError as exc:
            return _error(exc.status, str(exc), exc.param, exc.code)

    @app.get("/v1/files")
    def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ):
        found = [f for f in files.list() if purpose is None or f["purpose"] == purpose]
        if order == "asc":
            found.reverse()
        if after is not None:
            ids = [f["id"] for f in found]
            if after not in ids:
                raise APIError(400, f"after: no file with id {after!r}", "after")
            found = found[ids.index(after) + 1 :]
        page = found[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(found) > limit,
        }

    def _file(file_id: str) -> dict:
        obj = files.get(file_id) or service.output_object(file_id)
        if obj is None:
            raise APIError(404, f"no file with id {file_id!r}", "file_id")
        return obj

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str):
        return _file(file_id)

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str):
        path = files.path(file_id)
        if path is not None:
            return StreamingResponse(_read(path), media_type="application/jsonl")
        found = service.output_file(file_id)
        if found is None:
            raise APIError(404, f"no file with id {file_id!r}", "file_id")
        return StreamingResponse(service.output_lines(*found), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        if not (files.delete(file_id) or service.delete_output(file_id)):
            raise APIError(404, f"no file with id {file_id!r}", "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    # --- batches -----------------------------------------------------------------------

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        body = await _json_body(request, settings.max_body_bytes)
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(service.create, body)

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: int = Query(20, ge=1, le=100)):
        return service.list(after, limit)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str):
        return service.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        return service.cancel(batch_id)

    # --- models ------------------------------------------------------------------------

    @app.get("/v1/models")
    def list_models():
        return {"object": "list", "data": service.models()}

    @app.get("/v1/models/{model}")
    def get_model(model: str):
        for m in service.models():
            if m["id"] == model:
                return m
        raise APIError(404, f"no worker serves model {model!r}", "model", "model_not_found")

    return app


def loggable(path: str) -> str:
    """A request path as it may go into the log: at most LOGGED_PATH_CHARS characters,
    control and non-ASCII characters escaped (no line breaks, no terminal codes)."""
    cut = path[:LOGGED_PATH_CHARS]
    escaped = ascii(cut)[1:-1]
    return escaped + (f"...({len(path)} chars)" if len(path) > len(cut) else "")


def _refusal(request: Request, settings: Settings) -> JSONResponse | None:
    """The error response for a request without the API key, or with a body larger
    than allowed; None when it may go on."""
    if settings.api_key is not None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return _error(
                401, "no API key given: send Authorization: Bearer <key>", code="invalid_api_key"
            )
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            return _error(401, "incorrect API key provided", code="invalid_api_key")
    length = request.headers.get("content-length")
    limit = (
        settings.max_upload_bytes + ENVELOPE_BYTES  # the multipart envelope around the file
        if request.url.path == "/v1/files"
        else settings.max_body_bytes
    )
    if length is not None and length.isdigit() and int(length) > limit:
        return _error(
            413, f"the request body is larger than {limit} bytes", code="request_too_large"
        )
    return None


async def _json_body(request: Request, limit: int) -> dict:
    """The request's JSON object, read up to `limit` bytes. Raises APIError."""
    data = bytearray()
    async for chunk in request.stream():
        data.extend(chunk)
        if len(data) > limit:
            raise APIError(
                413, f"the request body is larger than {limit} bytes", code="request_too_large"
            )
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise APIError(400, f"the request body is not JSON: {exc}") from exc
    except RecursionError as exc:  # the parser recurses once per level of nesting
        raise APIError(400, "the request body is not JSON: nested too deeply") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _read(path: Path, size: int = 1 << 20):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk
