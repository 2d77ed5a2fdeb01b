"""spec-serve with real processes: uvicorn on a free loopback port, the session's private
redis-server, one `spec-worker` on the demo pair, and the official `openai` package used
as its documentation shows. One server and one worker serve every test of this module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from conftest import BIN, PAIR_ARGS, _free_port, script
from redis import Redis

from jobstore.keys import Keys

KEY = "sk-test-" + uuid.uuid4().hex


class Server:
    """A spec-serve subprocess on a loopback port; `restart` kills it (-9) first."""

    def __init__(self, env: dict, data_dir: Path, log_path: Path):
        self.env, self.data_dir, self.log_path = env, data_dir, log_path
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.port = _free_port()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [script("spec-serve"), "--port", str(self.port), "--data-dir", str(self.data_dir)],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.base_url}/models", headers=self.auth, timeout=2).is_success:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"spec-serve did not start:\n{self.log}")
            time.sleep(0.1)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {KEY}"}

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    """(server, worker log path, env, Keys): a private key prefix for the module."""
    root = tmp_path_factory.mktemp("serve")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, SPEC_KEY_PREFIX=prefix, SPEC_REDIS_URL=redis_url, SPEC_API_KEY=KEY)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    worker_log = open(root / "worker.log", "wb")
    worker = subprocess.Popen(
        [script("spec-worker"), *PAIR_ARGS], env=env, stdout=worker_log, stderr=subprocess.STDOUT
    )
    server = Server(env, root / "data", root / "serve.log")
    yield server, root, env, Keys(prefix)
    server.kill()
    worker.kill()
    worker.wait(timeout=10)
    worker_log.close()
    conn = Redis.from_url(redis_url)
    for pattern in (f"{prefix}*", "rq:*batch_*"):
        for key in conn.scan_iter(match=pattern, count=1000):
            conn.delete(key)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def chat(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "demo", "messages": [{"role": "user", "content": content}], **body},
    }


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [script(args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=300
    )


def comparable(line: dict) -> dict:
    """A result line without what differs between two runs of it: ids and timings."""
    line = json.loads(json.dumps(line))
    line.pop("id")
    if line["response"]:
        line["response"].pop("request_id")
        for key in ("id", "created", "metrics"):
            line["response"]["body"].pop(key)
    return line


def test_a_wrong_key_is_the_sdks_authentication_error(fleet):
    server = fleet[0]
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client("sk-wrong").files.list()
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "message": "incorrect API key provided",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    bare = httpx.get(f"{server.base_url}/batches")
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in server.log  # nor anything else secret: one line per request
    assert "GET /v1/batches 401" in server.log


def test_no_file_id_reaches_outside_the_data_directory(fleet):
    server, root = fleet[0], fleet[1]
    (root / "secret.jsonl").write_text("{}\n")
    for file_id in ("..%2Fsecret", "..%2F..%2Fsecret.jsonl", "file-out-..", "file-" + "0" * 24):
        got = httpx.get(f"{server.base_url}/files/{file_id}/content", headers=server.auth)
        assert got.status_code == 404, file_id
        assert set(got.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        server.client().files.retrieve("file-out-batch_nope")


def test_a_bad_file_fails_validation_with_its_line_numbers(fleet, tmp_path):
    client = fleet[0].client()
    jobs = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            chat("a", "hi", max_tokens=2),
            chat("b", "hi", max_tokens=2, temperature=-0.5),
            "{not json",
            {**chat("d", "x"), "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}},
            chat("a", "again", max_tokens=2),
        ],
    )
    uploaded = client.files.create(file=open(jobs, "rb"), purpose="batch")
    assert (uploaded.filename, uploaded.bytes) == ("bad.jsonl", jobs.stat().st_size)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"
    batch = wait_for(client, batch.id, lambda b: b.status != "validating", 60)
    assert batch.status == "failed" and batch.failed_at >= batch.created_at
    assert [(e.line, e.param) for e in batch.errors.data] == [
        (2, "body.temperature"),
        (3, None),
        (4, "url"),
        (5, "custom_id"),
    ]
    assert batch.errors.data[0].message == "must be >= 0, got -0.5"
    assert batch.errors.data[3].message == 'duplicate "a", first used on line 1'
    assert "endpoint is /v1/chat/completions" in batch.errors.data[2].message
    assert batch.request_counts.total == 0 and batch.output_file_id is None
    assert client.files.content(uploaded.id).read() == jobs.read_bytes()


def test_batches_list_pages_with_after_and_limit(fleet, tmp_path):
    client = fleet[0].client()
    empty = client.files.create(
        file=open(write_jsonl(tmp_path / "e.jsonl", []), "rb"), purpose="batch"
    )
    made = [
        client.batches.create(
            input_file_id=empty.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"n": str(i)},
        ).id
        for i in range(3)
    ]
    everything = [b.id for b in client.batches.list(limit=100).data]
    assert everything[:3] == made[::-1]  # newest first
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == everything[:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == everything[2:4]
    assert [b.id for b in client.batches.list(limit=2)] == everything  # the SDK's auto-paging
    assert client.batches.retrieve(made[0]).metadata == {"n": "0"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=empty.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert caught.value.body["param"] == "endpoint"


def test_a_batch_runs_through_the_fleet_as_spec_run_runs_it(fleet, tmp_path):
    server, _, env, keys = fleet
    client = server.client()
    lines = [
        chat(f"row-{i}", f"def f{i}(x):", max_tokens=3 + i % 4, temperature=[0.0, 0.8][i % 2])
        for i in range(6)
    ]
    jobs = write_jsonl(tmp_path / "jobs.jsonl", lines)

    batch_input_file = client.files.create(file=open(jobs, "rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=batch_input_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"description": "nightly eval job"},
    )
    batch = wait_for(client, batch.id, lambda b: b.status in ("completed", "failed"))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (6, 6)
    assert batch.error_file_id is None
    assert batch.in_progress_at <= batch.completed_at <= int(time.time())
    content = client.files.content(batch.output_file_id)
    results = [json.loads(x) for x in content.text.splitlines()]

    # The same lines spec-collect writes, and what spec-run makes of the same file.
    collected = tmp_path / "collected.jsonl"
    assert run(env, "spec-collect", batch.id, "-o", str(collected)).returncode == 0
    assert collected.read_text() == content.text
    local = tmp_path / "local.jsonl"
    spec_run = run(env, "spec-run", str(jobs), "-o", str(local), "--batch-id", batch.id, *PAIR_ARGS)
    assert spec_run.returncode == 0, spec_run.stderr
    expected = [json.loads(x) for x in local.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    assert [comparable(r) for r in results] == [comparable(r) for r in expected]
    status = json.loads(run(env, "spec-status", batch.id, "--json").stdout)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 6
    assert run(env, "spec-report", batch.id, "-o", str(tmp_path / "r.html")).returncode == 0

    output = client.files.retrieve(batch.output_file_id)
    assert (output.purpose, output.bytes) == ("batch_output", len(content.content))
    assert [m.id for m in client.models.list()] == ["demo"]


def test_cancel_on_a_running_batch(fleet, tmp_path):
    client = fleet[0].client()
    jobs = write_jsonl(
        tmp_path / "long.jsonl",
        [chat(f"c{i}", "import os\n", max_tokens=32, temperature=0.0) for i in range(30)],
    )
    file = client.files.create(file=open(jobs, "rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_for(client, batch.id, lambda b: b.status == "cancelled", 120)
    c = batch.request_counts
    assert c.total == 30 and c.completed + c.failed == 30 and c.failed >= 20
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == c.failed
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    done = client.files.content(batch.output_file_id).text.splitlines()
    assert len(done) == c.completed
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_server_killed_mid_batch_comes_back_with_its_files_and_batches(fleet, tmp_path):
    server = fleet[0]
    client = server.client()
    jobs = write_jsonl(
        tmp_path / "restart.jsonl",
        [chat(f"r{i}", "class A:\n", max_tokens=32, temperature=0.0) for i in range(12)],
    )
    file = client.files.create(file=open(jobs, "rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    running = wait_for(client, batch.id, lambda b: b.request_counts.completed >= 1)
    assert running.status == "in_progress"
    server.restart()  # kill -9, then a new process on the same data directory
    client = server.client()
    assert file.id in [f.id for f in client.files.list()]
    assert batch.id in [b.id for b in client.batches.list()]
    batch = wait_for(client, batch.id, lambda b: b.status == "completed")
    assert batch.request_counts.completed == 12
    assert len(client.files.content(batch.output_file_id).text.splitlines()) == 12
    client.files.delete(batch.output_file_id)
    assert client.batches.retrieve(batch.id).output_file_id is None
    assert client.files.delete(file.id).deleted
    assert file.id not in [f.id for f in client.files.list()]
