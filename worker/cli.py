"""Console scripts of a machine that generates: spec-worker (queue) and spec-run (local).

Errors and exit codes follow jobstore.options: `<command>: error: <message>` on stderr;
0 done (spec-worker: also after a first SIGTERM, once the current job is finished);
1 the request could not be done (invalid job file, model not loadable); 2 bad usage;
3 Redis unreachable; 128 + signal number after a second stop signal (the running job
was put back in its queue).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

import click

from contract.stats import tokens_per_second
from jobstore import config
from jobstore.errors import BatchIdError, RedisUnavailable
from jobstore.keys import Keys, check_batch_id, new_batch_id
from jobstore.options import EXIT_REDIS, fail, pair_options, redis_option

log = logging.getLogger("specfleet.worker")


def _say(message: str) -> None:
    click.echo(message, err=True)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load_pair(name: str, target: str | None, draft: str | None):
    import engine  # MLX: only the machines that generate import it

    try:
        budget = config.prefix_cache_bytes()
    except ValueError as exc:
        fail(name, str(exc))
    try:
        pair = engine.load_pair(target, draft, prefix_cache_bytes=budget)
    except engine.EngineError as exc:
        fail(name, f"cannot load the model pair: {exc}")
    # Said once, at start-up; a warning where some state is prefilled in full every time.
    not_kept = pair.prefix is not None and pair.prefix.not_kept
    log.log(logging.WARNING if not_kept else logging.INFO, "%s", engine.prefix_line(pair))
    if config.acceptance_check():
        _check_acceptance(pair)
    return pair


def _check_acceptance(pair) -> None:
    """Said once, at start-up: a drafter whose drafts are (almost) never accepted is a
    warning with its likely causes (engine.acceptance_check). Never stops the worker."""
    from engine.acceptance_check import check_acceptance

    try:
        found = check_acceptance(pair)
    except Exception as exc:  # a check, not the work: the worker serves anyway
        log.warning("acceptance check could not run (serving anyway): %r", exc)
        return
    if found is not None:
        warning = found.warning()
        log.log(
            logging.WARNING if warning else logging.INFO,
            "acceptance check: %s",
            warning or found.summary(),
        )


@click.command()
@redis_option
@pair_options
@click.option(
    "--alias", metavar="NAME", help="Model alias to serve (default: the pair's name, e.g. demo)."
)
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--max-jobs",
    type=click.IntRange(min=1),
    metavar="N",
    help="Exit after taking N lines (a job of several lines is never split: at least N).",
)
@click.option("--name", metavar="NAME", help="Worker name (default: host.pid).")
@click.option(
    "--batch",
    "max_batch",
    default=1,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Lines decoded together: claims queued jobs while fewer than N lines run.",
)
@click.option(
    "--audit",
    "audit_rate",
    type=click.FloatRange(0, 1),
    default=0.0,
    metavar="RATE",
    help="Re-run this share of greedy requests target-only and count mismatches (e.g. 0.01).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def worker(
    redis_url, target, draft, alias, burst, max_jobs, name, max_batch, audit_rate, log_level
):
    """Serve one model alias from its queue: load the pair once, run jobs in this process."""
    import redis  # redis-py, rq and pydantic load in the commands, not for `--help`
    from rq.serializers import JSONSerializer

    from jobstore.connection import connect, warn_if_evicting
    from worker.audit import Auditor
    from worker.guard import job_class
    from worker.jobs import WorkerContext
    from worker.redisfull import WaitWhileFull
    from worker.rqworker import SpecWorker

    _setup_logging(log_level)
    if alias is not None and not config.ALIAS_PATTERN.match(alias):
        raise click.BadParameter(f"not a model alias: {alias!r}", param_hint="--alias")
    url = config.redis_url(redis_url)
    try:
        conn = connect(url)
    except RedisUnavailable as exc:
        fail("spec-worker", str(exc), EXIT_REDIS)
    # A full Redis is waited out like an outage: results are held, not dropped.
    probe_conn = connect(url, check=False, reconnect=False)
    probe_key = f"{Keys.default().prefix}:probe:{os.getpid()}"

    def probe() -> None:
        probe_conn.set(probe_key, 1, px=1000)

    conn.set_retry(
        WaitWhileFull(url, config.RECONNECT_BASE_S, config.reconnect_cap_s(), probe=probe)
    )
    pair = _load_pair("spec-worker", target, draft)
    alias = alias or pair.name
    keys = Keys.default()
    name = name or f"{socket.gethostname()}.{os.getpid()}"
    announce = _register(conn, keys, pair, alias, name)
    auditor = Auditor(audit_rate) if audit_rate else None
    context = WorkerContext(pair, alias, name, conn, keys, config.result_ttl_s(), auditor)
    queue = keys.queue_name(alias)
    warning = warn_if_evicting(conn)
    if warning:
        log.warning(warning)
    log.info(
        "worker %s serving model %s from queue %s at %s", name, alias, queue, config.redact(url)
    )
    log.info("pair: %s", pair.info())
    spec_worker = SpecWorker(
        [queue],
        name=name,
        connection=conn,
        serializer=JSONSerializer,
        job_class=job_class(context),
        context=context,
        refused_key=keys.refused,
        stats_key=keys.worker(name),
        max_batch=max_batch,
        announce=announce,
        worker_ttl=60,
        maintenance_interval=30,
    )
    crash = _CrashWatch()
    logging.getLogger("rq.worker").addFilter(crash)
    try:
        with context.line_store():  # its side thread stores lines that wait
            spec_worker.work(burst=burst, max_jobs=max_jobs, logging_level=log_level.upper())
    except redis.exceptions.ConnectionError as exc:
        if not spec_worker.stopping:
            raise
        # Asked to stop while Redis was away: a job it was running comes back through
        # its heartbeat expiring, like a lost worker's.
        log.warning("stopped while Redis at %s was unreachable: %s", config.redact(url), exc)
    late = _note_stop_signals()
    if spec_worker.cold_signum is not None:
        sys.exit(128 + spec_worker.cold_signum)
    if crash.message:
        fail("spec-worker", crash.message)
    if late and spec_worker.stopping:
        log.warning("second %s: stopping now", signal.Signals(late[0]).name)
        _exit_now(128 + late[0])
    _exit_now(0)


def _note_stop_signals() -> list[int]:
    """From now on a stop signal is only noted (in the list returned): the work is over."""
    late: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda n, _frame: late.append(n))
    return late


def _exit_now(code: int) -> None:
    """Exit with `code` once logs are written, without Python's shutdown: while it runs
    (freeing the model takes a while) the default signal handlers are back, and a second
    stop signal would kill the process without a word or its exit code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _CrashWatch(logging.Filter):
    """Notices RQ's work loop giving up ("..., quitting"): RQ then returns normally, but
    the process must not exit 0 as if its queue were done."""

    message: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "quitting" in record.getMessage():
            self.message = record.getMessage()
        return True


def _register(conn, keys: Keys, pair, alias: str, name: str) -> tuple[dict, str, dict]:
    """Tell producers what this alias is: context length and tokenizer (for the
    submit-time length check), and who serves it. Returns what the heartbeat writes
    again (SpecWorker's `announce`): the worker's fields, the alias's key and fields."""
    mapping = {
        "context_length": pair.context_length,
        "target": pair.target_path,
        "draft": pair.draft_path or "",
        "updated_at": f"{time.time():.3f}",
    }
    tokenizer_json = _tokenizer_json(pair)
    if tokenizer_json:
        mapping["tokenizer_json"] = tokenizer_json
    conn.hset(keys.model(alias), mapping=mapping)
    now = f"{time.time():.3f}"
    identity = {"model": alias, "host": socket.gethostname(), "pid": os.getpid()}
    with conn.pipeline() as pipe:
        pipe.hdel(keys.worker(name), "stopped_at")
        pipe.hset(keys.worker(name), mapping={**identity, "started_at": now, "last_seen": now})
        pipe.expire(keys.worker(name), config.WORKER_STATS_TTL_S)  # renewed by heartbeats
        pipe.execute()
    mapping.pop("updated_at")
    return identity, keys.model(alias), mapping


def _tokenizer_json(pair) -> str | None:
    backend = getattr(getattr(pair.tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    try:
        text = backend.to_str() if backend is not None else None
    except Exception:
        text = None
    if text is None:
        path = os.path.join(pair.target_path, "tokenizer.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
    return text if text and len(text) < 32 * 1024 * 1024 else None


@click.command()
@click.argument("jobs_file", metavar="JOBS.jsonl")
@click.option("-o", "--output", required=True, metavar="FILE", help="Results file to write.")
@click.option(
    "--errors", "errors_path", metavar="FILE", help="Error lines file (default: into -o)."
)
@pair_options
@click.option(
    "--model", metavar="ALIAS", help="Run every line on the loaded pair, whatever its model says."
)
@click.option(
    "--alias", metavar="NAME", help="Model alias written in results (default: the pair's name)."
)
@click.option(
    "--batch-id", metavar="ID", help="Batch id for line ids and derived seeds (default: a new one)."
)
@click.option(
    "--skip-invalid", is_flag=True, help="Run the valid lines; invalid ones become error lines."
)
@click.option(
    "--batch",
    "max_batch",
    default=16,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Requests decoded together (1: one at a time).",
)
def run(
    jobs_file, output, errors_path, target, draft, model, alias, batch_id, skip_invalid, max_batch
):
    """Run a job file in this process, without Redis: the same validation, engine and
    result lines as the queue."""
    from jobstore.jobfile import JobFileError, validate
    from worker.local import context_check, run_file

    _setup_logging("WARNING")
    try:
        batch_id = check_batch_id(batch_id) if batch_id else new_batch_id()
    except BatchIdError as exc:
        fail("spec-run", str(exc))
    pair = _load_pair("spec-run", target, draft)
    alias = alias or model or pair.name
    check = context_check(pair, alias)
    try:
        valid, invalid = validate(jobs_file, model, check, lambda e: _say(e.format(jobs_file)))
    except JobFileError as exc:
        fail("spec-run", str(exc))
    if invalid and not skip_invalid:
        fail(
            "spec-run",
            f"{jobs_file}: {invalid} invalid line(s), {valid} valid: nothing was run "
            "(fix them, or pass --skip-invalid to run the valid lines)",
        )
    if valid + invalid == 0:
        fail("spec-run", f"{jobs_file}: no requests (the file is empty)")
    out = open(output, "wb")
    errors_out = open(errors_path, "wb") if errors_path else out
    try:
        from reporting.progress import RunProgress

        with RunProgress(valid + invalid, batch_id, in_flight=max_batch, model=alias) as shown:
            summary = run_file(
                pair,
                alias,
                jobs_file,
                batch_id,
                out,
                errors_out,
                model or None,
                shown.print,
                max_batch=max_batch,
                on_summary=shown.update_run,
            )
    finally:
        out.close()
        if errors_out is not out:
            errors_out.close()
    sd = summary.stats.to_dict()
    rate = tokens_per_second(summary.completion_tokens, summary.seconds * 1000)
    _say(
        f"spec-run: batch {batch_id}: {summary.completed} completed, {summary.failed} failed "
        f"in {summary.seconds:.1f} s; {summary.completion_tokens} tokens, {rate:.1f} tokens/s; "
        f"acceptance {sd['draft_acceptance_rate']:.2f}, mean acceptance length "
        f"{sd['mean_acceptance_length']:.2f}; prompt tokens {summary.prompt_tokens}, "
        f"{summary.cached_tokens} reused from the prefix cache"
    )
