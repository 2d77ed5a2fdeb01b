"""Live progress of a batch: a rich display on a terminal, plain lines in logs.

`Progress` renders status objects (FORMATS.md's batch status shape) as they come:
on a terminal it redraws one panel in place (counts, bar, tokens/s, acceptance, ETA,
one row per worker); elsewhere it prints one plain line at most every `every_s`
seconds, and always the last one, so logs hold no control characters. `spec-status
--watch` and `spec-submit --wait` feed it from Redis (`follow`, given a fetch function); `spec-run` feeds it
from its own counters (`RunProgress`). No MLX here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from contract.limits import TERMINAL_STATUSES
from contract.stats import tokens_per_second

#: Without a terminal, at most one progress line per this many seconds (plus the last).
PLAIN_EVERY_S = 10.0

__all__ = [
    "Progress",
    "RunProgress",
    "follow",
    "is_finished",
    "plain_line",
    "render",
    "worker_text",
]


def is_finished(state: dict) -> bool:
    """True once nothing more will happen to the batch: a final status, nothing running."""
    return state["status"] in TERMINAL_STATUSES and state["request_counts"]["running"] == 0


def duration(seconds: float | None) -> str:
    """A short human duration: 42 s, 3 m 05 s, 2 h 07 m; "-" when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} m {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} m"


def _numbers(state: dict) -> dict[str, Any]:
    c, sd = state["request_counts"], state["speculative_decoding"]
    return {
        "done": c["completed"] + c["failed"],
        "total": c["total"],
        "completed": c["completed"],
        "failed": c["failed"],
        "running": c["running"],
        "queued": c["queued"],
        "tps": state["throughput_tokens_per_second"],
        "acceptance": sd["draft_acceptance_rate"],
        "mal": sd["mean_acceptance_length"],
        "eta": duration(state["eta_seconds"]),
    }


def _audit_text(state: dict) -> str | None:
    audit = state.get("audit") or {}
    if not audit.get("checked"):
        return None
    text = f"audit {audit['checked']} checked, {audit['mismatches']} mismatches"
    return text + (" (speculative output differed from target-only)" if audit["mismatches"] else "")


def _seen_ago(worker: dict, now: float) -> str | None:
    seen = worker.get("last_seen")
    return None if seen is None else duration(max(0.0, now - seen))


def worker_text(worker: dict, now: float | None = None) -> str:
    """One worker of a status object in words: counts, speed, and when it was last heard
    from; a quiet one (not heard from for longer than the heartbeat TTL while it holds
    lines or its batch is unfinished) says so in capitals."""
    now = time.time() if now is None else now
    parts = [f"{worker['completed']} completed"]
    if worker.get("failed"):
        parts.append(f"{worker['failed']} failed")
    if worker.get("running"):
        parts.append(f"{worker['running']} running")
    parts.append(f"{worker['tokens_per_second']:.1f} tok/s")
    ago = _seen_ago(worker, now)
    if worker.get("quiet"):
        parts.append(f"QUIET: not heard from for {ago}")
    elif worker.get("stopped"):
        parts.append("stopped")
    elif ago is not None:
        parts.append(f"last seen {ago} ago")
    return ", ".join(parts)


def plain_line(state: dict) -> str:
    """One line for logs: every number of the display, no control characters."""
    n = _numbers(state)
    parts = [
        f"batch {state['id']} {state['status']}: {n['done']}/{n['total']} done",
        f"{n['completed']} completed, {n['failed']} failed, {n['running']} running, "
        f"{n['queued']} queued",
        f"{n['tps']:.1f} tok/s",
        f"acceptance {n['acceptance']:.2f}",
        f"mean acceptance length {n['mal']:.2f}",
        f"ETA {n['eta']}",
    ]
    audit = _audit_text(state)
    if audit:
        parts.append(audit)
    workers = state.get("workers") or []
    if workers:
        parts.append("workers: " + ", ".join(_worker_plain(w) for w in workers))
    return "; ".join(parts)


def _worker_plain(w: dict) -> str:
    """A worker in a log line: what changes only when work is done (a line printed
    whenever something changed must not change every second)."""
    text = f"{w['name']} {w['completed']} completed {w['tokens_per_second']:.1f} tok/s"
    if w.get("running"):
        text += f" {w['running']} running"
    if w.get("quiet"):
        text += " QUIET"
    return text


def render(state: dict):
    """The terminal display of one status object (a rich renderable)."""
    n = _numbers(state)
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(f"batch {state['id']}", style="bold"),
        Text(state["status"], style=_STATUS_STYLE.get(state["status"], "")),
        Text(f"ETA {n['eta']}"),
    )
    bar = Table.grid(padding=(0, 2))
    bar.add_row(
        ProgressBar(total=max(n["total"], 1), completed=n["done"], width=50),
        Text(f"{n['done']}/{n['total']} done"),
    )
    failed = f"{n['failed']} failed"
    counts = Text(
        f"{n['completed']} completed  {failed}  {n['running']} running  {n['queued']} queued"
    )
    if n["failed"]:
        start = counts.plain.index(failed)
        counts.stylize("red", start, start + len(failed))
    speed = Text(
        f"{n['tps']:.1f} tok/s  acceptance {n['acceptance']:.2f}  "
        f"mean acceptance length {n['mal']:.2f}"
    )
    parts: list = [head, bar, counts, speed]
    audit = _audit_text(state)
    if audit:
        parts.append(Text(audit, style="bold red" if state["audit"]["mismatches"] else ""))
    workers = state.get("workers") or []
    if workers:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for name, justify in (
            ("worker", "left"),
            ("model", "left"),
            ("completed", "right"),
            ("failed", "right"),
            ("tok/s", "right"),
            ("running", "right"),
            ("last seen", "right"),
        ):
            table.add_column(name, justify=justify, style="dim" if name == "model" else None)
        now = time.time()
        for w in workers:
            ago = _seen_ago(w, now)
            seen = "stopped" if w.get("stopped") else (f"{ago} ago" if ago else "-")
            if w.get("quiet"):
                seen = Text(f"QUIET {ago}", style="bold red")
            table.add_row(
                w["name"],
                w.get("model") or "-",
                str(w["completed"]),
                str(w.get("failed", 0)),
                f"{w['tokens_per_second']:.1f}",
                str(w.get("running", 0)),
                seen,
            )
        parts.append(table)
    return Group(*parts)


_STATUS_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "in_progress": "cyan",
}


class Progress:
    """Shows status objects as they come; use as a context manager (or call close).

    On a terminal (`console.is_terminal`), one display redrawn in place; otherwise a
    plain line at most every `every_s` seconds when something changed, and the last
    state again on close if it was not printed.
    """

    def __init__(
        self,
        console: Console | None = None,
        file: IO[str] | None = None,
        every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console or Console(file=file, highlight=False)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.every_s = every_s
        self._clock = clock
        self._live: Live | None = None
        self._last_line: str | None = None
        self._printed_line: str | None = None
        self._printed_at: float | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, state: dict) -> None:
        """Show this status object (redraw, or maybe a plain line)."""
        if self.live:
            if self._live is None:
                self._live = Live(
                    render(state),
                    console=self.console,
                    auto_refresh=False,  # redrawn on each update: no thread
                )
                self._live.start(refresh=True)
            else:
                self._live.update(render(state), refresh=True)
            return
        line = plain_line(state)
        self._last_line = line
        now = self._clock()
        due = self._printed_at is None or now - self._printed_at >= self.every_s
        if due and line != self._printed_line:
            self._print_plain(line, now)

    def print(self, message: str) -> None:
        """A message above the display (or a plain line)."""
        if self._live is not None:
            self._live.console.print(message, markup=False, highlight=False)
        else:
            self.console.file.write(message + "\n")
            self.console.file.flush()

    def close(self) -> None:
        """Stop redrawing (the last display stays on screen), or print the last line."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._last_line is not None and self._last_line != self._printed_line:
            self._print_plain(self._last_line, self._clock())

    def _print_plain(self, line: str, now: float) -> None:
        self.console.file.write(line + "\n")
        self.console.file.flush()
        self._printed_line, self._printed_at = line, now


def follow(
    fetch: Callable[[], dict],
    progress: Progress,
    poll_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Show fetch() every poll_s seconds until the batch is finished; returns the last
    state. KeyboardInterrupt and fetch's errors propagate (the display is left as is)."""
    while True:
        state = fetch()
        progress.update(state)
        if is_finished(state):
            return state
        sleep(poll_s)


class RunProgress:
    """Progress of `spec-run` (no Redis): builds status objects from the run's counters.

    `update_run(summary)` takes anything with `lines`, `completed`, `failed`,
    `completion_tokens` and `stats` (engine.SpecStats: its `to_dict()` is used), as
    worker.local.RunSummary has; `total` is the number of lines of the file, and
    `in_flight` how many lines the run decodes at once (shown as running), `model` the
    alias it serves.
    """

    def __init__(
        self,
        total: int,
        batch_id: str,
        in_flight: int = 1,
        model: str | None = None,
        worker: str = "local",
        progress: Progress | None = None,
        clock: Callable[[], float] = time.monotonic,
        **progress_args,
    ):
        self.total = total
        self.batch_id = batch_id
        self.in_flight = in_flight
        self.model = model
        self.worker = worker
        progress_args.setdefault("file", sys.stderr)  # stdout may be a results file
        self.progress = progress or Progress(clock=clock, **progress_args)
        self._clock = clock
        self._started = clock()

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.progress.close()

    def state(self, summary) -> dict:
        """The status object (FORMATS.md shape) of a run so far."""
        elapsed = self._clock() - self._started
        done = summary.completed + summary.failed
        finished = done >= self.total
        rate = tokens_per_second(summary.completion_tokens, elapsed * 1000)
        eta = 0.0 if finished else (elapsed * (self.total - done) / done if done else None)
        running = min(self.in_flight, self.total - done)
        status = "in_progress"
        if finished:
            status = "completed" if summary.completed else "failed"
        return {
            "id": self.batch_id,
            "status": status,
            "request_counts": {
                "total": self.total,
                "queued": max(0, self.total - done - running),
                "running": max(0, running),
                "completed": summary.completed,
                "failed": summary.failed,
            },
            "usage": {"completion_tokens": summary.completion_tokens},
            "speculative_decoding": summary.stats.to_dict(),
            "throughput_tokens_per_second": rate,
            "eta_seconds": None if eta is None else round(eta, 1),
            "workers": [
                {
                    "name": self.worker,
                    "model": self.model,
                    "completed": summary.completed,
                    "failed": summary.failed,
                    "tokens_per_second": rate,
                }
            ],
        }

    def update_run(self, summary) -> None:
        """Show the run's counters now."""
        self.progress.update(self.state(summary))

    def print(self, message: str) -> None:
        """A per-line message above the display (spec-run's `progress` callback)."""
        self.progress.print(message)
