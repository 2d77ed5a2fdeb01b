"""One error style for every command (jobstore.options): `<command>: error: <message>`,
one line on stderr, nothing on stdout; exit 1 when the request cannot be done, 2 for
bad usage (click's), 3 when Redis cannot be reached."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from producer import cli
from reporting import report
from worker import cli as worker_cli

COMMANDS = {
    "spec-submit": cli.submit,
    "spec-status": cli.status,
    "spec-collect": cli.collect,
    "spec-retry": cli.retry,
    "spec-cancel": cli.cancel,
    "spec-report": report.main,
    "spec-worker": worker_cli.worker,
    "spec-run": worker_cli.run,
}

#: What an unknown batch's message ends with, in a Redis that recorded no batch: check
#: the id and the address, or Redis lost its data, and the fix.
LOST = (
    " has no record of any batch; check the id, the Redis URL and SPEC_KEY_PREFIX. If it "
    "was submitted to this Redis, Redis has lost its data (restarted without persistence?): "
    "re-submit its file with --batch-id nope"
)


def _invoke(command: str, *args: str):
    return CliRunner().invoke(COMMANDS[command], list(args), catch_exceptions=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jobs(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')
    return str(path)


def test_input_errors_exit_1_with_one_line(redis_env, tmp_path, jobs):
    missing = str(tmp_path / "nope.jsonl")
    prefix = redis_env.prefix
    cases = [
        (
            "spec-submit",
            [missing],
            f"spec-submit: error: {missing}: cannot read: No such file or directory",
        ),
        (
            "spec-submit",
            [jobs, "--batch-id", "a b"],
            "spec-submit: error: batch id must be 1 to 64 letters, digits, '_' or '-', got 'a b'",
        ),
        *(
            (
                name,
                ["nope", *extra],
                f"{name}: error: no such batch 'nope': this Redis (prefix '{prefix}'){LOST}",
            )
            for name, extra in [
                ("spec-status", []),
                ("spec-collect", ["-o", str(tmp_path / "r.jsonl")]),
                ("spec-retry", []),
                ("spec-cancel", []),
            ]
        ),
        (
            "spec-report",
            ["nope", "-o", str(tmp_path / "r.html")],
            f"spec-report: error: no such batch 'nope': this Redis (prefix '{prefix}'){LOST}",
        ),
        (
            "spec-report",
            ["--results", missing, "-o", str(tmp_path / "r.html")],
            f"spec-report: error: {missing}: cannot open: No such file or directory",
        ),
        (
            "spec-run",
            [jobs, "-o", str(tmp_path / "r.jsonl"), "--batch-id", "a b"],
            "spec-run: error: batch id must be 1 to 64 letters, digits, '_' or '-', got 'a b'",
        ),
    ]
    for name, args, message in cases:
        result = _invoke(name, *args)
        assert (result.exit_code, result.stderr, result.stdout) == (1, message + "\n", ""), name


def test_unreachable_redis_exits_3_with_one_line(tmp_path, jobs):
    port = _free_port()
    url = f"redis://:secret@127.0.0.1:{port}/0"
    for name, args in [
        ("spec-submit", [jobs]),
        ("spec-status", ["b"]),
        ("spec-collect", ["b", "-o", str(tmp_path / "r.jsonl")]),
        ("spec-retry", ["b"]),
        ("spec-cancel", ["b"]),
        ("spec-report", ["b", "-o", str(tmp_path / "r.html")]),
        ("spec-worker", ["--burst"]),
    ]:
        result = _invoke(name, *args, "--redis", url)
        assert result.exit_code == 3, (name, result.stderr)
        assert result.stderr.startswith(
            f"{name}: error: cannot reach Redis at redis://:***@127.0.0.1:{port}/0: "
        ), result.stderr
        assert len(result.stderr.splitlines()) == 1 and "secret" not in result.stderr


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("spec-submit", ["j.jsonl", "--result-ttl", "-1"], "Invalid value for '--result-ttl'"),
        ("spec-submit", ["j.jsonl", "-o", "r.jsonl"], "-o and --errors need --wait"),
        ("spec-status", ["b", "--watch", "--json"], "--watch and --json do not go together"),
        ("spec-collect", ["b"], "Missing option '-o' / '--output'"),
        ("spec-report", ["-o", "r.html"], "give either BATCH or --results FILE"),
        ("spec-worker", ["--alias", "a/b"], "not a model alias: 'a/b'"),
        ("spec-run", ["j.jsonl", "-o", "r.jsonl", "--batch", "0"], "Invalid value for '--batch'"),
    ],
)
def test_usage_errors_are_clicks_with_exit_2(name, args, message):
    result = _invoke(name, *args)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("Usage: ")
    last = result.stderr.splitlines()[-1]
    assert last.startswith("Error: ") and message in last, last
