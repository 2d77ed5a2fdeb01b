"""Markdown output: tables, target lines, machine facts, and named sections of a file.

bench.py, queue_overhead.py and queue_scale.py print their report; with `--out FILE` each
also rewrites its own section of FILE, between `<!-- NAME:start -->` and
`<!-- NAME:end -->`, so several runs can share one file in any order. BENCHMARKS.md is a
summary written by hand from such runs (docs/benchmark-history.md keeps them all).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TITLE = (
    "# Benchmarks\n\nWritten by the scripts in `benchmarks/`; re-run them to refresh a section.\n"
)


@dataclass(frozen=True)
class Target:
    """A goal: measured value vs a threshold (higher is better unless `at_most`)."""

    label: str
    measured: float
    threshold: float
    unit: str = "x"
    at_most: bool = False

    @property
    def passed(self) -> bool:
        if self.at_most:
            return self.measured <= self.threshold
        return self.measured >= self.threshold

    def row(self) -> list[str]:
        if self.at_most:
            goal = f"<= {self.threshold:g}{self.unit}"
            margin = self.threshold - self.measured
        else:
            goal = f">= {self.threshold:g}{self.unit}"
            margin = self.measured - self.threshold
        verdict = "PASS" if self.passed else "MISS"
        return [
            self.label,
            f"{self.measured:.3g}{self.unit}",
            goal,
            f"**{verdict}** by {abs(margin):.3g}{self.unit}",
        ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(targets: list[Target]) -> str:
    return table(["target", "measured", "goal", "verdict"], [t.row() for t in targets])


def command_line() -> str:
    """The command that produced this run, as typed from the repository root."""
    return "python " + " ".join(shlex.quote(a) for a in [_rel(sys.argv[0])] + sys.argv[1:])


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def machine_facts(extra: dict | None = None, mlx: bool = True) -> str:
    """Platform, CPUs, versions, load: what a reader needs to weigh the numbers."""
    facts = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "CPUs": os.cpu_count(),
        "python": platform.python_version(),
        "load average at the end (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if mlx:
        import mlx.core as mx
        import mlx_lm

        facts.update(mlx=mx.__version__, **{"mlx-lm": mlx_lm.__version__})
        facts["device"] = str(mx.default_device())
    facts.update(extra or {})
    return "\n".join(f"- {k}: {v}" for k, v in facts.items())


def update_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the named section of a markdown file."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else TITLE
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def publish(md: str, out: Path | None, name: str) -> None:
    """Print the report; with `out`, also rewrite its section `name` of that file."""
    print(md)
    if out is not None:
        update_section(out, name, md)
        print(f"wrote {out}", file=sys.stderr, flush=True)
