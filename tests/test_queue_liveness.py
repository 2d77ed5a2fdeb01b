"""Liveness of running jobs: a long job keeps its heartbeat (it is not declared
abandoned), and the job of a worker killed with SIGKILL is picked up by another worker
within a bounded time, through the heartbeat expiry, not the job timeout."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import PAIR_ARGS, Hold, Pace, scaled, wait_until
from rq import Queue
from rq.job import Job
from rq.registry import StartedJobRegistry
from test_faults import _check_once_each, _done, _running
from test_queue import (
    LONG,
    _collect,
    _wait_running,
    mixed_lines,
    only_slow_timed_out,
    read_jsonl,
    submit_slow_and_quick,
    write_jobs,
)

from jobstore.keys import job_id

HEARTBEAT = {"SPEC_HEARTBEAT_INTERVAL_S": "0.2", "SPEC_HEARTBEAT_TTL_S": "1"}


def _started_expiry(redis_env, batch: str) -> float | None:
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    for member, score in redis_env.conn.zrange(registry.key, 0, -1, withscores=True):
        if member.decode().startswith(batch):
            return score
    return None


def test_a_long_job_keeps_its_heartbeat_and_runs_once(
    redis_env, start_worker, busy_pair_args, tmp_path
):
    # On the busy pair: the job computes for its whole length, as a real one does, and
    # the worker's heartbeat thread must still get its turn.
    # A TTL of 2 s, not 1: on a loaded 2-core machine the heartbeat thread of a worker
    # whose job computes has waited over a second for the CPU (a CI run of this suite
    # saw the job abandoned by its own worker at 1 s). Still far below the job's length.
    redis_env.env.update(HEARTBEAT, SPEC_HEARTBEAT_TTL_S="2")
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "long", **LONG}])
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = start_worker("--burst", *busy_pair_args)
    _wait_running(redis_env, batch, worker)
    first = _started_expiry(redis_env, batch)
    # Pushed forward within 3 s (registry scores are whole seconds), while still running.
    later = wait_until(
        lambda: (e := _started_expiry(redis_env, batch)) and e > first and e,
        timeout=3,
        what="the job's liveness to be pushed forward",
        poll=0.02,
    )
    assert worker.wait(timeout=300) == 0, worker.log
    (result,) = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    seconds = result["response"]["body"]["metrics"]["generation_time_ms"] / 1000
    assert seconds > 2, "the job must outlive its heartbeat TTL for this test to mean anything"
    assert later is not None and later > first  # still running, its liveness pushed forward
    assert "Abandoned" not in worker.log and "enqueued for retry" not in worker.log


def test_a_killed_workers_job_is_requeued_even_while_the_others_are_busy(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    # Both jobs are held (conftest.Hold) from the moment the workers are up until the
    # test has seen what it looks for: neither can end early, so both workers get one
    # (a worker that finished its job first used to take the other one, and "both busy"
    # never came on a loaded machine), and the survivor is still busy when the killed
    # worker's job is re-queued, however long the machine makes each step.
    hold = Hold(tmp_path / "hold")
    redis_env.env.update(HEARTBEAT, **hold.env)
    lines = [{"custom_id": "a", **LONG}, {"custom_id": "b", **LONG}]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    workers = {
        name: start_worker("--name", name, *slow_pair_args)
        for name in (f"{redis_env.prefix}-w0", f"{redis_env.prefix}-w1")
    }
    for worker in workers.values():  # both ready before the jobs come: one each
        worker.wait_for_log("Listening on", timeout=180)
    hold.hold()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0

    # Both busy, one job each; the worker running a is killed, the other keeps running b.
    def both_busy():
        running = _running(redis_env, batch)
        return running if len(set(running.values())) == 2 else None

    running = wait_until(both_busy, timeout=60, what="both workers busy", poll=0.02)
    a, b = job_id(batch, 1), job_id(batch, 2)  # a small file: one line per job
    doomed, survivor = workers[running[a]], workers[running[b]]
    doomed.signal(signal.SIGKILL)
    assert doomed.wait(timeout=10) == -signal.SIGKILL
    # Re-queued through the 1 s heartbeat expiry by the busy survivor's heartbeat thread,
    # long before the job timeout (minutes) and before the survivor is free again.
    wait_until(
        lambda: Job.fetch(a, connection=redis_env.conn).get_status() == "queued",
        timeout=15,
        what=f"job {a} re-queued",
    )
    assert _running(redis_env, batch) == {b: running[b]}  # the survivor: still on b
    assert not redis_env.conn.hexists(redis_env.keys.results(batch), "c:b")
    job = Job.fetch(a, connection=redis_env.conn)
    assert job.retries_left == 1  # one of its two retries used
    hold.release()
    wait_until(lambda: _done(redis_env, batch) == 2, timeout=120, what="both lines answered")
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [(r["custom_id"], r["error"]) for r in results] == [("a", None), ("b", None)]


def test_a_job_past_its_timeout_is_stopped_and_becomes_a_timeout_line(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    batch = submit_slow_and_quick(redis_env, tmp_path)
    worker = start_worker("--burst", *slow_pair_args)
    assert worker.wait(timeout=120) == 0, worker.log
    lines = only_slow_timed_out(redis_env, batch, tmp_path)
    assert lines[0]["error"]["message"] == "did not finish within 1 s (3 attempts)"


def test_a_job_taken_by_a_worker_that_died_before_starting_it_still_runs(
    redis_env, start_worker, tmp_path
):
    # RQ takes a job in steps: off the queue into an intermediate list, registered as
    # running, marked started. A worker killed between them (a test above once caught
    # that window) leaves the job in the list, "queued", in no registry.
    redis_env.env.update(HEARTBEAT)
    lines = mixed_lines(3)
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    queue = Queue(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    taken = redis_env.conn.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
    assert taken is not None and queue.count == 2
    worker = start_worker(*PAIR_ARGS)
    # And the id of a job finished and deleted (result TTL 0) after a second delivery of
    # it was queued: RQ takes such an id into the list and skips it (its own sweep, at
    # start and every 10 minutes, drops it). The reaper drops it, not puts it back.
    worker.wait_for_log("cleaning group registries", 60)  # after its sweep
    redis_env.conn.rpush(queue.intermediate_queue_key, "finished-and-deleted")
    wait_until(lambda: _done(redis_env, batch) == len(lines), 120, "every line answered")
    wait_until(lambda: "finished-and-deleted: gone" in worker.log, 30, "the gone id dropped")
    worker.stop()
    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert _check_once_each(results, [x["custom_id"] for x in lines]) == (0, 0)
    # Answered, not failed (RQ's own sweep, ten minutes on, would fail it as "stuck").
    assert [r["error"] for r in results] == [None] * len(lines)
    assert "died before starting it: put back" in worker.log
    assert "job finished-and-deleted was taken off" not in worker.log
    assert redis_env.conn.llen(queue.intermediate_queue_key) == 0


def test_deadlines_scale_with_the_machines_pace(monkeypatch):
    """A wait's deadline is its idle-machine seconds times Pace.factor (from the slowest
    worker start seen, or a child's wall over CPU time), clamped to MAX_FACTOR."""
    monkeypatch.setattr(Pace, "calibrated", True)
    monkeypatch.setattr(Pace, "factor", 1.0)
    Pace.note_start(3 * Pace.IDLE_START_S)  # a worker took three times its idle start
    assert Pace.factor == 3.0 and scaled(10) == 30
    Pace.note_start(Pace.IDLE_START_S)  # a faster start later does not shrink deadlines
    assert Pace.factor == 3.0
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0 s \(0.1 s scaled by the "):
        wait_until(lambda: False, 0.1, "nothing", poll=0.01)
    assert time.monotonic() - started >= 0.3
    Pace.note_start(100 * Pace.IDLE_START_S)
    assert Pace.factor == Pace.MAX_FACTOR
