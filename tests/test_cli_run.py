"""spec-run: the local mode, without Redis, on the demo pair."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PAIR_ARGS, script
from test_queue import comparable, read_jsonl, write_jobs


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPEC_REDIS_URL="redis://127.0.0.1:1/0")  # must not be used
    return subprocess.run(
        [script("spec-run"), *args, *PAIR_ARGS],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_invalid_file_runs_nothing(tmp_path):
    jobs = write_jobs(
        tmp_path / "jobs.jsonl",
        [
            {"custom_id": "a", "prompt": "x", "max_tokens": 2},
            {"custom_id": "a", "prompt": "y", "n": 129},
        ],
    )
    out = tmp_path / "out.jsonl"
    result = _run(jobs, "-o", str(out))
    assert result.returncode == 1
    assert result.stderr.splitlines()[-3:] == [
        f'{jobs}:2: custom_id: duplicate "a", first used on line 1',
        f"{jobs}:2: n: must be in [1, 128], got 129",
        f"spec-run: error: {jobs}: 1 invalid line(s), 1 valid: nothing was run "
        "(fix them, or pass --skip-invalid to run the valid lines)",
    ]
    assert not out.exists()


def test_skip_invalid_writes_every_line_in_input_order(tmp_path):
    lines = [
        {"custom_id": "a", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0.7},
        {"custom_id": "bad", "prompt": "x", "top_p": 0},
        {
            "custom_id": "b",
            "messages": [{"role": "user", "content": "你好 🍵"}],
            "max_tokens": 3,
            "model": "elsewhere",
        },
        {"custom_id": "c", "messages": [{"role": "user", "content": "你好 🍵"}], "max_tokens": 3},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = _run(jobs, "-o", str(out), "--skip-invalid", "--batch-id", "local1")
    assert result.returncode == 0, result.stderr
    written = read_jsonl(out)
    assert [(x["custom_id"], x["error"] and x["error"]["code"]) for x in written] == [
        ("a", None),
        ("bad", "invalid_request"),
        ("b", "model_not_served"),
        ("c", None),
    ]
    assert written[0]["id"] == "local1-1" and written[0]["response"]["body"]["seed"] is not None
    assert written[2]["error"]["message"] == (
        "this run serves model 'demo', the line asks for 'elsewhere' (pass --model demo to run every line on it)"
    )
    assert "spec-run: batch local1: 2 completed, 2 failed" in result.stderr

    # Same batch id, same file: the same lines (sampled ones too, by their derived seed).
    out2, errors2 = tmp_path / "out2.jsonl", tmp_path / "errors2.jsonl"
    again = _run(
        jobs, "-o", str(out2), "--errors", str(errors2), "--skip-invalid", "--batch-id", "local1"
    )
    assert again.returncode == 0, again.stderr
    assert [comparable(x) for x in read_jsonl(out2)] == [
        comparable(written[0]),
        comparable(written[3]),
    ]
    assert [json.dumps(x) for x in read_jsonl(errors2)] == [
        json.dumps(written[1]),
        json.dumps(written[2]),
    ]
