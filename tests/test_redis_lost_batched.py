"""Reliability round 4: a Redis restarted without persistence while a `--batch` worker
has given out every line of its jobs. The store then finds the batch gone after the
last line was handed to the engine, so the runner's "lines left" check never fires;
each job must still end with the documented "no record in Redis any more" line, not
"finished by another delivery as well" (what the round-4 hostile run saw, four times)."""

from __future__ import annotations

from conftest import wait_until
from rq.registry import StartedJobRegistry
from test_faults import (
    NO_PERSISTENCE_ARGS,
    private_redis,  # noqa: F401 - a fixture
)
from test_queue import write_jobs


def test_a_batched_worker_whose_lines_are_all_running_says_the_batch_is_gone(
    private_redis,  # noqa: F811
    slow_pair_args,
    tmp_path,
):
    server, env = private_redis(*NO_PERSISTENCE_ARGS)
    env.env.update(SPEC_JOB_LINES="1", SPEC_HEARTBEAT_INTERVAL_S="0.5", SPEC_HEARTBEAT_TTL_S="5")
    # Long enough (>= 400 steps of the slow pair, 15 ms each) to outlast the restart.
    lines = [
        {"custom_id": f"g{i}", "prompt": "def f():", "max_tokens": 400, "temperature": 0}
        for i in range(4)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = env.batch_id("gone")
    assert env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = env.start_worker("--batch", "4", *slow_pair_args)
    registry = StartedJobRegistry(env.keys.queue_name("demo"), connection=env.conn)
    wait_until(lambda: registry.count == 4, 120, "all four jobs running", 0.02)
    server.stop()
    server.start()

    def dropped() -> list[str]:
        return [x for x in worker.log.splitlines() if "no record in Redis any more" in x]

    wait_until(lambda: len(dropped()) == 4, 120, "four jobs dropped")
    assert all("answered but not stored" in x for x in dropped()), worker.log
    assert "another delivery" not in worker.log
    assert "Traceback" not in worker.log
