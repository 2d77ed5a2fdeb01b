"""The job file: every kind of bad line gets its exact line number, field and message;
good lines in either form come out normalised. No Redis, no model."""

from __future__ import annotations

import json

import pytest

from contract.defaults import JOB_FILE
from jobstore import config
from jobstore.jobfile import LineError, validate_file
from jobstore.lines import effective_seed, error_line, result_line
from jobstore.store import spec_summary

GOOD = '{"custom_id": "row-1", "prompt": "def f(x):", "max_tokens": 4}'
GOOD_AFTER = '{"custom_id": "row-3", "messages": [{"role": "user", "content": "hi"}]}'

# (kind, line 2 of a three-line file, the exact messages printed for it)
BAD_LINES = [
    (
        "not JSON",
        '{"custom_id": "x", "prompt": "hi"',
        ["not valid JSON: Expecting ',' delimiter at column 34"],
    ),
    ("not an object", '["x", "hi"]', ["must be a JSON object, got an array"]),
    ("a bare string", '"hello"', ["must be a JSON object, got a string"]),
    (
        "invalid UTF-8",
        b'{"custom_id": "x", "prompt": "\xff"}',
        ["not valid UTF-8: byte 0xff at column 31"],
    ),
    (
        "NaN",
        '{"custom_id": "x", "prompt": "hi", "temperature": NaN}',
        ["not valid JSON: NaN is not allowed (numbers must be finite)"],
    ),
    (
        "Infinity",
        '{"custom_id": "x", "prompt": "hi", "top_p": 1e999}',
        ["not valid JSON: 1e999 is out of range (numbers must be finite)"],
    ),
    (
        "duplicate key",
        '{"custom_id": "x", "prompt": "a", "prompt": "b"}',
        ['not valid JSON: duplicate key "prompt"'],
    ),
    ("missing custom_id", '{"prompt": "hi"}', ["custom_id: required"]),
    (
        "duplicate custom_id",
        '{"custom_id": "row-1", "prompt": "hi"}',
        ['custom_id: duplicate "row-1", first used on line 1'],
    ),
    (
        "custom_id not a string",
        '{"custom_id": 7, "prompt": "hi"}',
        ["custom_id: must be a string, got 7"],
    ),
    (
        "custom_id too long",
        json.dumps({"custom_id": "x" * 65, "prompt": "hi"}),
        ["custom_id: must be 1 to 64 characters, got 65"],
    ),
    (
        "custom_id empty",
        '{"custom_id": "", "prompt": "hi"}',
        ["custom_id: must be 1 to 64 characters, got 0"],
    ),
    (
        "both prompt and messages",
        '{"custom_id": "x", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
        ["messages: cannot be combined with prompt: give exactly one"],
    ),
    (
        "neither prompt nor messages",
        '{"custom_id": "x", "max_tokens": 5}',
        ["prompt: one of prompt or messages is required"],
    ),
    ("empty prompt", '{"custom_id": "x", "prompt": ""}', ["prompt: must not be empty"]),
    (
        "prompt not a string",
        '{"custom_id": "x", "prompt": ["a", "b"]}',
        ['prompt: must be a string, got ["a", "b"]'],
    ),
    (
        "max_tokens a string",
        '{"custom_id": "x", "prompt": "hi", "max_tokens": "12"}',
        ['max_tokens: must be an integer, got "12"'],
    ),
    (
        "max_tokens fractional",
        '{"custom_id": "x", "prompt": "hi", "max_tokens": 12.5}',
        ["max_tokens: must be an integer, got 12.5"],
    ),
    (
        "max_tokens zero",
        '{"custom_id": "x", "prompt": "hi", "max_tokens": 0}',
        ["max_tokens: must be >= 1, got 0"],
    ),
    (
        "max_tokens boolean",
        '{"custom_id": "x", "prompt": "hi", "max_tokens": true}',
        ["max_tokens: must be an integer, got true"],
    ),
    (
        "max_tokens twice",
        '{"custom_id": "x", "prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4}',
        ["max_completion_tokens: cannot be combined with max_tokens"],
    ),
    (
        "negative temperature (envelope)",
        '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "temperature": -0.5}}',
        ["body.temperature: must be >= 0, got -0.5"],
    ),
    (
        "temperature a string",
        '{"custom_id": "x", "prompt": "hi", "temperature": "hot"}',
        ['temperature: must be a number, got "hot"'],
    ),
    ("top_p zero", '{"custom_id": "x", "prompt": "hi", "top_p": 0}', ["top_p: must be > 0, got 0"]),
    (
        "top_p above one",
        '{"custom_id": "x", "prompt": "hi", "top_p": 1.5}',
        ["top_p: must be <= 1, got 1.5"],
    ),
    (
        "negative top_k",
        '{"custom_id": "x", "prompt": "hi", "top_k": -1}',
        ["top_k: must be >= 0, got -1"],
    ),
    ("min_p one", '{"custom_id": "x", "prompt": "hi", "min_p": 1}', ["min_p: must be < 1, got 1"]),
    (
        "seed fractional",
        '{"custom_id": "x", "prompt": "hi", "seed": 1.5}',
        ["seed: must be an integer, got 1.5"],
    ),
    (
        "stop a number",
        '{"custom_id": "x", "prompt": "hi", "stop": 5}',
        ["stop: must be a string or a list of strings, got 5"],
    ),
    (
        "unknown field",
        '{"custom_id": "x", "prompt": "hi", "temprature": 0.5}',
        ["temprature: unknown field"],
    ),
    (
        "unknown envelope field",
        '{"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "hi"}, "priority": 1}',
        ["priority: unknown field"],
    ),
    (
        "n > 1",
        '{"custom_id": "x", "prompt": "hi", "n": 2}',
        ["n: not supported: only n=1 is supported (one choice per line), got 2"],
    ),
    (
        "logprobs",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}',
        ["logprobs: not supported: logprobs are not supported, got true"],
    ),
    (
        "tools",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
        ['tools: not supported: tool calling is not supported, got [{"type": "function"}]'],
    ),
    (
        "response_format",
        '{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}}',
        [
            'body.response_format: not supported: only response_format {"type": "text"} is supported, got {"type": "json_object"}'
        ],
    ),
    (
        "presence_penalty",
        '{"custom_id": "x", "prompt": "hi", "presence_penalty": 0.5}',
        ["presence_penalty: not supported: presence_penalty is not supported (only 0), got 0.5"],
    ),
    (
        "stream",
        '{"custom_id": "x", "prompt": "hi", "stream": true}',
        ["stream: not supported: streaming is not supported in a batch, got true"],
    ),
    (
        "url and prompt disagree",
        '{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "hi"}}',
        ["body.prompt: not allowed with url /v1/chat/completions (use messages)"],
    ),
    (
        "unknown url",
        '{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"prompt": "hi"}}',
        ["url: must be '/v1/chat/completions' or '/v1/completions', got \"/v1/embeddings\""],
    ),
    (
        "method GET",
        '{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "hi"}}',
        ["method: must be 'POST', got \"GET\""],
    ),
    (
        "body not an object",
        '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": "hi"}',
        ['body: must be an object, got "hi"'],
    ),
    ("empty messages", '{"custom_id": "x", "messages": []}', ["messages: must not be empty"]),
    (
        "bad role",
        '{"custom_id": "x", "messages": [{"role": "robot", "content": "hi"}]}',
        ["messages[0].role: must be 'system', 'user' or 'assistant', got \"robot\""],
    ),
    (
        "content not text",
        '{"custom_id": "x", "messages": [{"role": "user", "content": 5}]}',
        ["messages[0].content: must be a string or a list of text parts, got 5"],
    ),
    (
        "image part",
        '{"custom_id": "x", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        [
            'messages[0].content: part 0: only text parts are supported, got {"type": "image_url", "image_url": {"url": "x"}}'
        ],
    ),
    (
        "draft length out of range",
        '{"custom_id": "x", "prompt": "hi", "speculative": {"num_draft_tokens": 17}}',
        ['speculative.num_draft_tokens: must be "auto" or an integer from 1 to 16, got 17'],
    ),
    (
        "unknown drafter",
        '{"custom_id": "x", "prompt": "hi", "speculative": {"drafter": "magic"}}',
        ["speculative.drafter: must be 'model', 'lookup' or 'none', got \"magic\""],
    ),
    (
        "bad model alias",
        '{"custom_id": "x", "prompt": "hi", "model": "my model"}',
        [
            "model: must be a model alias of 1 to 64 letters, digits, '.', '_' or '-', got \"my model\""
        ],
    ),
    (
        "metadata not strings",
        '{"custom_id": "x", "prompt": "hi", "metadata": {"k": 1}}',
        ["metadata.k: must be a string, got 1"],
    ),
]


def _write(tmp_path, bad: str | bytes):
    path = tmp_path / "jobs.jsonl"
    bad_bytes = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(GOOD.encode() + b"\n" + bad_bytes + b"\n" + GOOD_AFTER.encode() + b"\n")
    return path


def test_the_table_covers_at_least_25_kinds():
    assert len({kind for kind, _, _ in BAD_LINES}) >= 25


@pytest.mark.parametrize("kind,bad,expected", BAD_LINES, ids=[k for k, _, _ in BAD_LINES])
def test_bad_line_names_its_line_and_field(tmp_path, kind, bad, expected):
    path = _write(tmp_path, bad)
    items = list(validate_file(str(path)))
    errors = [i for i in items if isinstance(i, LineError)]
    assert [e.format("jobs.jsonl") for e in errors] == [f"jobs.jsonl:2: {m}" for m in expected]
    valid = [i for i in items if not isinstance(i, LineError)]
    assert [j.line for j in valid] == [1, 3]


def test_every_problem_of_a_line_is_reported(tmp_path):
    bad = '{"custom_id": "x", "prompt": "hi", "temperature": -1, "top_k": -2, "n": 3, "colour": "red"}'
    errors = list(validate_file(str(_write(tmp_path, bad))))
    messages = [e.format("j") for e in errors if isinstance(e, LineError)]
    assert messages == [
        "j:2: n: not supported: only n=1 is supported (one choice per line), got 3",
        "j:2: temperature: must be >= 0, got -1",
        "j:2: top_k: must be >= 0, got -2",
        "j:2: colour: unknown field",
    ]


def test_a_line_too_long_is_rejected_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "MAX_LINE_BYTES", 100)
    long_line = json.dumps({"custom_id": "x", "prompt": "y" * 500})
    errors = [
        e for e in validate_file(str(_write(tmp_path, long_line))) if isinstance(e, LineError)
    ]
    assert [e.format("j") for e in errors] == ["j:2: line is longer than 100 bytes"]


def test_bom_crlf_and_blank_lines_keep_physical_line_numbers(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n\r\n   \r\n"
        b'{"custom_id": "row-5", "prompt": "x", "top_k": -1}\r\n'
    )
    items = list(validate_file(str(path)))
    assert [type(i).__name__ for i in items] == ["JobLine", "LineError"]
    assert items[0].line == 1 and items[0].custom_id == "row-1"
    assert items[1].format("j") == "j:4: top_k: must be >= 0, got -1"


def test_missing_file_is_one_clear_error(tmp_path):
    from jobstore.jobfile import JobFileError

    with pytest.raises(JobFileError, match="nope.jsonl: cannot read: No such file or directory"):
        list(validate_file(str(tmp_path / "nope.jsonl")))


def test_both_forms_normalise_to_the_same_request(tmp_path):
    path = tmp_path / "jobs.jsonl"
    lines = [
        {
            "custom_id": "env",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hé 你好 🍵"}]}],
                "max_tokens": 9,
                "temperature": 0.5,
                "seed": 7,
                "stop": "\n\n",
                "n": 1,
                "presence_penalty": 0,
                "user": "u-1",
                "metadata": {"team": "a"},
            },
        },
        {
            "custom_id": "short",
            "model": "demo",
            "messages": [{"role": "user", "content": "Hé 你好 🍵"}],
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "seed": 7,
            "stop": ["\n\n"],
            "user": "u-1",
            "metadata": {"team": "a"},
        },
    ]
    path.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    env, short = list(validate_file(str(path)))
    assert env.params == short.params
    assert env.params == {
        "messages": [{"role": "user", "content": "Hé 你好 🍵"}],
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": 7,
        "stop": ["\n\n"],
        "num_draft_tokens": "auto",
        "drafter": "model",
    }
    assert env.endpoint == short.endpoint == "chat"
    assert env.echo == short.echo == {"user": "u-1", "metadata": {"team": "a"}}
    assert (env.prefix, short.prefix) == ("body.", "")


def test_defaults_and_model_override(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"custom_id": "a", "prompt": "x", "model": "other"}\n')
    (job,) = validate_file(str(path))
    assert job.model == "other"
    assert job.params["max_tokens"] == JOB_FILE.max_tokens == 256
    assert job.params["temperature"] == JOB_FILE.temperature == 1.0
    (job,) = validate_file(str(path), model_override="demo")
    assert job.model == "demo"


def test_derived_seed_is_stable_and_only_for_sampling(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        '{"custom_id": "a", "prompt": "x", "temperature": 0.8}\n'
        '{"custom_id": "b", "prompt": "x", "temperature": 0}\n'
        '{"custom_id": "c", "prompt": "x", "temperature": 0.8, "seed": 5}\n'
    )
    a, b, c = validate_file(str(path))
    assert effective_seed("batch1", a) == effective_seed("batch1", a)
    assert effective_seed("batch1", a) != effective_seed("batch2", a)
    assert 0 <= effective_seed("batch1", a) < 2**31
    assert effective_seed("batch1", b) is None
    assert effective_seed("batch1", c) == 5


def test_result_and_error_lines_have_the_openai_batch_shape(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        '{"custom_id": "c", "messages": [{"role": "user", "content": "hi"}], "user": "u"}\n'
        '{"custom_id": "p", "prompt": "hi"}\n'
    )
    chat, completion = validate_file(str(path))
    usage = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    line = result_line("B", chat, "demo", "ok", "stop", usage, {"x": 1}, 9, created=100)
    assert line == {
        "id": "B-1",
        "custom_id": "c",
        "response": {
            "status_code": 200,
            "request_id": "B-1",
            "body": {
                "id": "chatcmpl-B-1",
                "object": "chat.completion",
                "created": 100,
                "model": "demo",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
                "metrics": {"x": 1},
                "seed": 9,
                "user": "u",
            },
        },
        "error": None,
    }
    usage.pop("prompt_tokens_details")  # an engine that keeps no prefixes: 0
    body = result_line("B", completion, "demo", "ok", "length", usage, {}, None)["response"]["body"]
    assert body["object"] == "text_completion" and body["id"] == "cmpl-B-2"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["choices"] == [
        {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}
    ]
    assert error_line("B", 4, None, "timeout", "late") == {
        "id": "B-4",
        "custom_id": None,
        "response": None,
        "error": {"code": "timeout", "message": "late", "line": 4},
    }
    with pytest.raises(ValueError):
        error_line("B", 4, None, "oops", "no such code")


def test_result_bodies_parse_as_openai_objects(tmp_path):
    """Lines as a worker writes them (demo pair: real usage, metrics, seed) parse with the
    installed openai SDK's ChatCompletion / Completion types, field for field. No skip:
    the test extra installs openai, so a missing one is a failure, not a pass."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    import engine
    from worker.execute import execute

    path = tmp_path / "jobs.jsonl"
    path.write_text(
        '{"custom_id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}\n'
        '{"custom_id": "p", "prompt": "hi", "max_tokens": 4, "temperature": 0.5}\n'
    )
    chat, completion = validate_file(str(path))
    pair = engine.load_pair(calibrate=False)
    for job, kind in ((chat, ChatCompletion), (completion, Completion)):
        body = execute(pair, "demo", "B", job, "w1").line["response"]["body"]
        parsed = kind.model_validate(body)
        assert parsed.model_dump(exclude_unset=True) == body  # every field read back as is
        assert parsed.usage.prompt_tokens_details.cached_tokens == 0
        assert parsed.usage.completion_tokens == body["usage"]["completion_tokens"] > 0


def test_the_openai_sdk_the_tests_run_with_is_one_the_test_extra_allows():
    """The result-line tests prove compatibility with the SDK installed; the test extra's
    pin must admit it (it once said <3 while pip installed 3.x)."""
    import re
    from pathlib import Path

    import openai
    from packaging.specifiers import SpecifierSet

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    (pin,) = re.findall(r'"openai([<>=!~][^";]*)"', pyproject)
    assert openai.__version__ in SpecifierSet(pin), (openai.__version__, pin)


def test_summed_counters_match_the_engine_arithmetic():
    from dataclasses import asdict

    from engine.types import SpecStats
    from jobstore.store import result_counters

    a, b = SpecStats(drafter="model"), SpecStats(drafter="model")
    for proposed, accepted, emitted in [(4, 2, 3), (4, 4, 5), (2, 0, 1)]:
        a.record_step(proposed, accepted, emitted)
    for proposed, accepted, emitted in [(3, 1, 2), (5, 5, 6)]:
        b.record_step(proposed, accepted, emitted)
    fields: dict[str, int] = {}
    for stats in (a, b):
        for name, n in result_counters({}, asdict(stats), 0).items():
            fields[name] = fields.get(name, 0) + n
    a.merge(b)
    assert spec_summary({k: str(v) for k, v in fields.items()}) == a.to_dict()


def test_the_example_files_are_valid():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.jsonl"))
    assert examples
    for path in examples:
        items = list(validate_file(str(path)))
        assert items and not [i.format(path.name) for i in items if isinstance(i, LineError)]
