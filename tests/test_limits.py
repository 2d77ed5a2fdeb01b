"""jobstore.limits: the contract's constants, stated once, and the job file and the
engine agreeing with them."""

import pytest

from jobstore import limits
from jobstore.jobfile import parse_line


def test_request_bounds_in_words():
    assert {name: b.rule() for name, b in limits.REQUEST_BOUNDS.items()} == {
        "max_tokens": "must be >= 1",
        "temperature": "must be >= 0",
        "top_p": "must be in (0, 1]",
        "top_k": "must be >= 0",
        "min_p": "must be in [0, 1)",
    }


@pytest.mark.parametrize(
    "name, inside, outside",
    [
        ("max_tokens", [1, 4096], [0, -1]),
        ("temperature", [0, 0.7, 2], [-0.5]),
        ("top_p", [1e-9, 1], [0, 1.01]),
        ("top_k", [0, 50], [-1]),
        ("min_p", [0, 0.99], [1, -0.1]),
    ],
)
def test_job_file_and_bounds_accept_the_same_values(name, inside, outside):
    bound = limits.REQUEST_BOUNDS[name]
    for value, ok in [(v, True) for v in inside] + [(v, False) for v in outside]:
        raw = f'{{"custom_id": "a", "prompt": "hi", "{name}": {value}}}'.encode()
        (item,) = parse_line(1, raw)[:1]
        assert bound.contains(value) is ok, (name, value)
        assert (getattr(item, "field", None) is None) is ok, (name, value, item)


def test_num_draft_tokens_and_drafter_follow_the_limits():
    top = limits.MAX_DRAFT_TOKENS
    for spec, ok in [
        (f'{{"num_draft_tokens": {top}}}', True),
        (f'{{"num_draft_tokens": {top + 1}}}', False),
        *((f'{{"drafter": "{d}"}}', True) for d in limits.DRAFTERS),
        ('{"drafter": "dflash"}', False),
    ]:
        raw = f'{{"custom_id": "a", "prompt": "hi", "speculative": {spec}}}'.encode()
        first = parse_line(1, raw)[0]
        assert (getattr(first, "field", None) is None) is ok, (spec, first)


def test_the_engine_states_the_same_constants():
    """Until the engine takes them from jobstore.limits, it must at least agree."""
    from engine import core, drafters

    assert drafters.DRAFTERS == limits.DRAFTERS
    assert core.MAX_DRAFT_TOKENS == limits.MAX_DRAFT_TOKENS
