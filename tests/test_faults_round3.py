"""Reliability round 3, with real processes (private redis-servers, real spec-worker
processes, real signals): a Redis restarted without persistence under a running job, a
second SIGTERM while an idle worker shuts down, workers re-announcing themselves after
such a restart, `spec-submit -` and a Redis URL whose database is not a number.

Tests print `figures:` lines that docs/reliability.md quotes
(`pytest tests/test_faults_round3.py -s | grep '^figures:'`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from conftest import scaled, script, wait_until
from test_faults import (
    NO_PERSISTENCE_ARGS,
    figures,
    private_redis,  # noqa: F401 - a fixture
)
from test_queue import write_jobs

#: Short heartbeats: a restarted Redis hears from every worker within a second.
FAST = {"SPEC_HEARTBEAT_INTERVAL_S": "0.5", "SPEC_HEARTBEAT_TTL_S": "5"}


def _lost_fix(batch: str) -> str:
    return f"re-submit its file with --batch-id {batch}"


def test_a_redis_restarted_without_persistence_under_a_running_job(
    private_redis,  # noqa: F811
    slow_pair_args,
    tmp_path,
):
    """The worker stores nothing into the emptied Redis and drops its job with one log
    line; status, watch, collect, report and --wait each say so in one line, exit 1."""
    server, env = private_redis(*NO_PERSISTENCE_ARGS)
    env.env.update(FAST, SPEC_JOB_LINES="8")
    lines = [
        {"custom_id": f"r{i}", "prompt": "def parse(text):", "max_tokens": 12, "temperature": 0}
        for i in range(8)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = env.batch_id("lost")
    name = f"{env.prefix}-w"
    worker = env.start_worker("--name", name, *slow_pair_args)
    wait_log = tmp_path / "wait.log"
    with open(wait_log, "wb") as log:
        waiting = subprocess.Popen(
            [script("spec-submit"), jobs, "--batch-id", batch, "--wait"],
            env=env.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        conn, keys = env.conn, env.keys
        wait_until(lambda: conn.hlen(keys.results(batch)) >= 1, 120, "a stored line", 0.02)
        server.stop()
        server.start()
        env.conn = conn = server.client()
        worker.wait_for_log("the batch has no record in Redis any more", timeout=60)
        assert waiting.wait(timeout=scaled(60)) == 1, wait_log.read_text()
    finally:
        if waiting.poll() is None:
            waiting.kill()
    dropped = [x for x in worker.log.splitlines() if "no record in Redis" in x]
    assert len(dropped) == 1, worker.log
    assert f"re-submit its file with --batch-id {batch}" in dropped[0]
    assert "Traceback" not in worker.log
    assert list(conn.scan_iter(match=f"{keys.batch(batch)}*")) == []  # nothing stored
    lost = (
        f"no such batch '{batch}': this Redis (prefix '{env.prefix}') has no record of any "
        "batch; check the id, the Redis URL and SPEC_KEY_PREFIX. If it was submitted to this "
        f"Redis, Redis has lost its data (restarted without persistence?): {_lost_fix(batch)}"
    )
    assert wait_log.read_text().splitlines()[-1] == f"spec-submit: error: {lost}"
    for command, extra in [
        ("spec-status", []),
        ("spec-status", ["--watch"]),
        ("spec-collect", ["-o", str(tmp_path / "r.jsonl")]),
        ("spec-report", ["-o", str(tmp_path / "r.html")]),
    ]:
        res = env.run(command, batch, *extra, timeout=60)
        assert (res.returncode, res.stderr) == (1, f"{command}: error: {lost}\n"), res

    # A batch hash that a worker of an older version rebuilt (counters, no record).
    conn.hset(keys.batch(batch), mapping={"completed": 33, "last_done_at": "1.0"})
    conn.hset(keys.results(batch), "c:r0", "x")
    damaged = (
        f"batch {batch} has lost its record in this Redis (key {keys.batch(batch)} has no "
        f"created_at; was Redis restarted without persistence?): {_lost_fix(batch)}"
    )
    for command, extra in [
        ("spec-status", ["--json"]),
        ("spec-collect", ["-o", str(tmp_path / "r.jsonl"), "--delete"]),
        ("spec-report", ["-o", str(tmp_path / "r.html")]),
    ]:
        res = env.run(command, batch, *extra, timeout=60)
        assert (res.returncode, res.stderr) == (1, f"{command}: error: {damaged}\n"), res
    conn.delete(keys.batch(batch), keys.results(batch))

    # Re-submitting the file repairs it; the same worker, still running, answers it.
    res = env.run("spec-submit", jobs, "--batch-id", batch, "--wait")
    assert res.returncode == 0, res.stderr + worker.log
    assert res.stderr.splitlines()[-1] == f"batch {batch} completed: 8 completed, 0 failed"
    state = json.loads(env.run("spec-status", batch, "--json").stdout)
    assert state["request_counts"]["completed"] == 8
    assert [w["name"] for w in state["workers"]] == [name]
    assert state["workers"][0]["model"] == "demo"
    figures("redis lost its data", requests=8, worker_drop_lines=len(dropped), stored_after=0)


def test_a_second_sigterm_while_an_idle_worker_shuts_down_is_one_line_and_143(
    redis_env, start_worker
):
    """Wherever the second signal lands in the shutdown that the first one started
    (RQ's teardown, the exit after it), exit 128 + 15 and one line, no traceback."""
    workers = [start_worker() for _ in range(2)]
    for w in workers:
        w.wait_for_log("Listening on", timeout=120)
    for w, gap in zip(workers, (0.0, 0.05), strict=True):
        w.signal(signal.SIGTERM)
        # The first one handled (two signals at once are one to Python): then the second.
        wait_until(lambda w=w: "warm shut down requested" in w.log, 30, "shut down", 0.002)
        time.sleep(gap)
        w.signal(signal.SIGTERM)
    for w in workers:
        # An idle worker's shutdown can be over before the second signal arrives: then
        # exit 0 is right. Never a traceback or another code, and one line when it landed.
        code = w.wait(timeout=30)
        assert code in (0, 128 + signal.SIGTERM), w.log
        assert "Traceback" not in w.log and "quitting" not in w.log.split("shut down")[-1], w.log
        assert w.log.count("second SIGTERM: stopping now") == (code != 0), w.log


def test_workers_announce_themselves_again_after_redis_lost_its_data(
    private_redis,  # noqa: F811
    tmp_path,
):
    server, env = private_redis(*NO_PERSISTENCE_ARGS)
    env.env.update(FAST)
    names = [f"{env.prefix}-n{i}" for i in range(2)]
    workers = [env.start_worker("--name", n) for n in names]
    for w in workers:
        w.wait_for_log("Listening on", timeout=120)
    server.stop()
    server.start()
    restarted = time.monotonic()
    conn, keys = server.client(), env.keys

    def known() -> bool:
        models = [conn.hget(keys.worker(n), "model") for n in names]
        return conn.exists(keys.model("demo")) and models == [b"demo", b"demo"]

    wait_until(known, timeout=30, what="both workers to announce themselves", poll=0.02)
    took = time.monotonic() - restarted
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "a", "prompt": "x"}])
    res = env.run("spec-submit", jobs, "--batch-id", env.batch_id("again"))
    assert res.returncode == 0 and "no worker has served" not in res.stderr, res.stderr
    assert conn.hget(keys.worker(names[0]), "host")
    assert int(conn.hget(keys.model("demo"), "context_length")) > 0
    for w in workers:
        w.signal(signal.SIGTERM)
        assert w.wait(timeout=60) == 0, w.log
    figures(
        "re-announce",
        workers=2,
        heartbeat_interval_s=FAST["SPEC_HEARTBEAT_INTERVAL_S"],
        known_again_within_s=f"{took:.2f}",
    )


def test_submit_reads_standard_input_and_a_database_that_is_not_a_number_is_refused(
    redis_env, tmp_path
):
    text = json.dumps({"custom_id": "a", "prompt": "x", "max_tokens": 2}) + "\n"
    batch = redis_env.batch_id("stdin")
    res = redis_env.run("spec-submit", "-", "--batch-id", batch, input=text)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{batch}\n"
    assert res.stderr.splitlines()[0] == f"batch {batch}: 1 lines: 1 enqueued; models: demo (1)"
    assert redis_env.conn.hget(redis_env.keys.batch(batch), "source") == b"stdin"
    bad = redis_env.run("spec-submit", "-", input='{"custom_id": "b"}\n')
    assert bad.returncode == 1
    assert bad.stderr.splitlines()[0] == "stdin:1: prompt: one of prompt or messages is required"

    host = redis_env.url.split("://", 1)[1].split("/", 1)[0]
    for command in (["spec-status", "x"], ["spec-submit", "-"]):
        res = redis_env.run(*command, "--redis", f"redis://{host}/abc", input=text)
        assert res.returncode == 3
        assert res.stderr == (
            f"{command[0]}: error: cannot reach Redis at redis://{host}/abc: the database in "
            "the URL must be a number (redis://host:6379/0), got 'abc'\n"
        )


# -- changed and removed lines on re-submit ---------------------------------------------------


def _counters_of(results: list[dict]) -> dict[str, int]:
    """What the batch hash must hold for these result lines: every counter a result line
    carries, summed (busy time and audit counters are not in a line)."""
    from contract.stats import counters_of_line
    from jobstore.store import result_counters

    total: dict[str, int] = {"completed": len(results)}
    for r in results:
        body = r["response"]["body"]
        usage = body["usage"]
        stats = counters_of_line(
            body["metrics"]["speculative_decoding"], usage["completion_tokens"]
        )
        for name, n in result_counters(usage, stats, busy_ms=0).items():
            if n and name != "busy_ms":
                total[name] = total.get(name, 0) + n
    return total


def _batch_counters(env, batch: str) -> dict[str, int]:
    meta = {k.decode(): v.decode() for k, v in env.conn.hgetall(env.keys.batch(batch)).items()}
    wanted = ("completed", "prompt_tokens", "completion_tokens")
    return {
        k: int(v) for k, v in meta.items() if (k in wanted or k.startswith("sd:")) and int(v) != 0
    }


def test_a_resubmit_with_changed_lines_refuses_reruns_or_keeps_and_a_removed_line_stays(
    redis_env, start_worker, tmp_path
):
    from test_faults import PAIR_ARGS, _collect
    from test_queue import read_jsonl

    def line(cid: str, prompt: str) -> dict:
        return {"custom_id": cid, "prompt": prompt, "max_tokens": 6, "temperature": 0}

    first = [line("a", "def f(x):"), line("b", "import os\n"), line("c", "class Stack:")]
    # b now asks what a asks: its new answer must be a's, token for token.
    second = [line("a", "def f(x):"), line("b", "def f(x):"), line("c", "class Stack:")]
    batch = redis_env.batch_id("changed")
    v1 = write_jobs(tmp_path / "v1.jsonl", first)
    v2 = write_jobs(tmp_path / "v2.jsonl", second)
    assert redis_env.run("spec-submit", v1, "--batch-id", batch).returncode == 0

    # Two files under one batch id before any answer: the second is refused, whatever.
    refused = redis_env.run("spec-submit", v2, "--batch-id", batch)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        f"spec-submit: error: batch {batch}: 1 line(s) ask for something other than the "
        "request already submitted under their custom_id (first: b): pass --changed rerun "
        "to run them again (their old answers are replaced), or --changed keep to keep the "
        "old answers; nothing was enqueued\n"
    )
    pending = redis_env.run("spec-submit", v2, "--batch-id", batch, "--changed", "rerun")
    assert pending.returncode == 1
    assert pending.stderr == (
        f"spec-submit: error: batch {batch}: 1 changed line(s) are still queued or running "
        "with their old request (first: b): wait until they are answered, then run this "
        "again; nothing was enqueued\n"
    )
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=180) == 0
    before = {r["custom_id"]: r for r in read_jsonl(_collect(redis_env, batch, tmp_path / "1"))}
    assert (
        before["b"]["response"]["body"]["choices"][0]["text"]
        != (before["a"]["response"]["body"]["choices"][0]["text"])
    )

    # A line removed from a later file keeps its answer, and the counts say so.
    v3 = write_jobs(tmp_path / "v3.jsonl", [first[0], first[2]])
    res = redis_env.run("spec-submit", v3, "--batch-id", batch)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == f"batch {batch}: 2 lines: 0 enqueued, 2 already done"
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed"
    assert state["request_counts"] == {
        "total": 3,
        "queued": 0,
        "running": 0,
        "completed": 3,
        "failed": 0,
    }
    kept = {r["custom_id"]: r for r in read_jsonl(_collect(redis_env, batch, tmp_path / "3"))}
    assert kept == before

    # Answered and changed: refused by default; kept with --changed keep.
    assert redis_env.run("spec-submit", v2, "--batch-id", batch).stderr == refused.stderr
    res = redis_env.run("spec-submit", v2, "--batch-id", batch, "--changed", "keep")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == (
        f"batch {batch}: 3 lines: 0 enqueued, 3 already done, 1 changed (old answers kept)"
    )
    assert read_jsonl(_collect(redis_env, batch, tmp_path / "k")) == list(before.values())

    # --changed rerun: b's answer and its counters go, and it runs again.
    res = redis_env.run("spec-submit", v2, "--batch-id", batch, "--changed", "rerun")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == (
        f"batch {batch}: 3 lines: 1 enqueued, 2 already done, 1 changed (old answers "
        "replaced); models: demo (1)"
    )
    assert _batch_counters(redis_env, batch) == _counters_of([before["a"], before["c"]])
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "in_progress" and state["request_counts"]["completed"] == 2
    assert state["request_counts"]["queued"] == 1
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=180) == 0
    after = {r["custom_id"]: r for r in read_jsonl(_collect(redis_env, batch, tmp_path / "2"))}
    assert sorted(after) == ["a", "b", "c"]
    assert after["a"] == before["a"] and after["c"] == before["c"]
    new_b, old_a = after["b"]["response"]["body"], before["a"]["response"]["body"]
    assert new_b["choices"] == old_a["choices"] and new_b["usage"] == old_a["usage"]
    assert _batch_counters(redis_env, batch) == _counters_of(list(after.values()))
    done = redis_env.conn.lrange(redis_env.keys.done(batch), 0, -1)
    assert sorted(done) == [b"c:a", b"c:b", b"c:c"]
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed" and state["request_counts"]["completed"] == 3
    assert sum(w["completed"] for w in state["workers"]) == 3
    figures("changed lines", lines=3, changed=1, refused=3, kept=1, replaced=1, removed=1)


# -- hostile request records at the worker ------------------------------------------------------


def test_a_worker_bounds_a_request_record_written_straight_into_redis(redis_env, tmp_path):
    """A 50 MB record is never read; a 7.6 MB prompt is counted a window at a time and
    refused at the context: a `--batch 8` worker's peak memory stays bounded."""
    from rq import Callback, Queue, Retry
    from rq.serializers import JSONSerializer
    from test_faults import PAIR_ARGS, _collect, _run_measured
    from test_queue import read_jsonl

    from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION

    batch = redis_env.batch_id("hostile")
    jobs = write_jobs(
        tmp_path / "jobs.jsonl", [{"custom_id": "ok", "prompt": "x", "max_tokens": 2}]
    )
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    conn, keys = redis_env.conn, redis_env.keys

    def record(cid: str, line: int, prompt: str) -> str:
        return json.dumps(
            {
                "line": line,
                "custom_id": cid,
                "endpoint": "completion",
                "model": "demo",
                "params": {"prompt": prompt, "max_tokens": 4, "temperature": 0.0},
                "job": 99,
                "timeout": 600,
            }
        )

    huge = record("huge", 2, "def f(x): return x\n" * 2_700_000)  # 51 MB
    long = record("long", 3, "def f(x): return x\n" * 400_000)  # 7.6 MB
    conn.hset(keys.requests(batch), mapping={"c:huge": huge, "c:long": long})
    conn.zadd(keys.order(batch), {"c:huge": 2, "c:long": 3})
    queue = Queue(keys.queue_name("demo"), connection=conn, serializer=JSONSerializer)
    queue.enqueue(
        JOB_FUNCTION,
        args=[batch, ["c:huge", "c:long"]],
        job_id=f"{batch}-j99",
        result_ttl=0,
        retry=Retry(max=2),
        on_failure=Callback(FAILURE_CALLBACK),
    )
    started = time.monotonic()
    code, stderr, rss_mb = _run_measured(
        redis_env, ["spec-worker", "--burst", "--batch", "8", *PAIR_ARGS], tmp_path
    )
    took = time.monotonic() - started
    assert code == 0, stderr[-3000:]
    lines = {r["custom_id"]: r for r in read_jsonl(_collect(redis_env, batch, tmp_path / "r"))}
    assert lines["ok"]["error"] is None
    assert lines["huge"]["error"] == {
        "code": "invalid_request",
        "message": (
            f"the stored request cannot be read ({keys.requests(batch)} field 'c:huge': the "
            f"request record is {len(huge)} bytes, over the limit of 8392704 bytes (a job-file "
            "line may have at most 8388608 bytes)); it was not run"
        ),
        "line": 2,
    }
    error = lines["long"]["error"]
    assert error["code"] == "context_length_exceeded" and error["line"] == 3
    assert error["message"].startswith("prompt: at least ")
    assert error["message"].endswith(
        " prompt tokens + max_tokens 4 exceed the context of demo (1024 tokens); shorten the "
        "prompt or lower max_tokens"
    )
    assert rss_mb < WORKER_RSS_MB, rss_mb
    figures(
        "hostile records",
        record_bytes=len(huge),
        prompt_bytes=7_600_000,
        worker_peak_rss_mb=f"{rss_mb:.0f}",
        worker_s=f"{took:.1f}",
    )


#: Peak RSS allowed to a `--batch 8` demo worker given a 51 MB record and a 7.6 MB prompt
#: (6.1 GB before the worker bounded them).
WORKER_RSS_MB = 800
