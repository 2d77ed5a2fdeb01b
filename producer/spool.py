"""The first pass of spec-submit: validate every line once, report every problem, and
keep each line's verdict in a temporary file for the second pass.

The second pass (producer.submit) enqueues from the spool and parses or validates no
line again, so a million-line file costs one validation per line, not two. Per
non-blank line the spool holds either what is queued (`Queued`: line key, line number,
custom_id, model alias, time limit, the request record as JSON) or why the line was
rejected (`Rejected`). It is an anonymous temporary file (in TMPDIR, about the size of
the job file), gone once closed: memory stays bounded whatever the file's size.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobstore import config
from jobstore.keys import custom_id_of, line_key
from jobstore.lines import dumps

if TYPE_CHECKING:
    from jobstore.jobfile import JobLine, LineError, Verdict


@dataclass(frozen=True)
class Queued:
    """A valid line, ready to be queued."""

    key: str
    line: int
    custom_id: str
    model: str
    timeout: int  # seconds the line may run (config.job_timeout_s)
    record: str  # the request record (JobLine.to_record) as JSON
    digest: str = ""  # request_digest of the record: what a re-submit compares
    rows: int = 1  # the rows it takes in a batch: its choices (n)

    @classmethod
    def of(cls, job: JobLine, default_model: str) -> Queued:
        """A validated line; it runs on `default_model` if it names no model."""
        rows = int(job.params.get("n", 1))
        timeout = config.job_timeout_s(job.params["max_tokens"], job.prompt_chars(), rows)
        key = line_key(job.custom_id, job.line)
        model = job.model or default_model
        record = job.to_record(model)
        digest = request_digest(record)
        return cls(key, job.line, job.custom_id, model, timeout, dumps(record), digest, rows)

    def stored(self, job: int) -> str:
        """The request record as stored in Redis: with its job's number, its timeout and
        its digest (the worker keeps the digest with the result; a re-submit compares
        it)."""
        digest = f',"digest":"{self.digest}"' if self.digest else ""
        return f'{self.record[:-1]},"job":{job},"timeout":{self.timeout}{digest}}}'


def request_digest(record: dict) -> str:
    """A short hash of what a line asks for (its request record without its line number,
    so a line that only moved is the same line): in its stored record while queued, with
    its result once answered (jobstore.lines.pack)."""
    asked = {k: v for k, v in record.items() if k != "line"}
    return hashlib.blake2b(dumps(asked).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Rejected:
    """A line that is not valid: it becomes an `invalid_request` error line."""

    key: str
    line: int
    custom_id: str | None
    message: str

    @classmethod
    def of(cls, verdict: Verdict) -> Rejected:
        """A line validation rejected."""
        custom_id = verdict.custom_id
        return cls(line_key(custom_id, verdict.line), verdict.line, custom_id, verdict.message())


class Spool:
    """Verdicts in a temporary file, read back in the file's order (any number of
    times). Use as a context manager, or close it."""

    def __init__(self):
        self._file = tempfile.TemporaryFile(prefix="spec-submit-")
        self.valid = 0
        self.invalid = 0
        self.rows = 0  # rows of its lines: a valid line's choices (n), a rejected one 1

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    # One line per entry. Queued: line number, timeout, rows, model alias, digest, the line
    # key as JSON and the record, tab-separated (an alias has no tab, JSON text no raw tab
    # or newline); the custom_id is the key's. Rejected: a JSON list of its fields.
    def add(self, entry: Queued | Rejected) -> None:
        if isinstance(entry, Queued):
            key = dumps(entry.key)
            line = (
                f"{entry.line}\t{entry.timeout}\t{entry.rows}\t{entry.model}\t{entry.digest}\t"
                f"{key}\t{entry.record}\n"
            )
            self.valid += 1
            self.rows += entry.rows
        else:
            line = dumps([entry.key, entry.line, entry.custom_id, entry.message]) + "\n"
            self.invalid += 1
            self.rows += 1
        self._file.write(line.encode())

    def __iter__(self) -> Iterator[Queued | Rejected]:
        self._file.flush()
        self._file.seek(0)
        for raw in self._file:
            text = raw.decode()
            if text.startswith("["):
                yield Rejected(*json.loads(text))
                continue
            number, timeout, rows, model, digest, key, record = text.rstrip("\n").split("\t", 6)
            key = json.loads(key)
            yield Queued(
                key, int(number), custom_id_of(key), model, int(timeout), record, digest, int(rows)
            )

    @property
    def lines(self) -> int:
        return self.valid + self.invalid


def spool_file(
    path: str,
    model_override: str | None,
    default_model: str,
    check: Callable[[JobLine], LineError | None] | None,
    on_error: Callable[[LineError], None],
) -> Spool:
    """Validate the whole file (every problem through on_error) into a new Spool; a
    line without a model runs on `default_model`. Raises JobFileError when the file
    cannot be read (the spool is closed then)."""
    from jobstore.jobfile import validate_lines  # pydantic: only to submit

    spool = Spool()
    try:
        for verdict in validate_lines(path, model_override, check):
            for error in verdict.errors:
                on_error(error)
            if verdict.job is None:
                spool.add(Rejected.of(verdict))
            else:
                spool.add(Queued.of(verdict.job, default_model))
    except BaseException:
        spool.close()
        raise
    return spool
