"""Security with real processes: only this project's job function runs, Redis with a
password and with TLS works end to end, the password never shows in any output, and
a runaway result line is refused instead of filling Redis."""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import time

import pytest
from conftest import PAIR_ARGS
from rq import Callback, Queue
from rq.serializers import JSONSerializer
from test_faults import private_redis  # noqa: F401 - a fixture
from test_queue import _collect, read_jsonl, write_jobs

from jobstore.keys import JOB_FUNCTION

LINES = [
    {"custom_id": "a", "prompt": "def f(x):", "max_tokens": 3},
    {"custom_id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
]


def test_a_job_naming_any_other_function_is_refused_without_running(
    redis_env, start_worker, tmp_path
):
    conn, keys, prefix = redis_env.conn, redis_env.keys, redis_env.prefix
    queue = Queue(keys.queue_name("demo"), connection=conn, serializer=JSONSerializer)
    marker = tmp_path / "ran"
    only = "only worker.jobs.run_lines runs here"
    many = [f"c:{i}" for i in range(65)]  # one more than JOB_LINES_MAX
    forged = {
        f"{prefix}_subprocess": (
            queue.enqueue(
                "subprocess.call", ["touch", f"{marker}1"], job_id=f"{prefix}_subprocess"
            ),
            f"names function 'subprocess.call'; {only}",
        ),
        f"{prefix}_callback": (
            queue.enqueue(
                JOB_FUNCTION,
                f"{prefix}_b",
                ["c:a"],
                on_failure=Callback("os.system"),
                job_id=f"{prefix}_callback",
            ),
            "names failure callback 'os.system'",
        ),
        f"{prefix}_kwargs": (
            queue.enqueue(
                JOB_FUNCTION, f"{prefix}_b", line_keys=["c:a"], job_id=f"{prefix}_kwargs"
            ),
            "has an instance or keyword arguments; expected (batch id, [line keys])",
        ),
        f"{prefix}_ourcallback": (
            queue.enqueue(
                "worker.jobs.on_job_failure", f"{prefix}_b", ["c:a"], job_id=f"{prefix}_ourcallback"
            ),
            f"names function 'worker.jobs.on_job_failure'; {only}",
        ),
        # Arguments of the wrong shape: one line key (the old one-line job), too many
        # lines, something that is not a line key.
        f"{prefix}_oneline": (
            queue.enqueue(JOB_FUNCTION, f"{prefix}_b", "c:a", job_id=f"{prefix}_oneline"),
            f"arguments ['{prefix}_b', 'c:a'] are not (batch id, [line keys])",
        ),
        f"{prefix}_toomany": (
            queue.enqueue(JOB_FUNCTION, f"{prefix}_b", many, job_id=f"{prefix}_toomany"),
            f"arguments {str([f'{prefix}_b', many])[:80]} are not (batch id, [line keys])",
        ),
        f"{prefix}_notakey": (
            queue.enqueue(JOB_FUNCTION, f"{prefix}_b", ["x:1"], job_id=f"{prefix}_notakey"),
            f"arguments ['{prefix}_b', ['x:1']] are not (batch id, [line keys])",
        ),
    }
    worker = start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    assert not list(tmp_path.glob("ran*"))
    reports = {r["job_id"]: r["reason"] for r in map(json.loads, conn.lrange(keys.refused, 0, -1))}
    assert reports == {job_id: reason for job_id, (_, reason) in forged.items()}
    for job_id in forged:
        assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"
    assert "Job OK" not in worker.log


def _no_secret(secret: str, *texts: str) -> None:
    for text in texts:
        assert secret not in text, text


def test_a_password_protected_redis_works_and_the_password_never_shows(
    private_redis,  # noqa: F811
    tmp_path,
):
    password = "pw" + secrets.token_hex(16)
    server, env = private_redis("--save", "", password=password)
    url = server.url
    masked = f"redis://:***@127.0.0.1:{server.port}/0"
    jobs = write_jobs(tmp_path / "jobs.jsonl", LINES)
    batch = env.batch_id("pw")
    outputs: list[str] = []

    def run(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        res = env.run(*args)
        outputs.extend([res.stdout, res.stderr])
        assert res.returncode == code, res.stderr
        return res

    submitted = run("spec-submit", jobs, "--batch-id", batch, "--redis", url)
    assert f"spec-status {batch} --redis {masked}" in submitted.stderr
    worker = env.start_worker(*PAIR_ARGS)  # URL from SPEC_REDIS_URL
    worker.wait_for_log(f"{batch} line 2 (b): ", timeout=120)
    assert f"at {masked}" in worker.log
    state = json.loads(run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed" and state["request_counts"]["completed"] == 2
    run("spec-status", batch)
    out = tmp_path / "r.jsonl"
    run("spec-collect", batch, "-o", str(out), "--redis", url)
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b"]

    # The worker rides out a restart; its one line per attempt is redacted.
    server.stop()
    time.sleep(1.5)
    server.start()
    worker.wait_for_log("reconnected after", timeout=60)
    assert f"Redis at {masked}: " in worker.log
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log

    # Wrong or missing password: one line, nothing secret in it.
    wrong = url.replace(password, "not" + password)
    res = run("spec-status", batch, "--redis", wrong, code=3)
    assert res.stderr == (
        f"spec-status: error: cannot reach Redis at {masked}: "
        "invalid username-password pair or user is disabled.\n"
    )
    res = run("spec-status", batch, "--redis", f"redis://127.0.0.1:{server.port}/0", code=3)
    assert res.stderr == (
        f"spec-status: error: cannot reach Redis at redis://127.0.0.1:{server.port}/0: this Redis "
        "requires a password: put it in the URL, redis://:PASSWORD@host:port/0\n"
    )
    res = run("spec-worker", "--burst", "--redis", wrong, *PAIR_ARGS, code=3)
    assert len(res.stderr.splitlines()) == 1
    _no_secret(password, worker.log, *outputs)


def _certificate(tmp_path) -> tuple:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_redis_over_tls_with_a_password_works_end_to_end(
    private_redis,  # noqa: F811
    tmp_path,
):
    cert, key = _certificate(tmp_path)
    password = "pw" + secrets.token_hex(16)
    try:
        server, env = private_redis("--save", "", password=password, tls=(cert, key))
    except AssertionError as exc:
        if "TLS" in str(exc) and ("not" in str(exc) or "support" in str(exc)):
            pytest.skip(f"this redis-server has no TLS support: {str(exc)[-200:]}")
        raise
    assert server.url.startswith("rediss://") and f"ssl_ca_certs={cert}" in server.url
    jobs = write_jobs(tmp_path / "jobs.jsonl", LINES)
    batch = env.batch_id("tls")
    res = env.run("spec-submit", jobs, "--batch-id", batch)
    assert res.returncode == 0, res.stderr
    worker = env.start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    results = read_jsonl(_collect(env, batch, tmp_path / "r.jsonl"))
    assert [(r["custom_id"], r["error"]) for r in results] == [("a", None), ("b", None)]
    masked = f"rediss://:***@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    assert f"at {masked}" in worker.log

    # The CA can also come from the environment (OpenSSL's SSL_CERT_FILE) ...
    bare = f"rediss://:{password}@127.0.0.1:{server.port}/0"
    env.env["SSL_CERT_FILE"] = str(cert)
    status = env.run("spec-status", batch, "--redis", bare)
    assert status.returncode == 0 and "completed" in status.stdout, status.stderr
    del env.env["SSL_CERT_FILE"]
    # ... and without it, an unknown certificate is refused in one line.
    refused = env.run("spec-status", batch, "--redis", bare)
    assert refused.returncode == 3
    assert refused.stderr.startswith(
        f"spec-status: error: cannot reach Redis at rediss://:***@127.0.0.1:{server.port}/0: "
    )
    assert "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    # Plain text to the TLS port fails cleanly too.
    plain = env.run(
        "spec-status", batch, "--redis", f"redis://:{password}@127.0.0.1:{server.port}/0"
    )
    assert plain.returncode == 3 and len(plain.stderr.splitlines()) == 1
    _no_secret(password, worker.log, status.stdout, status.stderr, refused.stderr, plain.stderr)


def test_a_result_line_over_the_cap_becomes_an_error_line(redis_env, start_worker, tmp_path):
    redis_env.env["SPEC_MAX_RESULT_BYTES"] = "4096"
    lines = [
        {"custom_id": "small", "prompt": "def f(x):", "max_tokens": 2},
        {"custom_id": "big", "prompt": "def f(x):", "max_tokens": 2, "metadata": {"n": "x" * 5000}},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("cap")
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    small, big = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert small["error"] is None and len(json.dumps(small)) < 4096
    assert big["response"] is None
    code, message = big["error"]["code"], big["error"]["message"]
    assert (code, big["error"]["line"]) == ("invalid_request", 2)
    size = int(message.split(": ")[1].split(" ")[0])
    assert size > 5000
    assert message == (
        f"result line too large: {size} bytes, over the limit of 4096 bytes "
        "(SPEC_MAX_RESULT_BYTES on the workers): ask for less (max_tokens, metadata) "
        "or raise the limit"
    )
    assert f"{batch} line 2 (big): result line too large" in worker.log
    stored = redis_env.conn.hget(redis_env.keys.errors(batch), "c:big")
    assert len(stored) < 1024  # the big line never reached Redis
    meta = redis_env.conn.hgetall(redis_env.keys.batch(batch))
    assert (meta[b"completed"], meta[b"failed"]) == (b"1", b"1")
    tokens = small["response"]["body"]["usage"]["completion_tokens"]
    assert int(meta[b"completion_tokens"]) == tokens  # the refused line adds nothing
