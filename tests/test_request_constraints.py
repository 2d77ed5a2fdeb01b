"""contract.constraints: the grammar text each constraint compiles to matches what
llguidance itself builds and accepts exactly the outputs the constraint allows."""

from __future__ import annotations

import json

import pytest

from contract.constraints import ConstraintError, grammar, key, normalise

llguidance = pytest.importorskip("llguidance")

REGEXES = ["a/b", r"[a-z]+\/", "x\ny", "tab\there", r"a\\/b", r"\d{3}-\d{4}", r"(\/\/)?[^/]+"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_a_regex_becomes_the_terminal_llguidance_writes(pattern):
    text = json.loads(grammar({"type": "regex", "pattern": pattern}))
    assert (
        text["grammars"][0]["lark_grammar"] == "start: /" + llguidance.regex_to_lark(pattern) + "/"
    )


@pytest.fixture(scope="module")
def matcher():
    from llguidance.hf import from_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from jobstore.config import DEMO_PAIR_DIR

    tok = Tokenizer.from_file(str(DEMO_PAIR_DIR / "target" / "tokenizer.json"))
    ll = from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))

    def accepts(constraint: dict, text: str) -> bool:
        m = llguidance.LLMatcher(ll, grammar(constraint))
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()

    return accepts


@pytest.mark.parametrize("text", ["a/b", "ab/", "x\ny", "tab\there"])
def test_regex_outputs_match(matcher, text):
    patterns = {"a/b": "a/b", "ab/": r"[a-z]+\/", "x\ny": "x\ny", "tab\there": "tab\there"}
    assert matcher({"type": "regex", "pattern": patterns[text]}, text)
    assert not matcher({"type": "regex", "pattern": patterns[text]}, text + "!")


def test_choices_with_quotes_escapes_and_unicode_are_matched_exactly(matcher):
    choices = ['say "hi"', "back\\slash", "new\nline", "ctl\x01x", "é 你好", "a/b"]
    c = {"type": "choice", "choices": choices}
    assert all(matcher(c, choice) for choice in choices)
    assert not matcher(c, "say hi")


def test_json_is_compact_unless_asked(matcher):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = {"type": "json_schema", "schema": schema, "whitespace_flexible": False}
    assert matcher(compact, '{"a":12}') and not matcher(compact, '{ "a": 12}')
    flexible = {**compact, "whitespace_flexible": True}
    assert matcher(flexible, '{ "a": 12}')


def test_one_constraint_per_line_and_a_stable_key(matcher):
    _, a = normalise({"guided_json": '{"type": "object", "properties": {"x": {}}}'})
    _, b = normalise({"structured_outputs": {"json": {"type": "object", "properties": {"x": {}}}}})
    assert key(a) == key(b)
    # Property order is output order: such schemas must not share a compiled grammar.
    props = {"x": {"type": "integer"}, "y": {"type": "integer"}}
    xy = {
        "type": "json_schema",
        "schema": {"type": "object", "properties": props, "required": ["x", "y"]},
    }
    yx = json.loads(json.dumps(xy))
    yx["schema"]["properties"] = {"y": props["y"], "x": props["x"]}
    assert matcher(xy, '{"x":1,"y":2}') and matcher(yx, '{"y":2,"x":1}')
    assert not matcher(xy, '{"y":2,"x":1}')
    assert key(xy) != key(yx)
    with pytest.raises(ConstraintError) as exc:
        normalise({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}})
    assert exc.value.field == "guided_choice"
    assert normalise({"response_format": {"type": "text"}, "guided_regex": None}) == ("", None)
