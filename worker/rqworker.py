"""The RQ worker: one process, the pair loaded once, only this project's job runs.

`SpecWorker` is an RQ `SimpleWorker` (no fork per job: the pair stays warm, and
forking after Metal is initialised crashes on macOS) with these changes:

- Vetting (worker.guard): before anything of a job is executed, its payload must be
  JSON naming `worker.jobs.run_lines` with (batch id, [line keys]) arguments and no
  callbacks but ours. Anything else is refused: logged, moved to the failed registry
  with the reason, and reported in `P:refused`. `SafeJob` makes sure RQ itself never
  imports a function or callback a job names, even during registry clean-up.
- One job runner (worker.runner.JobRunner) runs every job, alone or with --batch N
  several decoded together, and finishes each in RQ (worker.rqcompat.finish_job) in
  place of RQ's `perform_job`. The worker's context (worker.jobs.WorkerContext: the
  pair, the connection, the auditor) is made once at start-up and passed in.
- Heartbeats: a thread refreshes the job's liveness every HEARTBEAT_INTERVAL_S while
  it runs, and liveness lasts HEARTBEAT_TTL_S, so a long job is not declared
  abandoned and a dead worker's job is noticed within about HEARTBEAT_TTL_S.
- Reaper: every worker cleans expired started jobs of its queue between jobs, while
  idle, and from its heartbeat thread while busy (RQ alone only does it while some
  worker is idle), so a dead worker's job is re-queued even when every other worker
  is busy.
- Time limits: each line has its own (stored with its request), enforced by the
  runner (one alarm per line, or its deadline in a batch); RQ's limit on the whole job
  is not armed.
- Signals: the first SIGTERM/SIGINT finishes the current line, puts the job back at the
  front of its queue if it has lines left, then exits 0; a second one stops now and
  puts the job back (retries untouched) for another worker, exiting 128 + the signal
  number. Lines already stored stay stored: whoever runs the job again skips them.
- Liveness for `spec-status`: every RQ heartbeat (busy or idle) also writes the
  worker's `last_seen` in `P:worker:W`, and a clean exit its `stopped_at`.
- `--max-jobs N` counts lines: the worker stops after the job that takes it to N. While Redis is unreachable (or
  full: worker.redisfull), a stop signal to an idle worker (or a second one) ends the
  wait for it.
- A job run again after its worker was killed, or delivered twice, ends as a success
  even when RQ still lists the dead run (rqcompat.forget_dead_executions). Two deliveries
  finish one at a time (a Redis lock per job), so neither reads run records the other
  is deleting.

RQ private names are used through worker.rqcompat only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from redis.exceptions import LockError
from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.timeouts import BaseDeathPenalty
from rq.worker import WorkerStatus

from jobstore import config
from jobstore.connection import ReconnectingRetry
from worker import rqcompat
from worker.guard import ColdShutdown, SafeJob, vet
from worker.jobs import WorkerContext
from worker.runner import JobRunner

__all__ = ["ColdShutdown", "SafeJob", "SpecWorker", "vet"]

log = logging.getLogger("specfleet.worker")


# Move a job id from a queue's intermediate list back to the front of the queue, only
# if it is still in that list (another worker's rescue, or RQ's own sweep, may have won).
#: Put a stranded job id back at the front of its queue: 1 if it was put back, 2 if it
#: was dropped because its job is gone (finished and deleted: a second delivery's id,
#: which RQ takes off the queue into the list and then skips), 0 if no longer there.
_RESCUE_LUA = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
    if redis.call('EXISTS', KEYS[3]) == 0 then
        return 2
    end
    redis.call('LPUSH', KEYS[2], ARGV[1])
    return 1
end
return 0
"""


#: How long one delivery may hold a job's finishing lock (RQ's success bookkeeping: a few
#: Redis round trips); a worker killed while holding it delays the other this long.
FINISH_LOCK_S = 10


class _NoDeathPenalty(BaseDeathPenalty):
    """No time limit: the reaper's only callback is our own short Redis write, and
    RQ's SIGALRM-based limit cannot be armed outside the main thread."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


class SpecWorker(SimpleWorker):
    """See the module docstring. Construct with `job_class=guard.job_class(context)` and
    the JSON serializer (worker.cli does); `context` is what every job runs with,
    `stats_key` the worker's `P:worker:W` hash."""

    death_penalty_class = _NoDeathPenalty  # each line has its own limit (worker.runner)

    def __init__(
        self,
        *args,
        context: WorkerContext,
        refused_key: str,
        stats_key: str,
        max_batch: int = 1,
        announce=None,
        **kwargs,
    ):
        # Set before RQ's __init__, which reads dequeue_timeout.
        self.heartbeat_interval = config.heartbeat_interval_s()
        self.heartbeat_ttl = config.heartbeat_ttl_s()
        self.context = context
        self.refused_key = refused_key
        self.stats_key = stats_key
        self.max_batch = max_batch
        #: (worker fields, model key, model fields): written again with the heartbeat, so
        #: a Redis that lost them (restarted without persistence) knows this worker again.
        self.announce = announce
        self.cold_signum: int | None = None
        self.stopping = False  # a stop signal has arrived
        self._last_reap = 0.0
        self._stranded_seen: dict[str, dict[str, float]] = {}  # queue -> job id -> first seen
        self._last_seen_at = 0.0
        self.jobs_left: int | None = None  # --max-jobs budget, counted in lines
        super().__init__(*args, **kwargs)
        self._rescue = self.connection.register_script(_RESCUE_LUA)

    def subscribe(self) -> None:
        rqcompat.subscribe(self)  # RQ's, with a short wake-up (see there)

    def work(self, *args, max_jobs: int | None = None, **kwargs) -> bool:
        # RQ counts jobs; --max-jobs counts lines, here.
        self.jobs_left = max_jobs
        return super().work(*args, **kwargs)

    # -- running only our job ---------------------------------------------------------

    def execute_job(self, job: Job, queue) -> None:
        reason = vet(job)
        if reason is not None:
            self.refuse(job.id, queue, reason)
            return
        runner = JobRunner(self, queue, self.max_batch, limit=self.jobs_left)
        runner.run(job)
        self.set_state(WorkerStatus.IDLE)
        taken = runner.taken
        if self.jobs_left is not None:
            self.jobs_left -= taken
            if self.jobs_left <= 0:
                log.info("worker %s: --max-jobs reached, stopping", self.name)
                rqcompat.stop_after_this(self)
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
        # success it is: the line is stored once whichever run stored it. Two deliveries
        # finish one after the other: the slower one stops as soon as it sees the line
        # stored, so both often finish within the same millisecond, and RQ's clean-up
        # of one would read the other's run records while the other deletes them.
        lock = self.connection.lock(
            f"{job.key}:finishing", timeout=FINISH_LOCK_S, blocking_timeout=2 * FINISH_LOCK_S
        )
        held = lock.acquire()  # False: its holder outlived FINISH_LOCK_S twice; go on
        try:
            self._finish_success(job, queue, started_job_registry, execution)
        finally:
            if held:
                try:
                    lock.release()
                except LockError:  # it expired while Redis was waited for: not ours now
                    log.info("job %s: its finishing lock expired before it was released", job.id)

    def _finish_success(self, job: Job, queue, started_job_registry, execution) -> None:
        for attempt in (1, 2):
            if not self.connection.hexists(job.key, "status"):
                # The other delivery finished first and deleted the job (result_ttl 0):
                # RQ's bookkeeping would fail on the missing job; only ours is left.
                # Or Redis lost everything (restarted without persistence): the runner
                # said so (drop_gone); that is no other delivery.
                keys = getattr(self.context, "keys", None)  # None: a bare worker (tests)
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(job, pipe, execution)
                    pipe.delete(job.key)  # a late heartbeat may have written it again
                    if keys is not None:
                        pipe.hexists(keys.batch(job.args[0]), "created_at")
                    replies = pipe.execute()
                if keys is None or replies[-1]:  # the batch is still known
                    log.info("job %s was finished by another delivery as well", job.id)
                return
            rqcompat.forget_dead_executions(job)  # a dead run's leftovers
            try:
                super().handle_job_success(job, queue, started_job_registry, execution)
                return
            except ValueError as exc:
                # A dead run's record expired between the two reads above: RQ read its
                # id and not its record, before writing anything. Once more, forgetting it.
                if attempt == 2 or "not found in Redis" not in str(exc):
                    raise
                log.info("job %s: a run record expired while finishing; once more", job.id)

    # -- liveness ---------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return int(self.heartbeat_ttl)

    def heartbeat(self, timeout: int | None = None, pipeline=None):
        # RQ heartbeats an idle worker on every pass of its dequeue loop and a busy one
        # from our heartbeat thread (with a pipeline): last_seen follows both, written
        # at most once a second outside the heartbeat thread.
        super().heartbeat(timeout, pipeline)
        now = time.time()
        if pipeline is None and now - self._last_seen_at < 1.0:
            return
        self._last_seen_at = now
        conn = pipeline if pipeline is not None else self.connection
        identity, model_key, model_fields = self.announce or ({}, None, None)
        conn.hset(self.stats_key, mapping={**identity, "last_seen": f"{now:.3f}"})
        conn.expire(self.stats_key, config.WORKER_STATS_TTL_S)
        # The alias's record (tokenizer: large) is written only when Redis has lost it.
        if model_key is not None and not self.connection.exists(model_key):
            self.connection.hset(model_key, mapping={**model_fields, "updated_at": f"{now:.3f}"})
            log.warning(
                "worker %s: announced model %s again (Redis had lost it)", self.name, model_key
            )

    def register_death(self):
        super().register_death()
        try:  # a clean exit: spec-status must not call this worker quiet
            self.connection.hset(self.stats_key, "stopped_at", f"{time.time():.3f}")
        except Exception as exc:  # Redis away at exit: it shows as quiet, and is
            log.warning("could not record the exit of worker %s: %s", self.name, exc)

    def reap(self, force: bool = False) -> None:
        """Clean expired started jobs of our queues: retried if they have retries left,
        else failed (their error line is written by the failure callback)."""
        now = time.monotonic()
        if not force and now - self._last_reap < self.heartbeat_interval:
            return
        self._last_reap = now
        for queue in self.queues:
            lock = f"{queue.key}:reaper"
            # A worker killed while it reaps leaves the lock: it expires within a heartbeat
            # interval (at least 1 s), so the dead worker's own job is not kept waiting.
            hold_ms = max(1000, int(self.heartbeat_interval * 1000))
            if not self.connection.set(lock, self.name, nx=True, px=hold_ms):
                continue
            try:
                registry = StartedJobRegistry(
                    queue.name,
                    connection=self.connection,
                    job_class=self.job_class,
                    serializer=self.serializer,
                    death_penalty_class=_NoDeathPenalty,
                )
                registry.cleanup()
                self._rescue_stranded(queue, registry)
            except Exception as exc:
                log.warning("reaper on %s failed: %s", queue.name, exc)
            finally:
                self.connection.delete(lock)

    def _rescue_stranded(self, queue, registry: StartedJobRegistry) -> None:
        """Put back jobs a worker took off the queue but died before starting.

        RQ moves a job being taken into the queue's intermediate list, then registers
        its execution, then marks it started. A worker killed between those steps leaves
        the job in the intermediate list, still "queued": the started registry's clean-up
        drops its expired entry without re-queuing it (the job was never started), and
        RQ's own sweep of the list runs only every maintenance interval (10 minutes).
        A live worker moves a job through in milliseconds, so a job seen there, outside
        the started registry, for longer than a heartbeat TTL is stranded: it goes back
        to the front of its queue (atomically: only if it is still in the list). An id
        whose job is gone is dropped instead: a second delivery of a job (queued again
        by a clean-up while its first run went on) that the first run finished and
        deleted; RQ takes such an id into the list and skips it, and putting it back
        would only start the round again, every heartbeat TTL."""
        now = time.monotonic()
        ids = [
            i.decode() if isinstance(i, bytes) else i
            for i in self.connection.lrange(queue.intermediate_queue_key, 0, -1)
        ]
        seen = self._stranded_seen.setdefault(queue.name, {})
        for job_id in list(seen):
            if job_id not in ids:
                del seen[job_id]
        for job_id in ids:
            if job_id in registry:
                seen.pop(job_id, None)
                continue
            first = seen.setdefault(job_id, now)
            if now - first < self.heartbeat_ttl:
                continue
            del seen[job_id]
            keys = [queue.intermediate_queue_key, queue.key, self.job_class.key_for(job_id)]
            done = self._rescue(keys=keys, args=[job_id])
            if done == 2:
                log.info("job %s: gone (finished), its id dropped from %s", job_id, queue.name)
            elif done:
                log.warning(
                    "job %s was taken off queue %s by a worker that died before starting "
                    "it: put back",
                    job_id,
                    queue.name,
                )

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

    def put_back(self, job: Job, queue, execution) -> None:
        """Return an interrupted job to the front of its queue for another worker."""
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipe, execution)
            rqcompat.enqueue_at_front(queue, job, pipe)
            pipe.execute()
        log.warning("job %s put back on %s (pid %d stopping)", job.id, queue.name, os.getpid())
