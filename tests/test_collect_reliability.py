"""spec-collect, spec-status and spec-report against a real redis-server when the output
cannot be written or the batch's state in Redis is damaged: one `error:` line, exit 1,
no traceback, no temporary file left, no line that is not JSON, nothing deleted that
was not final and written."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from click.testing import CliRunner
from rq.registry import StartedJobRegistry
from test_queue import read_jsonl
from test_queue_store import _fake_result, _submit_lines

from jobstore import store
from jobstore.lines import dumps
from producer import cli
from reporting import report


def _finished_batch(redis_env, tmp_path, n: int = 3, pad: int = 0) -> str:
    """A batch of n lines, every one with a result line (padded by `pad` bytes)."""
    batch = _submit_lines(redis_env, tmp_path, n)
    for i in range(n):
        line = json.loads(_fake_result(batch, i))
        line["response"]["body"] = {"text": "x" * pad}
        store.store_line(redis_env.conn, redis_env.keys, batch, f"c:r{i}", dumps(line), ok=True)
    return batch


def _run(command, *args: str):
    result = CliRunner().invoke(command, list(args))
    assert isinstance(result.exception, SystemExit | None), result.exception
    return result


def _leftovers(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.startswith(".spec-collect-"))


# --- point 5: output files ------------------------------------------------------------


def _read_only(tmp_path):
    path = tmp_path / "kept.jsonl"
    path.write_text("old\n")
    path.chmod(0o444)
    return str(path), f"-o {path}: the file is read-only"


def _directory(tmp_path):
    return str(tmp_path), f"-o {tmp_path}: is a directory, not a file"


def _no_directory(tmp_path):
    return "/nonexistent/dir/x", "-o /nonexistent/dir/x: directory /nonexistent/dir does not exist"


def _proc(tmp_path):
    return "/proc/version", "-o /proc/version: the file is read-only"


def _device(tmp_path):
    return "/dev/null", "-o /dev/null: not a regular file"  # never renamed over, even by root


@pytest.mark.parametrize("case", [_no_directory, _proc, _directory, _read_only, _device])
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(redis_env, tmp_path, case):
    batch = _finished_batch(redis_env, tmp_path)
    path, message = case(tmp_path)
    before = open("/proc/version").read()
    result = _run(cli.collect, batch, "-o", path, "--delete")
    assert (result.exit_code, result.stderr) == (1, f"spec-collect: error: {message}\n")
    assert _leftovers(tmp_path) == []
    assert redis_env.conn.exists(redis_env.keys.batch(batch))  # nothing deleted
    assert open("/proc/version").read() == before
    if case is _read_only:
        assert open(path).read() == "old\n"


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs: collect's files do not fit. Skipped where mount is not allowed."""
    where = tmp_path / "full"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_is_one_line_and_leaves_the_old_files_and_no_temporary(
    redis_env, tmp_path, full_disk
):
    batch = _finished_batch(redis_env, tmp_path, n=40, pad=4000)  # 160 KB of results
    out, errors = full_disk / "r.jsonl", full_disk / "e.jsonl"
    out.write_text("old results\n")
    result = redis_env.run("spec-collect", batch, "-o", str(out), "--errors", str(errors))
    assert (result.returncode, result.stderr) == (
        1,
        f"spec-collect: error: -o {out}: cannot write: No space left on device; "
        "the file was left as it was\n",
    )
    assert sorted(os.listdir(full_disk)) == ["r.jsonl"]
    assert out.read_text() == "old results\n"


def test_error_lines_are_not_written_over_the_results(redis_env, tmp_path, monkeypatch):
    batch = _finished_batch(redis_env, tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.jsonl").symlink_to("same.jsonl")
    (tmp_path / "same.jsonl").write_text("")
    os.link(tmp_path / "same.jsonl", tmp_path / "hard.jsonl")
    names = ("same.jsonl", str(tmp_path / "same.jsonl"), "link.jsonl", "./same.jsonl", "hard.jsonl")
    for errors in names:
        result = _run(cli.collect, batch, "-o", "same.jsonl", "--errors", errors, "--delete")
        assert (result.exit_code, result.stderr) == (
            1,
            f"spec-collect: error: -o same.jsonl and --errors {errors} are the same file: "
            "give --errors another file, or leave it out to write error lines into -o\n",
        ), errors
    assert (tmp_path / "same.jsonl").read_text() == ""
    assert redis_env.conn.exists(redis_env.keys.batch(batch))
    result = _run(cli.collect, batch, "-o", "same.jsonl", "--errors", "e.jsonl", "--delete")
    assert result.exit_code == 0, result.stderr
    assert len(read_jsonl("same.jsonl")) == 3 and read_jsonl("e.jsonl") == []


def test_a_symlinked_output_is_written_through_and_keeps_its_mode(redis_env, tmp_path):
    batch = _finished_batch(redis_env, tmp_path)
    real = tmp_path / "data" / "results.jsonl"
    real.parent.mkdir()
    real.write_text("old\n")
    real.chmod(0o640)
    link = tmp_path / "results.jsonl"
    link.symlink_to(real)
    result = _run(cli.collect, batch, "-o", str(link))
    assert (result.exit_code, result.stderr) == (0, f"wrote 3 result(s) to {link}\n")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert [x["custom_id"] for x in read_jsonl(real)] == ["r0", "r1", "r2"]
    assert real.stat().st_mode & 0o777 == 0o640
    assert _leftovers(tmp_path) == [] and _leftovers(real.parent) == []


def _take_first_job(redis_env, batch: str) -> tuple[str, str]:
    """Do what a worker does when it starts a job (RQ 3: out of the queue, into the
    started registry as `<job id>:<execution id>`); returns (registry key, member)."""
    conn, queue = redis_env.conn, redis_env.keys.queue_name("demo")
    job_id = conn.lpop(f"rq:queue:{queue}").decode()
    assert job_id == f"{batch}-j1"  # the first line's job (a small file: a line per job)
    conn.hset(f"rq:job:{job_id}", "status", "started")
    registry = StartedJobRegistry(queue, connection=conn)
    member = f"{job_id}:exec1"
    conn.zadd(registry.key, {member: time.time() + 600})
    return registry.key, member


def test_delete_after_cancel_waits_for_the_running_lines(redis_env, tmp_path):
    batch = _submit_lines(redis_env, tmp_path, 3)
    registry, member = _take_first_job(redis_env, batch)
    cancelled = _run(cli.cancel, batch)
    assert cancelled.stderr == (
        f"batch {batch}: cancelled 2 waiting line(s); 1 running will finish (a running job's "
        "lines not started yet are cancelled instead)\n"
    )
    out = tmp_path / "r.jsonl"
    refused = redis_env.run("spec-collect", batch, "-o", str(out), "--delete")
    assert (refused.returncode, refused.stderr) == (
        1,
        f"spec-collect: error: batch {batch} is cancelled but not finished (1 running): "
        "collect without --delete, or wait\n",
    )
    assert not out.exists() and redis_env.conn.exists(redis_env.keys.batch(batch))

    # The running line finishes (its result stored, its job out of the started registry).
    store.store_line(redis_env.conn, redis_env.keys, batch, "c:r0", _fake_result(batch, 0), ok=True)
    redis_env.conn.zrem(registry, member)
    collected = redis_env.run("spec-collect", batch, "-o", str(out), "--delete")
    assert collected.returncode == 0, collected.stderr
    lines = read_jsonl(out)
    assert [(x["custom_id"], x["error"] and x["error"]["code"]) for x in lines] == [
        ("r0", None),
        ("r1", "cancelled"),
        ("r2", "cancelled"),
    ]
    assert not redis_env.conn.exists(redis_env.keys.batch(batch))


# --- point 6: damaged batch state -----------------------------------------------------


@pytest.mark.parametrize(
    "key,field,value,problem",
    [
        ("", "completed", "abc", "expected an integer, got 'abc'"),
        ("", "sd:num_spec_steps", "1.5", "expected an integer, got '1.5'"),
        ("", "started_at", "yesterday", "expected a Unix time, got 'yesterday'"),
        ("", "sd:hist:x", "1", "position 'x' is not a number"),
        ("", "audit_checked", "", "expected an integer, got ''"),
        (":workers", "completed:w1", "many", "expected an integer, got 'many'"),
        (":workers", "completed", "1", "expected <counter>:<worker>"),
    ],
)
def test_a_damaged_counter_is_one_line_naming_key_and_field(
    redis_env, tmp_path, key, field, value, problem
):
    batch = _finished_batch(redis_env, tmp_path)
    name = redis_env.keys.batch(batch) + key
    redis_env.conn.hset(name, field, value)
    expected = f"error: key {name} field {field}: {problem}\n"
    runs = [(cli.status, [batch]), (cli.status, [batch, "--json"])]
    if not key:  # collect and cancel read the batch hash, not the per-worker one
        runs += [(cli.collect, [batch, "-o", str(tmp_path / "r.jsonl")]), (cli.cancel, [batch])]
    for command, args in runs:
        result = _run(command, *args)
        assert (result.exit_code, result.stderr) == (1, f"spec-{command.name}: {expected}")
    assert not (tmp_path / "r.jsonl").exists()


def test_a_key_of_the_wrong_type_is_one_line_for_status_collect_and_report(redis_env, tmp_path):
    batch = _finished_batch(redis_env, tmp_path)
    results = redis_env.keys.results(batch)
    redis_env.conn.delete(results)
    redis_env.conn.set(results, "oops")
    expected = f"error: key {results}: holds a string, expected a hash\n"
    for command, args in [
        (cli.status, [batch]),
        (cli.collect, [batch, "-o", str(tmp_path / "r.jsonl")]),
    ]:
        result = _run(command, *args)
        assert (result.exit_code, result.stderr) == (1, f"spec-{command.name}: {expected}")
    page = tmp_path / "report.html"
    result = _run(report.main, batch, "-o", str(page))
    assert (result.exit_code, result.stderr) == (
        1,
        f"spec-report: error: batch {batch}: {expected[7:]}",
    )
    # RQ's own keys too: the started registry of the batch's queue.
    redis_env.conn.delete(results)
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    redis_env.conn.set(registry.key, "oops")
    result = _run(cli.status, batch)
    assert (result.exit_code, result.stderr) == (
        1,
        f"spec-status: error: key {registry.key}: WRONGTYPE Operation against a key holding "
        "the wrong kind of value\n",
    )


def test_a_non_json_line_is_written_as_an_internal_error_line(redis_env, tmp_path):
    batch = _submit_lines(redis_env, tmp_path, 3)
    conn, keys = redis_env.conn, redis_env.keys
    store.store_line(conn, keys, batch, "c:r0", _fake_result(batch, 0), ok=True)
    store.store_line(conn, keys, batch, "c:r1", '{"id": "truncated', ok=True)
    store.store_line(conn, keys, batch, "c:r2", "[1, 2]", ok=False)
    out, errors = tmp_path / "r.jsonl", tmp_path / "e.jsonl"
    result = redis_env.run(
        "spec-collect", batch, "-o", str(out), "--errors", str(errors), "--delete"
    )
    where = f"key {keys.results(batch)} field c:r1"
    assert (result.returncode, result.stderr) == (
        1,
        f"wrote 1 result(s) to {out} and 2 error line(s) to {errors}\n"
        f"spec-collect: error: 2 stored line(s) of batch {batch} are not valid JSON (first: "
        f"{where}: not valid JSON (JSONDecodeError: Unterminated string starting at: line 1 "
        "column 8 (char 7))); wrote them as internal_error error lines; the batch was not "
        "deleted\n",
    )
    assert [x["custom_id"] for x in read_jsonl(out)] == ["r0"]
    lines = read_jsonl(errors)  # every line is JSON
    assert [(x["custom_id"], x["error"]["code"], x["error"]["line"]) for x in lines] == [
        ("r1", "internal_error", 2),
        ("r2", "internal_error", 3),
    ]
    assert lines[1]["error"]["message"] == (
        f"the stored line is damaged (key {keys.errors(batch)} field c:r2: not a JSON object "
        "(a list)): run the line again in a new batch"
    )
    assert conn.exists(keys.batch(batch))

    page = tmp_path / "report.html"
    shown = _run(report.main, batch, "-o", str(page))
    assert shown.exit_code == 0, shown.stderr
    assert shown.stderr.splitlines() == [
        f"spec-report: warning: {where}: damaged stored line (Unterminated string starting at: "
        "line 1 column 8 (char 7)); counted as an internal_error line",
        f"spec-report: warning: key {keys.errors(batch)} field c:r2: damaged stored line (not a "
        "result or error line (no custom_id)); counted as an internal_error line",
        f"wrote {page}: 3 requests, 2 failed, 0 completion tokens",
    ]
    assert "internal_error" in page.read_text()


def test_a_request_record_that_cannot_be_parsed_is_named_by_retry(redis_env, tmp_path):
    batch = _submit_lines(redis_env, tmp_path, 2)
    conn, keys = redis_env.conn, redis_env.keys
    assert _run(cli.cancel, batch).exit_code == 0  # both lines get an error line
    conn.hset(keys.requests(batch), "c:r1", "{not json")
    status = _run(cli.status, batch)
    assert status.exit_code == 0 and "2 failed" in status.stdout
    result = _run(cli.retry, batch)
    assert (result.exit_code, result.stderr) == (
        1,
        f"spec-retry: error: key {keys.requests(batch)} field c:r1: not a request record "
        "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1))\n",
    )
    assert conn.hlen(keys.errors(batch)) == 2  # nothing was changed


@pytest.mark.parametrize(
    "body,problem",
    [
        ({"created": float("nan")}, "ValueError: a time that is not a finite number"),
        ({"usage": {"prompt_tokens": 1e400}}, "OverflowError: cannot convert float infinity"),
        ({"metrics": {"speculative_decoding": {"acceptance_histogram": "xx"}}}, "ValueError"),
        ([1], "AttributeError: 'list' object has no attribute 'get'"),
    ],
)
def test_report_counts_a_result_it_cannot_sum_as_internal_error(redis_env, tmp_path, body, problem):
    batch = _finished_batch(redis_env, tmp_path, n=2)
    conn, keys = redis_env.conn, redis_env.keys
    bad = json.loads(_fake_result(batch, 1))
    bad["response"]["body"] = body
    conn.hset(keys.results(batch), "c:r1", json.dumps(bad))
    page = tmp_path / "report.html"
    shown = _run(report.main, batch, "-o", str(page))
    assert shown.exit_code == 0, shown.stderr
    warning, wrote = shown.stderr.splitlines()
    assert warning.startswith(
        f"spec-report: warning: key {keys.results(batch)} field c:r1: damaged stored line "
        f"(not a result or error line ({problem}"
    )
    assert wrote == f"wrote {page}: 2 requests, 1 failed, 0 completion tokens"
