"""contract.limits and contract.defaults: the contract's constants and request
defaults, stated once, and the job file and the engine taking them from there."""

import math

import pytest

from contract import limits
from contract.defaults import ENGINE, JOB_FILE
from jobstore.jobfile import parse_line


def test_request_bounds_in_words():
    assert {name: b.rule() for name, b in limits.REQUEST_BOUNDS.items()} == {
        "max_tokens": "must be >= 1",
        "temperature": "must be >= 0",
        "top_p": "must be in (0, 1]",
        "top_k": "must be >= 0",
        "min_p": "must be in [0, 1)",
        "n": "must be in [1, 128]",
        "top_logprobs": "must be in [0, 20]",
        "frequency_penalty": "must be in [-2, 2]",
        "presence_penalty": "must be in [-2, 2]",
        "repetition_penalty": "must be > 0",
    }


@pytest.mark.parametrize(
    "name, inside, outside",
    [
        ("max_tokens", [1, 4096], [0, -1]),
        ("temperature", [0, 0.7, 2], [-0.5]),
        ("top_p", [1e-9, 1], [0, 1.01]),
        ("top_k", [0, 50], [-1]),
        ("min_p", [0, 0.99], [1, -0.1]),
        ("n", [1, 128], [0, 129]),
        ("top_logprobs", [0, 20], [-1, 21]),
        ("frequency_penalty", [-2, 0.5, 2], [-2.01, 3]),
        ("presence_penalty", [-2, 2], [2.5]),
        ("repetition_penalty", [0.01, 1.3], [0, -1]),
    ],
)
def test_job_file_and_bounds_accept_the_same_values(name, inside, outside):
    bound = limits.REQUEST_BOUNDS[name]
    for value, ok in [(v, True) for v in inside] + [(v, False) for v in outside]:
        # top_logprobs is a chat field and needs logprobs on.
        line = '"messages": [{"role": "user", "content": "hi"}], "logprobs": true'
        raw = f'{{"custom_id": "a", {line}, "{name}": {value}}}'.encode()
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


def test_the_engine_takes_the_constants_from_the_contract():
    from engine import core, families, text
    from engine.types import Drafter

    assert families.DRAFTERS is limits.DRAFTERS
    assert text.DRAFTERS is limits.DRAFTERS
    assert core.MAX_DRAFT_TOKENS is limits.MAX_DRAFT_TOKENS
    assert Drafter.__args__ == limits.DRAFTERS


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("top_p", 0),
        ("top_p", math.nan),
        ("top_k", -1),
        ("min_p", 1),
    ],
)
def test_the_engine_refuses_what_the_bounds_exclude(name, value):
    from engine.text import _check
    from engine.types import GenerationRequest, InvalidRequestError

    bound = limits.REQUEST_BOUNDS[name]
    assert not bound.contains(value)
    with pytest.raises(InvalidRequestError) as info:
        _check(GenerationRequest(prompt="hi", **{name: value}))
    assert str(info.value) == f"{name}: {bound.rule()}, got {value!r}"


def test_the_two_doors_differ_only_in_temperature():
    from engine.types import GenerationRequest

    job, engine = JOB_FILE.as_dict(), ENGINE.as_dict()
    assert {k for k in job if job[k] != engine[k]} == {"temperature"}
    assert (JOB_FILE.temperature, ENGINE.temperature) == (1.0, 0.0)
    request = GenerationRequest(prompt="hi")
    assert {k: getattr(request, k) for k in engine} == engine
    (line,) = parse_line(1, b'{"custom_id": "a", "prompt": "hi"}')
    assert line.params == {"prompt": "hi", **job}
