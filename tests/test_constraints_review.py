"""Review cases of the logits pipeline under speculation: where a constraint, a
penalty or logprobs meet a draft in a way the main tests (test_constraints.py) do not
reach."""

from __future__ import annotations

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare as pearson

from contract import constraints
from engine import processors, sampling
from engine.batch import BatchDecoder

V6 = ["<e>", "a", "b", "c", "d", "e"]


@pytest.fixture(scope="module")
def v6(tmp_path_factory):
    from test_engine_sampling import small_vocab_pair
    from tokenizers import Tokenizer, decoders, models

    pair = small_vocab_pair.__wrapped__(tmp_path_factory)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(V6)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<e>"])
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=6, eos_token=0)
    executor = llguidance.LLExecutor()
    pair._grammars = type("G", (), {"executor": executor})()
    return pair, lltok


def _matcher(lltok, pattern: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(
        lltok, constraints.grammar({"type": "regex", "pattern": pattern}), log_level=0
    )
    assert not m.is_error(), m.get_error()
    return m


def _first_tokens(pair, lltok, pattern, prompt, params, n, k=1) -> np.ndarray:
    """Counts of the first token over n seeds, every row drafting k tokens by the model."""
    batch = BatchDecoder(pair)
    counts = np.zeros(6, np.int64)
    for start in range(0, n, 50):
        keys = range(start, min(n, start + 50))
        for s in keys:
            row = processors.RowLogits(vocab=6, eos=(0,), matcher=_matcher(lltok, pattern))
            batch.add(
                s, prompt, params, seed=s, drafter="model", num_draft_tokens=k,
                max_tokens=k + 1, logits=row,
            )  # fmt: skip
        for s, step in batch.step().items():
            counts[step.tokens[0]] += 1
            batch.remove(s)
    return counts


def test_a_sampled_draft_the_grammar_refuses_still_leaves_the_target_law(v6):
    """A model draft is drawn from q; cutting it at a refused token and sampling that
    position from p instead of the residual (p - q)+ skews the law (here p(a) 0.40 ->
    0.60: the draft model puts most of its mass on tokens the grammar forbids)."""
    pair, lltok = v6
    prompt, params = [5, 2], sampling.SamplingParams(temperature=2.0)
    raw = np.array(pair.target(mx.array([prompt]))[0, -1])
    raw[[0, 2, 4, 5]] = -np.inf  # the grammar "[ac]" allows a and c first
    p = np.array(sampling.probs(mx.array(raw), params), dtype=np.float64)
    q = np.array(sampling.probs(pair.draft(mx.array([prompt]))[0, -1], params))
    assert q[[0, 2, 4, 5]].sum() > 0.3  # the draft often proposes a refused token
    counts = _first_tokens(pair, lltok, "[ac]", prompt, params, 600)
    assert counts[[0, 2, 4, 5]].sum() == 0
    keep = p > 0
    expected = p[keep] / p[keep].sum() * counts.sum()
    assert pearson(counts[keep], expected).pvalue > 1e-6, (counts, p)


def test_a_refused_token_after_the_think_end_leaves_the_grammar_usable(v6):
    """The masks of a thinking row walk the drafts after its think-end token; a token the
    grammar refuses there (a drawn draft keeps it) must not put the matcher in error."""
    _, lltok = v6
    row = processors.RowLogits(vocab=6, eos=(0,), matcher=_matcher(lltok, "[ac]"), gate=4)
    drafts = [1, 4, 2, 5]  # thinking "a", the think-end "d", then "b": refused
    allowed = processors._masks([row], [drafts], 5, 6, llguidance.LLExecutor())[0]
    assert allowed[:2].all() and allowed[2].tolist() == [False, True, False, True, False, False]
    assert not row.matcher.is_error()
    row.commit([1, 4, 3])  # the think-end, then "c": the grammar takes it
    assert row.matcher.is_accepting()


# -- closing objects: OpenAI's strict mode, except where an object is spread over parts --

INT = {"type": "integer"}
BASE = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
#: Objects whose keys are not all in their own `properties` (each a valid, satisfiable schema).
SPREAD = {
    "allOf": {"allOf": [BASE, {"properties": {"b": INT}, "required": ["b"]}]},
    "$ref beside properties": {
        "$defs": {"Base": BASE},
        "$ref": "#/$defs/Base",
        "properties": {"b": INT},
        "required": ["b"],
    },
    "allOf of a $ref": {
        "definitions": {"Base": BASE},
        "allOf": [{"$ref": "#/definitions/Base"}, {"properties": {"b": INT}, "required": ["b"]}],
    },
    "anyOf beside properties": {
        "type": "object",
        "properties": {"b": INT},
        "required": ["b"],
        "anyOf": [BASE, {"properties": {"c": INT}, "required": ["c"]}],
    },
    "required beyond properties": {"type": "object", "properties": {"a": INT}, "required": ["b"]},
}


@pytest.mark.parametrize("name", list(SPREAD))
def test_an_object_with_keys_beyond_its_properties_stays_compilable_and_open(name):
    schema = SPREAD[name]
    doc = {"a": 1, "b": 2}
    import jsonschema

    jsonschema.validate(doc, schema)
    jsonschema.validate(doc, constraints.closed(schema))  # closing refused "b"
    grammar = constraints.grammar({"type": "json_schema", "schema": schema})
    assert not llguidance.LLMatcher.validate_grammar(grammar, None)


def test_objects_that_are_whole_are_still_closed():
    nested = {"type": "object", "properties": {"x": BASE}}
    spread = {
        "$defs": {"Base": BASE, "Other": BASE},
        "type": "object",
        "properties": {
            "one": {"allOf": [{"$ref": "#/$defs/Other"}]},  # one part: no intersection
            "two": SPREAD["$ref beside properties"] | {"$defs": None},
        },
    }
    out = constraints.closed(nested)
    assert out["additionalProperties"] is False
    assert out["properties"]["x"]["additionalProperties"] is False
    out = constraints.closed(spread)
    assert out["additionalProperties"] is False
    assert out["$defs"]["Other"]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["Base"]  # a part of "two"
    assert "additionalProperties" not in out["properties"]["two"]
    assert (
        nested == {"type": "object", "properties": {"x": BASE}}
        and "additionalProperties" not in BASE
    )


REGEXES = [
    r"a/b",
    r"a\/b",
    r"\//",
    "/\\//",
    r"\\",
    "a\nb\tc\rd",
    r"\d+\.\w*",
    r"[/]x",
    "é{2}",
    r'"q"',
]


def test_a_regex_becomes_the_grammar_llguidance_builds_for_it():
    # An escaped slash ("\/", usual in regexes written for JavaScript) did not compile.
    for pattern in REGEXES:
        mine = constraints.grammar({"type": "regex", "pattern": pattern})
        assert mine == llguidance.LLMatcher.grammar_from_regex(pattern), pattern
        assert not llguidance.LLMatcher.validate_grammar(mine, None), pattern


# -- malformed constraints: the row is refused, the batch goes on --------------------------


def test_a_malformed_constraint_is_a_request_error_and_its_batch_goes_on(tmp_path):
    from tiny_models import tiny_pair

    import engine
    from engine import GenerationRequest

    pair = tiny_pair(tmp_path)
    bad = {"type": "object", "x-guidance": 5}
    with pytest.raises(constraints.ConstraintError, match=r"guided_json\.x-guidance: must be"):
        constraints.normalise({"guided_json": bad})
    requests = [
        GenerationRequest(prompt="x", max_tokens=3, constraint=c)
        for c in (
            {"type": "json_schema", "schema": bad},
            {"type": "regex"},
            None,
            {"type": "ebnf", "grammar": "x"},
        )
    ]
    out = dict(engine.generate_many(pair, requests))
    assert isinstance(out[0], engine.InvalidRequestError) and "x-guidance" in str(out[0])
    assert isinstance(out[1], engine.InvalidRequestError) and "pattern" in str(out[1])
    assert isinstance(out[3], engine.InvalidRequestError) and "ebnf" in str(out[3])
    assert len(out[2].token_ids) == 3


# -- chat_template_kwargs against templates with Jinja extensions ---------------------------


def test_chat_template_kwargs_are_checked_in_templates_that_break_out_of_loops():
    from types import SimpleNamespace

    from engine import InvalidRequestError
    from engine.text import _template_kwargs

    def pair(template):
        return SimpleNamespace(name="t", tokenizer=SimpleNamespace(chat_template=template))

    loops = (
        "{% for m in messages %}{% if loop.index > 4 %}{% break %}{% endif %}{{ m }}"
        "{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    assert _template_kwargs(pair(loops), {"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(InvalidRequestError, match="enable_thinkin: not a variable"):
        _template_kwargs(pair(loops), {"enable_thinkin": False})
    # A tag of an extension the check does not know: the tokenizer renders it as it can.
    tracked = "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}"
    assert _template_kwargs(pair(tracked), {"x": 1}) == {"x": 1}


# -- logprobs: a token's own bytes ------------------------------------------------------------


def test_logprobs_bytes_are_the_tokens_own_so_pieces_of_a_character_join_up(tmp_path):
    from tiny_models import tiny_pair

    import engine
    from engine import GenerationRequest

    pair = tiny_pair(tmp_path)
    assert len(pair.tokenizer.encode("é", add_special_tokens=False)) == 2  # a byte a token
    req = GenerationRequest(
        prompt="x",
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        constraint={"type": "regex", "pattern": "é"},
    )
    res = engine.generate(pair, req)
    assert res.text == "é" and len(res.logprobs) == 2
    assert bytes(b for e in res.logprobs for b in e["bytes"]) == "é".encode()
    assert [e["bytes"] for e in res.logprobs] == [[0xC3], [0xA9]]


def test_messages_a_template_refuses_and_kwargs_the_engine_sets_are_request_errors(tmp_path):
    import json

    from tiny_models import tiny_pair

    import engine
    from engine import GenerationRequest

    pair = tiny_pair(tmp_path)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    (tmp_path / "target" / "tokenizer_config.json").write_text(json.dumps(config))
    pair = engine.load_pair(tmp_path / "target", tmp_path / "draft")
    user = {"role": "user", "content": "hi"}
    requests = [
        GenerationRequest(messages=[user, user], max_tokens=2),
        GenerationRequest(messages=[user], max_tokens=2, chat_template_kwargs={"messages": []}),
        GenerationRequest(
            messages=[user], max_tokens=2, chat_template_kwargs={"add_generation_prompt": False}
        ),
        GenerationRequest(messages=[user], max_tokens=2),
    ]
    out = dict(engine.generate_many(pair, requests))
    assert "roles must alternate" in str(out[0]) and str(out[0]).startswith("messages:")
    assert "chat_template_kwargs.messages: the engine sets it" in str(out[1])
    assert "chat_template_kwargs.add_generation_prompt: the engine sets it" in str(out[2])
    assert all(isinstance(out[i], engine.InvalidRequestError) for i in (0, 1, 2))
    assert len(out[3].token_ids) == 2
