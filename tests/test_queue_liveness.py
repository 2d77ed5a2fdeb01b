"""Liveness of running jobs: a long job keeps its heartbeat (it is not declared
abandoned), and the job of a worker killed with SIGKILL is picked up by another worker
within a bounded time, through the heartbeat expiry, not the job timeout."""

from __future__ import annotations

import signal
import time

from rq.job import Job
from rq.registry import StartedJobRegistry
from test_queue import LONG, _collect, _wait_running, read_jsonl, write_jobs

HEARTBEAT = {"SPEC_HEARTBEAT_INTERVAL_S": "0.2", "SPEC_HEARTBEAT_TTL_S": "1"}


def _started_expiry(redis_env, batch: str) -> float | None:
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    for member, score in redis_env.conn.zrange(registry.key, 0, -1, withscores=True):
        if member.decode().startswith(batch):
            return score
    return None


def test_a_long_job_keeps_its_heartbeat_and_runs_once(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    redis_env.env.update(HEARTBEAT)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "long", **LONG}])
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = start_worker("--burst", *slow_pair_args)
    _wait_running(redis_env, batch)
    first = _started_expiry(redis_env, batch)
    time.sleep(1.5)  # registry scores are whole seconds
    later = _started_expiry(redis_env, batch)
    assert worker.wait(timeout=300) == 0, worker.log
    (result,) = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    seconds = result["response"]["body"]["metrics"]["generation_time_ms"] / 1000
    assert seconds > 2, "the job must outlive its heartbeat TTL for this test to mean anything"
    assert later is not None and later > first  # still running, its liveness pushed forward
    assert "Abandoned" not in worker.log and "enqueued for retry" not in worker.log


def test_a_killed_workers_job_is_picked_up_by_another(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    redis_env.env.update(HEARTBEAT)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "long", **LONG}])
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    doomed = start_worker(*slow_pair_args)
    _wait_running(redis_env, batch)
    rescuer = start_worker(*slow_pair_args)
    rescuer.wait_for_log("Listening on", timeout=60)
    doomed.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + 60
    while not redis_env.conn.hexists(redis_env.keys.results(batch), "c:long"):
        assert time.monotonic() < deadline, rescuer.log
        time.sleep(0.1)
    # Picked up through the 1 s heartbeat expiry, far below the job timeout (minutes).
    job = (
        Job.fetch(f"{batch}-1", connection=redis_env.conn)
        if redis_env.conn.exists(f"rq:job:{batch}-1")
        else None
    )
    assert job is None or job.get_status() != "started"
    assert f"{batch}-1" in rescuer.log
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait(timeout=60) == 0
    (result,) = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert result["custom_id"] == "long" and result["error"] is None
