"""spec-submit and friends against a real Redis, without workers: bad files enqueue
nothing, good ones enqueue in bulk, errors are one clear line, passwords never print."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import pytest
from click.testing import CliRunner
from conftest import stored
from test_jobfile import BAD_LINES, GOOD, GOOD_AFTER

from jobstore.keys import job_id
from producer import cli


def _keys_of(env) -> list[bytes]:
    return sorted(
        list(env.conn.scan_iter(match=f"{env.prefix}*"))
        + list(env.conn.scan_iter(match=f"rq:*{env.prefix}*"))
    )


def _submit(*args: str):
    return CliRunner().invoke(cli.submit, list(args), catch_exceptions=False)


def _register_word_model(env, alias: str, context_length: int) -> None:
    """A served alias whose tokenizer makes one token per word (tokenizers library)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    env.conn.hset(
        env.keys.model(alias),
        mapping={"context_length": context_length, "tokenizer_json": tok.to_str()},
    )


CONTEXT_LINES = [
    (
        "prompt longer than the context",
        json.dumps({"custom_id": "x", "prompt": "a " * 60, "max_tokens": 16, "model": "words"}),
        "prompt: too long for model words: at least 60 prompt tokens + max_tokens 16 > context 64 tokens",
    ),
    (
        "chat longer than the context (envelope)",
        json.dumps(
            {
                "custom_id": "x",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "words",
                    "messages": [{"role": "user", "content": "a " * 40}] * 2,
                    "max_tokens": 1,
                },
            }
        ),
        "body.messages: too long for model words: at least 80 prompt tokens + max_tokens 1 > context 64 tokens",
    ),
    (
        "max_tokens beyond the context",
        json.dumps({"custom_id": "x", "prompt": "a", "max_tokens": 64, "model": "words"}),
        "max_tokens: must be < the context of model words (64 tokens), got 64",
    ),
]


@pytest.mark.parametrize(
    "kind,bad,expected",
    [(k, b, e) for k, b, e in BAD_LINES] + [(k, b, [e]) for k, b, e in CONTEXT_LINES],
    ids=[k for k, _, _ in BAD_LINES] + [k for k, _, _ in CONTEXT_LINES],
)
def test_bad_line_is_reported_and_nothing_is_enqueued(redis_env, tmp_path, kind, bad, expected):
    _register_word_model(redis_env, "words", 64)
    before = _keys_of(redis_env)
    path = tmp_path / "jobs.jsonl"
    bad_bytes = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(GOOD.encode() + b"\n" + bad_bytes + b"\n" + GOOD_AFTER.encode() + b"\n")
    result = _submit(str(path), "--batch-id", redis_env.batch_id())
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[: len(expected)] == [f"{path}:2: {m}" for m in expected]
    assert lines[len(expected)] == (
        f"spec-submit: error: {path}: 1 invalid line(s), 2 valid: nothing was enqueued "
        "(fix them, or pass --skip-invalid to run the valid lines)"
    )
    assert result.stdout == ""
    assert _keys_of(redis_env) == before  # nothing enqueued, no batch created


def test_every_invalid_line_is_printed_before_stopping(redis_env, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "\n".join(
            [GOOD, '{"custom_id": "b", "prompt": "x", "top_k": -1}', "", "not json", GOOD_AFTER]
        )
        + "\n"
    )
    result = _submit(str(path))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[:2] == [
        f"{path}:2: top_k: must be >= 0, got -1",
        f"{path}:4: not valid JSON: Expecting value at column 1",
    ]


def test_skip_invalid_enqueues_the_rest_and_records_error_lines(redis_env, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "\n".join([GOOD, '{"custom_id": "b", "prompt": "x", "top_k": -1}', GOOD_AFTER]) + "\n"
    )
    batch = redis_env.batch_id()
    result = _submit(str(path), "--batch-id", batch, "--skip-invalid")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{batch}\n"
    assert (
        f"batch {batch}: 3 lines: 2 enqueued, 1 invalid (error lines); models: demo (2)"
        in result.stderr
    )
    assert f"follow it:  spec-status {batch}" in result.stderr
    conn, keys = redis_env.conn, redis_env.keys
    # A small file: one line per job, so a fleet's rows share it out.
    assert conn.lrange(f"rq:queue:{keys.queue_name('demo')}", 0, -1) == [
        job_id(batch, 1).encode(),
        job_id(batch, 2).encode(),
    ]
    error = stored(conn.hget(keys.errors(batch), "c:b"))
    assert error == {
        "id": f"{batch}-2",
        "custom_id": "b",
        "response": None,
        "error": {"code": "invalid_request", "message": "top_k: must be >= 0, got -1", "line": 2},
    }
    status = CliRunner().invoke(cli.status, [batch, "--json"])
    counts = json.loads(status.stdout)["request_counts"]
    assert counts == {"total": 3, "queued": 2, "running": 0, "completed": 0, "failed": 1}


def test_jobs_are_json_with_finite_timeouts_and_route_by_model(redis_env, tmp_path):
    from rq import Queue
    from rq.serializers import JSONSerializer

    path = tmp_path / "jobs.jsonl"
    path.write_text(
        '{"custom_id": "a", "prompt": "x", "max_tokens": 10}\n'
        '{"custom_id": "b", "prompt": "x", "max_tokens": 100, "model": "other"}\n'
    )
    batch = redis_env.batch_id()
    assert _submit(str(path), "--batch-id", batch).exit_code == 0
    keys = redis_env.keys
    demo = Queue(keys.queue_name("demo"), connection=redis_env.conn, serializer=JSONSerializer)
    other = Queue(keys.queue_name("other"), connection=redis_env.conn, serializer=JSONSerializer)
    (job_a,) = demo.jobs
    (job_b,) = other.jobs
    assert (job_a.id, job_a.func_name, job_a.args) == (
        job_id(batch, 1),
        "worker.jobs.run_lines",
        [batch, ["c:a"]],
    )
    assert job_b.args == [batch, ["c:b"]]
    assert 0 < job_a.timeout < job_b.timeout < 24 * 3600
    data = zlib.decompress(redis_env.conn.hget(f"rq:job:{job_a.id}", "data"))
    assert json.loads(data) == ["worker.jobs.run_lines", None, [batch, ["c:a"]], {}]  # not pickle
    # Each request record names its job and its own time limit.
    record = json.loads(redis_env.conn.hget(keys.requests(batch), "c:a"))
    assert (record["job"], record["timeout"]) == (1, job_a.timeout)


def test_a_large_file_is_enqueued_as_jobs_of_many_lines(redis_env, tmp_path, monkeypatch):
    from rq import Queue
    from rq.serializers import JSONSerializer

    from jobstore import config

    monkeypatch.setattr(config, "JOB_SPREAD", 4)  # 300 lines // 4: as if a large file
    path = tmp_path / "jobs.jsonl"
    ids = [f"r{i}" for i in range(300)]
    path.write_text("".join(json.dumps({"custom_id": c, "prompt": "x"}) + "\n" for c in ids))
    batch = redis_env.batch_id()
    assert _submit(str(path), "--batch-id", batch).exit_code == 0
    queue = Queue(
        redis_env.keys.queue_name("demo"), connection=redis_env.conn, serializer=JSONSerializer
    )
    jobs = queue.jobs
    assert [len(j.args[1]) for j in jobs] == [64, 64, 64, 64, 44]  # JOB_LINES_MAX each
    assert [k for j in jobs for k in j.args[1]] == [f"c:{c}" for c in ids]
    assert [j.id for j in jobs] == [job_id(batch, n) for n in range(1, 6)]
    records = redis_env.conn.hgetall(redis_env.keys.requests(batch))
    assert json.loads(records[b"c:r64"])["job"] == 2


def test_resubmitting_a_queued_batch_enqueues_nothing_twice(redis_env, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(GOOD + "\n" + GOOD_AFTER + "\n")
    batch = redis_env.batch_id()
    assert _submit(str(path), "--batch-id", batch).exit_code == 0
    again = _submit(str(path), "--batch-id", batch)
    assert again.exit_code == 0
    assert f"batch {batch}: 2 lines: 0 enqueued, 2 already queued or running" in again.stderr
    queue_key = f"rq:queue:{redis_env.keys.queue_name('demo')}"
    assert redis_env.conn.llen(queue_key) == 2


def test_invalid_batch_id_and_model_are_usage_errors(redis_env, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(GOOD + "\n")
    result = _submit(str(path), "--batch-id", "has space")
    assert result.exit_code == 1
    assert result.stderr == (
        "spec-submit: error: batch id must be 1 to 64 letters, digits, '_' or '-', got 'has space'\n"
    )
    assert _submit(str(path), "--model", "a/b").exit_code == 2


def test_missing_and_empty_files(redis_env, tmp_path):
    result = _submit(str(tmp_path / "nope.jsonl"))
    assert result.exit_code == 1
    assert "nope.jsonl: cannot read: No such file or directory" in result.stderr
    (tmp_path / "empty.jsonl").write_text("\n\n")
    result = _submit(str(tmp_path / "empty.jsonl"))
    assert result.exit_code == 1
    assert result.stderr.endswith("empty.jsonl: no requests (the file is empty)\n")


def test_unreachable_redis_is_one_line_with_the_password_redacted(tmp_path, monkeypatch):
    path = tmp_path / "jobs.jsonl"
    path.write_text(GOOD + "\n")
    url = "redis://:hunter2@127.0.0.1:1/0"
    for command, args in [
        ("spec-submit", [str(path)]),
        ("spec-status", ["b"]),
        ("spec-collect", ["b", "-o", str(tmp_path / "r.jsonl")]),
        ("spec-retry", ["b"]),
        ("spec-cancel", ["b"]),
        ("spec-worker", ["--burst"]),
    ]:
        from conftest import script

        result = subprocess.run(
            [script(command), *args, "--redis", url], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 3, (command, result.stderr)
        assert result.stderr.startswith(
            f"{command}: error: cannot reach Redis at redis://:***@127.0.0.1:1/0: "
        ), result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert "hunter2" not in result.stderr + result.stdout


def test_redis_url_comes_from_the_environment(tmp_path, monkeypatch):
    from jobstore import config

    monkeypatch.delenv("SPEC_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert config.redis_url() == "redis://localhost:6379/0"
    monkeypatch.setenv("REDIS_URL", "redis://a:1/0")
    assert config.redis_url() == "redis://a:1/0"
    monkeypatch.setenv("SPEC_REDIS_URL", "redis://b:2/0")
    assert config.redis_url() == "redis://b:2/0"
    assert config.redis_url("redis://c:3/0") == "redis://c:3/0"
    assert config.redact("rediss://user:pw@host:6380/1") == "rediss://user:***@host:6380/1"
    assert config.redact("redis://host:6379/0") == "redis://host:6379/0"


def test_unknown_batch_is_one_clear_line(redis_env, tmp_path):
    for command, extra in [
        (cli.status, []),
        (cli.collect, ["-o", str(tmp_path / "r.jsonl")]),
        (cli.retry, []),
        (cli.cancel, []),
    ]:
        result = CliRunner().invoke(command, ["nope", *extra])
        assert result.exit_code == 1
        assert result.stderr.endswith(
            f"error: no such batch 'nope': this Redis (prefix '{redis_env.prefix}') has no "
            "record of any batch; check the id, the Redis URL and SPEC_KEY_PREFIX. If it was "
            "submitted to this Redis, Redis has lost its data (restarted without persistence?)"
            ": re-submit its file with --batch-id nope\n"
        )


def test_the_producer_never_imports_mlx_or_the_engine():
    code = (
        "import sys, producer.cli, producer.submit, producer.collect, producer.tokencount\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'engine', 'worker'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_demo_alias_is_checked_with_the_bundled_tokenizer(redis_env, tmp_path):
    """No worker has registered "demo" yet: the producer reads the bundled tokenizer file."""
    from tokenizers import Tokenizer

    from producer.tokencount import DEMO_TARGET_DIR

    prompt = "def f(x):\n    return x\n" * 300
    n = len(
        Tokenizer.from_file(str(DEMO_TARGET_DIR / "tokenizer.json"))
        .encode(prompt, add_special_tokens=False)
        .ids
    )
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        GOOD + "\n" + json.dumps({"custom_id": "long", "prompt": prompt, "max_tokens": 8}) + "\n"
    )
    result = _submit(str(path))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"{path}:2: prompt: too long for model demo: at least {n} prompt tokens + max_tokens 8 > context 1024 tokens"
    )
    assert n + 8 > 1024
