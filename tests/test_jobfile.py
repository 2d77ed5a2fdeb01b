"""The job file: every kind of bad line gets its exact line number, field and message;
good lines in either form come out normalised. No Redis, no model."""

from __future__ import annotations

import json

import pytest

from contract.defaults import JOB_FILE
from jobstore import config
from jobstore.jobfile import LineError, validate_file
from jobstore.lines import Choice, effective_seed, error_line, result_line
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
        "n out of range",
        '{"custom_id": "x", "prompt": "hi", "n": 129}',
        ["n: must be in [1, 128], got 129"],
    ),
    ("n zero", '{"custom_id": "x", "prompt": "hi", "n": 0}', ["n: must be in [1, 128], got 0"]),
    (
        "best_of other than n",
        '{"custom_id": "x", "prompt": "hi", "n": 2, "best_of": 3}',
        ["best_of: not supported: best_of must equal n (every choice is returned), got 3"],
    ),
    (
        "chat logprobs not a boolean",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}',
        ["logprobs: must be true or false, got 3"],
    ),
    (
        "top_logprobs without logprobs",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
        ["top_logprobs: requires logprobs: true"],
    ),
    (
        "top_logprobs out of range",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
        ["top_logprobs: must be in [0, 20], got 21"],
    ),
    (
        "completions logprobs out of range",
        '{"custom_id": "x", "prompt": "hi", "logprobs": 6}',
        ["logprobs: must be in [0, 5], got 6"],
    ),
    (
        "completions logprobs true",
        '{"custom_id": "x", "prompt": "hi", "logprobs": true}',
        ["logprobs: must be an integer from 0 to 5 on /v1/completions, got true"],
    ),
    (
        "completions top_logprobs",
        '{"custom_id": "x", "prompt": "hi", "top_logprobs": 2}',
        ["top_logprobs: not allowed with /v1/completions: give logprobs as an integer from 0 to 5"],
    ),
    (
        "frequency_penalty out of range (envelope)",
        '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "frequency_penalty": 3}}',
        ["body.frequency_penalty: must be in [-2, 2], got 3"],
    ),
    (
        "presence_penalty out of range",
        '{"custom_id": "x", "prompt": "hi", "presence_penalty": -2.5}',
        ["presence_penalty: must be in [-2, 2], got -2.5"],
    ),
    (
        "repetition_penalty zero",
        '{"custom_id": "x", "prompt": "hi", "repetition_penalty": 0}',
        ["repetition_penalty: must be > 0, got 0"],
    ),
    (
        "penalty a string",
        '{"custom_id": "x", "prompt": "hi", "frequency_penalty": "high"}',
        ['frequency_penalty: must be a number, got "high"'],
    ),
    (
        "logit_bias out of range",
        '{"custom_id": "x", "prompt": "hi", "logit_bias": {"42": 150}}',
        ["logit_bias: 42: must be in [-100, 100], got 150"],
    ),
    (
        "logit_bias key not a token id",
        '{"custom_id": "x", "prompt": "hi", "logit_bias": {"hello": 5}}',
        ['logit_bias: key "hello" is not a token id (a decimal integer)'],
    ),
    (
        "chat_template_kwargs on completions",
        '{"custom_id": "x", "prompt": "hi", "chat_template_kwargs": {"enable_thinking": false}}',
        ["chat_template_kwargs: not allowed with /v1/completions (a prompt has no chat template)"],
    ),
    (
        "chat_template_kwargs not an object",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}',
        ["chat_template_kwargs: must be an object, got [1]"],
    ),
    (
        "tools",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
        ['tools: not supported: tool calling is not supported, got [{"type": "function"}]'],
    ),
    (
        "response_format of an unknown type",
        '{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}}',
        ['body.response_format.type: must be "text", "json_object" or "json_schema", got "yaml"'],
    ),
    (
        "json_schema without a schema",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}',
        ["response_format.json_schema.schema: required"],
    ),
    (
        "two constraints",
        '{"custom_id": "x", "prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a+"}',
        ["guided_regex: only one constraint per line; response_format already sets one"],
    ),
    (
        "schema that does not compile",
        '{"custom_id": "x", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string", "minLength": "x"}}}}',
        [
            "response_format.json_schema.schema: Expected positive integer for 'minLength', got \"x\""
        ],
    ),
    (
        "unsupported schema keyword",
        '{"custom_id": "x", "prompt": "hi", "structured_outputs": {"json": {"type": "array", "uniqueItems": true}}}',
        ['structured_outputs.json: Unimplemented keys: ["uniqueItems"]'],
    ),
    (
        "regex that does not compile",
        '{"custom_id": "x", "prompt": "hi", "guided_regex": "(a"}',
        [
            'guided_regex: at 1(8): invalid regex "(a" (in regex): regex parse error: (a ^ error: '
            "unclosed group 1 | start: /(a/ ^"
        ],
    ),
    (
        "grammar that does not compile",
        '{"custom_id": "x", "prompt": "hi", "guided_grammar": "start: foo"}',
        ['guided_grammar: at 1(8): unknown name: "foo" 1 | start: foo ^'],
    ),
    (
        "empty choice list",
        '{"custom_id": "x", "prompt": "hi", "guided_choice": []}',
        ["guided_choice: must be a non-empty list of non-empty strings, got []"],
    ),
    (
        "prediction",
        '{"custom_id": "x", "prompt": "hi", "prediction": {"type": "content", "content": "x"}}',
        [
            'prediction: not supported: predicted outputs are not supported, got {"type": "content", "content": "x"}'
        ],
    ),
    (
        "web_search_options",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "web_search_options": {}}',
        ["web_search_options: not supported: web search is not supported, got {}"],
    ),
    (
        "audio modality",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}',
        ['modalities: not supported: only text output is supported, got ["text", "audio"]'],
    ),
    (
        "echo",
        '{"custom_id": "x", "prompt": "hi", "echo": true}',
        ["echo: not supported: echo is not supported, got true"],
    ),
    (
        "suffix",
        '{"custom_id": "x", "prompt": "hi", "suffix": "end"}',
        ['suffix: not supported: suffix (insertion) is not supported, got "end"'],
    ),
    (
        "reasoning_effort",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}',
        ['reasoning_effort: not supported: reasoning_effort is not supported, got "low"'],
    ),
    (
        "verbosity",
        '{"custom_id": "x", "messages": [{"role": "user", "content": "hi"}], "verbosity": "low"}',
        ['verbosity: not supported: verbosity is not supported (set max_tokens), got "low"'],
    ),
    (
        "vLLM min_tokens",
        '{"custom_id": "x", "prompt": "hi", "min_tokens": 5}',
        ["min_tokens: not supported: min_tokens is not supported, got 5"],
    ),
    (
        "vLLM ignore_eos",
        '{"custom_id": "x", "prompt": "hi", "ignore_eos": true}',
        ["ignore_eos: not supported: ignore_eos is not supported, got true"],
    ),
    (
        "service_tier not a string",
        '{"custom_id": "x", "prompt": "hi", "service_tier": 5}',
        ["service_tier: must be a string, got 5"],
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
    bad = '{"custom_id": "x", "prompt": "hi", "temperature": -1, "top_k": -2, "echo": true, "colour": "red"}'
    errors = list(validate_file(str(_write(tmp_path, bad))))
    messages = [e.format("j") for e in errors if isinstance(e, LineError)]
    assert messages == [
        "j:2: echo: not supported: echo is not supported, got true",
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
        "n": 1,
        "logprobs": False,
        "top_logprobs": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": None,
        "chat_template_kwargs": None,
        "constraint": None,
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
    line = result_line("B", chat, "demo", [Choice("ok", "stop")], usage, {"x": 1}, 9, created=100)
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
    body = result_line("B", completion, "demo", [Choice("ok", "length")], usage, {}, None)[
        "response"
    ]["body"]
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
    pair = engine.load_pair()
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


# Records stored by the code before the request surface grew (n, logprobs, penalties,
# constraints): a line at its defaults must be stored byte for byte as then.
DISTILABEL_LINES = [
    (
        b'{"custom_id":"d1","method":"POST","url":"/v1/chat/completions","body":{"model":"demo",'
        b'"messages":[{"role":"user","content":"hi"}],"max_tokens":64,"temperature":0.7,'
        b'"top_p":1.0,"n":1,"logprobs":false,"top_logprobs":null,"frequency_penalty":0.0,'
        b'"presence_penalty":0.0,"stop":null,"response_format":null,"seed":3}}',
        '{"line":1,"custom_id":"d1","endpoint":"chat","model":"demo","params":{"messages":'
        '[{"role":"user","content":"hi"}],"max_tokens":64,"temperature":0.7,"seed":3},'
        '"prefix":"body."}',
    ),
    (
        b'{"custom_id":"d2","prompt":"x"}',
        '{"line":2,"custom_id":"d2","endpoint":"completion","model":null,"params":'
        '{"prompt":"x","max_tokens":256,"temperature":1.0}}',
    ),
    (
        b'{"custom_id":"d3","prompt":"x","n":1,"best_of":1,"logprobs":null,"echo":false,'
        b'"response_format":{"type":"text"},"logit_bias":{},"repetition_penalty":1,'
        b'"modalities":["text"],"tool_choice":"none","stream":false}',
        '{"line":3,"custom_id":"d3","endpoint":"completion","model":null,"params":'
        '{"prompt":"x","max_tokens":256,"temperature":1.0}}',
    ),
    (  # fields that steer a provider's service, and vLLM's extras at their "off" values
        b'{"custom_id":"d4","prompt":"x","service_tier":"auto","prompt_cache_key":"k1",'
        b'"safety_identifier":"u-9","min_tokens":0,"ignore_eos":false,'
        b'"skip_special_tokens":true,"include_reasoning":true,"verbosity":null}',
        '{"line":4,"custom_id":"d4","endpoint":"completion","model":null,"params":'
        '{"prompt":"x","max_tokens":256,"temperature":1.0}}',
    ),
]


def test_a_default_line_is_stored_as_before():
    from jobstore.jobfile import JobLine, parse_line
    from jobstore.lines import dumps

    for number, (raw, stored) in enumerate(DISTILABEL_LINES, 1):
        (job,) = parse_line(number, raw)
        assert dumps(job.to_record()) == stored
        back = JobLine.from_record(json.loads(stored))
        assert back.params == job.params


def test_new_request_fields_reach_the_params():
    from jobstore.jobfile import JobLine, parse_line
    from jobstore.lines import dumps

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    chat = {
        "custom_id": "c",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3,
        "best_of": 3,
        "logprobs": True,
        "top_logprobs": 4,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.3,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100, "7": 2.5},
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    }
    (job,) = parse_line(1, json.dumps(chat).encode())
    assert {k: job.params[k] for k in list(job.params)[10:]} == {
        "n": 3,
        "logprobs": True,
        "top_logprobs": 4,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.3,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100, "7": 2.5},
        "chat_template_kwargs": {"enable_thinking": False},
        "constraint": {"type": "json_schema", "schema": schema, "whitespace_flexible": False},
    }
    back = JobLine.from_record(json.loads(dumps(job.to_record())))
    assert back.params == job.params
    # The completions endpoint's integer logprobs: logprobs on, that many alternatives.
    (job,) = parse_line(
        2, b'{"custom_id": "p", "prompt": "x", "logprobs": 2, "guided_regex": "a+"}'
    )
    assert (job.params["logprobs"], job.params["top_logprobs"]) == (True, 2)
    assert job.params["constraint"] == {"type": "regex", "pattern": "a+"}
    (job,) = parse_line(3, b'{"custom_id": "q", "prompt": "x", "logprobs": 0}')
    assert (job.params["logprobs"], job.params["top_logprobs"]) == (True, 0)
    for door, expected in [
        (
            '"structured_outputs": {"choice": ["yes", "no"]}',
            {"type": "choice", "choices": ["yes", "no"]},
        ),
        ('"guided_grammar": "start: \\"a\\""', {"type": "grammar", "grammar": 'start: "a"'}),
        (
            '"response_format": {"type": "json_object"}',
            {"type": "json_schema", "schema": {"type": "object"}, "whitespace_flexible": False},
        ),
    ]:
        (job,) = parse_line(4, ('{"custom_id": "r", "prompt": "x", ' + door + "}").encode())
        assert job.params["constraint"] == expected


# Result lines written by result_line before choices became a list: one choice must
# still give these bytes.
_METRICS = {
    "time_to_first_token_ms": 1.5,
    "generation_time_ms": 20.25,
    "tokens_per_second": 395.1,
    "speculative_decoding": {
        "drafter": "model",
        "num_spec_steps": 2,
        "num_draft_tokens": 8,
        "num_accepted_draft_tokens": 6,
        "draft_acceptance_rate": 0.75,
        "mean_acceptance_length": 4.0,
        "acceptance_histogram": [0, 0, 1, 0, 1],
        "per_position_acceptance": [1.0, 1.0, 0.5, 0.5],
        "draft_tokens_per_position": [2, 2, 2, 2],
    },
    "worker": {"name": "w1", "host": "h"},
}
_USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 8,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 4},
}
_SPEC = (
    '"speculative_decoding":{"drafter":"model","num_spec_steps":2,"num_draft_tokens":8,'
    '"num_accepted_draft_tokens":6,"draft_acceptance_rate":0.75,"mean_acceptance_length":4.0,'
    '"acceptance_histogram":[0,0,1,0,1],"per_position_acceptance":[1.0,1.0,0.5,0.5],'
    '"draft_tokens_per_position":[2,2,2,2]}'
)
_TAIL = (
    '"usage":{"prompt_tokens":7,"completion_tokens":8,"total_tokens":15,'
    '"prompt_tokens_details":{"cached_tokens":4}},"metrics":{"time_to_first_token_ms":1.5,'
    '"generation_time_ms":20.25,"tokens_per_second":395.1,' + _SPEC + ","
    '"worker":{"name":"w1","host":"h"}}'
)
GOLDEN_CHAT = (
    '{"id":"B-1","custom_id":"c","response":{"status_code":200,"request_id":"B-1","body":'
    '{"id":"chatcmpl-B-1","object":"chat.completion","created":100,"model":"demo","choices":'
    '[{"index":0,"message":{"role":"assistant","content":"Hé \\"ok\\"\\n"},"logprobs":null,'
    '"finish_reason":"stop"}],' + _TAIL + ',"seed":9,"user":"u","metadata":{"k":"v"}}},'
    '"error":null}'
)
GOLDEN_COMPLETION = (
    '{"id":"B-2","custom_id":"p","response":{"status_code":200,"request_id":"B-2","body":'
    '{"id":"cmpl-B-2","object":"text_completion","created":100,"model":"demo","choices":'
    '[{"index":0,"text":" return x","logprobs":null,"finish_reason":"length"}],'
    + _TAIL
    + ',"seed":null}},"error":null}'
)


def _two_lines():
    from jobstore.jobfile import parse_line

    (chat,) = parse_line(
        1,
        b'{"custom_id":"c","messages":[{"role":"user","content":"hi"}],"user":"u",'
        b'"metadata":{"k":"v"}}',
    )
    (completion,) = parse_line(2, b'{"custom_id":"p","prompt":"def f(x):"}')
    return chat, completion


def test_a_one_choice_line_is_byte_identical_to_before():
    from jobstore.lines import dumps, pack, unpack

    chat, completion = _two_lines()
    line = result_line("B", chat, "demo", [Choice('Hé "ok"\n', "stop")], _USAGE, _METRICS, 9, 100)
    assert dumps(line) == GOLDEN_CHAT
    line = result_line(
        "B", completion, "demo", [Choice(" return x", "length")], _USAGE, _METRICS, None, 100
    )
    assert dumps(line) == GOLDEN_COMPLETION
    assert unpack(pack(GOLDEN_CHAT), 1 << 20) == GOLDEN_CHAT


def _entries(pieces: list[tuple[str, float]]) -> list[dict]:
    return [
        {
            "token": t,
            "logprob": lp,
            "bytes": list(t.encode()),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode())},
                {"token": "zz", "logprob": lp - 1.5, "bytes": list(b"zz")},
            ],
        }
        for t, lp in pieces
    ]


def test_choices_reasoning_and_logprobs_in_openai_shapes():
    from jobstore.lines import dumps, pack, unpack

    openai_types = pytest.importorskip("openai.types")
    chat, completion = _two_lines()
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    choices = [
        Choice("{}", "stop", _entries([("{", -0.25), ("}", -0.5)]), reasoning="think: 你好"),
        Choice("[1]", "length", _entries([("[", -1.0), ("1", -2.0), ("]", -0.125)])),
    ]
    body = result_line("B", chat, "demo", choices, usage, {}, 9)["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "{}",
        "reasoning_content": "think: 你好",
    }
    assert "reasoning_content" not in body["choices"][1]["message"]
    parsed = openai_types.chat.ChatCompletion.model_validate(body)
    assert [c.message.content for c in parsed.choices] == ["{}", "[1]"]
    content = parsed.choices[1].logprobs.content
    assert [(x.token, x.logprob, x.bytes) for x in content][:1] == [("[", -1.0, [91])]
    assert [t.token for t in content[0].top_logprobs] == ["[", "zz"]
    assert parsed.choices[0].message.model_extra == {"reasoning_content": "think: 你好"}
    # The completions endpoint: the legacy shape, offsets in characters of the text.
    choices = [Choice("é1", "stop", _entries([("é", -0.5), ("1", -0.75)]))]
    body = result_line("B", completion, "demo", choices, usage, {}, None)["response"]["body"]
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["é", "1"],
        "token_logprobs": [-0.5, -0.75],
        "top_logprobs": [{"é": -0.5, "zz": -2.0}, {"1": -0.75, "zz": -2.25}],
        "text_offset": [0, 1],
    }
    parsed = openai_types.Completion.model_validate(body)
    assert parsed.choices[0].logprobs.text_offset == [0, 1]
    text = dumps(result_line("B", chat, "demo", choices * 3, usage, {}, 9))
    assert unpack(pack(text), 1 << 20) == text


def test_text_offsets_count_a_character_split_across_tokens_once():
    from jobstore.lines import completion_logprobs

    euro = "€".encode()  # three bytes, sent as two tokens, then "x"
    entries = [
        {"token": "bytes:\\xe2\\x82", "logprob": -1.0, "bytes": list(euro[:2])},
        {"token": "bytes:\\xac", "logprob": -1.0, "bytes": list(euro[2:])},
        {"token": "x", "logprob": -1.0, "bytes": [120]},
    ]
    assert completion_logprobs(entries)["text_offset"] == [0, 0, 1]
