"""`spec-collect`: a batch's result and error lines written to files, as they are stored.

Lines are read through jobstore.store.read_lines (CHUNK_LINES keys a round trip), so
memory stays bounded however many lines a batch has. A stored line that cannot be
written as a JSONL line becomes an `internal_error` error line naming its key and
field, never an invalid line in a collected file. `stored_lines` is also what
spec-serve's output files hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

from redis import Redis

from jobstore import config, store
from jobstore.keys import JOBS_FIELD, Keys, custom_id_of, job_id
from jobstore.lines import dumps, error_line
from producer.errors import BatchError, CorruptLines, redis_refusals
from producer.meta import models_of, read_meta
from producer.outputs import Outputs, check_outputs
from producer.status import TERMINAL, status


def stored_lines(
    conn: Redis, keys: Keys, batch_id: str, order: Literal["input", "completion"] = "input"
) -> Iterator[tuple[Literal["result", "error", "pending"], str, str | None]]:
    """Every line of the batch as spec-collect writes it, in `order`, read CHUNK_LINES at
    a time: (kind, JSON line, problem). A line without a result or error line yet is
    ("pending", "", None); a stored line that is damaged comes as ("error", its
    `internal_error` line, where: key, field and what is wrong)."""
    for line in store.read_lines(conn, keys, batch_id, order):
        if line.kind == "pending":
            yield "pending", "", None
            continue
        problem = _problem(line)
        if problem:
            where = f"key {line.hash_key} field {line.key}: {problem}"
            yield "error", _corrupt_line(conn, keys, batch_id, line.key, where), where
            continue
        yield line.kind, line.text, None


@redis_refusals
def collect(
    conn: Redis,
    keys: Keys,
    batch_id: str,
    out_path: str,
    errors_path: str | None = None,
    order: Literal["input", "completion"] = "input",
    delete: bool = False,
) -> dict[str, int]:
    """Write the batch's lines: results to out_path, error lines to errors_path (or also
    to out_path when it is None). Files are written whole or not at all (temporary
    files beside the targets, renamed over them once both are written; a symlink is
    written through). Returns counts {"results", "errors", "pending"}.

    A stored line that is not a JSON object is written as an `internal_error` error
    line instead, and CorruptLines is raised once the files are written. With delete,
    every line must be final (nothing queued or running) and written, else BatchError
    before anything is written; the batch's keys are removed after the files are.
    Raises OutputError when a file cannot be written (then no file was changed).
    """
    meta = read_meta(conn, keys, batch_id)
    targets = check_outputs(out_path, errors_path)
    if delete:
        _check_final(conn, keys, batch_id)
    counts = {"results": 0, "errors": 0, "pending": 0}
    corrupt, first_corrupt = 0, ""
    with Outputs(targets) as files:
        err_role = "--errors" if errors_path else "-o"
        for kind, raw, problem in stored_lines(conn, keys, batch_id, order):
            if kind == "pending":
                counts["pending"] += 1
                continue
            if problem:
                first_corrupt = first_corrupt or problem
                corrupt += 1
            if kind == "result":
                files.write("-o", raw)
                counts["results"] += 1
            else:
                files.write(err_role, raw)
                counts["errors"] += 1
    if corrupt:
        raise CorruptLines(
            f"{corrupt} stored line(s) of batch {batch_id} are not valid JSON "
            f"(first: {first_corrupt}); wrote them as internal_error error lines"
            + ("; the batch was not deleted" if delete else ""),
            {**counts, "corrupt": corrupt},
        )
    if delete:
        if counts["pending"]:
            raise BatchError(
                f"batch {batch_id}: {counts['pending']} line(s) have no result or error line "
                "yet: the files were written, the batch was not deleted"
            )
        _delete(conn, keys, batch_id, models_of(meta), int(meta.get(JOBS_FIELD, 0)))
    return counts


def _check_final(conn: Redis, keys: Keys, batch_id: str) -> None:
    """Raises BatchError unless every line of the batch is final: a result or error line
    for each, nothing queued or running, no spec-submit still enqueueing."""
    state = status(conn, keys, batch_id)
    c = state["request_counts"]
    waiting = [f"{c[k]} {k}" for k in ("running", "queued") if c[k]]
    if conn.exists(keys.submitting(batch_id)):
        waiting.append("a spec-submit still enqueueing")
    if waiting or state["status"] not in TERMINAL:
        what = "cancelled but not finished" if state["status"] == "cancelled" else "not finished"
        detail = f" ({', '.join(waiting)})" if waiting else ""
        raise BatchError(f"batch {batch_id} is {what}{detail}: collect without --delete, or wait")


def _problem(line: store.StoredLine) -> str | None:
    """Why a stored line cannot be written as a JSONL line (damaged compressed data, text
    that is not JSON, JSON that is not an object), else None."""
    if line.damage is not None:
        return f"not a valid stored line ({line.damage})"
    try:
        value = json.loads(line.text)
    except (ValueError, RecursionError) as exc:
        return f"not valid JSON ({type(exc).__name__}: {exc})"
    if not isinstance(value, dict):
        return f"not a JSON object (a {type(value).__name__})"
    return None


def _corrupt_line(conn: Redis, keys: Keys, batch_id: str, line_key: str, where: str) -> str:
    """The internal_error error line written in place of a damaged stored line."""
    line = store.line_number(conn, keys, batch_id, line_key)
    custom_id = custom_id_of(line_key)
    message = f"the stored line is damaged ({where}): run the line again in a new batch"
    return dumps(error_line(batch_id, line, custom_id, "internal_error", message))


def _delete(conn: Redis, keys: Keys, batch_id: str, models: list[str], jobs: int) -> None:
    """Remove every key of the batch and its RQ jobs (numbers 1..jobs). UNLINK: Redis
    frees a big hash in the background instead of stalling every client."""
    step = config.CHUNK_LINES
    for first in range(1, jobs + 1, step):
        with conn.pipeline(transaction=False) as pipe:
            for number in range(first, min(first + step, jobs + 1)):
                job = job_id(batch_id, number)
                pipe.unlink(keys.rq_job(job))
                for alias in models:
                    pipe.zrem(keys.rq_failed(alias), job)
            pipe.execute()
    with conn.pipeline() as pipe:
        pipe.unlink(*keys.batch_keys(batch_id))
        pipe.zrem(keys.batches, batch_id)
        pipe.execute()
