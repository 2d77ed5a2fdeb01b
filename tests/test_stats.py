"""jobstore.stats: the one place rates come from counters, and the report's sums are
exact counts, never rebuilt from rounded rates."""

from jobstore import stats
from reporting.report import parse_line, summarize


def test_summary_derives_every_rate_from_raw_counters():
    got = stats.summary("model", 4, 10, 6, 13, [1, 1, 0, 2], [4, 3, 3], [3, 2, 1])
    assert got == {
        "drafter": "model",
        "num_spec_steps": 4,
        "num_draft_tokens": 10,
        "num_accepted_draft_tokens": 6,
        "draft_acceptance_rate": 0.6,
        "mean_acceptance_length": 3.25,
        "acceptance_histogram": [1, 1, 0, 2],
        "per_position_acceptance": [0.75, 0.6667, 0.3333],
        "draft_tokens_per_position": [4, 3, 3],
    }
    assert stats.summary("none", 0, 0, 0, 0, [], [], [])["mean_acceptance_length"] == 0.0
    assert stats.drafter_of([]) == "none"
    assert stats.drafter_of(["lookup", "lookup"]) == "lookup"
    assert stats.drafter_of(["model", "lookup"]) == "mixed"


def _line(i: int) -> dict:
    # 30001 steps proposing one draft each, 20000 accepted: per-position acceptance
    # 0.6666 after rounding, which times 30001 is 19998.7, not 20000.
    spec = stats.summary("model", 30001, 30001, 20000, 50001, [10001, 20000], [30001], [20000])
    usage = {"prompt_tokens": 5, "completion_tokens": 50001, "total_tokens": 50006}
    body = {"model": "demo", "usage": usage, "metrics": {"speculative_decoding": spec}}
    return {"custom_id": f"r{i}", "response": {"body": body}, "error": None}


def test_report_sums_the_lines_raw_counters():
    s = summarize(parse_line(_line(i)) for i in range(3))
    assert s.accepted_per_position == [60000]
    assert s.draft_tokens_per_position == [90003]
    assert s.num_emitted_tokens == 150003
    assert s.acceptance_histogram == [30003, 60000]
    assert s.mean_acceptance_length == stats.rate(150003, 90003)
