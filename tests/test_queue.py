"""Through Redis with real worker processes on the demo pair: results equal spec-run's,
each line once, foreign jobs refused, re-submission idempotent, --wait, cancel, retry,
and the worker's reaction to SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
from conftest import PAIR_ARGS, PAIR_TARGET_DIR, stored, wait_until
from rq import Callback, Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from jobstore import keys as key_layout

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    "# 计算斐波那契数列 🐍\ndef fib(n):",
    "Écris un haïku sur le thé 🍵",
    "for i in range(10):",
]


def mixed_lines(n: int = 50) -> list[dict]:
    """n requests mixing chat and completion, both forms, greedy and sampled (seeded
    and not), stop strings, and unicode (CJK, emoji, accents) in prompts and ids."""
    out = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        body: dict = {"max_tokens": 4 + i % 7}
        if i % 2:
            body["messages"] = [
                {"role": "system", "content": "You write Python. 你好 👋"},
                {"role": "user", "content": prompt},
            ]
        else:
            body["prompt"] = prompt
        body["temperature"] = [0.0, 0.8, 1.0, 0.0, 0.6][i % 5]
        if i % 3 == 0:
            body["seed"] = 1000 + i
        if i % 4 == 1:
            body["stop"] = ["\n", ")", " ", "("]  # one of them shows up within a few tokens
        if i % 5 == 2:
            body["top_k"] = 20
            body["top_p"] = 0.9
        if i % 6 == 5:
            body["speculative"] = {
                "num_draft_tokens": 2 + i % 3,
                "drafter": ["model", "lookup"][i % 2],
            }
        custom_id = f"req-{i:02d}-{'茶' if i % 7 == 0 else 'x'}"
        if i % 2 == 0:
            url = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            out.append({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
        else:
            out.append({"custom_id": custom_id, **body})
    return out


def write_jobs(path, lines: list[dict]) -> str:
    path.write_text(
        "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8"
    )
    return str(path)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def comparable(line: dict) -> dict:
    """A result line without what legitimately differs between runs: creation time,
    ids and timings (metrics: the adaptive draft length depends on the process)."""
    line = json.loads(json.dumps(line))
    line.pop("id")
    if line["response"]:
        line["response"].pop("request_id")
        body = line["response"]["body"]
        for key in ("id", "created", "metrics"):
            body.pop(key)
    return line


def test_end_to_end_two_workers_equal_spec_run(redis_env, start_worker, tmp_path):
    lines = mixed_lines(50)
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("e2e")

    spec_run_local(redis_env, jobs, batch, tmp_path / "local.jsonl")

    submitted = redis_env.run("spec-submit", jobs, "--batch-id", batch)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout == f"{batch}\n"
    # Each worker takes exactly half, so the fleet view must show both.
    names = ["mac-a.1", "mac-b.2"]
    workers = [start_worker("--burst", "--max-jobs", "25", "--name", n, *PAIR_ARGS) for n in names]
    for w in workers:
        assert w.wait(timeout=400) == 0, w.log

    out, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    collected = redis_env.run("spec-collect", batch, "-o", str(out), "--errors", str(errors))
    assert collected.returncode == 0, collected.stderr
    assert collected.stderr == f"wrote 50 result(s) to {out} and 0 error line(s) to {errors}\n"

    results, expected = read_jsonl(out), read_jsonl(tmp_path / "local.jsonl")
    assert read_jsonl(errors) == []
    assert [r["custom_id"] for r in results] == [
        x["custom_id"] for x in lines
    ]  # once each, input order
    assert [r["id"] for r in results] == [f"{batch}-{i}" for i in range(1, 51)]
    for got, want in zip(results, expected, strict=True):
        assert comparable(got) == comparable(want)
        body = got["response"]["body"]
        assert body["object"] == (
            "text_completion" if "text" in body["choices"][0] else "chat.completion"
        )
        assert body["model"] == "demo"
        assert (
            body["usage"]["total_tokens"]
            == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        )
        # 0 tokens when the model's first token is end-of-text, which then ends the line.
        assert 0 <= body["usage"]["completion_tokens"] <= 10
        if body["usage"]["completion_tokens"] == 0:
            assert body["choices"][0]["finish_reason"] == "stop"
        assert set(body["metrics"]) >= {
            "time_to_first_token_ms",
            "generation_time_ms",
            "tokens_per_second",
            "speculative_decoding",
        }
    # The fleet view: every line names the worker and host that ran it.
    ran_by = [r["response"]["body"]["metrics"]["worker"] for r in results]
    assert {w["host"] for w in ran_by} == {socket.gethostname()}
    assert sorted(w["name"] for w in ran_by) == [names[0]] * 25 + [names[1]] * 25
    finish = [r["response"]["body"]["choices"][0]["finish_reason"] for r in results]
    assert finish.count("stop") >= 3 and finish.count("length") >= 3  # stop strings exercised
    # Sampled lines without a seed got one derived from (batch, custom_id), and say so.
    assert all(
        r["response"]["body"]["seed"] is not None
        for r, x in zip(results, lines, strict=True)
        if x.get("body", x)["temperature"] > 0
    )

    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed"
    assert state["request_counts"] == {
        "total": 50,
        "queued": 0,
        "running": 0,
        "completed": 50,
        "failed": 0,
    }
    bodies = [r["response"]["body"] for r in results]
    assert state["usage"] == {
        "prompt_tokens": sum(b["usage"]["prompt_tokens"] for b in bodies),
        "completion_tokens": sum(b["usage"]["completion_tokens"] for b in bodies),
        "cached_prompt_tokens": sum(
            b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies
        ),
    }
    sd = state["speculative_decoding"]
    lines_sd = [b["metrics"]["speculative_decoding"] for b in bodies]
    for counter in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
        assert sd[counter] == sum(x[counter] for x in lines_sd)
    assert sorted((w["name"], w["completed"]) for w in state["workers"]) == [
        (names[0], 25),
        (names[1], 25),
    ]
    report = redis_env.run("spec-report", batch, "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report.html").read_text()
    assert names[0] in page and names[1] in page and ">local<" not in page
    assert all(w["model"] == "demo" for w in state["workers"])
    assert state["throughput_tokens_per_second"] > 0
    assert state["eta_seconds"] == 0.0 and state["completed_at"] >= state["created_at"]


def test_forged_jobs_are_refused_and_never_run(redis_env, start_worker, tmp_path):
    conn, keys = redis_env.conn, redis_env.keys
    name = keys.queue_name("demo")
    marker = tmp_path / "pwned"
    json_queue = Queue(name, connection=conn, serializer=JSONSerializer)
    forged = {
        f"{redis_env.prefix}_system": json_queue.enqueue(
            "os.system", f"touch {marker}1", job_id=f"{redis_env.prefix}_system"
        ),
        f"{redis_env.prefix}_pickle": Queue(name, connection=conn).enqueue(
            os.system, f"touch {marker}2", job_id=f"{redis_env.prefix}_pickle"
        ),
        f"{redis_env.prefix}_callback": json_queue.enqueue(
            key_layout.JOB_FUNCTION,
            "x",
            ["c:y"],
            on_success=Callback("os.system"),
            job_id=f"{redis_env.prefix}_callback",
        ),
    }
    jobs = write_jobs(
        tmp_path / "jobs.jsonl", [{"custom_id": "ok", "prompt": "def f(x):", "max_tokens": 3}]
    )
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0

    worker = start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    assert not list(tmp_path.glob("pwned*"))
    reports = {r["job_id"]: r for r in map(json.loads, conn.lrange(keys.refused, 0, -1))}
    assert set(reports) == set(forged)
    assert (
        reports[f"{redis_env.prefix}_system"]["reason"]
        == "names function 'os.system'; only worker.jobs.run_lines runs here"
    )
    assert (
        reports[f"{redis_env.prefix}_pickle"]["reason"]
        == "payload is not a JSON job (DeserializationError)"
    )
    assert (
        reports[f"{redis_env.prefix}_callback"]["reason"] == "names a success or stopped callback"
    )
    failed = FailedJobRegistry(name, connection=conn).get_job_ids()
    assert set(forged) <= set(failed)
    for job_id in forged:
        assert f"REFUSED job {job_id} from queue {name}" in worker.log
        assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"
    assert conn.hexists(keys.results(batch), "c:ok")  # the real job still ran


def test_submitting_the_same_batch_twice_runs_each_line_once(redis_env, start_worker, tmp_path):
    lines = [
        {"custom_id": f"r{i}", "prompt": PROMPTS[i], "max_tokens": 3, "temperature": 0.9}
        for i in range(3)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=120) == 0
    first = read_jsonl(_collect(redis_env, batch, tmp_path / "first.jsonl"))

    again = redis_env.run("spec-submit", jobs, "--batch-id", batch)
    assert again.returncode == 0
    assert f"batch {batch}: 3 lines: 0 enqueued, 3 already done" in again.stderr
    second_worker = start_worker("--burst", *PAIR_ARGS)
    assert second_worker.wait(timeout=120) == 0
    assert "Job OK" not in second_worker.log  # nothing ran again
    second = read_jsonl(_collect(redis_env, batch, tmp_path / "second.jsonl"))
    assert second == first and [r["custom_id"] for r in second] == ["r0", "r1", "r2"]
    meta = redis_env.conn.hgetall(redis_env.keys.batch(batch))
    assert (meta[b"completed"], meta.get(b"failed", b"0")) == (b"3", b"0")


def spec_run_local(redis_env, jobs: str, batch: str, out, *extra: str):
    """What `spec-run` writes for `jobs` on the test pair (the yardstick of the queue's
    output), with the batch id `batch`; `extra` are more spec-run options."""
    local = redis_env.run(
        "spec-run", jobs, "-o", str(out), "--batch-id", batch, *extra, *PAIR_ARGS, timeout=400
    )
    assert local.returncode == 0, local.stderr
    return out


def submit_slow_and_quick(redis_env, tmp_path) -> str:
    """A submitted batch of a long line "slow" limited to 1 s (as if derived from a tiny
    max_tokens) and a 2-token line "quick"; returns the batch id."""
    jobs = write_jobs(
        tmp_path / "jobs.jsonl",
        [{"custom_id": "slow", **LONG}, {"custom_id": "quick", "prompt": "x", "max_tokens": 2}],
    )
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    set_line_timeout(redis_env, batch, "c:slow", 1)
    return batch


def only_slow_timed_out(redis_env, batch: str, tmp_path) -> list[dict]:
    """The collected lines of `submit_slow_and_quick`'s batch, checked: "slow" a timeout
    error line, "quick" a result."""
    lines = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [(x["custom_id"], x["error"] and x["error"]["code"]) for x in lines] == [
        ("slow", "timeout"),
        ("quick", None),
    ]
    return lines


def _collect(redis_env, batch: str, path, *extra: str):
    result = redis_env.run("spec-collect", batch, "-o", str(path), *extra)
    assert result.returncode == 0, result.stderr
    return path


def test_submit_wait_returns_when_done_and_writes_the_files(redis_env, start_worker, tmp_path):
    worker = start_worker(*PAIR_ARGS)
    lines = [
        {"custom_id": "a", "prompt": "def f(x):", "max_tokens": 3},
        {"custom_id": "bad", "prompt": "x", "temperature": -1},
        {"custom_id": "b", "messages": [{"role": "user", "content": "hi 🍵"}], "max_tokens": 3},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    done = redis_env.run(
        "spec-submit",
        jobs,
        "--skip-invalid",
        "--wait",
        "-o",
        str(out),
        "--errors",
        str(errors),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    batch = done.stdout.strip()
    assert f"wrote 2 result(s) to {out} and 1 error line(s) to {errors}" in done.stderr
    assert done.stderr.rstrip().endswith(f"batch {batch} completed: 2 completed, 1 failed")
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b"]
    (error,) = read_jsonl(errors)
    assert error["error"] == {
        "code": "invalid_request",
        "message": "temperature: must be >= 0, got -1",
        "line": 2,
    }

    worker.signal(signal.SIGTERM)  # idle: stops at once, exit 0
    assert worker.wait(timeout=30) == 0


def test_cancel_then_retry(redis_env, start_worker, tmp_path):
    lines = [{"custom_id": f"r{i}", "prompt": PROMPTS[i], "max_tokens": 2} for i in range(4)]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0

    cancelled = redis_env.run("spec-cancel", batch)
    assert cancelled.returncode == 0
    assert (
        cancelled.stderr == f"batch {batch}: cancelled 4 waiting line(s); 0 running will finish\n"
    )
    assert redis_env.conn.llen(f"rq:queue:{redis_env.keys.queue_name('demo')}") == 0
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "cancelled"
    assert state["request_counts"] == {
        "total": 4,
        "queued": 0,
        "running": 0,
        "completed": 0,
        "failed": 4,
    }
    errors = read_jsonl(_collect(redis_env, batch, tmp_path / "c.jsonl"))
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        (f"r{i}", "cancelled", i + 1) for i in range(4)
    ]

    retried = redis_env.run("spec-retry", batch)
    assert retried.stderr == f"batch {batch}: re-queued 4 failed line(s)\n"
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=120) == 0
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed"
    assert state["request_counts"]["completed"] == 4 and state["request_counts"]["failed"] == 0
    results = read_jsonl(
        _collect(redis_env, batch, tmp_path / "r.jsonl", "--order", "completion", "--delete")
    )
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1", "r2", "r3"]
    assert not list(redis_env.conn.scan_iter(match=f"{redis_env.keys.batch(batch)}*"))
    assert not redis_env.run("spec-status", batch).returncode == 0


def test_the_worker_rechecks_the_context_and_jobs_for_other_models_wait(
    redis_env, start_worker, tmp_path
):
    """The producer's check is a lower bound (no chat template); the worker's is exact."""
    from tokenizers import Tokenizer

    from producer.tokencount import _context_length

    context = _context_length(json.loads((PAIR_TARGET_DIR / "config.json").read_text()))
    tok = Tokenizer.from_file(str(PAIR_TARGET_DIR / "tokenizer.json"))
    content = "tea " * 20
    n = len(tok.encode(content, add_special_tokens=False).ids)
    lines = [
        {
            "custom_id": "tight",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": context - n,
        },
        {"custom_id": "elsewhere", "prompt": "x", "max_tokens": 2, "model": "other-model"},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    submitted = redis_env.run("spec-submit", jobs, "--batch-id", batch)
    assert submitted.returncode == 0, submitted.stderr
    assert "no worker has served model 'other-model' yet" in submitted.stderr
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=120) == 0

    (error,) = [stored(v) for v in redis_env.conn.hvals(redis_env.keys.errors(batch))]
    assert error["custom_id"] == "tight" and error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["message"].startswith("messages: prompt (")
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["request_counts"] == {
        "total": 2,
        "queued": 1,
        "running": 0,
        "completed": 0,
        "failed": 1,
    }
    other = Queue(redis_env.keys.queue_name("other-model"), connection=redis_env.conn)
    # Never taken by the demo worker.
    assert other.job_ids == [key_layout.job_id(batch, 2)]


def set_line_timeout(redis_env, batch: str, line_key: str, seconds: int) -> None:
    """Give one queued line a time limit of `seconds` (as if its request asked for very
    little work): the limit is stored with the line's request."""
    requests = redis_env.keys.requests(batch)
    record = json.loads(redis_env.conn.hget(requests, line_key))
    record["timeout"] = seconds
    redis_env.conn.hset(requests, line_key, json.dumps(record))


def _wait_running(redis_env, batch: str, worker, timeout: float = 60) -> None:
    """Until a worker decodes a line of the batch: its job taken (RQ's started registry)
    and a line handed to the engine (the batch's `started_at`). A job only taken has
    no line running yet: a stop then puts the whole job back. `worker` (the one that
    will take it) is waited for first: its start is measured for Pace, and is not
    counted against `timeout`."""
    worker.wait_for_log("Listening on", timeout=180)
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    wait_until(
        lambda: (
            any(j.startswith(batch) for j in registry.get_job_ids(cleanup=False))
            and redis_env.conn.hexists(redis_env.keys.batch(batch), "started_at")
        ),
        timeout,
        "a line of the batch to start",
        poll=0.02,
    )


#: A job of a few seconds on the slow pair (slow_pair_args), which never ends it early.
LONG = {
    "prompt": "def parse(text):\n    for line in text.splitlines():",
    "max_tokens": 300,
    "temperature": 0.0,
}


@pytest.mark.parametrize(
    "signals,exit_code", [(1, 0), (2, 128 + signal.SIGTERM)], ids=["warm", "cold"]
)
def test_sigterm_finishes_or_puts_back_the_running_job(
    redis_env, start_worker, slow_pair_args, tmp_path, signals, exit_code
):
    lines = [{"custom_id": f"r{i}", **LONG} for i in range(2)]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = start_worker(*slow_pair_args)
    _wait_running(redis_env, batch, worker)
    worker.signal(signal.SIGTERM)
    if signals == 2:
        # Two signals that reach the process before Python runs its handler are one
        # signal to Python: send the second once the first has been heard.
        worker.wait_for_log("warm shut down requested", timeout=60)
        worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=120) == exit_code, worker.log

    conn, keys = redis_env.conn, redis_env.keys
    done = conn.hlen(keys.results(batch))
    queued = conn.lrange(f"rq:queue:{keys.queue_name('demo')}", 0, -1)
    running = StartedJobRegistry(keys.queue_name("demo"), connection=conn).get_job_ids(
        cleanup=False
    )
    assert running == []  # nothing left half-started
    assert done + len(queued) == 2  # nothing lost
    if signals == 1:
        assert done == 1  # the running job was finished, not dropped, and no other started
    else:
        assert done == 0
        assert f"put back on {keys.queue_name('demo')}" in worker.log
        assert queued[0].decode().startswith(batch)  # at the front, for the next worker
    assert start_worker("--burst", *slow_pair_args).wait(timeout=300) == 0
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [r["custom_id"] for r in results] == ["r0", "r1"]


@pytest.mark.parametrize("job_lines", ["1", "3"], ids=["job-per-line", "one-job"])
def test_a_poison_request_is_tried_three_times_then_becomes_an_error_line(
    redis_env, start_worker, tmp_path, job_lines
):
    """Alone in its job, or in one job with the other lines: the poison line is tried
    three times, every other line is answered once."""
    lines = [
        {"custom_id": "before", "prompt": "x", "max_tokens": 2},
        {"custom_id": "poison", "prompt": "x", "max_tokens": 2},
        {"custom_id": "fine", "prompt": "x", "max_tokens": 2},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    env = dict(redis_env.env, SPEC_JOB_LINES=job_lines)
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch, env=env).returncode == 0
    queued = redis_env.conn.llen(f"rq:queue:{redis_env.keys.queue_name('demo')}")
    assert queued == (3 if job_lines == "1" else 1)
    # A record that reads back fine but makes every run raise (an unreadable record is an
    # error line at once: tests/test_worker_reliability.py).
    requests = redis_env.keys.requests(batch)
    record = json.loads(redis_env.conn.hget(requests, "c:poison"))
    record["params"]["frobnicate"] = 1
    redis_env.conn.hset(requests, "c:poison", json.dumps(record))
    worker = start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log  # the worker kept serving
    for attempt in (1, 2, 3):
        assert worker.log.count(f"line 2 (poison): attempt {attempt} of 3 failed") == 1
    assert worker.log.count("line 2 (poison): attempt") == 3
    for other in ("line 1 (before): ", "line 3 (fine): "):  # answered once, never re-run
        assert worker.log.count(other) == 1, worker.log
    errors = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [(x["custom_id"], x["error"] and x["error"]["code"]) for x in errors] == [
        ("before", None),
        ("poison", "internal_error"),
        ("fine", None),
    ]
    assert errors[1]["error"]["message"].startswith("TypeError: ")
    assert "frobnicate" in errors[1]["error"]["message"]
    assert errors[1]["error"]["message"].endswith("(3 attempts)")
