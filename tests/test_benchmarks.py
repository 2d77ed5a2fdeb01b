"""The benchmark runs end to end (`bench.py --quick`) and reports every row of issue 4.

Speed is not asserted here (STYLE.md: benchmarks print ratios, tests do not time);
what is asserted is that every row and target is reported, and that our engine's
greedy output in every row equals the target-only output (lossless), which the
benchmark checks token for token.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "engine" / "demo"

ROWS = (
    ["(a) mlx-lm stream_generate, target only (baseline)"]
    + [f"(b) mlx-lm speculative, k={k}" for k in range(1, 9)]
    + [f"(c) ours, k={k}" for k in (1, 2, 3, 4, 6, 8)]
    + ['(d) ours, "auto"', '(e) ours, "auto", useless draft', '(f) ours, drafter "lookup"']
    + ['(f\') ours, drafter "lookup"']
    + ["ours (speculative sampling)", "mlx-lm (", "(h) ours batched", "(h) ours sequential"]
    + ["(h) mlx-lm batch_generate"]
)
TARGETS = ["(d)", "(d)", "(e)", "(f)", "(g)", "(h)", "(i)"]


def _benchmark(script: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`benchmarks/<script>` with these arguments, as a user runs it, output captured."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _table_row(text: str, label: str) -> list[str]:
    for line in text.splitlines():
        if line.startswith("| " + label):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no table row starting with {label!r}")


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO / "target").is_dir(), reason="the demo pair is not in engine/demo")
def test_quick_benchmark_reports_every_row(tmp_path):
    out = tmp_path / "BENCH.md"
    proc = _benchmark(
        "bench.py", "--quick", "--out", str(out), "--cache", str(tmp_path / "cache"), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_report(out.read_text())


def check_report(text: str) -> None:
    """Every row and target of issue 4 is there, and our greedy rows are lossless."""
    assert "<!-- bench:start -->" in text and "<!-- bench:end -->" in text
    assert "python benchmarks/bench.py --quick" in text
    assert re.search(r"- BLAS: OpenBLAS|- BLAS: Accelerate", text), "fast BLAS not loaded"
    assert re.search(r"max \|logit difference\|.*: \S+ \(OK", text), "widening changed logits"

    for label in ROWS:
        _table_row(text, label)
    targets = [line for line in text.splitlines() if re.match(r"\| \([a-i]\) ", line)]
    verdicts = [line for line in targets if "**PASS**" in line or "**MISS**" in line]
    assert [v[2:5] for v in verdicts] == TARGETS

    # Lossless: our greedy rows emit exactly the target-only tokens on every prompt.
    for label in ["(c) ours, k=1", "(c) ours, k=8", '(d) ours, "auto"']:
        same = _table_row(text, label)[-1]
        n, total = same.split("/")
        assert n == total, f"{label}: {same} prompts identical to target-only"
    same = _table_row(text, '(e) ours, "auto", useless draft')[-1]
    assert same.split("/")[0] == same.split("/")[1]
    assert re.search(r"Batched outputs equal to sequential ones: (\d+)/\1\.", text)


@pytest.mark.skipif(not (DEMO / "target").is_dir(), reason="the demo pair is not in engine/demo")
def test_lockstep_names_its_fixed_ks_and_splits_steps_by_kind():
    """`lockstep.py --ks --kinds`: a column per fixed K asked for, every contender lossless,
    and each contender's steps split into full, join and thin steps that add up to its
    time (the split that shows what rows parting costs)."""
    proc = _benchmark(
        "lockstep.py", "--pairs", "demo", "--sizes", "4",
        "--runs", "1", "--max-tokens", "8", "--ks", "1,3", "--kinds",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| pair | batch | none"))
    assert "| K=1 / none | K=3 / none | auto / best, paired |" in header and "K=2" not in header
    row = next(line for line in lines if line.startswith("| demo | 4 | ") and "/" in line)
    # "auto" over the best fixed contender of the cell, K = 0 included, run by run
    assert re.search(r"\| \d\.\d{3} \(\d\.\d\d-\d\.\d\d\) of K=[013] \|", row), row
    n, total = row.strip("|").split("|")[-1].strip().split("/")
    assert n == total == "10", row  # 5 contenders, each in the untimed run and the timed one
    kinds = [line for line in lines if re.match(r"\| demo \| 4 \| (none|auto|K=1|K=3) \|", line)]
    assert [k.split("|")[3].strip() for k in kinds] == ["none", "auto", "K=1", "K=3"]
    for line in kinds:
        cells = [c.strip() for c in line.strip("|").split("|")]
        full, join, thin = (c.split(" / ") for c in cells[3:6])
        assert int(join[0]) >= 2  # the first rows join on one step, the next ones on one or more
        assert abs(sum(float(ms) for _, ms, _ in (full, join, thin)) - float(cells[6])) <= 2
        assert float(full[2]) > 0  # full steps emit tokens (one a row at least)
    plain = next(k for k in kinds if "| none |" in k)
    assert plain.split("|")[6].strip().startswith("0 /")  # plain rows finish together


@pytest.mark.skipif(not (DEMO / "target").is_dir(), reason="the demo pair is not in engine/demo")
def test_lockstep_refill_has_rows_joining_while_others_decode():
    """`lockstep.py --refill` (a worker's `--batch` workload): each request its own length,
    the same for every contender of a run, so rows join after the first step while others
    decode (more than one join step), and every contender stays lossless."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lockstep

    a, b = lockstep.refill_lengths(64, 64, 3), lockstep.refill_lengths(64, 64, 4)
    assert a == lockstep.refill_lengths(64, 64, 3) and a != b
    assert min(a + b) >= 16 and max(a + b) <= 96 and len(set(a)) > 16
    proc = _benchmark(
        "lockstep.py", "--refill", "--pairs", "demo", "--sizes", "2", "--per-run", "3",
        "--runs", "1", "--max-tokens", "8", "--ks", "1", "--kinds",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "(refilling), 12-token prompts" in lines[0], lines[0]
    row = next(line for line in lines if line.startswith("| demo | 2 | ") and "/" in line)
    n, total = row.strip("|").split("|")[-1].strip().split("/")
    assert n == total == "8", row  # 4 contenders, each in the untimed run and the timed one
    plain = next(line for line in lines if line.startswith("| demo | 2 | none |"))
    cells = plain.strip("|").split("|")
    join_steps, thin_steps = (int(cells[i].split("/")[0]) for i in (4, 5))
    # 6 requests of unequal lengths through 2 rows: rows join while the other decodes, and
    # the last two do not finish together (with equal lengths they do: no thin step)
    assert join_steps >= 3 and thin_steps >= 1, plain


def test_lockstep_fresh_prompts_are_new_every_run_until_the_pool_is_used():
    """`lockstep.py --fresh`: each run of a cell decodes prompts no other run decodes, as
    long as the pool lasts, then the pool again from its start."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lockstep

    pool = [[i] for i in range(10)]
    runs = lockstep.fresh_prompts(pool, 4)
    assert [runs(r) for r in range(3)] == [
        [[0], [1], [2], [3]],
        [[4], [5], [6], [7]],
        [[8], [9], [0], [1]],
    ]


def test_positions_reports_acceptance_by_draft_position_for_each_k():
    """`positions.py`: a row per (requests, K), K = 1 added when not asked for; each row's
    tokens a row-step are 1 plus the products of its acceptance by position (each given
    the positions before it passed), and its prediction is the one-rate E(K) at K = 1's
    rate on the same requests."""
    proc = _benchmark("positions.py", "--per-run", "1,2", "--ks", "2,3", "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d+ \| \d \|", line)]
    cells = [[c.strip() for c in row.strip(" |").split("|")] for row in rows]
    assert [(c[0], c[1]) for c in cells] == [(n, k) for n in ("4", "8") for k in ("1", "2", "3")]
    rate = None
    for _, k, steps, tokens, predicted, over, by_position in cells:
        assert int(steps) > 0
        rates = [float(r) for r in by_position.split(", ")]
        assert len(rates) == int(k)
        reach, total = 1.0, 1.0
        for r in rates:
            reach *= r
            total += reach
        assert float(tokens) == pytest.approx(total, abs=3e-3)
        rate = rates[0] if k == "1" else rate
        assert float(predicted) == pytest.approx(sum(rate**j for j in range(int(k) + 1)), abs=3e-3)
        assert float(over) == pytest.approx(float(tokens) / float(predicted), abs=3e-3)
