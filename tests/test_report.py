"""spec-report: exact sums over result lines, a self-contained page, the Redis path, and
the page as a real headless browser draws it."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.types import SpecStats
from reporting.report import (
    Aggregate,
    Line,
    main,
    read_jsonl,
    render,
    summarize,
    throughput_series,
)

T0 = 1764460800
PLOTS = (
    "throughput",
    "acceptance-length",
    "position-acceptance",
    "time-per-request",
    "tokens-per-request",
)


def _stats(rng: random.Random, max_tokens: int, k: int, a: float) -> SpecStats:
    """Counters of one simulated request: per-token acceptance a, draft length k,
    recorded exactly as the engine's text layer records them."""
    stats = SpecStats(drafter="model")
    emitted = 0
    while emitted < max_tokens:
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        used = min(accepted + 1, max_tokens - emitted)
        stats.record_step(k, min(accepted, used), used)
        emitted += used
    stats.num_emitted_tokens = emitted
    return stats


def synth_lines(n: int = 30, seed: int = 0) -> tuple[list[dict], list[SpecStats]]:
    """n result lines in the FORMATS.md shape, one request after another as `spec-run`
    writes them, with 2..5 draft tokens per step and acceptance 0.4..0.8."""
    rng = random.Random(seed)
    lines, all_stats = [], []
    clock = float(T0)
    for i in range(n):
        max_tokens = rng.randint(16, 120)
        stats = _stats(rng, max_tokens, k=rng.randint(2, 5), a=rng.uniform(0.4, 0.8))
        gen_ms = round(max_tokens * rng.uniform(8, 14), 3)
        clock += gen_ms / 1000 + 0.005
        prompt_tokens = rng.randint(5, 60)
        lines.append(
            {
                "id": f"batch_x-{i + 1}",
                "custom_id": f"row-{i + 1}",
                "response": {
                    "status_code": 200,
                    "request_id": f"batch_x-{i + 1}",
                    "body": {
                        "id": f"chatcmpl-batch_x-{i + 1}",
                        "object": "chat.completion",
                        "created": int(clock),
                        "model": "demo",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "x" * max_tokens},
                                "logprobs": None,
                                "finish_reason": "length",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": max_tokens,
                            "total_tokens": prompt_tokens + max_tokens,
                        },
                        "metrics": {
                            "time_to_first_token_ms": round(gen_ms / max_tokens, 3),
                            "generation_time_ms": gen_ms,
                            "tokens_per_second": round(max_tokens / gen_ms * 1000, 3),
                            "speculative_decoding": stats.to_dict(),
                        },
                        "seed": None,
                    },
                },
                "error": None,
            }
        )
        all_stats.append(stats)
    return lines, all_stats


ERRORS = [
    {
        "id": "batch_x-31",
        "custom_id": "row-31",
        "response": None,
        "error": {
            "code": "context_length_exceeded",
            "message": "prompt: prompt (600 tokens) + max_tokens (64) = 664 exceeds 512",
            "line": 31,
        },
    },
    {
        "id": "batch_x-32",
        "custom_id": "row-32",
        "response": None,
        "error": {"code": "timeout", "message": "ran past 120 s", "line": 32},
    },
]


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def files(tmp_path):
    lines, stats = synth_lines()
    return (
        _write(tmp_path / "results.jsonl", lines),
        _write(tmp_path / "errors.jsonl", ERRORS),
        stats,
    )


def test_summary_equals_the_engines_own_sum_of_the_same_requests(files):
    results, errors, stats = files
    s = summarize([*read_jsonl(results), *read_jsonl(errors)])
    total = SpecStats(drafter="model")
    for one in stats:
        total.merge(one)
    want = total.to_dict()
    assert (s.requests, s.failed) == (32, 2)
    assert s.completion_tokens == total.num_emitted_tokens
    assert s.acceptance_histogram == want["acceptance_histogram"]
    assert s.draft_tokens_per_position == want["draft_tokens_per_position"]
    assert s.accepted_per_position == total.accepted_per_position
    assert (s.num_draft_tokens, s.num_accepted_draft_tokens) == (
        want["num_draft_tokens"],
        want["num_accepted_draft_tokens"],
    )
    assert round(s.mean_acceptance_length, 4) == want["mean_acceptance_length"]
    assert s.drafter() == "model"
    assert dict(s.errors) == {"context_length_exceeded": 1, "timeout": 1}


def test_position_counts_without_draft_tokens_per_position_match(files):
    """Lines from tools that omit draft_tokens_per_position give the same per-position sums."""
    results, _, _ = files
    stripped = []
    for line in read_jsonl(results):
        spec = {k: v for k, v in line.spec.items() if k != "draft_tokens_per_position"}
        stripped.append(Line(**{**line.__dict__, "spec": spec}))
    full = summarize(read_jsonl(results))
    s = summarize(stripped)
    assert s.accepted_per_position == full.accepted_per_position
    assert s.draft_tokens_per_position == full.draft_tokens_per_position


def test_throughput_is_spread_over_each_request_and_split_by_worker():
    lines = [
        Line("a", True, worker="mac-a", created=10.5, generation_ms=2000, completion_tokens=100),
        Line("b", True, worker="mac-b", created=12.5, generation_ms=4000, completion_tokens=40),
        Line("c", False, error_code="timeout"),
    ]
    series = throughput_series(lines, bins=4)
    assert series == {
        "mac-a": [(0.5, 50.0), (1.5, 50.0), (2.5, 0.0), (3.5, 0.0)],
        "mac-b": [(0.5, 10.0), (1.5, 10.0), (2.5, 10.0), (3.5, 10.0)],
    }


def test_throughput_conserves_tokens_with_whole_second_timestamps(files):
    results, _, _ = files
    lines = list(read_jsonl(results))
    series = throughput_series(lines)
    (points,) = series.values()
    width = 2 * points[0][0]
    assert width >= 2.0  # `created` is whole seconds: no bin narrower than its rounding
    assert sum(v for _, v in points) * width == pytest.approx(
        sum(ln.completion_tokens for ln in lines)
    )


def test_a_large_batch_is_summed_exactly_and_plotted_from_a_bounded_sample(files):
    """Memory stays bounded: sums and the worker table cover every line, the per-line
    plots a uniform sample, scaled back up to the whole batch."""
    results, errors, _ = files
    lines = [*read_jsonl(results), *read_jsonl(errors)] * 50  # 1,600 lines
    agg = Aggregate(sample=100)
    for line in lines:
        agg.add(line)
    full = summarize(lines)
    got = agg.summary()
    assert (got.requests, got.failed, got.completion_tokens) == (1600, 100, full.completion_tokens)
    assert got.acceptance_histogram == full.acceptance_histogram
    assert len(agg.sample) == 100 and agg.seen_ok == 1500 and agg.scale == 15
    assert sum(w.requests for w in agg.workers.values()) == 1500
    assert sum(w.tokens for w in agg.workers.values()) == full.completion_tokens
    page = render(agg)
    assert "uniform sample of 100 of 1,500 successful lines" in page
    (points,) = throughput_series(agg.sample, scale=agg.scale).values()
    (exact,) = throughput_series([ln for ln in lines if ln.ok]).values()
    total = sum(v for _, v in exact)
    assert sum(v for _, v in points) == pytest.approx(total, rel=0.25)  # a sample, scaled


def _run(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_page_is_one_file_that_fetches_nothing(files, tmp_path):
    results, errors, _ = files
    out = tmp_path / "report.html"
    res = _run(["--results", str(results), "--errors", str(errors), "-o", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    for kind in PLOTS:
        assert f'data-plot="{kind}"' in page
    # The only URL is SVG's namespace name, which is never fetched.
    assert page.count("http") == page.count('xmlns="http://www.w3.org/2000/svg"') == len(PLOTS)
    for tag in ("<script", "<link", "<img", "src=", "@import", "url("):
        assert tag not in page
    assert "<th>requests</th><td class=n>32</td>" in page
    assert "<th>failed</th><td class=n>2</td>" in page
    assert "context_length_exceeded" in page and "row-31" in page
    assert "wrote" in res.output and "32 requests, 2 failed" in res.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "give either BATCH or --results FILE"),
        (["b1", "--results", "r.jsonl"], 2, "give either BATCH or --results FILE"),
        (["b1", "--errors", "e.jsonl"], 2, "--errors goes with --results"),
        (
            ["--results", "missing.jsonl"],
            1,
            "missing.jsonl: cannot open: No such file or directory",
        ),
        (["--results", "bad.jsonl"], 1, "bad.jsonl:2: "),
    ],
)
def test_usage_and_input_errors(tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text(
        '{"custom_id": "a", "response": null, "error": {}}\n{oops\n'
    )
    res = _run([*args, "-o", "out.html"])
    assert res.exit_code == code
    assert message in res.output
    assert not (tmp_path / "out.html").exists()


# --- from Redis ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_report_from_a_batch_in_redis(redis_url, files, tmp_path, monkeypatch):
    from jobstore import store
    from jobstore.connection import connect
    from jobstore.keys import Keys

    monkeypatch.setenv("SPEC_KEY_PREFIX", f"report{os.getpid()}")
    conn, keys = connect(redis_url), Keys.default()
    conn.hset(keys.batch("b1"), "created_at", T0)
    results, errors, _ = files
    for path, ok in ((results, True), (errors, False)):
        for text in path.read_text().splitlines():
            line = json.loads(text)
            key = f"c:{line['custom_id']}"
            # The line's place in its file, as spec-submit records it: a batch whose
            # lines have no order is one a restarted Redis lost (spec-report says so).
            conn.zadd(keys.order("b1"), {key: conn.zcard(keys.order("b1")) + 1})
            store.store_line(conn, keys, "b1", key, text, ok=ok)
    out = tmp_path / "redis.html"
    res = _run(["b1", "--redis", redis_url, "-o", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "batch b1" in page and "<th>requests</th><td class=n>32</td>" in page
    res = _run(["nope", "--redis", redis_url, "-o", str(out)])
    assert res.exit_code == 1 and "no such batch 'nope'" in res.output


def test_redis_down_is_one_clear_line(tmp_path):
    res = _run(["b1", "--redis", f"redis://:pw@127.0.0.1:{_free_port()}/0", "-o", "x.html"])
    assert res.exit_code == 3
    assert "cannot reach Redis at redis://:***@127.0.0.1" in res.output and "pw" not in res.output


# --- in a real browser -----------------------------------------------------------------------


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += length + 12
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        cur = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                cur[i] = (cur[i] + cur[i - bpp]) & 0xFF
        elif f == 2:
            cur = bytearray((c + p) & 0xFF for c, p in zip(cur, prev, strict=True))
        elif f == 3:
            for i in range(stride):
                left = cur[i - bpp] if i >= bpp else 0
                cur[i] = (cur[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif f == 4:
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b, c = prev[i], prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[i] = (cur[i] + pred) & 0xFF
        rows.append(bytes(cur))
        prev = cur
    return width, height, rows


def test_page_renders_in_headless_chromium(files, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium not installed (Debian: apt-get install chromium); CI installs it")
    results, errors, _ = files
    page = tmp_path / "report.html"
    assert (
        _run(["--results", str(results), "--errors", str(errors), "-o", str(page)]).exit_code == 0
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    shot = tmp_path / "report.png"
    run = subprocess.run(
        [
            browser,
            *flags,
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={shot}",
            "--window-size=1200,2000",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert console == []
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    assert dom.count('<svg class="plot"') == len(PLOTS)
    assert dom.count('class="bar"') > 20 and dom.count('class="series"') == 1
    width, height, rows = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 2000)
    colours = {row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    # A blank or unstyled page has a handful of colours; plots, text and antialiasing many.
    assert len(colours) > 50
    if os.environ.get("SPEC_KEEP_SCREENSHOT"):  # to look at it: SPEC_KEEP_SCREENSHOT=/tmp/r.png
        shutil.copy(shot, os.environ["SPEC_KEEP_SCREENSHOT"])
