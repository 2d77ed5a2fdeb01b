"""Live progress: the renderer on a terminal, plain lines in logs, `spec-run`'s counters,
and `spec-status --watch` through a pseudo-terminal while a real worker runs a batch."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import time

import pytest
from click.testing import CliRunner
from conftest import script
from rich.console import Console

import engine
from producer import cli
from reporting.progress import Progress, RunProgress, duration, follow, plain_line

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def state(completed: int, failed: int = 0, running: int = 1, total: int = 4, **over) -> dict:
    done = completed + failed
    out = {
        "id": "b1",
        "status": "in_progress",
        "created_at": 0,
        "completed_at": None,
        "request_counts": {
            "total": total,
            "queued": total - done - running,
            "running": running,
            "completed": completed,
            "failed": failed,
        },
        "usage": {"prompt_tokens": 10, "completion_tokens": 40},
        "speculative_decoding": {"draft_acceptance_rate": 0.4567, "mean_acceptance_length": 2.31},
        "throughput_tokens_per_second": 123.456,
        "eta_seconds": 75.2,
        "workers": [
            {"name": "host.1", "model": "demo", "completed": completed, "failed": failed}
            | {"tokens_per_second": 61.5}
        ],
        "audit": {"checked": 0, "mismatches": 0},
    }
    out.update(over)
    return out


def test_terminal_display_redraws_with_every_number():
    console = Console(record=True, force_terminal=True, width=100, color_system="standard")
    with Progress(console=console) as shown:
        assert shown.live
        shown.update(state(1))
        first = console.export_text(clear=False)
        shown.update(state(3, failed=1, running=0, eta_seconds=0.0, status="completed"))
    text = console.export_text()
    assert "1/4 done" in first and "3/4 done" not in first
    assert "batch b1  in_progress  ETA 1 m 15 s" in first
    assert "1 completed  0 failed  1 running  2 queued" in first
    assert "123.5 tok/s  acceptance 0.46  mean acceptance length 2.31" in first
    assert re.search(r"host\.1\s+demo\s+1\s+0\s+61\.5", first)
    last = text[len(first) :]
    assert "4/4 done" in last and "batch b1  completed  ETA 0 s" in last
    assert "3 completed  1 failed  0 running  0 queued" in last
    assert re.search(r"host\.1\s+demo\s+3\s+1\s+61\.5", last)


def test_audit_counts_are_shown_only_once_something_was_audited():
    assert "audit" not in plain_line(state(1))
    line = plain_line(state(1, audit={"checked": 5, "mismatches": 1}))
    assert "; audit 5 checked, 1 mismatches (speculative output differed from target-only);" in line


def test_without_a_terminal_plain_lines_at_intervals_and_the_last_one():
    out, now = io.StringIO(), [0.0]
    with Progress(file=out, every_s=10, clock=lambda: now[0]) as shown:
        assert not shown.live
        for t, completed in [(0, 0), (1, 1), (5, 2), (11, 2), (12, 3)]:
            now[0] = t
            shown.update(state(completed))
    lines = out.getvalue().splitlines()
    # t=0 printed; 1 and 5 too soon; 11 printed (changed, 10 s later); 12 printed at close.
    assert [re.search(r"(\d)/4 done", x).group(1) for x in lines] == ["0", "2", "3"]
    assert "\x1b" not in out.getvalue()
    assert lines[0] == (
        "batch b1 in_progress: 0/4 done; 0 completed, 0 failed, 1 running, 3 queued; "
        "123.5 tok/s; acceptance 0.46; mean acceptance length 2.31; ETA 1 m 15 s; "
        "workers: host.1 0 completed 61.5 tok/s"
    )


def test_an_unchanged_state_is_not_printed_again():
    out, now = io.StringIO(), [0.0]
    with Progress(file=out, every_s=1, clock=lambda: now[0]) as shown:
        for t in range(5):
            now[0] = t
            shown.update(state(2))
    assert len(out.getvalue().splitlines()) == 1


@pytest.mark.parametrize(
    "seconds,text",
    [(None, "-"), (0, "0 s"), (59.4, "59 s"), (61, "1 m 01 s"), (7260, "2 h 01 m")],
)
def test_durations(seconds, text):
    assert duration(seconds) == text


def test_follow_stops_once_finished_and_nothing_runs():
    fetched = iter(
        [
            state(1),
            state(1, status="cancelled"),  # cancelled, one line still running: not yet
            state(4, running=0, status="completed"),
            state(4, running=0, status="completed"),  # never fetched
        ]
    )
    seen, naps = [], []

    class Recorder:
        def update(self, s):
            seen.append((s["status"], s["request_counts"]["completed"]))

    final = follow(lambda: next(fetched), Recorder(), 0.5, sleep=naps.append)
    assert seen == [("in_progress", 1), ("cancelled", 1), ("completed", 4)]
    assert naps == [0.5, 0.5] and final["status"] == "completed"


def test_spec_run_counters_become_a_status_object():
    class Summary:
        lines, completed, failed, completion_tokens = 3, 2, 1, 50
        stats = engine.SpecStats(drafter="model")

    Summary.stats.record_step(4, 2, 3)
    Summary.stats.record_step(4, 0, 1)
    now = [100.0]
    out = io.StringIO()
    run = RunProgress(total=5, batch_id="local1", clock=lambda: now[0], file=out)
    now[0] = 110.0
    s = run.state(Summary)
    assert s["request_counts"] == {
        "total": 5,
        "queued": 1,
        "running": 1,
        "completed": 2,
        "failed": 1,
    }
    assert s["throughput_tokens_per_second"] == 5.0
    assert s["eta_seconds"] == pytest.approx(20 / 3, abs=0.05)
    assert s["speculative_decoding"]["draft_acceptance_rate"] == 0.25
    assert s["speculative_decoding"]["mean_acceptance_length"] == 2.0
    wide = RunProgress(total=5, batch_id="local1", in_flight=4, clock=lambda: now[0])
    assert wide.state(Summary)["request_counts"]["running"] == 2  # only 2 lines left
    Summary.lines, Summary.completed = 5, 4
    assert wide.state(Summary)["status"] == "completed"
    assert wide.state(Summary)["eta_seconds"] == 0.0
    Summary.lines, Summary.completed = 3, 2
    with run:
        run.update_run(Summary)
        run.print("[3] line 3 c: 20 tokens")
    assert out.getvalue().splitlines() == [
        "batch local1 in_progress: 3/5 done; 2 completed, 1 failed, 1 running, 1 queued; "
        "5.0 tok/s; acceptance 0.25; mean acceptance length 2.00; ETA 7 s; "
        "workers: local 2 completed 5.0 tok/s",
        "[3] line 3 c: 20 tokens",
    ]


# --- spec-status --watch against a real Redis ------------------------------------------


def _submit(env, tmp_path, n: int, max_tokens: int) -> str:
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": max_tokens})
            + "\n"
            for i in range(n)
        )
    )
    batch = env.batch_id()
    done = env.run("spec-submit", str(path), "--batch-id", batch)
    assert done.returncode == 0, done.stderr
    return batch


class PtyCommand:
    """A console script whose stdin/stdout/stderr are a pseudo-terminal (100x30)."""

    def __init__(self, env, *args: str):
        import fcntl
        import struct
        import termios

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        child_env = {k: v for k, v in env.env.items() if k not in ("COLUMNS", "LINES")}
        child_env.update(TERM="xterm-256color")
        child_env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [script(args[0]), *args[1:]],
            env=child_env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            start_new_session=True,
        )
        os.close(slave)
        self.master = master
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def read_until(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; output so far:\n{self.text}")
            if not self._read(0.2) and self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}:\n{self.text}")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.05):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.text}")
        return self.proc.returncode

    def _read(self, wait_s: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], wait_s)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data
        return bool(data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self.master)


def test_watch_on_a_terminal_redraws_as_a_worker_completes_lines(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    batch = _submit(redis_env, tmp_path, n=4, max_tokens=24)
    watch = PtyCommand(redis_env, "spec-status", batch, "--watch")
    try:
        watch.read_until(lambda t: "0/4 done" in t, timeout=60)
        start_worker("--burst", *slow_pair_args)
        assert watch.wait(timeout=300) == 0
    finally:
        watch.close()
    text = watch.text
    assert "\x1b[" in watch.raw.decode(errors="replace")  # a live display, not lines
    done = [int(x) for x in re.findall(r"(\d)/4 done", text)]
    assert done[0] == 0 and done[-1] == 4
    assert done == sorted(done) and len(set(done)) >= 2, done
    assert f"batch {batch}  completed" in text
    assert re.search(r"\S+\s+demo\s+4\s+0\s+\d+\.\d", text)  # the worker's row


def test_watch_without_a_terminal_prints_plain_lines(redis_env, start_worker, tmp_path):
    from conftest import PAIR_ARGS

    batch = _submit(redis_env, tmp_path, n=2, max_tokens=3)
    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=180) == 0
    done = redis_env.run("spec-status", batch, "--watch", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith(
        f"batch {batch} completed: 2/2 done; 2 completed, 0 failed, 0 running, 0 queued; "
    )
    assert re.search(
        r"; \d+\.\d tok/s; acceptance \d\.\d\d; mean acceptance length \d\.\d\d; ETA 0 s; "
        r"workers: \S+ 2 completed \d+\.\d tok/s$",
        line,
    ), line


def test_ctrl_c_stops_watching_and_leaves_the_batch(redis_env, tmp_path):
    batch = _submit(redis_env, tmp_path, n=1, max_tokens=3)  # no worker: stays queued
    proc = subprocess.Popen(
        [script("spec-status"), batch, "--watch"],
        env=redis_env.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background (`cmd &` in a script)
        # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = proc.stdout.readline()  # watching has begun
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    out = first + out
    assert proc.returncode == 130
    assert out.startswith(f"batch {batch} queued: 0/1 done; ")
    assert err.splitlines()[0] == f"spec-status: stopped watching; batch {batch} goes on"
    assert "Traceback" not in err
    assert redis_env.conn.exists(redis_env.keys.batch(batch))


def test_watch_and_json_together_is_a_usage_error():
    result = CliRunner().invoke(cli.status, ["b", "--watch", "--json"])
    assert result.exit_code == 2
    assert "--watch and --json do not go together" in result.output
