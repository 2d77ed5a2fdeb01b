"""What the RQ worker (worker.rqworker) and its job runner (worker.runner) share:
running only our job, and keeping running jobs alive.

- `SafeJob` makes sure RQ itself never imports a function or callback a job names,
  even during registry clean-up; `job_class(ctx)` is the SafeJob a worker uses, its
  failure callback bound to the worker's context. No job function is ever resolved:
  the worker's job runner (worker.runner) runs a job's lines itself.
- `vet` says why a payload must not run: it must be JSON naming
  `worker.jobs.run_lines` with (batch id, [line keys]) arguments (1 to JOB_LINES_MAX
  keys) and no callbacks but ours.
- `Heartbeat` refreshes running jobs' liveness from a side thread and reaps abandoned
  jobs of the queue while the worker is busy.
- `ColdShutdown` is what a second stop signal raises in the main thread.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from rq.job import Job

from jobstore import config
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION, is_line_key
from worker import rqcompat

log = logging.getLogger("specfleet.worker")


class ColdShutdown(SystemExit):
    """Raised in the main thread by a second stop signal (not an Exception: jobs must not
    catch it). A SystemExit with code 128 + signal number: wherever it lands (a job, RQ's
    loop, RQ's teardown), RQ lets it through and the process exits with that code, quietly."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by a second {signal.Signals(self.signum).name}"


class SafeJob(Job):
    """A Job that resolves no function and only this project's failure callback."""

    #: The worker's context (worker.jobs.WorkerContext) its failure callback writes
    #: with; set on the class a worker makes with `job_class`.
    context: Any = None

    @property
    def func(self):
        # A worker runs a job's lines with its JobRunner (worker.runner), never by
        # calling what the job names, so RQ's perform path must not run at all.
        raise RuntimeError(f"refusing to resolve {self.func_name!r}: jobs run through the runner")

    @property
    def success_callback(self):
        return None

    @property
    def stopped_callback(self):
        return None

    @property
    def failure_callback(self):
        if rqcompat.callback_names(self).failure == FAILURE_CALLBACK:
            from worker.jobs import on_job_failure

            return functools.partial(on_job_failure, self.context)
        return None


def job_class(context) -> type[SafeJob]:
    """The SafeJob class of one worker: its failure callback writes with `context`
    (the worker's WorkerContext: key prefix, worker name, result TTL)."""
    return type("SafeJob", (SafeJob,), {"context": context})


def vet(job: Job) -> str | None:
    """Why a job must not run, or None when it is one of ours."""
    try:
        func, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:  # not JSON, or not an RQ payload at all
        return f"payload is not a JSON job ({type(exc).__name__})"
    if func != JOB_FUNCTION:
        return f"names function {func!r}; only {JOB_FUNCTION} runs here"
    if rqcompat.has_instance(job) or kwargs:
        return "has an instance or keyword arguments; expected (batch id, [line keys])"
    if not (
        isinstance(args, list | tuple)
        and len(args) == 2
        and isinstance(args[0], str)
        and config.ID_PATTERN.match(args[0])
        and isinstance(args[1], list)
        and 1 <= len(args[1]) <= config.JOB_LINES_MAX
        and all(is_line_key(k) for k in args[1])
    ):
        return f"arguments {str(args)[:80]} are not (batch id, [line keys])"
    names = rqcompat.callback_names(job)
    if names.success or names.stopped:
        return "names a success or stopped callback"
    if names.failure not in (None, FAILURE_CALLBACK):
        return f"names failure callback {names.failure!r}"
    return None


class Heartbeat:
    """Refreshes running jobs' liveness from a side thread while the block runs;
    `running()` lists the (job, execution) pairs to keep alive (one, or a batch's).
    `worker` is a SpecWorker (maintain_heartbeats, reap, heartbeat_interval)."""

    def __init__(self, worker: Any, running: Callable[[], list]):
        self._worker, self._running = worker, running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._worker.heartbeat_interval):
            for job, execution in self._running():
                try:
                    self._worker.maintain_heartbeats(job, execution)
                except Exception as exc:  # Redis hiccup: try again next interval
                    log.warning("heartbeat for job %s failed: %s", job.id, exc)
            try:
                self._worker.reap()
            except Exception as exc:
                log.warning("reaping from the heartbeat thread failed: %s", exc)
