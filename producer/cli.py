"""Console scripts of a machine that submits and collects: spec-submit, spec-status,
spec-collect, spec-retry, spec-cancel. No MLX here.

Errors and exit codes follow jobstore.options: `<command>: error: <message>` on stderr;
1 the request could not be done (invalid job file, unknown batch), 2 bad usage, 3 Redis
unreachable, 130 Ctrl-C while watching.
"""

from __future__ import annotations

import json
import sys

import click

from jobstore import config
from jobstore.keys import Keys, check_batch_id, new_batch_id
from jobstore.options import fail, friendly_errors, redis_option
from producer.errors import BatchError, CorruptLines, SubmitError

# What talks to Redis (redis-py, rq), producer.spool (pydantic) and reporting.progress
# (rich) is imported by the commands that use it: `--help` loads none of them.


def _connect(redis_url: str | None):
    from jobstore.connection import connect

    return connect(redis_url)


def _warn_if_evicting(conn) -> None:
    from jobstore.connection import warn_if_evicting

    warning = warn_if_evicting(conn)
    if warning:
        _say(f"warning: {warning}")


def _status(conn, keys, batch_id: str) -> dict:
    from producer.status import status

    return status(conn, keys, batch_id)


def _collect(conn, keys, batch_id: str, *args):
    from producer.collect import collect

    return collect(conn, keys, batch_id, *args)


def _say(message: str) -> None:
    click.echo(message, err=True)


def _follow_hint(batch_id: str, redis_url: str | None) -> str:
    where = f" --redis {config.redact(redis_url)}" if redis_url else ""
    return (
        f"follow it:  spec-status {batch_id}{where}\n"
        f"collect it: spec-collect {batch_id}{where} -o results.jsonl"
    )


@click.command()
@click.argument("jobs_file", metavar="JOBS.jsonl")
@redis_option
@click.option(
    "--model",
    metavar="ALIAS",
    help="Run every line on this model alias (overrides the lines' model).",
)
@click.option(
    "--batch-id", metavar="ID", help="Batch id to use; re-submitting one skips lines already done."
)
@click.option(
    "--skip-invalid", is_flag=True, help="Enqueue the valid lines; invalid ones become error lines."
)
@click.option(
    "--result-ttl",
    type=click.IntRange(min=0),
    metavar="SECONDS",
    help="Delete the batch from Redis this long after its last write (0: keep until "
    "spec-collect --delete) [default: $SPEC_RESULT_TTL_S, else keep].",
)
@click.option(
    "--changed",
    type=click.Choice(["rerun", "keep"]),
    help="Lines already answered under their custom_id with another request: run them "
    "again, their old answers replaced (rerun), or keep the old answers (keep) "
    "[default: refuse the submission].",
)
@click.option("--wait", is_flag=True, help="Wait until the batch is finished.")
@click.option("-o", "--output", metavar="FILE", help="With --wait: write the results here.")
@click.option(
    "--errors",
    "errors_path",
    metavar="FILE",
    help="With --wait: write error lines here (default: into -o).",
)
@friendly_errors("spec-submit", BatchError, SubmitError)
def submit(
    jobs_file,
    redis_url,
    model,
    batch_id,
    skip_invalid,
    result_ttl,
    changed,
    wait,
    output,
    errors_path,
):
    """Validate JOBS.jsonl ("-": standard input) and enqueue its lines as one batch.

    Every problem is printed as FILE:LINE: field: message. With any invalid line
    nothing is enqueued (exit 1) unless --skip-invalid. Prints the batch id on stdout.
    """
    if (output or errors_path) and not wait:
        raise click.UsageError("-o and --errors need --wait (or use spec-collect later)")
    if model is not None and not config.ALIAS_PATTERN.match(model):
        raise click.BadParameter(f"not a model alias: {model!r}", param_hint="--model")
    batch_id = check_batch_id(batch_id) if batch_id else new_batch_id()
    conn = _connect(redis_url)
    keys = Keys.default()
    from producer.spool import spool_file
    from producer.submit import enqueue_file
    from producer.tokencount import ContextChecker

    checker = ContextChecker(conn, keys, model or config.DEFAULT_MODEL)
    shown = "stdin" if jobs_file == "-" else jobs_file  # "-" reads standard input

    with spool_file(
        jobs_file, model, config.DEFAULT_MODEL, checker, lambda e: _say(e.format(shown))
    ) as spool:
        valid, invalid = spool.valid, spool.invalid
        if invalid and not skip_invalid:
            fail(
                "spec-submit",
                f"{shown}: {invalid} invalid line(s), {valid} valid: nothing was "
                "enqueued (fix them, or pass --skip-invalid to run the valid lines)",
            )
        if valid + invalid == 0:
            fail("spec-submit", f"{shown}: no requests (the file is empty)")
        report = enqueue_file(
            conn,
            keys,
            spool,
            shown,
            batch_id,
            result_ttl,
            total_lines=spool.lines,
            total_rows=spool.rows,
            changed=changed or "refuse",
        )
    click.echo(batch_id)
    parts = [f"{report.enqueued} enqueued"]
    if report.invalid:
        parts.append(f"{report.invalid} invalid (error lines)")
    if report.already_done:
        parts.append(f"{report.already_done} already done")
    if report.already_pending:
        parts.append(f"{report.already_pending} already queued or running")
    if report.replaced:
        parts.append(f"{report.replaced} changed (old answers replaced)")
    if report.kept_changed:
        parts.append(f"{report.kept_changed} changed (old answers kept)")
    models = ", ".join(f"{alias} ({n})" for alias, n in sorted(report.models.items()))
    _say(
        f"batch {batch_id}: {report.lines} lines: {', '.join(parts)}"
        + (f"; models: {models}" if models else "")
    )
    for alias in report.models:
        if not conn.exists(keys.model(alias)):
            _say(
                f"note: no worker has served model {alias!r} yet; its jobs wait for `spec-worker --alias {alias}`"
            )
    _warn_if_evicting(conn)
    if not wait:
        _say(_follow_hint(batch_id, redis_url))
        return
    final = _watch(conn, keys, batch_id, sys.stderr, "spec-submit", redis_url)
    if output:
        counts = _collect(conn, keys, batch_id, output, errors_path)
        _say(_collected(counts, output, errors_path))
    counts = final["request_counts"]
    _say(
        f"batch {batch_id} {final['status']}: {counts['completed']} completed, {counts['failed']} failed"
    )


def _watch(conn, keys, batch_id: str, stream, name: str, redis_url: str | None) -> dict:
    """Show the batch's progress on stream until it is finished; returns the last status.
    Ctrl-C stops watching (exit 130); the batch goes on."""
    from reporting import progress

    shown = progress.Progress(file=stream)
    try:
        with shown:
            return progress.follow(lambda: _status(conn, keys, batch_id), shown, config.WAIT_POLL_S)
    except KeyboardInterrupt:
        _say(f"{name}: stopped watching; batch {batch_id} goes on")
        _say(_follow_hint(batch_id, redis_url))
        sys.exit(130)


def _collected(counts: dict, output: str, errors_path: str | None) -> str:
    text = f"wrote {counts['results']} result(s) to {output}"
    if errors_path:
        text += f" and {counts['errors']} error line(s) to {errors_path}"
    elif counts["errors"]:
        text += f" (including {counts['errors']} error line(s))"
    if counts["pending"]:
        text += f"; {counts['pending']} line(s) not finished yet"
    return text


@click.command()
@click.argument("batch_id", metavar="BATCH")
@redis_option
@click.option("--json", "as_json", is_flag=True, help="Print the status object (FORMATS.md).")
@click.option(
    "--watch",
    is_flag=True,
    help="Follow the batch until it is finished (live on a terminal, else a line at intervals).",
)
@friendly_errors("spec-status", BatchError)
def status(batch_id, redis_url, as_json, watch):
    """Show a batch's progress: counts, throughput, acceptance, ETA, workers, audit.

    With --watch, exits 0 once the batch is finished, 130 on Ctrl-C.
    """
    if watch and as_json:
        raise click.UsageError("--watch and --json do not go together (poll --json instead)")
    conn = _connect(redis_url)
    keys = Keys.default()
    _warn_if_evicting(conn)
    if watch:
        _watch(conn, keys, batch_id, sys.stdout, "spec-status", redis_url)
        return
    state = _status(conn, keys, batch_id)
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    from reporting.progress import worker_text

    c, sd = state["request_counts"], state["speculative_decoding"]
    choices = state["choices"]["completed"]
    eta = "-" if state["eta_seconds"] is None else f"{state['eta_seconds']:.0f} s"
    click.echo(f"batch {state['id']}: {state['status']}")
    click.echo(
        f"  requests: {c['total']} total, {c['queued']} queued, {c['running']} running, "
        f"{c['completed']} completed, {c['failed']} failed"
        + (f" ({choices} choices)" if choices != c["completed"] else "")
    )
    click.echo(
        f"  tokens: {state['usage']['prompt_tokens']} prompt "
        f"({state['usage'].get('cached_prompt_tokens', 0)} reused from prefix caches), "
        f"{state['usage']['completion_tokens']} completion; "
        f"{state['throughput_tokens_per_second']:.1f} tok/s; ETA {eta}"
    )
    click.echo(
        f"  speculative decoding: drafter {sd['drafter']}, acceptance "
        f"{sd['draft_acceptance_rate']:.2f}, mean acceptance length {sd['mean_acceptance_length']:.2f}"
    )
    audit = state["audit"]
    if audit["checked"]:
        click.echo(
            f"  audit: {audit['checked']} checked against target-only, "
            f"{audit['mismatches']} mismatches"
            + (
                " (speculative output differed: see the workers' logs)"
                if audit["mismatches"]
                else ""
            )
        )
    for w in state["workers"]:
        click.echo(f"  worker {w['name']} ({w['model']}): {worker_text(w)}")


@click.command()
@click.argument("batch_id", metavar="BATCH")
@redis_option
@click.option("-o", "--output", required=True, metavar="FILE", help="Results file to write.")
@click.option(
    "--errors", "errors_path", metavar="FILE", help="Error lines file (default: into -o)."
)
@click.option(
    "--order", type=click.Choice(["input", "completion"]), default="input", show_default=True
)
@click.option(
    "--delete",
    is_flag=True,
    help="Delete the batch from Redis once written (only when every line is final: "
    "nothing queued or running).",
)
@friendly_errors("spec-collect", BatchError)
def collect(batch_id, redis_url, output, errors_path, order, delete):
    """Write a batch's result lines (and error lines) to files."""
    conn = _connect(redis_url)
    try:
        counts = _collect(conn, Keys.default(), batch_id, output, errors_path, order, delete)
    except CorruptLines as exc:
        _say(_collected(exc.counts, output, errors_path))
        raise
    _say(_collected(counts, output, errors_path) + ("; deleted the batch" if delete else ""))


@click.command()
@click.argument("batch_id", metavar="BATCH")
@redis_option
@friendly_errors("spec-retry", BatchError)
def retry(batch_id, redis_url):
    """Queue again the lines of a batch that ended in an error line."""
    from producer.retry import retry as retry_batch

    conn = _connect(redis_url)
    n = retry_batch(conn, Keys.default(), batch_id)
    _say(f"batch {batch_id}: re-queued {n} failed line(s)")


@click.command()
@click.argument("batch_id", metavar="BATCH")
@redis_option
@friendly_errors("spec-cancel", BatchError)
def cancel(batch_id, redis_url):
    """Cancel a batch: waiting lines are removed (error code `cancelled`); running ones finish."""
    from producer.cancel import cancel as cancel_batch

    conn = _connect(redis_url)
    keys = Keys.default()
    n = cancel_batch(conn, keys, batch_id)
    running = _status(conn, keys, batch_id)["request_counts"]["running"]
    note = " (a running job's lines not started yet are cancelled instead)" if running else ""
    _say(f"batch {batch_id}: cancelled {n} waiting line(s); {running} running will finish{note}")
