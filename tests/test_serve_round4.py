"""spec-serve, reliability round 4 (issue 46, items 3-9) and the Batch API as dataset
tools drive it (issue 48): in this process (FastAPI's TestClient), with a private
redis-server where Redis has to go away, and the stub worker (benchmarks/stub_worker.py)
where a batch has to finish."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from test_faults import NO_PERSISTENCE_ARGS, private_redis  # noqa: F401 - a fixture
from test_serve_inprocess import KEY, _create, _line, _upload, _wait, api  # noqa: F401 - a fixture

from server import batches
from server.app import LOGGED_PATH_CHARS, Settings, create_app
from server.files import ENVELOPE_BYTES, MAX_PARTS, STALE_PARTIAL_S, FileStore, UploadError

STUB_WORKER = Path(__file__).resolve().parent.parent / "benchmarks" / "stub_worker.py"


def _error_shape(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# --- 3. JSON bodies nested too deeply -------------------------------------------------


def test_a_json_body_nested_100000_deep_is_a_400(api, caplog):  # noqa: F811
    with api() as client:
        got = client.post("/v1/batches", content=b"[" * 100_000 + b"]" * 100_000)
        assert got.status_code == 400, got.text
        assert _error_shape(got)["message"] == "the request body is not JSON: nested too deeply"
        # Within the depth json takes: an ordinary refusal of what it holds.
        shallow = client.post("/v1/batches", json={"input_file_id": [[[["x"]]]]})
        assert shallow.status_code == 400 and _error_shape(shallow)["param"] == "input_file_id"
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


# --- 4. partial uploads left by a killed server -----------------------------------------


def _aged(path: Path, text: str, age_s: float) -> Path:
    path.write_text(text)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_partial_uploads_left_by_a_dead_server_are_swept(api, tmp_path, monkeypatch):  # noqa: F811
    root = FileStore(tmp_path / "data", 1 << 20).root
    stale = _aged(root / ".file-aaaaaaaaaaaaaaaaaaaaaaaa.part", "{}\n", STALE_PARTIAL_S + 60)
    stale_meta = _aged(root / ".file-aaaaaaaaaaaaaaaaaaaaaaaa.json.part", "{", STALE_PARTIAL_S + 60)
    orphan = _aged(root / "file-bbbbbbbbbbbbbbbbbbbbbbbb.jsonl", "{}\n", STALE_PARTIAL_S + 60)
    # Another server sharing the directory is receiving this one: written to recently.
    live = _aged(root / ".file-cccccccccccccccccccccccc.part", "{}\n", 5)
    monkeypatch.setattr(batches, "EXPIRY_SWEEP_S", 0.05)
    with api() as client:  # start-up sweeps
        assert not stale.exists() and not stale_meta.exists() and not orphan.exists()
        assert live.exists()
        kept = _upload(client, _line("a") + "\n")
        later = _aged(root / ".file-dddddddddddddddddddddddd.part", "{}\n", STALE_PARTIAL_S + 1)
        deadline = time.monotonic() + 30
        while later.exists():  # the expiry sweep, every EXPIRY_SWEEP_S
            assert time.monotonic() < deadline, "the sweep never removed a stale upload"
            time.sleep(0.05)
        assert live.exists()
        assert client.get(f"/v1/files/{kept}").json()["status"] == "processed"


# --- 5. the whole upload request is bounded ----------------------------------------------


class _Stream:
    """An async body that counts what the server read of it."""

    def __init__(self, chunks):
        self.chunks, self.read = chunks, 0

    async def __aiter__(self):
        for chunk in self.chunks:
            self.read += len(chunk)
            yield chunk


def _store_upload(tmp_path: Path, chunks, max_bytes: int = 1 << 20) -> tuple[UploadError, int]:
    store = FileStore(tmp_path / "data", max_bytes)
    body = _Stream(chunks)
    with pytest.raises(UploadError) as caught:
        asyncio.run(store.create("multipart/form-data; boundary=b", body))
    assert list(store.root.iterdir()) == []  # nothing half-kept
    return caught.value, body.read


def _field(name: str, value: bytes) -> bytes:
    return b'--b\r\nContent-Disposition: form-data; name="' + name.encode() + b'"\r\n\r\n' + value


def test_a_stream_of_small_fields_is_refused_as_it_arrives(tmp_path):
    # 150,000 distinct fields of 1,000 bytes (~151 MB, chunked): read to its end before.
    fields = (_field(f"f{i}", b"v" * 1000) + b"\r\n" for i in range(150_000))
    error, read = _store_upload(tmp_path, fields)
    assert error.status == 400 and f"more than {MAX_PARTS} parts" in str(error)
    assert read < (MAX_PARTS + 1) * 1100, read
    print(f"\nfigures: 150000 fields: refused_after_bytes={read}")
    # Parts of 7 headers of 4 KB each (python-multipart's own bounds are per part).
    part = b"--b\r\n" + b"".join(b"X-Pad: " + b"p" * 4000 + b"\r\n" for _ in range(7))
    headers = [part + b'Content-Disposition: form-data; name="x"\r\n\r\nv\r\n'] * MAX_PARTS
    error, read = _store_upload(tmp_path, headers)
    assert error.status == 413 and error.code == "request_too_large"
    assert read <= ENVELOPE_BYTES + len(headers[0]), read  # refused in the chunk past it


def test_bytes_after_the_closing_boundary_count_against_the_limit(tmp_path):
    upload = (
        _field("purpose", b"batch")
        + b'\r\n--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        + b"{}\n\r\n--b--\r\n"
    )
    epilogue = (b"e" * 65536 for _ in range(2000))  # 131 MB the parser would drop unseen
    error, read = _store_upload(tmp_path, [upload, *epilogue], max_bytes=1000)
    assert error.status == 413 and error.code == "request_too_large"
    assert read <= 1000 + ENVELOPE_BYTES + 65536, read
    print(f"\nfigures: 131 MB epilogue: refused_after_bytes={read}")


# --- 6. private data directory and uploads -----------------------------------------------


def test_the_data_directory_and_uploads_are_private(api, tmp_path):  # noqa: F811
    old = tmp_path / "data" / "files"
    old.mkdir(parents=True, mode=0o755)  # as an older version left it
    old.chmod(0o755)
    with api() as client:
        file_id = _upload(client, _line("a") + "\n")
    modes = {
        p.name: stat.S_IMODE(p.stat().st_mode)
        for p in [old, old / f"{file_id}.jsonl", old / f"{file_id}.json"]
    }
    assert modes == {"files": 0o700, f"{file_id}.jsonl": 0o600, f"{file_id}.json": 0o600}
    fresh = tmp_path / "new" / "data"
    FileStore(fresh, 1000)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


# --- 7. logged paths ------------------------------------------------------------------


def test_a_long_unauthenticated_path_is_logged_cut_and_escaped(api, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="specfleet.serve")
    path = "/v1/files/%1b[31mforged%08%7f%20ok" + "x" * 60_000  # httpx sends up to 64 KiB
    with api() as client:
        got = client.get(path, headers={"Authorization": "Bearer wrong"})
    assert got.status_code == 401
    (line,) = [r.getMessage() for r in caplog.records if " 401 " in r.getMessage()]
    assert len(line) < LOGGED_PATH_CHARS + 100, len(line)
    assert not any(c in line for c in "\n\x1b\x08\x7f")
    assert line.startswith("GET /v1/files/\\x1b[31mforged\\x08\\x7f ok")
    assert f"...({len(path) - 8} chars) 401 " in line  # four %xx, one character each


# --- 8. an API key no client can send -------------------------------------------------


def test_a_non_ascii_api_key_is_refused_at_start_up(monkeypatch):
    from click.testing import CliRunner

    from server.cli import serve

    monkeypatch.setenv("SPEC_API_KEY", "sk-clé")
    got = CliRunner().invoke(serve, ["--redis", "redis://127.0.0.1:1/0"])
    assert got.exit_code == 1
    assert got.output == (
        "spec-serve: error: SPEC_API_KEY has the character 'é' at position 6: an API key "
        "must be printable ASCII (HTTP clients send only ASCII in headers)\n"
    )


# --- 9. Redis away ----------------------------------------------------------------------


def _timed(call, limit_s: float):
    """(response, seconds) of call() run in a thread; fails if it has not answered
    within limit_s (the thread is left to finish when Redis is back)."""
    got: list = []
    began = time.monotonic()
    thread = threading.Thread(target=lambda: got.append(call()), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert got, f"no answer within {limit_s} s"
    return got[0], time.monotonic() - began


def _unavailable(response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "5"
    error = _error_shape(response)
    assert (error["type"], error["code"]) == ("server_error", "service_unavailable")


def test_while_redis_is_away_requests_get_a_503_at_once(
    private_redis,  # noqa: F811
    tmp_path,
):
    server, env = private_redis(*NO_PERSISTENCE_ARGS)
    app = create_app(Settings(env.url, tmp_path / "data", KEY))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        file_id = _upload(client, _line("a") + "\n")
        created = _create(client, file_id).json()
        url = f"/v1/batches/{created['id']}"
        server.stop()  # refused connections
        try:
            got, took = _timed(lambda: client.get(url), 3)
            _unavailable(got)
            got, took_create = _timed(lambda: _create(client, file_id), 3)
            _unavailable(got)
            assert client.get(f"/v1/files/{file_id}").status_code == 200  # disk only
        finally:
            server.start()
        assert client.get("/v1/batches").status_code == 200  # back (and empty)
        os.kill(server.proc.pid, signal.SIGSTOP)  # a Redis that accepts and never answers
        try:
            got, took_hung = _timed(lambda: client.get(url), 3)
            _unavailable(got)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert client.get("/v1/batches").status_code == 200
    print(
        f"\nfigures: redis away: refused_s={took:.2f}, create_s={took_create:.2f}, "
        f"hung_s={took_hung:.2f}"
    )


# --- issue 48: the Batch API as dataset tools drive it -----------------------------------


def test_the_openai_sdk_runs_a_batch_as_dataset_tools_do(api, redis_env, tmp_path):  # noqa: F811
    lines = [
        json.loads(_line("q0", model="demo")),
        json.loads(_line("q1", model="demo", messages=[{"role": "user", "content": "a b c d"}])),
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {}},
    ]
    jobs = tmp_path / "requests.jsonl"
    jobs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with api(skip_invalid=True) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )
        uploaded = client.files.create(file=jobs.open("rb"), purpose="batch")
        deadline = time.monotonic() + 30
        while client.files.retrieve(uploaded.id).status != "processed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"request_file_name": "requests.jsonl", "tool": "curator"},
        )
        assert batch.metadata == {"request_file_name": "requests.jsonl", "tool": "curator"}
        assert batch.usage is not None and batch.usage.total_tokens == 0
        _wait(http, batch.id, lambda b: b["status"] != "validating")
        worker = subprocess.run(
            [sys.executable, str(STUB_WORKER), "--burst", "--log-level", "WARNING"],
            env=redis_env.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert worker.returncode == 0, worker.stderr
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline + 60, batch
            time.sleep(0.05)
        assert batch.status == "completed" and batch.model == "demo"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
        assert batch.metadata == {"request_file_name": "requests.jsonl", "tool": "curator"}
        usage = batch.usage
        assert usage.output_tokens == 2 and usage.input_tokens > 0  # the stub: 1 token a line
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.input_tokens_details.cached_tokens == 0
        assert usage.output_tokens_details.reasoning_tokens == 0
        output = [json.loads(x) for x in client.files.content(batch.output_file_id).iter_lines()]
        assert sorted(r["custom_id"] for r in output) == ["q0", "q1"]
        errors = [json.loads(x) for x in client.files.content(batch.error_file_id).iter_lines()]
        assert [e["custom_id"] for e in errors] == ["bad"]
        for file_id in (batch.output_file_id, batch.error_file_id, uploaded.id):
            assert client.files.delete(file_id).deleted
        assert client.batches.retrieve(batch.id).output_file_id is None
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
