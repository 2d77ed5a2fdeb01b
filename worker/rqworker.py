"""The RQ worker: one process, the pair loaded once, only this project's job runs.

`SpecWorker` is an RQ `SimpleWorker` (no fork per job: the pair stays warm, and
forking after Metal is initialised crashes on macOS) with these changes:

- Vetting: before anything of a job is executed, its payload must be JSON naming
  `worker.jobs.run_request` with (batch id, line key) arguments and no callbacks but
  ours. Anything else is refused: logged, moved to the failed registry with the
  reason, and reported in `P:refused`. `SafeJob` makes sure RQ itself never imports a
  function or callback a job names, even during registry clean-up.
- Heartbeats: a thread refreshes the job's liveness every HEARTBEAT_INTERVAL_S while
  it runs, and liveness lasts HEARTBEAT_TTL_S, so a long job is not declared
  abandoned and a dead worker's job is noticed within about HEARTBEAT_TTL_S.
- Reaper: every worker cleans expired started jobs of its queue between jobs, while
  idle, and from its heartbeat thread while busy (RQ alone only does it while some
  worker is idle), so a dead worker's job is re-queued even when every other worker
  is busy.
- Signals: the first SIGTERM/SIGINT finishes the current job, then exits 0; a second
  one stops now and puts the job back at the front of its queue (retries untouched)
  for another worker, exiting 128 + the signal number. While Redis is unreachable, a
  stop signal to an idle worker (or a second one) ends the wait for it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from rq import SimpleWorker
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.timeouts import BaseDeathPenalty
from rq.worker import WorkerStatus

from jobstore import config
from jobstore.connection import ReconnectingRetry
from jobstore.keys import FAILURE_CALLBACK, JOB_FUNCTION

log = logging.getLogger("specfleet.worker")


class ColdShutdown(BaseException):
    """Raised in the main thread by a second stop signal (BaseException: jobs must not
    catch it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by a second {signal.Signals(signum).name}")
        self.signum = signum


class SafeJob(Job):
    """A Job that resolves only this project's function and failure callback."""

    @property
    def func(self):
        if self.func_name != JOB_FUNCTION:
            raise RuntimeError(f"refusing to run {self.func_name!r}")
        from worker.jobs import run_request

        return run_request

    @property
    def success_callback(self):
        return None

    @property
    def stopped_callback(self):
        return None

    @property
    def failure_callback(self):
        if self._failure_callback_name == FAILURE_CALLBACK:
            from worker.jobs import on_job_failure

            return on_job_failure
        return None


def vet(job: Job) -> str | None:
    """Why a job must not run, or None when it is one of ours."""
    try:
        func, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:  # not JSON, or not an RQ payload at all
        return f"payload is not a JSON job ({type(exc).__name__})"
    if func != JOB_FUNCTION:
        return f"names function {func!r}; only {JOB_FUNCTION} runs here"
    if job._instance is not None or kwargs:
        return "has an instance or keyword arguments; expected (batch id, line key)"
    if not (
        isinstance(args, list | tuple)
        and len(args) == 2
        and all(isinstance(a, str) for a in args)
        and config.ID_PATTERN.match(args[0])
    ):
        return f"arguments {str(args)[:80]} are not (batch id, line key)"
    if job._success_callback_name or job._stopped_callback_name:
        return "names a success or stopped callback"
    if job._failure_callback_name not in (None, FAILURE_CALLBACK):
        return f"names failure callback {job._failure_callback_name!r}"
    return None


class _NoDeathPenalty(BaseDeathPenalty):
    """No time limit: the reaper's only callback is our own short Redis write, and
    RQ's SIGALRM-based limit cannot be armed outside the main thread."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


class _Heartbeat:
    """Refreshes running jobs' liveness from a side thread; `running()` lists the
    (job, execution) pairs to keep alive (one, or a batch's)."""

    def __init__(self, worker: SpecWorker, running: Callable[[], list]):
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


class SpecWorker(SimpleWorker):
    """See the module docstring. Construct with `job_class=SafeJob` and the JSON
    serializer (worker.cli does)."""

    def __init__(self, *args, refused_key: str, max_batch: int = 1, **kwargs):
        # Set before RQ's __init__, which reads dequeue_timeout.
        self.heartbeat_interval = config.heartbeat_interval_s()
        self.heartbeat_ttl = config.heartbeat_ttl_s()
        self.refused_key = refused_key
        self.max_batch = max_batch
        self.cold_signum: int | None = None
        self.stopping = False  # a stop signal has arrived
        self._last_reap = 0.0
        self.jobs_left: int | None = None  # --max-jobs budget, counted in lines
        super().__init__(*args, **kwargs)

    def work(self, *args, max_jobs: int | None = None, **kwargs) -> bool:
        # RQ counts one job per dequeue; a batch claims several, and each counts here.
        self.jobs_left = max_jobs
        return super().work(*args, max_jobs=max_jobs, **kwargs)

    # -- running only our job ---------------------------------------------------------

    def execute_job(self, job: Job, queue) -> None:
        reason = vet(job)
        if reason is not None:
            self.refuse(job.id, queue, reason)
            return
        if self.max_batch > 1:  # several lines decoded together (worker.rqbatch)
            from worker.rqbatch import BatchSession

            session = BatchSession(self, queue, self.max_batch, limit=self.jobs_left)
            session.run(job)
            self.set_state(WorkerStatus.IDLE)
            if self.jobs_left is not None:
                self.jobs_left -= session.taken
                if self.jobs_left <= 0:
                    log.info("worker %s: --max-jobs reached, stopping", self.name)
                    self._stop_requested = True
        else:

            def running():
                execution = self.execution
                return [(job, execution)] if execution is not None else []

            with _Heartbeat(self, running):
                super().execute_job(job, queue)
        self.reap()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                job_id = getattr(exc, "job_id", None)
                queue = getattr(exc, "queue", None)
                if job_id is None or queue is None:
                    raise
                # A job hash RQ cannot even read: refuse it and keep serving.
                self.refuse(job_id, queue, f"unreadable job ({type(exc).__name__}: {exc})")

    def refuse(self, job_id: str, queue, reason: str) -> None:
        """Never run a job: mark it failed with the reason and report it."""
        log.error("REFUSED job %s from queue %s: %s", job_id, queue.name, reason)
        report = {
            "job_id": job_id,
            "queue": queue.name,
            "worker": self.name,
            "reason": reason,
            "at": round(time.time(), 3),
        }
        registry = FailedJobRegistry(queue.name, connection=self.connection, job_class=SafeJob)
        with self.connection.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            pipe.hset(
                Job.key_for(job_id),
                mapping={"status": JobStatus.FAILED.value, "exc_info": f"refused: {reason}"},
            )
            pipe.expire(Job.key_for(job_id), config.FAILURE_TTL_S)
            pipe.zadd(registry.key, {job_id: time.time() + config.FAILURE_TTL_S})
            pipe.lpush(self.refused_key, json.dumps(report))
            pipe.ltrim(self.refused_key, 0, 999)
            pipe.execute()

    # -- liveness ---------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return int(self.heartbeat_ttl)

    def reap(self, force: bool = False) -> None:
        """Clean expired started jobs of our queues: retried if they have retries left,
        else failed (their error line is written by the failure callback)."""
        now = time.monotonic()
        if not force and now - self._last_reap < self.heartbeat_interval:
            return
        self._last_reap = now
        for queue in self.queues:
            lock = f"{queue.key}:reaper"
            if not self.connection.set(
                lock, self.name, nx=True, ex=max(5, int(self.heartbeat_interval))
            ):
                continue
            try:
                StartedJobRegistry(
                    queue.name,
                    connection=self.connection,
                    job_class=SafeJob,
                    serializer=self.serializer,
                    death_penalty_class=_NoDeathPenalty,
                ).cleanup()
            except Exception as exc:
                log.warning("reaper on %s failed: %s", queue.name, exc)
            finally:
                self.connection.delete(lock)

    @property
    def dequeue_timeout(self) -> int:
        # An idle worker wakes at least once per heartbeat interval, to reap.
        return max(1, min(self.worker_ttl - 15, int(self.heartbeat_interval)))

    @property
    def should_run_maintenance_tasks(self) -> bool:
        # RQ asks this on every pass of its idle loop: the place to reap when due.
        self.reap()
        return super().should_run_maintenance_tasks

    def run_maintenance_tasks(self):
        super().run_maintenance_tasks()
        self.reap(force=True)

    # -- stopping ---------------------------------------------------------------------
    # The connection retries for ever while Redis is away (jobstore.connection). A first
    # stop signal to a busy worker keeps it waiting, so the job's result is stored when
    # Redis is back; a stop signal to an idle worker, or a second one, ends the waiting.

    def _give_up_on_redis(self) -> None:
        self.stopping = True
        retry = self.connection.get_retry()
        if isinstance(retry, ReconnectingRetry):
            retry.interrupt()

    def request_stop(self, signum, frame):
        if self.get_state() != WorkerStatus.BUSY:
            self._give_up_on_redis()
        self.stopping = True
        super().request_stop(signum, frame)

    def request_force_stop(self, signum, frame):
        self._give_up_on_redis()
        log.warning("second %s: stopping now", signal.Signals(signum).name)
        self.cold_signum = signum
        raise ColdShutdown(signum)

    def _finalize_failure(self, job, queue, execution, exc_info) -> None:
        if exc_info[0] is ColdShutdown:
            self._put_back(job, queue, execution)
            raise SystemExit(128 + exc_info[1].signum)
        super()._finalize_failure(job, queue, execution, exc_info)

    def _put_back(self, job: Job, queue, execution) -> None:
        """Return an interrupted job to the front of its queue for another worker."""
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipe, execution)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        log.warning("job %s put back on %s (pid %d stopping)", job.id, queue.name, os.getpid())
