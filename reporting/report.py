"""`spec-report`: one self-contained HTML page about a finished (or running) batch.

Reads result and error lines (FORMATS.md) from local files or from a batch in Redis,
and writes one HTML file with a summary table and inline SVG plots, drawn here in
Python: no JavaScript, no CDN, nothing fetched when it is opened. No MLX here.

Lines are read once, as a stream, into an `Aggregate`: exact sums and per-worker
counts, and a uniform sample of at most SAMPLE_LINES successful lines for the plots of
single requests, so a batch of a million lines costs the same memory as one of 100,000.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import click

from contract import stats
from jobstore.options import fail, friendly_errors, redis_option

#: Worker name for lines that do not say which worker ran them (e.g. `spec-run`).
LOCAL_WORKER = "local"

#: Bins of the throughput-over-time plot and of the per-request histograms.
TIME_BINS = 40
HIST_BINS = 20

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


class ReportError(Exception):
    """The input cannot be read as result/error lines; the message says where."""


@dataclass(frozen=True)
class Line:
    """What the report needs from one result or error line."""

    custom_id: str | None
    ok: bool
    worker: str = LOCAL_WORKER
    model: str | None = None
    created: float | None = None
    generation_ms: float = 0.0
    busy_ms: float | None = None  # metrics.busy_ms: the worker's wall time for it, if told
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    spec: dict | None = None
    error_code: str | None = None
    error_message: str | None = None


def parse_line(obj: dict) -> Line:
    """A result line or an error line (FORMATS.md) as a Line. Raises ReportError, also
    for a line whose fields have the wrong types (the report could not sum it)."""
    try:
        line = _parse(obj)
        if not all(math.isfinite(t) for t in (line.created or 0.0, line.generation_ms)):
            raise ValueError("a time that is not a finite number")
        if line.busy_ms is not None and not math.isfinite(line.busy_ms):
            raise ValueError("a time that is not a finite number")
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ReportError(f"not a result or error line ({type(exc).__name__}: {exc})") from exc
    return line


def _parse(obj: dict) -> Line:
    if not isinstance(obj, dict) or "custom_id" not in obj:
        raise ReportError("not a result or error line (no custom_id)")
    response, error = obj.get("response"), obj.get("error")
    if response is None:
        error = error if isinstance(error, dict) else {}
        return Line(
            obj["custom_id"],
            False,
            error_code=str(error.get("code", "unknown")),
            error_message=str(error.get("message", "")),
        )
    body = response.get("body") or {}
    metrics = body.get("metrics") or {}
    usage = body.get("usage") or {}
    # Workers may name themselves in the line; lines without a name ran in one place.
    worker = obj.get("worker") or metrics.get("worker") or LOCAL_WORKER
    if isinstance(worker, dict):  # metrics.worker: {"name", "host"}
        worker = worker.get("name") or LOCAL_WORKER
    spec = metrics.get("speculative_decoding")
    completion_tokens = int(usage.get("completion_tokens") or 0)
    if spec:  # the counters the report sums, read as integers: a line it cannot sum fails
        stats.counters_of_line(spec, completion_tokens)
    return Line(
        obj["custom_id"],
        True,
        worker=str(worker),
        model=str(body["model"]) if body.get("model") is not None else None,
        created=float(body["created"]) if body.get("created") is not None else None,
        generation_ms=float(metrics.get("generation_time_ms") or 0.0),
        busy_ms=float(metrics["busy_ms"]) if metrics.get("busy_ms") is not None else None,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=completion_tokens,
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        spec=spec,
    )


def read_jsonl(path: str) -> Iterator[Line]:
    """Lines of a results or errors file; blank lines skipped. Raises ReportError."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"{path}: cannot open: {exc.strerror}") from exc
    with f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield parse_line(json.loads(text))
            except (ReportError, ValueError, RecursionError) as exc:  # ValueError: not JSON
                raise ReportError(f"{path}:{number}: {exc}") from exc


def read_batch(
    conn, keys, batch_id: str, chunk: int = 500, warn: Callable[[str], None] | None = None
) -> Iterator[Line]:
    """The lines a batch has written so far, in the order they were written, from
    the `results`/`errors` hashes and the `done` list of jobstore.keys. A damaged stored
    line (not JSON, or not a result or error line) counts as an `internal_error` line,
    and `warn` is called with its key and field. Raises ReportError (unknown batch, a
    key of the wrong type)."""
    import redis

    from jobstore.store import read_lines, record_problem, wrong_key_type

    try:
        problem = wrong_key_type(conn, keys, batch_id)
        if problem:
            raise ReportError(f"batch {batch_id}: {problem}")
        problem = record_problem(conn, keys, batch_id)
        if problem:
            raise ReportError(problem)
        for line in read_lines(conn, keys, batch_id, "completion", chunk):
            if line.kind != "pending":
                yield _stored_line(line, warn)
    except redis.exceptions.ResponseError as exc:
        raise ReportError(f"batch {batch_id}: {exc}") from exc


def _stored_line(line, warn: Callable[[str], None] | None) -> Line:
    """A stored line (jobstore.store.StoredLine) as a Line; a damaged one as an
    `internal_error` Line, told to `warn`."""
    from jobstore.keys import custom_id_of

    problem = line.damage
    if problem is None:
        try:
            return parse_line(json.loads(line.text))
        except (ValueError, RecursionError, ReportError) as exc:  # ValueError: not JSON
            problem = str(exc)
    problem = f"key {line.hash_key} field {line.key}: damaged stored line ({problem})"
    if warn:
        warn(f"{problem}; counted as an internal_error line")
    return Line(custom_id_of(line.key), False, error_code="internal_error", error_message=problem)


# --- statistics -----------------------------------------------------------------------


@dataclass
class Summary:
    """Sums over a batch's lines (the same counters FORMATS.md sums for a batch)."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    generation_s: float = 0.0
    wall_s: float = 0.0
    num_spec_steps: int = 0
    num_emitted_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    draft_tokens_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafters: Counter = field(default_factory=Counter)
    models: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict = field(default_factory=dict)

    @property
    def per_request_tokens_per_second(self) -> float:
        """Decode speed of one stream: completion tokens / summed generation time (rows
        decoded together each count their whole time: not the machine's tokens/s)."""
        return self.completion_tokens / self.generation_s if self.generation_s else 0.0

    @property
    def throughput(self) -> float:
        """Batch throughput: completion tokens / wall-clock span of the batch."""
        return stats.tokens_per_second(self.completion_tokens, self.wall_s * 1000)

    @property
    def draft_acceptance_rate(self) -> float:
        return stats.rate(self.num_accepted_draft_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return stats.rate(self.num_emitted_tokens, self.num_spec_steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [
            stats.rate(a, d)
            for a, d in zip(self.accepted_per_position, self.draft_tokens_per_position, strict=True)
        ]

    def drafter(self) -> str:
        """The sum's drafter (`contract.stats.drafter_of`), with each drafter's request
        count when there are several."""
        name = stats.drafter_of(self.drafters)
        if len(self.drafters) > 1:
            name += " (" + ", ".join(f"{d}: {n}" for d, n in self.drafters.most_common()) + ")"
        return name


def _add(into: list, values: Iterable) -> None:
    values = list(values)
    if len(into) < len(values):
        into.extend([0] * (len(values) - len(into)))
    for i, v in enumerate(values):
        into[i] += v


class _Sums(Summary):
    """A Summary that lines are added to one at a time (`add`), then `finish`ed."""

    def __init__(self):
        super().__init__()
        self._first_start, self._last_end = math.inf, -math.inf

    def add(self, line: Line) -> None:
        self.requests += 1
        if not line.ok:
            self.failed += 1
            self.errors[line.error_code] += 1
            self.error_examples.setdefault(line.error_code, (line.custom_id, line.error_message))
            return
        self.prompt_tokens += line.prompt_tokens
        self.cached_tokens += line.cached_tokens
        self.completion_tokens += line.completion_tokens
        self.generation_s += line.generation_ms / 1000
        if line.model:
            self.models[line.model] += 1
        if line.created is not None:
            self._first_start = min(self._first_start, line.created - line.generation_ms / 1000)
            self._last_end = max(self._last_end, line.created)
        spec = line.spec
        if not spec:
            return
        counts = stats.counters_of_line(spec, line.completion_tokens)
        self.drafters[counts["drafter"]] += 1
        self.num_spec_steps += counts["num_spec_steps"]
        self.num_emitted_tokens += counts["num_emitted_tokens"]
        self.num_draft_tokens += counts["num_draft_tokens"]
        self.num_accepted_draft_tokens += counts["num_accepted_draft_tokens"]
        _add(self.acceptance_histogram, counts["acceptance_histogram"])
        _add(self.draft_tokens_per_position, counts["draft_tokens_per_position"])
        _add(self.accepted_per_position, counts["accepted_per_position"])
        _add(self.accepted_per_position, [0] * len(self.draft_tokens_per_position))

    def finish(self) -> Summary:
        if self._last_end > self._first_start:
            self.wall_s = self._last_end - self._first_start
        return self


def summarize(lines: Iterable[Line]) -> Summary:
    """Sum every line's counters; failed lines count as requests and errors."""
    s = _Sums()
    for line in lines:
        s.add(line)
    return s.finish()


#: Successful lines kept, a uniform sample, for the plots drawn from single lines
#: (throughput over time, time and tokens per request): the report's memory stays
#: bounded however many lines a batch has; every sum and table is over all lines.
SAMPLE_LINES = 100_000


@dataclass
class _Worker:
    requests: int = 0
    tokens: int = 0
    generation_ms: float = 0.0
    busy_ms: float = 0.0
    untimed: int = 0  # lines without metrics.busy_ms (older workers, other tools)

    @property
    def tokens_per_second(self) -> float | None:
        """contract.stats.tokens_per_second over the worker's busy time, as spec-status
        shows it; None when some line did not say its busy time."""
        return None if self.untimed else stats.tokens_per_second(self.tokens, self.busy_ms)

    @property
    def per_request_tokens_per_second(self) -> float:
        secs = self.generation_ms / 1000
        return self.tokens / secs if secs else 0.0


class Aggregate:
    """What the page shows, gathered line by line in bounded memory: exact sums and
    per-worker counts, and a uniform sample (reservoir, fixed seed) of at most
    `sample` successful lines for the per-line plots."""

    def __init__(self, sample: int = SAMPLE_LINES):
        self._sums = _Sums()
        self.workers: dict[str, _Worker] = defaultdict(_Worker)
        self.sample: list[Line] = []
        self.seen_ok = 0
        self._size = sample
        self._rng = random.Random(0)
        self._names: dict[str, str] = {}  # one string per worker name

    def add(self, line: Line) -> None:
        self._sums.add(line)
        if not line.ok:
            return
        w = self.workers[line.worker]
        w.requests += 1
        w.tokens += line.completion_tokens
        w.generation_ms += line.generation_ms
        if line.busy_ms is None:
            w.untimed += 1
        else:
            w.busy_ms += line.busy_ms
        self.seen_ok += 1
        if len(self.sample) < self._size:
            self.sample.append(self._slim(line))
        else:
            j = self._rng.randrange(self.seen_ok)
            if j < self._size:
                self.sample[j] = self._slim(line)

    def _slim(self, line: Line) -> Line:
        """What the per-line plots read of a line (its statistics are summed already):
        a sampled line costs a few hundred bytes, not its whole parsed body."""
        worker = self._names.setdefault(line.worker, line.worker)
        return Line(
            None,
            True,
            worker=worker,
            created=line.created,
            generation_ms=line.generation_ms,
            completion_tokens=line.completion_tokens,
        )

    @property
    def scale(self) -> float:
        """Successful lines per sampled line (1.0 when every line is kept)."""
        return self.seen_ok / len(self.sample) if self.sample else 1.0

    def summary(self) -> Summary:
        return self._sums.finish()


def throughput_series(
    lines: list[Line], bins: int = TIME_BINS, scale: float = 1.0
) -> dict[str, list[tuple]]:
    """Completion tokens/s over time, per worker: each request's tokens are spread
    evenly over [end - generation time, end], then summed per time bin (bins tile the
    batch's span exactly, so tokens are conserved). `end` is `created`, or its
    midpoint `created + 0.5` when every `created` is in whole seconds (truncated), and
    then bins are at least 2 s wide: narrower ones would show rounding, not load.
    `scale` multiplies every rate (a sample of the lines stands for all of them).
    Returns {worker: [(seconds since the first start, tokens/s), ...]}."""
    timed = [ln for ln in lines if ln.ok and ln.created is not None]
    if not timed:
        return {}
    whole_seconds = all(ln.created == int(ln.created) for ln in timed)
    shift = 0.5 if whole_seconds else 0.0
    spans = [
        (
            ln.worker,
            ln.created + shift - ln.generation_ms / 1000,
            ln.created + shift,
            ln.completion_tokens,
        )
        for ln in timed
    ]
    t0 = min(start for _, start, _, _ in spans)
    span = max(max(end for _, _, end, _ in spans) - t0, 1e-3)
    if whole_seconds:
        bins = max(1, min(bins, int(span // 2.0)))
    width = span / bins
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * bins)
    for worker, start, end, tokens in spans:
        row = out[worker]
        if end - start <= 0:
            row[min(int((end - t0) / width), bins - 1)] += tokens / width
            continue
        rate = tokens / (end - start)
        for b in range(int((start - t0) / width), min(int((end - t0) / width), bins - 1) + 1):
            lo, hi = max(start, t0 + b * width), min(end, t0 + (b + 1) * width)
            if hi > lo:
                row[b] += rate * (hi - lo) / width
    return {
        w: [((b + 0.5) * width, v * scale) for b, v in enumerate(row)]
        for w, row in sorted(out.items())
    }


# --- SVG -------------------------------------------------------------------------------

W, H = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 48


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == int(v) and abs(v) < 1e6:
        return f"{int(v)}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _frame(kind: str, title: str, xlabel: str, ylabel: str, inner: str) -> str:
    return (
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<svg class="plot" data-plot="{kind}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        f'role="img" aria-label="{html.escape(title)}" xmlns="http://www.w3.org/2000/svg">'
        f"{inner}"
        f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{H - 8}" text-anchor="middle">'
        f"{html.escape(xlabel)}</text>"
        f'<text transform="translate(14 {TOP + (H - TOP - BOTTOM) / 2}) rotate(-90)" '
        f'text-anchor="middle">{html.escape(ylabel)}</text></svg></figure>'
    )


def _empty(kind: str, title: str, why: str) -> str:
    inner = (
        f'<text class="empty" x="{W / 2}" y="{H / 2}" text-anchor="middle">'
        f"{html.escape(why)}</text>"
    )
    return _frame(kind, title, "", "", inner)


def _axes(xlo, xhi, ylo, yhi, xticks=None) -> tuple[str, callable, callable]:
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def sx(x):
        return LEFT + (x - xlo) / ((xhi - xlo) or 1) * pw

    def sy(y):
        return TOP + ph - (y - ylo) / ((yhi - ylo) or 1) * ph

    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="bg"/>']
    for y in _nice_ticks(ylo, yhi):
        if y <= yhi + 1e-9:
            parts.append(
                f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" class="grid"/>'
            )
            parts.append(
                f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>'
            )
    for x, label in xticks if xticks is not None else ((x, _fmt(x)) for x in _nice_ticks(xlo, xhi)):
        if xlo - 1e-9 <= x <= xhi + 1e-9:
            parts.append(
                f'<text x="{sx(x):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{label}</text>'
            )
    return "".join(parts), sx, sy


def line_chart(kind, title, xlabel, ylabel, series: dict[str, list[tuple]]) -> str:
    """One polyline per named series of (x, y) points, with a legend."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return _empty(kind, title, "no timed result lines")
    xhi = max(x for x, _ in points) + min(x for x, _ in points)  # bin centres: end of last bin
    yhi = max(max(y for _, y in points), 1e-9) * 1.1
    body, sx, sy = _axes(0, xhi, 0, yhi)
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        body += f'<polyline class="series" points="{path}" fill="none" stroke="{color}" stroke-width="2"/>'
        body += "".join(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>' for x, y in pts
        )
        body += (
            f'<rect x="{LEFT + 10}" y="{TOP + 8 + 16 * i}" width="10" height="10" fill="{color}"/>'
            f'<text x="{LEFT + 24}" y="{TOP + 17 + 16 * i}">{html.escape(name)}</text>'
        )
    return _frame(kind, title, xlabel, ylabel, body)


def bar_chart(kind, title, xlabel, ylabel, bars: list[tuple[str, float, str]], ymax=None) -> str:
    """Bars of (label, value, hover text), left to right."""
    if not bars or not any(v for _, v, _ in bars):
        return _empty(kind, title, "no data")
    yhi = ymax if ymax is not None else max(v for _, v, _ in bars) * 1.1
    n = len(bars)
    every = max(1, math.ceil(n / 12))
    ticks = [
        (i + 0.5, html.escape(label)) for i, (label, _, _) in enumerate(bars) if i % every == 0
    ]
    body, sx, sy = _axes(0, n, 0, yhi, xticks=ticks)
    for i, (_, value, hover) in enumerate(bars):
        x0, x1 = sx(i) + 1, sx(i + 1) - 1
        body += (
            f'<rect class="bar" x="{x0:.1f}" y="{sy(value):.1f}" width="{max(x1 - x0, 1):.1f}" '
            f'height="{sy(0) - sy(value):.1f}" fill="{PALETTE[0]}"><title>{html.escape(hover)}</title></rect>'
        )
    return _frame(kind, title, xlabel, ylabel, body)


def histogram(kind, title, xlabel, values: list[float], bins: int = HIST_BINS) -> str:
    """Counts of `values` in equal-width bins."""
    if not values:
        return _empty(kind, title, "no result lines")
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins if hi > lo else 1.0
    if all(v == int(v) for v in values):  # counts: whole-number bins, labelled exactly
        width = max(1, math.ceil((hi - lo + 1) / bins))
        bins = max(1, math.ceil((hi - lo + 1) / width))
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    bars = [
        (_fmt(lo + i * width), c, f"[{_fmt(lo + i * width)}, {_fmt(lo + (i + 1) * width)}): {c}")
        for i, c in enumerate(counts)
    ]
    return bar_chart(kind, title, xlabel, "requests", bars)


# --- page ------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.4 "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 3px 12px 3px 0; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr + tr td, tr + tr th { border-top: 1px solid #eee; }
.plots { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; } figcaption { font-weight: bold; margin-bottom: 4px; }
svg text { font-size: 11px; fill: #333; } svg .empty { font-size: 14px; fill: #888; }
svg .bg { fill: #fafafa; stroke: #ccc; } svg .grid { stroke: #e4e4e4; }
.note { color: #666; font-size: 12px; }
"""


def _row(name: str, value: str, note: str = "") -> str:
    return (
        f"<tr><th>{html.escape(name)}</th><td class=n>{html.escape(value)}</td>"
        f'<td class="note">{html.escape(note)}</td></tr>'
    )


def _summary_table(s: Summary) -> str:
    rows = [
        _row("requests", f"{s.requests}"),
        _row("failed", f"{s.failed}"),
        _row("prompt tokens", f"{s.prompt_tokens:,}"),
        _row(
            "prompt tokens reused",
            f"{s.cached_tokens:,}",
            f"from the workers' prefix caches: hit rate {stats.rate(s.cached_tokens, s.prompt_tokens):.0%}"
            f", {s.prompt_tokens - s.cached_tokens:,} prefilled",
        ),
        _row("completion tokens", f"{s.completion_tokens:,}"),
        _row(
            "per-request tokens/s",
            f"{s.per_request_tokens_per_second:.1f}",
            "completion tokens / summed generation time",
        ),
        _row(
            "batch throughput",
            f"{s.throughput:.1f} tokens/s",
            "completion tokens / wall-clock span",
        ),
        _row(
            "draft acceptance rate",
            f"{s.draft_acceptance_rate:.3f}",
            "accepted / proposed draft tokens",
        ),
        _row(
            "mean acceptance length",
            f"{s.mean_acceptance_length:.2f}",
            "tokens per target forward pass",
        ),
        _row("drafter", s.drafter()),
        _row("model", ", ".join(f"{m} ({n})" for m, n in s.models.most_common()) or "-"),
    ]
    return "<table class=summary>" + "".join(rows) + "</table>"


def _worker_table(workers: dict[str, _Worker]) -> str:
    rows = [
        "<tr><th>worker</th><th>requests</th><th>completion tokens</th>"
        '<th title="completion tokens / the worker\'s busy wall time, as spec-status">'
        "tokens/s</th>"
        '<th title="completion tokens / summed generation time of its requests">'
        "per-request tokens/s</th></tr>"
    ]
    for name, w in sorted(workers.items()):
        tps = w.tokens_per_second
        rows.append(
            f"<tr><td>{html.escape(name)}</td><td class=n>{w.requests}</td>"
            f"<td class=n>{w.tokens:,}</td>"
            f"<td class=n>{'-' if tps is None else f'{tps:.1f}'}</td>"
            f"<td class=n>{w.per_request_tokens_per_second:.1f}</td></tr>"
        )
    return "<table class=workers>" + "".join(rows) + "</table>"


def _error_table(s: Summary) -> str:
    if not s.errors:
        return "<p>No failed requests.</p>"
    rows = ["<tr><th>code</th><th>count</th><th>first example</th></tr>"]
    for code, n in s.errors.most_common():
        cid, message = s.error_examples[code]
        rows.append(
            f"<tr><td>{html.escape(code)}</td><td class=n>{n}</td>"
            f"<td>{html.escape(str(cid))}: {html.escape(message)}</td></tr>"
        )
    return "<table class=errors>" + "".join(rows) + "</table>"


def _plots(s: Summary, agg: Aggregate) -> str:
    ok = agg.sample
    hist = s.acceptance_histogram
    steps = sum(hist)
    accept_bars = [
        (str(i), n, f"{n} verify steps accepted {i} draft tokens ({n / steps:.1%})")
        for i, n in enumerate(hist)
    ]
    position_bars = [
        (str(i + 1), rate, f"position {i + 1}: {acc}/{prop} accepted ({rate:.1%})")
        for i, (rate, acc, prop) in enumerate(
            zip(
                s.per_position_acceptance,
                s.accepted_per_position,
                s.draft_tokens_per_position,
                strict=True,
            )
        )
    ]
    return "".join(
        [
            line_chart(
                "throughput",
                "Throughput over time, per worker",
                "seconds since the first request started",
                "completion tokens/s",
                throughput_series(ok, scale=agg.scale),
            ),
            bar_chart(
                "acceptance-length",
                "Acceptance length (draft tokens accepted per verify step)",
                "draft tokens accepted",
                "verify steps",
                accept_bars,
            ),
            bar_chart(
                "position-acceptance",
                "Acceptance by draft position",
                "draft position",
                "share accepted",
                position_bars,
                ymax=1.0,
            ),
            histogram(
                "time-per-request",
                "Time per request",
                "generation time (ms)",
                [ln.generation_ms for ln in ok],
            ),
            histogram(
                "tokens-per-request",
                "Tokens per request",
                "completion tokens",
                [float(ln.completion_tokens) for ln in ok],
            ),
        ]
    )


def render(lines: Iterable[Line] | Aggregate, title: str = "specfleet batch report") -> str:
    """The whole HTML page for these lines (read once), or for lines already gathered."""
    agg = lines if isinstance(lines, Aggregate) else gather(lines)
    s = agg.summary()
    made = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    sampled = ""
    if agg.scale > 1:
        sampled = (
            f"<p class=note>Plots of single requests are drawn from a uniform sample of "
            f"{len(agg.sample):,} of {agg.seen_ok:,} successful lines; every total and "
            "table is over all lines.</p>"
        )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p class=note>made {html.escape(made)} by spec-report</p>"
        f"<h2>Summary</h2>{_summary_table(s)}"
        f"<h2>Workers</h2>{_worker_table(agg.workers)}"
        f"<h2>Errors</h2>{_error_table(s)}"
        f'<h2>Plots</h2>{sampled}<div class="plots">{_plots(s, agg)}</div>'
        "</body></html>\n"
    )


def gather(lines: Iterable[Line]) -> Aggregate:
    """Read lines once into an Aggregate (bounded memory)."""
    agg = Aggregate()
    for line in lines:
        agg.add(line)
    return agg


@click.command()
@click.argument("batch_id", required=False, metavar="[BATCH]")
@click.option(
    "--results", "results_path", metavar="FILE", help="Local results.jsonl (instead of BATCH)."
)
@click.option("--errors", "errors_path", metavar="FILE", help="Local errors.jsonl, with --results.")
@redis_option
@click.option("-o", "--output", required=True, metavar="FILE", help="HTML file to write.")
@friendly_errors("spec-report", ReportError)
def main(batch_id, results_path, errors_path, redis_url, output):
    """Write a one-file HTML report (summary, per-worker table, plots) for BATCH in
    Redis, or for local result lines with --results [--errors]."""
    if bool(batch_id) == bool(results_path):
        raise click.UsageError("give either BATCH or --results FILE")
    if errors_path and not results_path:
        raise click.UsageError("--errors goes with --results")
    if results_path:
        lines = read_jsonl(results_path)
        if errors_path:
            lines = itertools.chain(lines, read_jsonl(errors_path))
        title = f"specfleet report: {results_path}"
    else:
        lines = _batch_lines(batch_id, redis_url)
        title = f"specfleet report: batch {batch_id}"
    agg = gather(lines)
    page = render(agg, title)
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        fail("spec-report", f"{output}: cannot write: {exc.strerror}")
    s = agg.summary()
    click.echo(
        f"wrote {output}: {s.requests} requests, {s.failed} failed, "
        f"{s.completion_tokens} completion tokens",
        err=True,
    )


def _batch_lines(batch_id: str, redis_url: str | None) -> Iterator[Line]:
    from jobstore.connection import connect
    from jobstore.keys import Keys

    conn = connect(redis_url)

    def warn(message: str) -> None:
        click.echo(f"spec-report: warning: {message}", err=True)

    return read_batch(conn, Keys.default(), batch_id, warn=warn)
