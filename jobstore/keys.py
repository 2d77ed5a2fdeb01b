"""The Redis key layout, in one place.

With P = SPEC_KEY_PREFIX (default "specfleet"), B a batch id, A a model alias:

    P:batch:B            hash  batch meta and summed counters (created_at, source,
                               models, cancelled, result_ttl, started_at, last_done_at,
                               completed_at, jobs (job numbers handed out), completed,
                               failed, prompt_tokens, completion_tokens, busy_ms,
                               sd:<counter>, sd:hist:<i>, sd:dpp:<i>, sd:app:<i>,
                               sd:drafter:<name>, audit_checked, audit_mismatches)
    P:batch:B:requests   hash  line key -> the validated line (JobLine record, JSON, with
                               the number of its job, its timeout and its request's
                               digest); deleted once the line has a result, kept with an
                               error line (spec-retry)
    P:batch:B:order      zset  line key -> line number (every line, valid or not)
    P:batch:B:hashes     hash  line key -> a short hash of the request it was queued with,
                               written by spec-submit before the digest went into the
                               request record and the stored result; only read now
    P:batch:B:results    hash  line key -> result line (jobstore.lines.pack, after its
                               request's digest: a re-submit compares it), written once
    P:batch:B:errors     hash  line key -> error line (jobstore.lines.pack), written once
    P:batch:B:done       list  line keys in the order their line was written
    P:batch:B:workers    hash  "<counter>:<worker>" -> per-worker counters of this batch
                               (completed, failed, tokens, busy_ms, jobs started)
    P:batch:B:submitting string set (with a TTL) while spec-submit is still enqueueing
                               (without one after a submit that stopped part-way)
    P:batch:B:submit-lock string a random token: held by the one spec-submit enqueueing B
                               (SET NX PX, renewed while it runs, expires by itself)
    P:batch:B:api        hash  a batch created through spec-serve: its OpenAI fields
                               (input_file_id, endpoint, completion_window, metadata,
                               state, timestamps, validation errors)
    P:batches            zset  batch id -> created_at, of every batch submitted here; kept
                               after the batch expires (~50 B a batch) so that a
                               vanished batch is told from a mistyped id
    P:api-batches        zset  batch id -> created_at, of batches created by spec-serve
    P:model:A            hash  a served alias: context_length, tokenizer_json, updated_at
    P:worker:W           hash  a worker's lifetime counters, model, host, pid, started_at,
                               last_seen (refreshed with every heartbeat, busy or idle),
                               stopped_at (set when it exits cleanly)
    P:refused            list  reports of jobs a worker refused to run (newest first)
    P:probe:<pid>        string a worker's test write while Redis is full (expires in 1 s)

RQ's own keys: queue `P:A` (so `rq:queue:P:A`), jobs `rq:job:B-j<n>` (see `job_id`: one
job carries 1 to JOB_LINES_MAX lines of one alias), failed jobs `rq:failed:P:A`. Their
names come from RQ's own classes (`Keys.rq_job`, `Keys.rq_failed`), never spelled by
hand elsewhere.

A line key is `c:<custom_id>`, or `l:<line>` for a rejected line whose custom_id is
missing, invalid or a duplicate: one result or error per key, ever.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

from jobstore import config
from jobstore.errors import BatchIdError

#: The one function workers run, with (batch id, [line keys]); they refuse jobs naming
#: anything else.
JOB_FUNCTION = "worker.jobs.run_lines"
#: Called by RQ when a job raised, timed out or was abandoned (writes the error line
#: once no retries are left).
FAILURE_CALLBACK = "worker.jobs.on_job_failure"

#: Batch hash fields of audit mode (`spec-worker --audit RATE`): requests re-run
#: target-only, and how many of them came out different from the speculative output.
AUDIT_CHECKED = "audit_checked"
AUDIT_MISMATCHES = "audit_mismatches"


def new_batch_id() -> str:
    """`batch_<UTC time>_<random>`: sortable, unique, safe in keys and job ids."""
    return f"batch_{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}_{secrets.token_hex(3)}"


def check_batch_id(batch_id: str) -> str:
    """The batch id, if it is safe in keys and RQ job ids; raises BatchIdError."""
    if not config.ID_PATTERN.match(batch_id):
        raise BatchIdError(
            f"batch id must be 1 to 64 letters, digits, '_' or '-', got {batch_id!r}"
        )
    return batch_id


#: Batch hash field: how many job numbers spec-submit and spec-retry have handed out.
JOBS_FIELD = "jobs"


def line_key(custom_id: str | None, line: int) -> str:
    """The key of a line: `c:<custom_id>`, or `l:<line>` when it has no usable custom_id."""
    return f"c:{custom_id}" if custom_id is not None else f"l:{line}"


def custom_id_of(key: str) -> str | None:
    """The custom_id a line key carries (`line_key`'s inverse), None for an `l:` key."""
    return key[2:] if key.startswith("c:") else None


def is_line_key(value: object) -> bool:
    """Whether a value has a line key's shape (`c:<custom_id>` or `l:<line>`)."""
    return isinstance(value, str) and _LINE_KEY.fullmatch(value) is not None


_LINE_KEY = re.compile(r"c:.{1,64}|l:[0-9]{1,12}", re.DOTALL)


def job_id(batch_id: str, number: int) -> str:
    """The RQ job id of a batch's job number `number`: `B-j<number>`. Numbers come from
    the batch hash's `jobs` counter, so a re-submitted or retried line always gets a new
    job, and a line's request record names the job that carries it."""
    return f"{batch_id}-j{number}"


def is_job_of(batch_id: str, job_id: str) -> bool:
    """Whether an RQ job id is one of this batch's jobs (`job_id`'s shape)."""
    prefix = f"{batch_id}-"
    return job_id.startswith(prefix) and _JOB_TAIL.fullmatch(job_id, len(prefix)) is not None


_JOB_TAIL = re.compile(r"j[0-9]+")


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix."""

    prefix: str

    @classmethod
    def default(cls) -> Keys:
        return cls(config.key_prefix())

    def queue_name(self, alias: str) -> str:
        return f"{self.prefix}:{alias}"

    @staticmethod
    def rq_job(job_id: str) -> str:
        """RQ's hash of one job (a prefix of job keys when given a prefix of job ids)."""
        from rq.job import Job  # rq loads in a quarter second: not for `--help`

        key = Job.key_for(job_id)
        return key.decode() if isinstance(key, bytes) else key  # bytes in older rq

    def rq_failed(self, alias: str) -> str:
        """RQ's failed-job registry of an alias's queue."""
        from rq.registry import FailedJobRegistry

        return FailedJobRegistry.key_template.format(self.queue_name(alias))

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def requests(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:requests"

    def order(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:order"

    def hashes(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:hashes"

    def results(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:results"

    def errors(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:errors"

    def done(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:done"

    def batch_workers(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:workers"

    def submitting(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:submitting"

    def submit_lock(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:submit-lock"

    def api_batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:api"

    @property
    def api_batches(self) -> str:
        return f"{self.prefix}:api-batches"

    def batch_keys(self, batch_id: str) -> list[str]:
        """Every key of a batch (for TTLs and deletion)."""
        return [
            self.batch(batch_id),
            self.requests(batch_id),
            self.order(batch_id),
            self.results(batch_id),
            self.errors(batch_id),
            self.done(batch_id),
            self.batch_workers(batch_id),
            self.submitting(batch_id),
            self.api_batch(batch_id),
            self.hashes(batch_id),
        ]

    def batch_key_types(self, batch_id: str) -> dict[str, str]:
        """The Redis type of every key of a batch ("none", absent, is always fine too)."""
        return {
            self.batch(batch_id): "hash",
            self.requests(batch_id): "hash",
            self.order(batch_id): "zset",
            self.results(batch_id): "hash",
            self.errors(batch_id): "hash",
            self.done(batch_id): "list",
            self.batch_workers(batch_id): "hash",
            self.submitting(batch_id): "string",
            self.api_batch(batch_id): "hash",
            self.hashes(batch_id): "hash",
        }

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    def model(self, alias: str) -> str:
        return f"{self.prefix}:model:{alias}"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    @property
    def refused(self) -> str:
        return f"{self.prefix}:refused"
