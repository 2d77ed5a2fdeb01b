"""contract.stats: the one place rates come from counters and the counter schema is
named, and the report's sums are exact counts, never rebuilt from rounded rates."""

from dataclasses import asdict, fields

from contract import stats
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


def test_the_counter_schema_is_spec_stats_fields():
    from engine.types import SpecStats

    assert [f.name for f in fields(SpecStats)] == ["drafter", *stats.COUNTERS, *stats.SERIES]


def test_hash_fields_round_trip_the_counters():
    counters = {
        "drafter": "lookup",
        "num_spec_steps": 4,
        "num_draft_tokens": 10,
        "num_accepted_draft_tokens": 6,
        "num_emitted_tokens": 13,
        "acceptance_histogram": [1, 1, 0, 2],
        "draft_tokens_per_position": [4, 3, 3],
        "accepted_per_position": [3, 2, 1],
    }
    flat = stats.to_fields(counters)
    assert flat == {
        "sd:num_spec_steps": 4,
        "sd:num_draft_tokens": 10,
        "sd:num_accepted_draft_tokens": 6,
        "sd:num_emitted_tokens": 13,
        "sd:hist:0": 1,
        "sd:hist:1": 1,
        "sd:hist:2": 0,
        "sd:hist:3": 2,
        "sd:dpp:0": 4,
        "sd:dpp:1": 3,
        "sd:dpp:2": 3,
        "sd:app:0": 3,
        "sd:app:1": 2,
        "sd:app:2": 1,
        "sd:drafter:lookup": 1,
    }
    assert stats.from_fields({k: str(v) for k, v in flat.items()}) == {
        **counters,
        "num_forced_tokens": 0,
    }
    forced = stats.to_fields({**counters, "num_forced_tokens": 5})
    assert forced == {**flat, "sd:num_forced_tokens": 5}
    both = {**flat, "sd:drafter:model": 1, "completed": 2}
    assert stats.from_fields(both)["drafter"] == "mixed"
    assert stats.from_fields({})["acceptance_histogram"] == []


def test_every_sum_names_its_drafter_the_same_way():
    from engine.types import SpecStats

    total = SpecStats()
    total.merge(SpecStats(drafter="model", num_spec_steps=1))
    assert total.drafter == "model" == stats.drafter_of(["model"])
    total.merge(SpecStats(drafter="model", num_spec_steps=2))
    assert total.drafter == "model"
    total.merge(SpecStats(drafter="lookup", num_spec_steps=1))
    assert total.drafter == "mixed" == stats.drafter_of(["model", "lookup"])
    lines = [parse_line(_line(0)), parse_line(_line(1))]
    assert summarize(lines).drafter() == "model"
    assert summarize([]).drafter() == "none" == stats.drafter_of([])
    merged = stats.from_fields({**stats.to_fields(asdict(total)), "sd:drafter:lookup": 1})
    assert merged["drafter"] == "mixed"
