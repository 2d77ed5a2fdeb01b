"""What the worker relies on in RQ beyond its public API, in one place (rq 3.0.x).

Every use of an RQ private name, and every repair of RQ's own bookkeeping, is here, so
an RQ upgrade is checked at one module: `PRIVATE_NAMES` lists them, and
tests/test_worker_reliability.py asserts that each still exists with the parameters
used. pyproject.toml pins rq to the range tested.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

#: (owner, name, parameters it is called with; None: an instance attribute)
PRIVATE_NAMES: list[tuple[type, str, tuple[str, ...] | None]] = [
    (Job, "_instance", None),
    (Job, "_success_callback_name", None),
    (Job, "_failure_callback_name", None),
    (Job, "_stopped_callback_name", None),
    (Queue, "_enqueue_job", ("self", "job", "pipeline", "at_front")),
    (BaseWorker, "_finalize_success", ("self", "job", "queue", "execution", "return_value")),
    (BaseWorker, "_finalize_failure", ("self", "job", "queue", "execution", "exc_info")),
    (BaseWorker, "_stop_requested", None),
    (BaseWorker, "_pubsub_exception_handler", ("self", "exc", "pubsub", "pubsub_thread")),
]

#: How often the worker's pubsub thread wakes (RQ's own: 60 s). redis-py 8.2's
#: `PubSubWorkerThread.stop()` waits for the thread, which sleeps that long in a wait for
#: messages once unsubscribed: a `--burst` worker took up to a minute to exit.
PUBSUB_WAKE_S = 1.0


def subscribe(worker: BaseWorker) -> None:
    """RQ's `subscribe` (the worker's command channel), with the thread waking every
    PUBSUB_WAKE_S so that stopping it, at the worker's exit, waits at most that long."""
    worker.log.info("Worker %s: subscribing to channel %s", worker.name, worker.pubsub_channel_name)
    worker.pubsub = worker.connection.pubsub()
    worker.pubsub.subscribe(**{worker.pubsub_channel_name: worker.handle_payload})
    worker.pubsub_thread = worker.pubsub.run_in_thread(
        sleep_time=PUBSUB_WAKE_S, daemon=True, exception_handler=worker._pubsub_exception_handler
    )


class CallbackNames(NamedTuple):
    success: str | None
    failure: str | None
    stopped: str | None


def callback_names(job: Job) -> CallbackNames:
    """The callbacks a job names, read without importing them."""
    return CallbackNames(
        job._success_callback_name, job._failure_callback_name, job._stopped_callback_name
    )


def has_instance(job: Job) -> bool:
    """Whether the job names a method of an instance (read after its payload is loaded)."""
    return job._instance is not None


def enqueue_at_front(queue: Queue, job: Job, pipeline) -> None:
    """Put an interrupted job back at the front of its queue, retries untouched."""
    queue._enqueue_job(job, pipeline=pipeline, at_front=True)


def stop_requested(worker: BaseWorker) -> bool:
    """Whether the worker was asked to stop after its current work."""
    return worker._stop_requested


def stop_after_this(worker: BaseWorker) -> None:
    """Make RQ's work loop end after the current job, as a first stop signal does."""
    worker._stop_requested = True


def finish_job(
    worker: BaseWorker, job: Job, queue: Queue, execution: Execution, outcome: Any
) -> bool:
    """Finish a job whose lines have run, as RQ's `perform_job` does once the job
    function returned `outcome` or raised it (an exception): the job marked finished
    (result TTL, success bookkeeping: the worker's `handle_job_success`) or failed
    (failure callback, retry or failed registry, exception handlers). A success whose
    bookkeeping raises is recorded as a failure, as RQ does. Returns True for a success.

    The runner calls this in place of `perform_job`, having already prepared the job's
    execution (`prepare_job_execution`) when it claimed it; RQ's own time limit on the
    whole job is not armed (each line has its own)."""
    if not isinstance(outcome, BaseException):
        try:
            worker._finalize_success(job, queue, execution, outcome)
            return True
        except Exception:
            exc_info = sys.exc_info()
    else:
        exc_info = (type(outcome), outcome, outcome.__traceback__)
    worker._finalize_failure(job, queue, execution, exc_info)
    return False


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
