"""Lines and counters in Redis, without a model: written once per (batch, line) however
often a job runs, counters summed exactly, collect streams in chunks and in either order."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_faults import figures, private_redis  # noqa: F401 (private_redis is a fixture)

from jobstore import config, store
from jobstore.lines import dumps, error_line
from producer import cli
from producer.collect import collect
from producer.status import status


def _submit_lines(redis_env, tmp_path, n: int) -> str:
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": "x", "max_tokens": 2}) + "\n"
            for i in range(n)
        )
    )
    batch = redis_env.batch_id()
    result = CliRunner().invoke(cli.submit, [str(path), "--batch-id", batch])
    assert result.exit_code == 0, result.stderr
    return batch


def _fake_result(batch: str, i: int) -> str:
    return dumps(
        {
            "id": f"{batch}-{i + 1}",
            "custom_id": f"r{i}",
            "response": {"status_code": 200},
            "error": None,
        }
    )


def test_a_line_is_stored_once_with_its_counters_even_if_written_twice(redis_env, tmp_path):
    batch = _submit_lines(redis_env, tmp_path, 2)
    conn, keys = redis_env.conn, redis_env.keys
    counters = {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "busy_ms": 40,
        "sd:num_spec_steps": 2,
        "sd:hist:1": 2,
    }
    assert store.store_line(
        conn, keys, batch, "c:r0", _fake_result(batch, 0), ok=True, counters=counters, worker="w1"
    )
    assert not store.store_line(
        conn, keys, batch, "c:r0", _fake_result(batch, 0), ok=True, counters=counters, worker="w2"
    )
    failed = dumps(error_line(batch, 1, "r0", "timeout", "late"))
    assert not store.store_line(conn, keys, batch, "c:r0", failed, ok=False, worker="w2")
    meta = {k.decode(): v.decode() for k, v in conn.hgetall(keys.batch(batch)).items()}
    assert (meta["completed"], meta["completion_tokens"], meta["sd:num_spec_steps"]) == (
        "1",
        "5",
        "2",
    )
    assert "failed" not in meta and "completed_at" not in meta
    assert conn.lrange(keys.done(batch), 0, -1) == [b"c:r0"]
    assert conn.hget(keys.worker("w1"), "completed") == b"1" and not conn.exists(keys.worker("w2"))
    workers = status(conn, keys, batch)["workers"]
    assert workers == [
        {
            "name": "w1",
            "model": None,
            "completed": 1,
            "failed": 0,
            "running": 0,
            "tokens_per_second": 125.0,
            "last_seen": None,  # no worker process registered it
            "stopped": False,
            "quiet": False,
        }
    ]

    assert store.store_line(conn, keys, batch, "c:r1", failed, ok=False, worker="w2")
    state = status(conn, keys, batch)
    assert state["status"] == "completed" and state["completed_at"] is not None
    assert state["request_counts"] == {
        "total": 2,
        "queued": 0,
        "running": 0,
        "completed": 1,
        "failed": 1,
    }


def test_a_job_that_runs_again_does_not_generate_again(redis_env, tmp_path):
    """A job whose lines are already stored has nothing left to run (no model needed)."""
    pytest.importorskip("mlx")
    from worker import jobs

    batch = _submit_lines(redis_env, tmp_path, 2)
    conn, keys = redis_env.conn, redis_env.keys
    store.store_line(conn, keys, batch, "c:r0", _fake_result(batch, 0), ok=True, worker="w1")
    ctx = jobs.WorkerContext(pair=None, alias="demo", worker_name="w2", conn=conn, keys=keys)
    found = jobs.read_lines(ctx, batch, ["c:r0", "c:r1"])
    assert ([line.key for line in found.todo], found.cancelled, found.gone) == (
        ["c:r1"],
        False,
        False,
    )


def test_collect_streams_in_chunks_in_input_or_completion_order(redis_env, tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CHUNK_LINES", 3)
    batch = _submit_lines(redis_env, tmp_path, 8)
    conn, keys = redis_env.conn, redis_env.keys
    finish_order = [5, 0, 7, 2, 1]
    for i in finish_order:
        store.store_line(conn, keys, batch, f"c:r{i}", _fake_result(batch, i), ok=True)
    out = tmp_path / "out.jsonl"
    counts = collect(conn, keys, batch, str(out))
    assert counts == {"results": 5, "errors": 0, "pending": 3}
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        "r0",
        "r1",
        "r2",
        "r5",
        "r7",
    ]
    collect(conn, keys, batch, str(out), order="completion")
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        f"r{i}" for i in finish_order
    ]
    result = CliRunner().invoke(cli.collect, [batch, "-o", str(out), "--delete"])
    assert result.exit_code == 1
    assert (
        result.stderr
        == f"spec-collect: error: batch {batch} is not finished (3 queued): collect without "
        "--delete, or wait\n"
    )


def test_rq_key_names_are_rqs_own(redis_env):
    """The RQ keys the store deletes and the submit-time classification reads are the
    keys RQ itself writes: a job's hash and its queue's failed-job registry."""
    from rq import Queue
    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer

    keys = redis_env.keys
    queue = Queue(keys.queue_name("demo"), connection=redis_env.conn, serializer=JSONSerializer)
    job = queue.enqueue("json.dumps", [1], job_id="keytest-1")
    job_key = job.key.decode() if isinstance(job.key, bytes) else job.key
    assert keys.rq_job("keytest-1") == job_key == "rq:job:keytest-1"
    registry = FailedJobRegistry(queue=queue)
    assert keys.rq_failed("demo") == registry.key == f"rq:failed:{keys.prefix}:demo"
    job.delete()


# -- what a line costs Redis (issue 46 item 10) -------------------------------------------


def _commands(conn) -> int:
    """Commands Redis ran since the last CONFIG RESETSTAT (scripts' inner ones too)."""
    stats = conn.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")


def test_storing_and_reading_lines_costs_commands_per_call_not_per_line(private_redis, tmp_path):  # noqa: F811
    """Storing 32 finished lines and reading a job of 32 lines take a fixed number of
    Redis commands (inner ones included), not one or two per line as they did (5.4
    commands per answered line at 16,384 lines; the per-line HEXISTS + HSETNX of the
    store and HSTRLEN + HGET of the worker's bounded read)."""
    from worker import jobs

    _, env = private_redis("--save", "", "--appendonly", "no")
    conn, keys = env.conn, env.keys
    n = 32
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "".join(json.dumps({"custom_id": f"r{i}", "prompt": "x"}) + "\n" for i in range(n))
    )
    batch = env.batch_id("cost")
    assert env.run("spec-submit", str(path), "--batch-id", batch).returncode == 0
    line_keys = [f"c:r{i}" for i in range(n)]
    ctx = jobs.WorkerContext(pair=None, alias="demo", worker_name="w1", conn=conn, keys=keys)

    jobs.read_lines(ctx, batch, line_keys[:1])  # loads the script
    store.put_lines(conn, keys, "none", [store.LineToStore("c:x", "{}", True)])  # and this one
    conn.config_resetstat()
    found = jobs.read_lines(ctx, batch, line_keys)
    read = _commands(conn)
    assert [line.key for line in found.todo] == line_keys
    assert all(len(line.digest) == 16 for line in found.todo)

    lines = [
        store.LineToStore(line.key, _fake_result(batch, i), True, {"completion_tokens": 1})
        for i, line in enumerate(found.todo)
    ]
    lines.append(lines[0])  # the same line twice in one call: stored once
    conn.config_resetstat()
    done = store.put_lines(conn, keys, batch, lines, worker="w1", ttl_s=60)
    stored = _commands(conn)
    assert done.written == [True] * n + [False]
    meta = conn.hmget(keys.batch(batch), "completed", "completion_tokens")
    assert meta == [str(n).encode(), str(n).encode()]
    figures("commands per call", lines=n, read_job=read, store=stored)
    assert read <= 5  # EVALSHA and three HMGETs
    assert stored <= 25  # EVALSHA, its reads and writes, the TTLs of seven keys


def test_a_result_keeps_its_requests_digest_and_a_resubmit_reads_it(redis_env, tmp_path):
    """The digest a re-submit compares lives in the queued record and then in the stored
    result (not in a hash of its own, ~90 B a line); a batch queued before that keeps
    working from its `hashes` hash."""
    from jobstore.lines import packed_digest, unpack
    from producer.spool import request_digest

    batch = _submit_lines(redis_env, tmp_path, 3)
    conn, keys = redis_env.conn, redis_env.keys
    assert not conn.exists(keys.hashes(batch))
    record = json.loads(conn.hget(keys.requests(batch), "c:r0"))
    digest = record["digest"]
    assert digest == request_digest(
        {k: v for k, v in record.items() if k not in ("job", "timeout", "digest")}
    )

    line = store.LineToStore("c:r0", _fake_result(batch, 0), True, None, digest)
    assert store.put_lines(conn, keys, batch, [line]).written == [True]
    raw = conn.hget(keys.results(batch), "c:r0")
    assert packed_digest(raw) == digest
    assert unpack(raw, 1 << 20) == _fake_result(batch, 0)
    states, digests = store.classify(conn, keys, batch, ["c:r0", "c:r1", "c:r9"])
    assert states[0] == "done" and states[2] == "new"
    assert (digests[0], digests[2]) == (digest, None)

    # Queued (and answered) before digests were kept: the `hashes` hash says.
    store.store_line(conn, keys, batch, "c:r1", _fake_result(batch, 1), ok=True)
    conn.hset(keys.hashes(batch), "c:r1", "00112233aabbccdd")
    assert store.classify(conn, keys, batch, ["c:r1"]) == (["done"], ["00112233aabbccdd"])
