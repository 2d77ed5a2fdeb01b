"""The RQ worker: one process, the pair loaded once, only this project's job runs.

`SpecWorker` is an RQ `SimpleWorker` (no fork per job: the pair stays warm, and
forking after Metal is initialised crashes on macOS) with these changes:

- Vetting (worker.guard): before anything of a job is executed, its payload must be
  JSON naming `worker.jobs.run_request` with (batch id, line key) arguments and no
  callbacks but ours. Anything else is refused: logged, moved to the failed registry
  with the reason, and reported in `P:refused`. `SafeJob` makes sure RQ itself never
  imports a function or callback a job names, even during registry clean-up.
- Heartbeats: a thread refreshes the job's liveness every HEARTBEAT_INTERVAL_S while
  it runs, and liveness lasts HEARTBEAT_TTL_S, so a long job is not declared
  abandoned and a dead worker's job is noticed within about HEARTBEAT_TTL_S.
- Reaper: every worker cleans expired started jobs of its queue between jobs, while
  idle, and from its heartbeat thread while busy (RQ alone only does it while some
  worker is idle), so a dead worker's job is re-queued even when every other worker
  is busy.
- Signals: the first SIGTERM/SIGINT finishes the current job, then exits 0; a second
  one stops now and puts the job back at the front of its queue (retries untouched)
  for another worker, exiting 128 + the signal number. While Redis is unreachable (or
  full: worker.redisfull), a stop signal to an idle worker (or a second one) ends the
  wait for it.
- A job run again after its worker was killed, or delivered twice, ends as a success
  even when RQ still lists the dead run (rqcompat.forget_dead_executions).

RQ private names are used through worker.rqcompat only; --batch N is worker.rqbatch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.timeouts import BaseDeathPenalty
from rq.worker import WorkerStatus

from jobstore import config
from jobstore.connection import ReconnectingRetry
from worker import rqcompat
from worker.guard import ColdShutdown, Heartbeat, SafeJob, vet
from worker.rqbatch import BatchSession

__all__ = ["ColdShutdown", "SafeJob", "SpecWorker", "vet"]

log = logging.getLogger("specfleet.worker")


class _NoDeathPenalty(BaseDeathPenalty):
    """No time limit: the reaper's only callback is our own short Redis write, and
    RQ's SIGALRM-based limit cannot be armed outside the main thread."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


class SpecWorker(rqcompat.BeforeFailureHook, SimpleWorker):
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
            session = BatchSession(self, queue, self.max_batch, limit=self.jobs_left)
            session.run(job)
            self.set_state(WorkerStatus.IDLE)
            if self.jobs_left is not None:
                self.jobs_left -= session.taken
                if self.jobs_left <= 0:
                    log.info("worker %s: --max-jobs reached, stopping", self.name)
                    rqcompat.stop_after_this(self)
        else:

            def running():
                execution = self.execution
                return [(job, execution)] if execution is not None else []

            with Heartbeat(self, running):
                super().execute_job(job, queue)
        self.reap()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                job_id = getattr(exc, "job_id", None)
                queue = getattr(exc, "queue", None)
                if job_id is None or queue is None or isinstance(exc, StopRequested):
                    raise  # a stop signal met RQ reading a job: not the job's fault
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

    def handle_job_success(self, job: Job, queue, started_job_registry, execution) -> None:
        # A run after a killed one, or the slower of two deliveries, must end as the
        # success it is: the line is stored once whichever run stored it.
        if not self.connection.hexists(job.key, "status"):
            # The other delivery finished first and deleted the job (result_ttl 0):
            # RQ's bookkeeping would fail on the missing job; only ours is left to clean.
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipe, execution)
                pipe.delete(job.key)  # a late heartbeat may have written it again
                pipe.execute()
            log.info("job %s was finished by another delivery as well", job.id)
            return
        rqcompat.forget_dead_executions(job)  # a dead run's leftovers
        super().handle_job_success(job, queue, started_job_registry, execution)

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

    def before_failure(self, job: Job, queue, execution, exc_info) -> None:
        if exc_info[0] is ColdShutdown:  # not the job's failure: another worker runs it
            self.put_back(job, queue, execution)
            raise SystemExit(128 + exc_info[1].signum)

    def put_back(self, job: Job, queue, execution) -> None:
        """Return an interrupted job to the front of its queue for another worker."""
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipe, execution)
            rqcompat.enqueue_at_front(queue, job, pipe)
            pipe.execute()
        log.warning("job %s put back on %s (pid %d stopping)", job.id, queue.name, os.getpid())
