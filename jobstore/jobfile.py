"""The job file: read it line by line, validate every line, say exactly what is wrong.

Shared by `spec-submit` (producer) and `spec-run` / the worker, so both accept and
reject the same lines with the same messages. Nothing here imports MLX or Redis.

A line is read as bytes (bounded by MAX_LINE_BYTES), decoded as strict UTF-8, parsed
as JSON (NaN, Infinity and duplicate keys rejected), then checked by pydantic models
with `extra="forbid"`. Two forms are accepted (FORMATS.md): the OpenAI batch envelope
`{"custom_id", "method", "url", "body": {...}}` and the short form with the body's
fields at the top level. Field names in messages carry a `body.` prefix in the
envelope form, so they point at the place in the line the user must edit. A line's
output constraint (response_format, structured_outputs, guided_*) is compiled here too
(jobstore.grammars), once the rest of the line is valid.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from contract.constraints import CONSTRAINT_FIELDS, ConstraintError, normalise
from contract.defaults import JOB_FILE
from contract.limits import (
    DRAFTERS,
    LOGIT_BIAS_MAX,
    MAX_COMPLETION_LOGPROBS,
    MAX_CUSTOM_ID_CHARS,
    MAX_DRAFT_TOKENS,
    MAX_STOP_STRINGS,
    REQUEST_BOUNDS,
    SEED_MAX,
    SEED_MIN,
)
from jobstore import config
from jobstore.errors import JobStoreError
from jobstore.grammars import check_constraint

CHAT_URL = "/v1/chat/completions"
COMPLETION_URL = "/v1/completions"
Endpoint = Literal["chat", "completion"]

#: OpenAI fields kept and echoed back, because ignoring them changes no output.
ECHOED_FIELDS = ("user", "metadata", "store")

#: OpenAI fields that would change the output and that this service does not do:
#: name -> (values that mean "off" and may be dropped, what to say).
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "echo is not supported"),
    "suffix": ((), "suffix (insertion) is not supported"),
    "stream": ((False,), "streaming is not supported in a batch"),
    "stream_options": ((), "streaming is not supported in a batch"),
    "tools": ((), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "parallel_tool_calls": ((), "tool calling is not supported"),
    "functions": ((), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "verbosity": ((), "verbosity is not supported (set max_tokens)"),
    # vLLM's extra sampling fields that this service does not do.
    "min_tokens": ((0,), "min_tokens is not supported"),
    "ignore_eos": ((False,), "ignore_eos is not supported"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "include_reasoning": ((True,), "a thinking model's reasoning is always returned, apart"),
}

#: OpenAI fields that steer the provider's service, not the output (a processing tier, a
#: cache-routing hint, an abuse-tracking id): accepted when they are strings and dropped.
SERVICE_FIELDS = ("service_tier", "prompt_cache_key", "safety_identifier")


#: What validation gives a parameter the line does not set, left out of a stored record
#: when equal (max_tokens and temperature are always stored, so a queued line keeps the
#: defaults it was validated under).
RECORD_DEFAULTS: dict[str, Any] = {
    k: v for k, v in JOB_FILE.as_dict().items() if k not in ("max_tokens", "temperature")
}


@dataclass(frozen=True)
class JobLine:
    """One valid line, normalised.

    `params` holds exactly the keyword arguments of `engine.GenerationRequest`
    (prompt or messages, max_tokens, temperature, top_p, top_k, min_p, seed, stop,
    num_draft_tokens, drafter, n, logprobs, top_logprobs, frequency_penalty,
    presence_penalty, repetition_penalty, logit_bias, chat_template_kwargs, and
    `constraint`: the normalised output constraint of contract.constraints, or None),
    as plain JSON values; `echo` the echoed OpenAI fields.
    """

    line: int
    custom_id: str
    endpoint: Endpoint
    model: str | None
    params: dict
    echo: dict = field(default_factory=dict)
    prefix: str = ""  # "body." when the line used the envelope form, for messages

    def to_record(self, model: str | None = None) -> dict:
        """A JSON-able dict (stored in Redis, read back by `from_record`), with `model`
        when the line names none. Parameters at their defaults (RECORD_DEFAULTS) and an
        empty echo or prefix are left out: a million queued lines then hold only what
        their requests said."""
        record: dict = {
            "line": self.line,
            "custom_id": self.custom_id,
            "endpoint": self.endpoint,
            "model": self.model or model,
            "params": {
                k: v
                for k, v in self.params.items()
                if not (k in RECORD_DEFAULTS and _same(v, RECORD_DEFAULTS[k]))
            },
        }
        if self.echo:
            record["echo"] = self.echo
        if self.prefix:
            record["prefix"] = self.prefix
        return record

    @classmethod
    def from_record(cls, record: dict) -> JobLine:
        return cls(
            line=int(record["line"]),
            custom_id=record["custom_id"],
            endpoint=record["endpoint"],
            model=record.get("model"),
            params={**RECORD_DEFAULTS, **record["params"]},
            echo=dict(record.get("echo") or {}),
            prefix=record.get("prefix", ""),
        )

    def with_model(self, model: str) -> JobLine:
        return JobLine(
            self.line, self.custom_id, self.endpoint, model, self.params, self.echo, self.prefix
        )

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.endpoint == "completion" else "messages"

    def prompt_chars(self) -> int:
        if self.endpoint == "completion":
            return len(self.params["prompt"])
        return sum(len(m["content"]) for m in self.params["messages"])


@dataclass(frozen=True)
class LineError:
    """One problem with one line. `field` is a dotted path (`body.temperature`), or None
    when the line as a whole is wrong (not UTF-8, not JSON)."""

    line: int
    field: str | None
    message: str
    custom_id: str | None = None

    def format(self, filename: str) -> str:
        """`FILE:LINE: field: message`, the form every tool prints."""
        where = f"{filename}:{self.line}"
        return (
            f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        )


@dataclass(frozen=True)
class Verdict:
    """What validation says of one non-blank line: its JobLine, or every problem it has
    (all of this line, at least one)."""

    line: int
    job: JobLine | None
    errors: tuple[LineError, ...] = ()

    @property
    def custom_id(self) -> str | None:
        """The custom_id its outcome is stored under (None: under its line number)."""
        return self.job.custom_id if self.job is not None else self.errors[0].custom_id

    def message(self) -> str:
        """A rejected line's problems in one message: `field: message; ...`."""
        return "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in self.errors)


class JobFileError(JobStoreError):
    """The job file cannot be read at all (missing, a directory, unreadable)."""


# --- pydantic models: only where untrusted data enters ---------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Any

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            parts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"part {i}: only text parts are supported, got {_show(part)}")
                _TextPart.model_validate(part)
                parts.append(part["text"])
            return "".join(parts)
        raise ValueError(f"must be a string or a list of text parts, got {_show(v)}")


class _Speculative(_Strict):
    num_draft_tokens: Any = JOB_FILE.num_draft_tokens
    drafter: Literal[DRAFTERS] = JOB_FILE.drafter

    @field_validator("num_draft_tokens")
    @classmethod
    def _k(cls, v: Any) -> Any:
        if v == "auto" and isinstance(v, str):
            return v
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DRAFT_TOKENS:
            return v
        raise ValueError(
            f'must be "auto" or an integer from 1 to {MAX_DRAFT_TOKENS}, got {_show(v)}'
        )


#: The numeric fields checked against contract.limits.REQUEST_BOUNDS by one validator,
#: in its words (`must be in [-2, 2], got 3`).
_BOUNDED = ("n", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty")
_TOKEN_ID = re.compile(r"^(0|[1-9][0-9]{0,9})$")


class _Body(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, **REQUEST_BOUNDS["max_tokens"].pydantic())
    max_completion_tokens: int | None = Field(None, **REQUEST_BOUNDS["max_tokens"].pydantic())
    temperature: float = Field(JOB_FILE.temperature, **REQUEST_BOUNDS["temperature"].pydantic())
    top_p: float = Field(JOB_FILE.top_p, **REQUEST_BOUNDS["top_p"].pydantic())
    top_k: int = Field(JOB_FILE.top_k, **REQUEST_BOUNDS["top_k"].pydantic())
    min_p: float = Field(JOB_FILE.min_p, **REQUEST_BOUNDS["min_p"].pydantic())
    seed: int | None = Field(JOB_FILE.seed, ge=SEED_MIN, lt=SEED_MAX)
    stop: Any = JOB_FILE.stop
    speculative: _Speculative | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # null means the default for each of these (as OpenAI reads null).
    n: int | None = None
    best_of: int | None = None
    logprobs: Any = None  # chat: a boolean; completions: an integer (checked per endpoint)
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator(*_BOUNDED, mode="before")
    @classmethod
    def _bounded(cls, v: Any, info) -> Any:
        # Before pydantic's own check, to show the value as written (3, not 3.0).
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        bound = REQUEST_BOUNDS[info.field_name]
        if number and not bound.contains(v):
            raise ValueError(f"{bound.rule()}, got {_show(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict | None) -> dict | None:
        if not v:
            return None
        for key, bias in v.items():
            if not _TOKEN_ID.match(key):
                raise ValueError(f"key {_show(key)} is not a token id (a decimal integer)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"{key}: must be a number, got {_show(bias)}")
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
                raise ValueError(
                    f"{key}: must be in [-{LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}], got {_show(bias)}"
                )
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and not config.ALIAS_PATTERN.match(v):
            raise ValueError(
                f"must be a model alias of 1 to 64 letters, digits, '.', '_' or '-', got {_show(v)}"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str):
            return [v] if v else None
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"must have at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
            return [s for s in v if s] or None
        raise ValueError(f"must be a string or a list of strings, got {_show(v)}")


class _Envelope(_Strict):
    custom_id: Any = None
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions"] | None = None
    body: dict


# --- reading -----------------------------------------------------------------------------


def read_lines(path: str) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, raw bytes without the line ending) for every physical line.

    Bytes are None for a line longer than MAX_LINE_BYTES (skipped without being held in
    memory). A UTF-8 byte-order mark at the start of the file is dropped. A path of
    "-" reads standard input, as Unix tools do.
    Raises JobFileError when the file cannot be opened.
    """
    try:
        if path == "-":  # a copy of the descriptor: closing it leaves stdin open
            f = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
        else:
            f = open(path, "rb")  # noqa: SIM115 - closed below, generator owns it
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    with f:
        number = 0
        while True:
            raw = f.readline(config.MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > config.MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the long line
                    raw = f.readline(1 << 20)
                yield number, None
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield number, raw.rstrip(b"\r\n")


def validate_lines(
    path: str,
    model_override: str | None = None,
    check: Callable[[JobLine], LineError | None] | None = None,
) -> Iterator[Verdict]:
    """Validate a job file, yielding one Verdict per non-blank line, in file order.

    model_override replaces every line's `model`; `check` is an extra per-line check
    (the prompt-versus-context check, which needs a tokenizer). Duplicate custom_ids
    are reported on every line after the first. Raises JobFileError.
    """
    first_line: dict[str, int] = {}
    for number, raw in read_lines(path):
        if raw is None:
            too_long = LineError(number, None, f"line is longer than {config.MAX_LINE_BYTES} bytes")
            yield Verdict(number, None, (too_long,))
            continue
        if not raw.strip():
            continue
        results = parse_line(number, raw, model_override)
        cid = results[0].custom_id
        if cid is not None and cid in first_line:
            duplicate = LineError(
                number,
                "custom_id",
                f"duplicate {_show(cid)}, first used on line {first_line[cid]}",
            )
            # The line's outcome is stored under its line number, not the taken custom_id.
            kept = [replace(e, custom_id=None) for e in results if isinstance(e, LineError)]
            results = [duplicate, *kept]
        else:
            if cid is not None:
                first_line[cid] = number
            if isinstance(results[0], JobLine) and check is not None:
                problem = check(results[0])
                if problem is not None:
                    results = [problem]
        if isinstance(results[0], JobLine):
            yield Verdict(number, results[0])
        else:
            yield Verdict(number, None, tuple(results))


def validate_file(
    path: str,
    model_override: str | None = None,
    check: Callable[[JobLine], LineError | None] | None = None,
) -> Iterator[JobLine | LineError]:
    """`validate_lines`, flat: a JobLine or one or more LineErrors per non-blank line."""
    for verdict in validate_lines(path, model_override, check):
        if verdict.job is not None:
            yield verdict.job
        else:
            yield from verdict.errors


def validate(
    path: str,
    model_override: str | None,
    check: Callable[[JobLine], LineError | None] | None,
    on_error: Callable[[LineError], None],
) -> tuple[int, int]:
    """Validate the whole file, reporting every problem through on_error; returns the
    (valid, invalid) line counts. Raises JobFileError when the file cannot be read."""
    valid = invalid = 0
    for verdict in validate_lines(path, model_override, check):
        for error in verdict.errors:
            on_error(error)
        valid += verdict.job is not None
        invalid += verdict.job is None
    return valid, invalid


def parse_line(number: int, raw: bytes, model_override: str | None = None) -> list:
    """Parse one non-blank line: [JobLine] or a non-empty list of LineError."""
    try:
        return _parse_line(number, raw, model_override)
    except RecursionError:  # json and the checks below recurse once per level of nesting
        return [LineError(number, None, "not valid JSON: nested too deeply")]


def _parse_line(number: int, raw: bytes, model_override: str | None) -> list:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        return [LineError(number, None, f"not valid UTF-8: byte 0x{bad} at column {exc.start + 1}")]
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except _JsonProblem as exc:
        return [LineError(number, None, f"not valid JSON: {exc}")]
    except json.JSONDecodeError as exc:
        return [LineError(number, None, f"not valid JSON: {exc.msg} at column {exc.colno}")]
    if not isinstance(obj, dict):
        return [LineError(number, None, f"must be a JSON object, got {_json_type(obj)}")]

    raw_cid = obj.get("custom_id")
    cid = raw_cid if isinstance(raw_cid, str) and 1 <= len(raw_cid) <= MAX_CUSTOM_ID_CHARS else None
    errors: list[LineError] = []

    def err(field_name: str | None, message: str) -> None:
        errors.append(LineError(number, field_name, message, cid))

    if "custom_id" not in obj:
        err("custom_id", "required")
    elif not isinstance(raw_cid, str):
        err("custom_id", f"must be a string, got {_show(raw_cid)}")
    elif not 1 <= len(raw_cid) <= MAX_CUSTOM_ID_CHARS:
        err("custom_id", f"must be 1 to {MAX_CUSTOM_ID_CHARS} characters, got {len(raw_cid)}")

    envelope = any(k in obj for k in ("body", "method", "url"))
    url = None
    if envelope:
        prefix = "body."
        try:
            env = _Envelope.model_validate(obj)
            body, url = env.body, env.url
        except ValidationError as exc:
            for loc, message in _describe(exc):
                if loc != "custom_id":
                    err(loc, message)
            body = obj.get("body") if isinstance(obj.get("body"), dict) else None
            if body is None:
                return errors
    else:
        prefix = ""
        body = {k: v for k, v in obj.items() if k != "custom_id"}

    body = dict(body)
    for name, (harmless, why) in UNSUPPORTED_FIELDS.items():
        if name in body:
            value = body.pop(name)
            if value is not None and not any(_same(value, h) for h in harmless):
                err(prefix + name, f"not supported: {why}, got {_show(value)}")
    for name in SERVICE_FIELDS:
        if name in body:
            value = body.pop(name)
            if value is not None and not isinstance(value, str):
                err(prefix + name, f"must be a string, got {_show(value)}")
    asked = {f: body.pop(f) for f in CONSTRAINT_FIELDS if f in body}
    try:
        field_name, constraint = normalise(asked)
    except ConstraintError as exc:
        err(prefix + exc.field, exc.message)
        field_name, constraint = "", None
    try:
        parsed = _Body.model_validate(body)
    except ValidationError as exc:
        for loc, message in _describe(exc):
            err(prefix + loc, message)
        return errors

    endpoint = _endpoint(parsed, url, prefix, err)
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
        err(prefix + "max_completion_tokens", "cannot be combined with max_tokens")
    choices = _choices(parsed, prefix, err, endpoint)
    if errors:
        return errors
    if constraint is not None:  # compiled last: only a line otherwise valid costs a compile
        problem = check_constraint(field_name, constraint)
        if problem is not None:
            return [LineError(number, prefix + problem.field, problem.message, cid)]

    params: dict[str, Any] = {}
    if endpoint == "completion":
        params["prompt"] = parsed.prompt
    else:
        params["messages"] = [{"role": m.role, "content": m.content} for m in parsed.messages]
    spec = parsed.speculative or _Speculative()
    params.update(
        max_tokens=parsed.max_tokens or parsed.max_completion_tokens or JOB_FILE.max_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        top_k=parsed.top_k,
        min_p=parsed.min_p,
        seed=parsed.seed,
        stop=parsed.stop,
        num_draft_tokens=spec.num_draft_tokens,
        drafter=spec.drafter,
        **choices,
        constraint=constraint,
    )
    echo = {k: getattr(parsed, k) for k in ECHOED_FIELDS if getattr(parsed, k) is not None}
    model = model_override or parsed.model
    return [JobLine(number, raw_cid, endpoint, model, params, echo, prefix)]


def _choices(parsed: _Body, prefix: str, err, endpoint: Endpoint | None) -> dict[str, Any]:
    """The choice, log-probability, penalty and template parameters of a line, named as
    GenerationRequest's fields, each at its default when the line leaves it out (or
    null). Problems go to `err`; the completions endpoint's integer `logprobs` (its
    legacy shape) becomes logprobs=True with that many top log-probabilities."""
    n = JOB_FILE.n if parsed.n is None else parsed.n
    if parsed.best_of is not None and parsed.best_of not in (1, n):
        err(
            prefix + "best_of",
            f"not supported: best_of must equal n (every choice is returned), got {parsed.best_of}",
        )
    logprobs, top = JOB_FILE.logprobs, JOB_FILE.top_logprobs
    raw = parsed.logprobs
    if endpoint == "completion":
        if parsed.top_logprobs is not None:
            err(
                prefix + "top_logprobs",
                f"not allowed with {COMPLETION_URL}: give logprobs as an integer "
                f"from 0 to {MAX_COMPLETION_LOGPROBS}",
            )
        if raw is not None and raw is not False:
            if isinstance(raw, bool) or not isinstance(raw, int):
                err(
                    prefix + "logprobs",
                    f"must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} on {COMPLETION_URL}, "
                    f"got {_show(raw)}",
                )
            elif not 0 <= raw <= MAX_COMPLETION_LOGPROBS:
                err(
                    prefix + "logprobs",
                    f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {raw}",
                )
            else:
                logprobs, top = True, raw
        if parsed.chat_template_kwargs:
            err(
                prefix + "chat_template_kwargs",
                f"not allowed with {COMPLETION_URL} (a prompt has no chat template)",
            )
    elif endpoint == "chat":
        if raw is not None and not isinstance(raw, bool):
            err(prefix + "logprobs", f"must be true or false, got {_show(raw)}")
        else:
            logprobs = bool(raw)
        if parsed.top_logprobs is not None:
            if parsed.top_logprobs and not logprobs:
                err(prefix + "top_logprobs", "requires logprobs: true")
            top = parsed.top_logprobs
    return {
        "n": n,
        "logprobs": logprobs,
        "top_logprobs": top,
        "frequency_penalty": _number(parsed.frequency_penalty, JOB_FILE.frequency_penalty),
        "presence_penalty": _number(parsed.presence_penalty, JOB_FILE.presence_penalty),
        "repetition_penalty": _number(parsed.repetition_penalty, JOB_FILE.repetition_penalty),
        "logit_bias": parsed.logit_bias or JOB_FILE.logit_bias,
        "chat_template_kwargs": parsed.chat_template_kwargs or JOB_FILE.chat_template_kwargs,
    }


def _number(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def _endpoint(parsed: _Body, url: str | None, prefix: str, err) -> Endpoint | None:
    has_prompt, has_messages = parsed.prompt is not None, parsed.messages is not None
    if url == CHAT_URL:
        if has_prompt:
            err(prefix + "prompt", f"not allowed with url {CHAT_URL} (use messages)")
        elif not has_messages:
            err(prefix + "messages", f"required with url {CHAT_URL}")
        return "chat"
    if url == COMPLETION_URL:
        if has_messages:
            err(prefix + "messages", f"not allowed with url {COMPLETION_URL} (use prompt)")
        elif not has_prompt:
            err(prefix + "prompt", f"required with url {COMPLETION_URL}")
        return "completion"
    if has_prompt and has_messages:
        err(prefix + "messages", "cannot be combined with prompt: give exactly one")
        return None
    if not has_prompt and not has_messages:
        err(prefix + "prompt", "one of prompt or messages is required")
        return None
    return "completion" if has_prompt else "chat"


# --- messages ----------------------------------------------------------------------------

_MESSAGES = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer, got {input}",
    "float_type": "must be a number, got {input}",
    "string_type": "must be a string, got {input}",
    "bool_type": "must be true or false, got {input}",
    "list_type": "must be a list, got {input}",
    "dict_type": "must be an object, got {input}",
    "model_type": "must be an object, got {input}",
    "model_attributes_type": "must be an object, got {input}",
    "literal_error": "must be {expected}, got {input}",
    "greater_than_equal": "must be >= {ge}, got {input}",
    "greater_than": "must be > {gt}, got {input}",
    "less_than_equal": "must be <= {le}, got {input}",
    "less_than": "must be < {lt}, got {input}",
    "too_short": "must not be empty",
    "finite_number": "must be a finite number",
}


def _describe(exc: ValidationError) -> list[tuple[str, str]]:
    """(field path, message) for every problem pydantic found, in our words."""
    out = []
    for e in exc.errors(include_url=False):
        loc = _loc(e["loc"])
        template = _MESSAGES.get(e["type"])
        ctx = dict(e.get("ctx") or {})
        if e["type"] == "value_error":
            message = str(ctx.get("error", e["msg"]))
        elif template:
            ctx["input"] = _show(e.get("input"))
            message = template.format(**{k: _num(v) for k, v in ctx.items()})
        else:
            message = f"{e['msg']}, got {_show(e.get('input'))}"
        out.append((loc, message))
    return out


def _loc(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _num(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _show(value: Any, limit: int = 60) -> str:
    """A value as the user wrote it (JSON), shortened."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def _same(value: Any, harmless: Any) -> bool:
    if isinstance(value, bool) != isinstance(harmless, bool):
        return False
    return value == harmless


class _JsonProblem(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _JsonProblem(f"duplicate key {_show(key)}")
        seen[key] = value
    return seen


def _no_constant(name: str) -> float:
    raise _JsonProblem(f"{name} is not allowed (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonProblem(f"{text} is out of range (numbers must be finite)")
    return value
