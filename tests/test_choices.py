"""n choices per line in the worker: run alone (engine.generate_choices) or as rows of a
batch (worker.batching), a line is answered once with all its choices in order, each
choice what its derived seed gives alone; usage and statistics sum over choices."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tiny_models import tiny_pair

import engine
from contract.defaults import choice_seed
from jobstore.jobfile import parse_line
from worker.batching import decode_together
from worker.execute import execute, to_request


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tiny"))


def _job(number: int, **fields):
    body = {"custom_id": f"c{number}", "prompt": "def fibonacci(n):", "max_tokens": 6, **fields}
    (job,) = parse_line(number, json.dumps(body).encode())
    return job


def _texts(outcome) -> list[str]:
    return [c["text"] for c in outcome.line["response"]["body"]["choices"]]


def test_each_choice_is_what_its_seed_gives_alone(pair):
    job = _job(1, n=3, temperature=1.5, seed=11)
    outcome = execute(pair, "demo", "B", job)
    body = outcome.line["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    alone = [
        engine.generate(pair, replace(to_request(job, 11), n=1, seed=choice_seed(11, i)))
        for i in range(3)
    ]
    assert _texts(outcome) == [r.text for r in alone]
    assert len(set(_texts(outcome))) > 1  # three samples, not one repeated
    completion = sum(r.usage["completion_tokens"] for r in alone)
    assert body["usage"]["completion_tokens"] == outcome.completion_tokens == completion
    assert body["usage"]["prompt_tokens"] == alone[0].usage["prompt_tokens"]
    assert outcome.counters["extra_choices"] == 2
    assert outcome.counters["sd:num_emitted_tokens"] == completion


def test_batched_lines_give_what_each_line_gives_alone(pair):
    jobs = [
        _job(1, n=3, temperature=1.5, seed=5),
        _job(2, temperature=0.0),
        _job(3, n=2, temperature=0.0),
        _job(4, n=2, temperature=1.5),  # seeded from the batch id and custom_id
    ]
    together = dict(
        (job.line, outcome)
        for job, outcome in decode_together(pair, "demo", [("B", j) for j in jobs], max_batch=3)
    )
    assert sorted(together) == [1, 2, 3, 4]
    for job in jobs:
        alone = execute(pair, "demo", "B", job)
        assert _texts(together[job.line]) == _texts(alone), job.custom_id
        same = ("prompt_tokens", "completion_tokens", "extra_choices", "sd:num_emitted_tokens")
        got = together[job.line].counters
        assert {k: got.get(k) for k in same} == {k: alone.counters.get(k) for k in same}
    greedy = together[3]
    assert len(set(_texts(greedy))) == 1 and len(_texts(greedy)) == 2
    # A greedy line's choices are one decoding repeated: statistics sum over choices too.
    assert greedy.counters["sd:num_emitted_tokens"] == greedy.completion_tokens


def test_a_refused_choice_fails_its_line_once(pair, monkeypatch):
    real = engine.generate_many
    refused_seed = choice_seed(7, 1)
    dropped = []

    def refusing(pair_, requests, max_batch=16, expired=None):
        def watched(i):
            gone = expired(i)
            if gone:
                dropped.append(i)
            return gone

        yield from real(pair_, requests, max_batch, watched)

    def run_refusing(pair_, request):  # RequestRun's check, for one seed
        if request.seed == refused_seed:
            raise engine.InvalidRequestError("logit_bias: token id 999999 is not in the vocabulary")
        return original_run(pair_, request)

    import engine.text as text

    original_run = text.RequestRun
    monkeypatch.setattr(text, "RequestRun", run_refusing)
    monkeypatch.setattr(engine, "generate_many", refusing)
    jobs = [_job(1, n=4, temperature=1.5, seed=7, max_tokens=30), _job(2, temperature=0.0)]
    outcomes = list(decode_together(pair, "demo", [("B", j) for j in jobs], max_batch=8))
    assert [(j.line, o.ok) for j, o in outcomes] == [(1, False), (2, True)]
    assert outcomes[0][1].line["error"] == {
        "code": "invalid_request",
        "message": "logit_bias: token id 999999 is not in the vocabulary",
        "line": 1,
    }
    assert dropped == [0]  # choice 0 (started) left the batch; choices 2 and 3 never started


#: A stub worker (benchmarks/stub_worker.py) that dies (exit 9) when its batched engine
#: is about to answer the second row it was given: mid-line for a line of n > 1.
DYING_WORKER = """
import os, sys
sys.path.insert(0, sys.argv.pop(1))
import stub_worker

plain = stub_worker.stub_generate_many

def dying(pair, requests, max_batch=16, expired=None):
    for n, item in enumerate(plain(pair, requests, max_batch, expired)):
        if n == 1:
            os._exit(9)
        yield item

stub_worker.stub_generate_many = dying
stub_worker.main(sys.argv[1:])
"""


def test_a_worker_killed_mid_line_runs_the_whole_line_again(redis_env, tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    from test_queue import _collect, read_jsonl, write_jobs
    from test_queue_liveness import HEARTBEAT, _started_expiry

    stubs = str(Path(__file__).resolve().parent.parent / "benchmarks")
    redis_env.env.update(HEARTBEAT)

    def worker(code: str, *args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code, stubs, "--burst", *args]
        return subprocess.run(
            command, env=redis_env.env, capture_output=True, text=True, timeout=120
        )

    healthy = DYING_WORKER.replace("stub_worker.stub_generate_many = dying\n", "")
    assert worker(healthy).returncode == 0  # registers the alias
    lines = [
        {"custom_id": "three", "prompt": "x", "n": 3, "temperature": 0.5, "max_tokens": 1},
        {"custom_id": "one", "prompt": "y", "max_tokens": 1},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    env = {**redis_env.env, "SPEC_JOB_LINES": "8"}  # both lines in one job
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch, env=env).returncode == 0
    assert worker(DYING_WORKER, "--batch", "4").returncode == 9
    # Choice 0 was answered when it died: nothing of the line is stored.
    assert redis_env.conn.hlen(redis_env.keys.results(batch)) == 0
    deadline = time.monotonic() + 30
    while (_started_expiry(redis_env, batch) or 0) > time.time():  # its heartbeat lapses
        assert time.monotonic() < deadline
        time.sleep(0.1)
    survivor = worker(healthy, "--batch", "4")
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    bodies = {r["custom_id"]: r["response"]["body"] for r in results}
    assert [c["index"] for c in bodies["three"]["choices"]] == [0, 1, 2]
    assert bodies["three"]["usage"]["completion_tokens"] == 3
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["request_counts"]["completed"] == 2
    assert state["choices"] == {"completed": 4}
    assert state["usage"]["completion_tokens"] == 4


def test_job_size_limits_count_choices_as_rows(tmp_path):
    from jobstore import config
    from producer.spool import Spool, spool_file
    from producer.submit import _jobs

    path = tmp_path / "jobs.jsonl"
    lines = [
        {"custom_id": "a", "prompt": "x", "n": 40, "max_tokens": 10},
        {"custom_id": "b", "prompt": "x", "n": 30, "max_tokens": 10},
        {"custom_id": "c", "prompt": "x", "max_tokens": 10},
        {"custom_id": "d", "prompt": "x", "n": 100, "max_tokens": 10},
        {"custom_id": "e", "prompt": "x", "top_p": 0},  # rejected: one row
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with spool_file(str(path), None, "demo", None, lambda e: None) as spool:
        assert isinstance(spool, Spool) and (spool.lines, spool.rows) == (5, 172)
        queued = [e for e in spool if hasattr(e, "rows")]
    assert [e.rows for e in queued] == [40, 30, 1, 100]
    assert queued[0].timeout == config.job_timeout_s(10, 1, rows=40) > config.job_timeout_s(10, 1)
    # Jobs of at most JOB_LINES_MAX (64) rows; a line of more is a job alone.
    groups = [[e.custom_id for e in job] for job in _jobs(queued, config.JOB_LINES_MAX)]
    assert groups == [["a"], ["b", "c"], ["d"]]
