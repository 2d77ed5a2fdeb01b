"""A batch's record read back from Redis and checked before it is used (key types,
counters, timestamps), and the line keys its RQ jobs carry: what status, collect,
retry and cancel all read first. Damage is a CorruptBatch naming the key and field."""

from __future__ import annotations

import math

from redis import Redis
from rq.job import Job

from contract.stats import FIELD_PREFIX, SERIES_FIELD_PREFIXES
from jobstore import store
from jobstore.keys import AUDIT_CHECKED, AUDIT_MISMATCHES, JOBS_FIELD, Keys, is_line_key
from producer.errors import BatchError, CorruptBatch


def text(value) -> str:
    """A value read from Redis as text (bytes decoded, damaged bytes replaced)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def check_key_types(conn: Redis, keys: Keys, batch_id: str) -> None:
    """Raises CorruptBatch naming the first key of the batch that holds the wrong type."""
    problem = store.wrong_key_type(conn, keys, batch_id)
    if problem:
        raise CorruptBatch(problem)


#: Batch hash fields read as integers (besides every `sd:` counter) and as timestamps.
_INT_FIELDS = (
    "completed",
    "failed",
    JOBS_FIELD,
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "busy_ms",
    "result_ttl",
    AUDIT_CHECKED,
    AUDIT_MISMATCHES,
)
_TIME_FIELDS = ("created_at", "started_at", "last_done_at", "completed_at")


def _check_meta(key: str, meta: dict[str, str]) -> None:
    for field, value in meta.items():
        if field in _INT_FIELDS or field.startswith(FIELD_PREFIX):
            integer(key, field, value)
        elif field in _TIME_FIELDS:
            timestamp(key, field, value)
        if field.startswith(SERIES_FIELD_PREFIXES):
            index = field.split(":", 2)[2]
            if not index.isdigit():
                raise CorruptBatch(f"key {key} field {field}: position {index!r} is not a number")


def integer(key: str, field: str, value: str) -> int:
    """A hash field's value as an integer; raises CorruptBatch naming key and field."""
    try:
        return int(value)
    except ValueError as exc:
        raise CorruptBatch(f"key {key} field {field}: expected an integer, got {value!r}") from exc


def timestamp(key: str, field: str, value: str) -> float:
    """A hash field's value as a Unix time; raises CorruptBatch naming key and field."""
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not math.isfinite(t):
        raise CorruptBatch(f"key {key} field {field}: expected a Unix time, got {value!r}")
    return t


def read_meta(conn: Redis, keys: Keys, batch_id: str) -> dict[str, str]:
    """The batch's hash, checked (key types, record, counters, timestamps). Raises
    BatchError for an unknown or lost batch, CorruptBatch for damaged state."""
    check_key_types(conn, keys, batch_id)
    problem = store.record_problem(conn, keys, batch_id)
    if problem:
        raise BatchError(problem)
    raw = conn.hgetall(keys.batch(batch_id))
    meta = {text(k): text(v) for k, v in raw.items()}
    _check_meta(keys.batch(batch_id), meta)
    return meta


def models_of(meta: dict[str, str]) -> list[str]:
    """The model aliases a batch has queued lines for (its `model:<alias>` fields)."""
    return sorted(k.split(":", 1)[1] for k in meta if k.startswith("model:"))


def job_lines(job: Job | None) -> list[str]:
    """The line keys a job of this project carries ([] for anything else)."""
    if job is None:
        return []
    try:
        args = job.args
    except Exception:  # not a JSON payload: not ours
        return []
    if isinstance(args, list | tuple) and len(args) == 2 and isinstance(args[1], list):
        return [k for k in args[1] if is_line_key(k)]
    return []
