"""What the worker relies on in RQ beyond its public API, in one place (rq 3.0.x).

Every use of an RQ private name, and every repair of RQ's own bookkeeping, is here, so
an RQ upgrade is checked at one module: tests/test_worker_reliability.py asserts that
each name below still exists with the signature used.
"""

from __future__ import annotations

from rq.executions import Execution
from rq.job import Job


def forget_dead_executions(job: Job) -> int:
    """Drop the job's runs whose execution record is gone; returns how many.

    RQ keeps an execution's id in the job's execution registry for a minute after the
    record itself expired (a killed or frozen worker's run), or with only a heartbeat
    field when a late heartbeat wrote it again; deleting the finished job
    (`result_ttl=0`) then fails with `ValueError: Execution ... not found in Redis`,
    and a line that was stored is reported failed and retried.
    """
    conn, registry = job.connection, job.execution_registry
    runs = [Execution(id=i, job_id=job.id, connection=conn) for i in registry.get_execution_ids()]
    dead = [run for run in runs if not conn.hexists(run.key, "created_at")]
    if dead:
        with conn.pipeline() as pipe:
            for execution in dead:
                registry.remove(execution, pipeline=pipe)
                pipe.delete(execution.key)
            pipe.execute()
    return len(dead)
