"""`spec-worker --batch N`: queued lines decoded together, with the queue's guarantees:
the same lines as spec-run, each stored once, a killed worker's claimed jobs picked up
again, and a job past its timeout failing alone."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import PAIR_ARGS, scaled, wait_until
from rq.registry import StartedJobRegistry
from test_queue import (
    LONG,
    _collect,
    comparable,
    mixed_lines,
    only_slow_timed_out,
    read_jsonl,
    spec_run_local,
    submit_slow_and_quick,
    write_jobs,
)
from test_queue_liveness import HEARTBEAT


def _peak(log: str) -> int:
    found = [int(n) for n in re.findall(r"up to (\d+) at once", log)]
    return max(found, default=0)


def test_batched_workers_write_what_spec_run_writes(redis_env, start_worker, tmp_path):
    lines = mixed_lines(40)
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("bat")
    spec_run_local(redis_env, jobs, batch, tmp_path / "local.jsonl", "--batch", "1")
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    workers = [start_worker("--burst", "--batch", "8", *PAIR_ARGS) for _ in range(2)]
    for w in workers:
        assert w.wait(timeout=400) == 0, w.log
    assert max(_peak(w.log) for w in workers) > 1, "lines were never decoded together"
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    expected = read_jsonl(tmp_path / "local.jsonl")
    for got, want in zip(results, expected, strict=True):
        assert comparable(got) == comparable(want)


def test_max_jobs_counts_every_line_a_batched_worker_takes(redis_env, start_worker, tmp_path):
    lines = mixed_lines(7)
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    queue = redis_env.keys.queue_name("demo")
    first = start_worker("--burst", "--batch", "4", "--max-jobs", "5", *PAIR_ARGS)
    assert first.wait(timeout=300) == 0, first.log
    assert redis_env.conn.hlen(redis_env.keys.results(batch)) == 5
    assert redis_env.conn.llen(f"rq:queue:{queue}") == 2
    rest = start_worker("--burst", "--batch", "4", *PAIR_ARGS)
    assert rest.wait(timeout=300) == 0, rest.log
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]


def test_a_killed_batched_workers_jobs_all_run_again_once(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    # A 3 s heartbeat TTL: a loaded machine once kept the worker's heartbeat thread off
    # for over a second, and a lapsed entry is retried by whoever cleans the registry.
    redis_env.env.update({**HEARTBEAT, "SPEC_HEARTBEAT_TTL_S": "3"})
    lines = [{"custom_id": f"l{i}", **LONG} for i in range(5)]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    doomed = start_worker("--batch", "4", *slow_pair_args)
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    # four jobs claimed into one batch (counted without cleaning: a clean-up here would
    # act as a reaper with the test's short TTL)
    wait_until(lambda: registry.get_job_count(cleanup=False) >= 4, 60, "four jobs claimed")
    doomed.signal(signal.SIGKILL)
    assert doomed.wait(timeout=10) == -signal.SIGKILL
    survivor = start_worker("--burst", "--batch", "4", *slow_pair_args)
    assert survivor.wait(timeout=300) == 0, survivor.log
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [(r["custom_id"], r["error"]) for r in results] == [
        (x["custom_id"], None) for x in lines
    ]
    assert int(redis_env.conn.hget(redis_env.keys.batch(batch), "completed")) == 5


def test_a_batched_job_past_its_timeout_fails_alone(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    batch = submit_slow_and_quick(redis_env, tmp_path)
    worker = start_worker("--burst", "--batch", "4", *slow_pair_args)
    assert worker.wait(timeout=180) == 0, worker.log
    only_slow_timed_out(redis_env, batch, tmp_path)


#: A stub worker (benchmarks/stub_worker.py) whose batched engine fails on any batch
#: that takes a request with POISON in its prompt; one line at a time it answers it.
POISONED_WORKER = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import stub_worker

plain = stub_worker.stub_generate_many

def poisoned(pair, requests, max_batch=16, expired=None):
    def watched():
        for request in requests:
            if "POISON" in (request.prompt or ""):
                raise RuntimeError("a request the batch cannot take")
            yield request
    return plain(pair, watched(), max_batch, expired)

stub_worker.stub_generate_many = poisoned
stub_worker.main(sys.argv[1:])
"""


def test_a_failed_batch_runs_its_jobs_lines_one_by_one(redis_env, tmp_path):
    stubs = str(Path(__file__).resolve().parent.parent / "benchmarks")

    def worker(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", POISONED_WORKER, stubs, "--burst", *args]
        return subprocess.run(
            command, env=redis_env.env, capture_output=True, text=True, timeout=scaled(120)
        )

    assert worker().returncode == 0  # registers the alias
    lines = [{"custom_id": f"p{i}", "prompt": f"x{i}", "max_tokens": 1} for i in range(12)]
    lines[5]["prompt"] = "POISON"
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    done = worker("--batch", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batched run failed; running its remaining lines one by one" in done.stderr
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    assert all(r["error"] is None for r in results)
    assert redis_env.conn.hlen(redis_env.keys.results(batch)) == len(lines)
