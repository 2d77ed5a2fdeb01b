"""Structured outputs and the per-row logits pipeline, exact under speculation.

Greedy output under a constraint (a JSON schema, a regex, a choice, a Lark grammar) and
under penalties and biases equals target-only decoding with mlx-lm's own `generate_step`
and a logits processor written here from the definitions (llguidance's mask of the
tokens the grammar allows, OpenAI's penalty formula, vLLM's repetition penalty): for
every drafter kind, single and batched (rows of different constraints beside
unconstrained rows), with the prefix cache on. Log-probabilities equal the target's
raw log-softmax. Broken copies of the pipeline (a mask one position late, penalties
that do not count the drafts of the same pass, a grammar never rolled back) fail.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.generate import generate_step
from tiny_models import tiny_pair

import engine
from engine import GenerationRequest, processors
from engine.text import grammars

PROMPTS = ["def fibonacci(n):", "import os\n", "The quick brown fox"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3},
        "nick": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["name", "age", "tags"],
}
NESTED = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": -5, "maximum": 5},
                "y": {"type": "integer"},
            },
            "required": ["x", "y"],
        }
    },
    "type": "object",
    "properties": {
        "kind": {"enum": ["line", "dot"]},
        "at": {"$ref": "#/$defs/point"},
        "label": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    "required": ["kind", "at"],
}


def schema(s: dict) -> dict:
    return {"type": "json_schema", "schema": s, "whitespace_flexible": False}


CONSTRAINTS = {
    "person": schema(PERSON),
    "nested": schema(NESTED),
    "object": schema({"type": "object"}),
    "regex": {"type": "regex", "pattern": r"[a-c]{2,5}-\d{1,3}"},
    "choice": {"type": "choice", "choices": ["yes", "no", "maybe so"]},
    "grammar": {"type": "grammar", "grammar": 'start: "(" item ("," item)* ")"\nitem: /[0-9]+/'},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("constraints"))


def reference(pair, request: GenerationRequest) -> list[int]:
    """Target-only greedy tokens (EOS excluded) under the request's processors, through
    mlx-lm's generate_step with a logits processor written from the definitions."""
    ids = pair.tokenizer.encode(request.prompt)
    vocab = pair.target_vocab
    matcher = grammars(pair).matcher(request.constraint) if request.constraint else None
    fed = {"n": len(ids)}

    def process(tokens, logits):
        tokens = tokens.tolist()
        out = tokens[len(ids) :]
        if matcher is not None:
            for t in tokens[fed["n"] :]:
                assert matcher.consume_token(t)
            fed["n"] = len(tokens)
        x = np.array(logits[0].astype(mx.float32))
        for t, b in (request.logit_bias or {}).items():
            x[int(t)] += b
        if request.repetition_penalty != 1.0:
            for t in set(ids + out):
                x[t] = (
                    x[t] / request.repetition_penalty
                    if x[t] > 0
                    else x[t] * request.repetition_penalty
                )
        for t, c in Counter(out).items():
            x[t] -= c * request.frequency_penalty + request.presence_penalty
        if matcher is not None:
            bits = allocate_token_bitmask(1, vocab)
            fill_next_token_bitmask(matcher, bits)
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            x[~allowed] = -np.inf
        return mx.array(x)[None]

    out = []
    for token, _ in generate_step(
        mx.array(ids), pair.target, max_tokens=request.max_tokens, logits_processors=[process]
    ):
        token = int(token)
        if token in pair.tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


def _requests(drafter: str, k, constraints, max_tokens: int = 40, **extra) -> list:
    return [
        GenerationRequest(
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=max_tokens,
            constraint=c,
            drafter=drafter,
            num_draft_tokens=k,
            **extra,
        )
        for i, c in enumerate(constraints)
    ]


def _check_exact(pair, requests, max_batch: int = 8) -> list:
    refs = [reference(pair, r) for r in requests]
    single = [engine.generate(pair, r) for r in requests]
    batched = dict(engine.generate_many(pair, requests, max_batch=max_batch))
    for i, (r, ref) in enumerate(zip(requests, refs, strict=True)):
        assert single[i].token_ids == ref, (i, r.constraint, r.drafter)
        assert batched[i].token_ids == ref, (i, r.constraint, r.drafter)
        if r.logprobs and ref:  # the target's raw log-softmax, from one pass over the text
            ids = pair.tokenizer.encode(r.prompt)
            logits = pair.target(mx.array([ids + ref]))[0, len(ids) - 1 : len(ids) - 1 + len(ref)]
            want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            for res in (single[i], batched[i]):
                got = [e["logprob"] for e in res.logprobs]
                assert np.allclose(got, want[np.arange(len(ref)), ref], atol=1e-4), i
    return single


@pytest.mark.parametrize("drafter,k", [("model", 3), ("model", "auto"), ("lookup", 2), ("none", 1)])
def test_greedy_under_every_constraint_equals_target_only_single_and_batched(pair, drafter, k):
    mixed = list(CONSTRAINTS.values()) + [None, CONSTRAINTS["person"]]
    results = _check_exact(pair, _requests(drafter, k, mixed))
    for r, c in zip(results, mixed, strict=True):
        if r.finish_reason != "stop" or c is None:
            continue
        if c["type"] == "json_schema":
            jsonschema.validate(json.loads(r.text), c["schema"])
        elif c["type"] == "choice":
            assert r.text in c["choices"]
    # A bounded grammar ends its row: finish_reason "stop", the text complete.
    names = list(CONSTRAINTS)
    for name in ("regex", "choice"):
        assert results[names.index(name)].finish_reason == "stop", name


def test_forced_tokens_are_proposed_for_free_and_counted_apart(pair):
    req = _requests("none", 1, [CONSTRAINTS["person"]], max_tokens=60)[0]
    res = engine.generate(pair, req)
    spec = res.metrics["speculative_decoding"]
    # '{"name":"' and the other fixed keys come from the grammar, not a draft.
    assert spec["num_forced_tokens"] >= 4
    assert spec["num_draft_tokens"] == 0 and spec["num_spec_steps"] < len(res.token_ids)
    # Without a constraint nothing is forced, and the field is absent.
    plain = engine.generate(pair, _requests("none", 1, [None])[0])
    assert "num_forced_tokens" not in plain.metrics["speculative_decoding"]


def test_json_outputs_validate_over_many_prompts_and_max_tokens_cuts_with_length(pair):
    reqs = [
        GenerationRequest(
            prompt=p, max_tokens=80, constraint=CONSTRAINTS[name], temperature=0.8, seed=s
        )
        for s, (p, name) in enumerate(
            (p, n) for p in PROMPTS for n in ("person", "nested", "object")
        )
    ]
    for i, res in engine.generate_many(pair, reqs, max_batch=6):
        if res.finish_reason == "stop":
            value = json.loads(res.text)
            jsonschema.validate(value, reqs[i].constraint["schema"])
    short = engine.generate(pair, _requests("model", 2, [CONSTRAINTS["person"]], max_tokens=5)[0])
    assert short.finish_reason == "length" and len(short.token_ids) == 5


def test_penalties_and_bias_greedy_equal_the_reference(pair):
    extra = dict(
        frequency_penalty=0.8,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={"40": 3.0, 41: -100},
    )
    for drafter, k in (("model", 3), ("lookup", 3), ("model", "auto")):
        reqs = _requests(drafter, k, [None, CONSTRAINTS["regex"], None], max_tokens=30, **extra)
        _check_exact(pair, reqs)
    # The penalties change the text (the test is not vacuous).
    assert engine.generate(pair, _requests("none", 1, [None], 30)[0]).token_ids != reference(
        pair, _requests("none", 1, [None], 30, **extra)[0]
    )


def _penalised(logits: np.ndarray, prompt, out, bias, freq, pres, rep) -> np.ndarray:
    x = logits.copy()
    for t, b in bias.items():
        x[t] += b
    for t in set(prompt + out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(out).items():
        x[t] -= c * freq + pres
    return x


def test_each_verified_position_counts_the_drafts_before_it():
    """Position i of a pass is penalised for the output so far and drafts d[:i]."""
    rng = np.random.default_rng(3)
    vocab, bias = 16, {3: 2.0, 5: -1.0}
    rows = [
        processors.RowLogits(
            vocab=vocab,
            eos=(0,),
            bias=bias,
            frequency=0.5,
            presence=0.25,
            repetition=1.5,
            prompt=[1, 2],
        ),
        None,
        processors.RowLogits(vocab=vocab, eos=(0,), frequency=-0.7, presence=1.0, prompt=[]),
    ]
    rows[0].commit([4, 4])
    rows[2].commit([5])
    drafts = [[4, 5, 5, 9], [7], [5, 5]]
    logits = rng.normal(size=(3, 5, vocab)).astype(np.float32)
    got = np.array(processors.process(mx.array(logits), rows, drafts, None))
    assert np.array_equal(got[1], logits[1])
    for i in range(5):
        want0 = _penalised(logits[0, i], [1, 2], [4, 4] + drafts[0][:i], bias, 0.5, 0.25, 1.5)
        np.testing.assert_allclose(got[0, i], want0, rtol=1e-6)
        if i <= len(drafts[2]):
            want2 = _penalised(logits[2, i], [], [5] + drafts[2][:i], {}, -0.7, 1.0, 1.0)
            np.testing.assert_allclose(got[2, i], want2, rtol=1e-6)


def test_penalties_that_forget_the_drafts_of_the_same_pass_fail(pair, monkeypatch):
    # End to end: a draft that is the target itself proposes the unpenalised text, which
    # a pass must judge with the penalties of its own earlier drafts.
    twin = dataclasses.replace(pair, draft=pair.target)
    reqs = _requests("model", 6, [None] * 3, max_tokens=40, frequency_penalty=0.4)
    _check_exact(twin, reqs)
    monkeypatch.setattr(processors, "_draft_entries", lambda procs, drafts, width, vocab: None)
    with pytest.raises(AssertionError):
        test_each_verified_position_counts_the_drafts_before_it()
    with pytest.raises(AssertionError):
        _check_exact(twin, reqs)


def test_a_mask_one_position_late_fails(pair, monkeypatch):
    real = processors._allowed

    def late(bitmask, procs, width, vocab):
        m = real(bitmask, procs, width, vocab)
        return np.concatenate([np.ones_like(m[:, :1]), m[:, :-1]], axis=1)

    monkeypatch.setattr(processors, "_allowed", late)
    # Wrong tokens, or a grammar refusing what was emitted.
    with pytest.raises((AssertionError, processors.GrammarStateError)):
        _check_exact(pair, _requests("model", 3, [CONSTRAINTS["person"], CONSTRAINTS["regex"]]))


def test_grammar_state_follows_random_accept_and_reject_patterns(pair):
    """Random drafts, random acceptance: every step's masks equal those of a matcher
    replayed from scratch over the emitted text and the drafts before each position."""
    rng = random.Random(7)
    g = grammars(pair)
    con = CONSTRAINTS["nested"]
    for trial in range(8):
        row = processors.RowLogits(
            vocab=pair.target_vocab, eos=tuple(pair.tokenizer.eos_token_ids), matcher=g.matcher(con)
        )
        emitted: list[int] = []
        for _ in range(30):
            fresh = g.matcher(con)
            assert fresh.consume_tokens(emitted)
            if fresh.is_stopped():
                break
            # A draft the grammar allows (walk it), then a few random tokens after it.
            draft = []
            walker = fresh.deep_copy()
            for _ in range(rng.randint(0, 5)):
                bits = allocate_token_bitmask(1, pair.target_vocab)
                fill_next_token_bitmask(walker, bits)
                ok = np.nonzero(
                    np.unpackbits(bits.view(np.uint8), bitorder="little")[: pair.target_vocab]
                )[0]
                if len(ok) == 0 or walker.is_stopped():
                    break
                t = int(rng.choice(list(ok)))
                if t in pair.tokenizer.eos_token_ids:
                    break
                draft.append(t)
                walker.consume_token(t)
            draft += [rng.randrange(pair.target_vocab) for _ in range(rng.randint(0, 2))]
            draft = row.trim(draft)
            width = len(draft) + 1
            got = processors._masks([row], [draft], width, pair.target_vocab, g.executor)[0]
            for i in range(width):
                ref = fresh.deep_copy()
                assert ref.consume_tokens(draft[:i])
                bits = allocate_token_bitmask(1, pair.target_vocab)
                fill_next_token_bitmask(ref, bits)
                want = np.unpackbits(bits.view(np.uint8), bitorder="little")[
                    : pair.target_vocab
                ].astype(bool)
                if not want.any():
                    want[list(pair.tokenizer.eos_token_ids)] = True
                assert (got[i] == want).all(), (trial, i)
            n = rng.randint(0, len(draft))  # accepted drafts; the next token from the mask
            allowed = np.nonzero(got[n])[0]
            nxt = int(rng.choice(list(allowed)))
            step = draft[:n] + [nxt]
            row.commit(step)
            emitted += step
            if nxt in pair.tokenizer.eos_token_ids:
                break


def test_a_grammar_that_is_never_fed_the_emitted_tokens_fails(pair, monkeypatch):
    monkeypatch.setattr(processors.RowLogits, "commit", lambda self, emitted: None)
    with pytest.raises(AssertionError):
        _check_exact(pair, _requests("model", 3, [CONSTRAINTS["person"]] * 2))


def test_the_second_row_with_a_schema_compiles_nothing(pair):
    g = grammars(pair)
    unique = schema({"type": "object", "properties": {"zz": {"type": "integer"}}})
    before = g.compiles
    engine.generate(pair, GenerationRequest(prompt="x", max_tokens=4, constraint=unique))
    engine.generate(pair, GenerationRequest(prompt="y", max_tokens=4, constraint=unique))
    assert g.compiles == before + 1


def test_a_grammar_that_does_not_compile_is_a_request_error(pair):
    bad = {"type": "regex", "pattern": "a(b"}
    with pytest.raises(engine.InvalidRequestError, match="regex: does not compile"):
        engine.generate(pair, GenerationRequest(prompt="x", max_tokens=4, constraint=bad))


def test_logprobs_are_the_targets_raw_log_softmax_single_and_batched(pair):
    reqs = [
        GenerationRequest(
            prompt=p,
            max_tokens=12,
            logprobs=True,
            top_logprobs=3,
            drafter=d,
            num_draft_tokens=k,
            constraint=c,
        )
        for p, (d, k), c in zip(
            PROMPTS,
            (("model", 3), ("lookup", 2), ("none", 1)),
            (None, CONSTRAINTS["regex"], None),
            strict=True,
        )
    ]
    batched = dict(engine.generate_many(pair, reqs, max_batch=3))
    for i, r in enumerate(reqs):
        single = engine.generate(pair, r)
        ids = pair.tokenizer.encode(r.prompt)
        toks = single.token_ids
        logits = pair.target(mx.array([ids + toks]))[0, len(ids) - 1 : len(ids) - 1 + len(toks)]
        ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for res in (single, batched[i]):
            assert len(res.logprobs) == len(toks)
            for j, (t, entry) in enumerate(zip(toks, res.logprobs, strict=True)):
                assert abs(entry["logprob"] - ref[j, t]) < 1e-4
                order = sorted(range(ref.shape[1]), key=lambda v: (-ref[j, v], v))[:3]
                assert [e["token"] for e in entry["top_logprobs"]] == [
                    pair.tokenizer.decode([v]) for v in order
                ]
                assert all(
                    abs(e["logprob"] - ref[j, v]) < 1e-4
                    for e, v in zip(entry["top_logprobs"], order, strict=True)
                )
                # The token's own bytes (one byte of a character has no text of its own).
                assert bytes(entry["bytes"]) == grammars(pair).tokenizer.decode_bytes([t])
    assert engine.generate(pair, GenerationRequest(prompt="x", max_tokens=3)).logprobs is None


def test_n_choices_each_equal_the_request_alone_with_its_derived_seed(pair):
    req = GenerationRequest(prompt="def f", max_tokens=10, temperature=0.9, seed=5, n=4)
    results = engine.generate_choices(pair, req)
    assert len(results) == 4
    for i, (res, alone) in enumerate(zip(results, engine.choice_requests(req), strict=True)):
        assert alone.seed == (5 if i == 0 else alone.seed) and alone.n == 1
        assert res.token_ids == engine.generate(pair, alone).token_ids
    assert len({tuple(r.token_ids) for r in results}) > 1
    greedy = engine.generate_choices(pair, GenerationRequest(prompt="def f", max_tokens=10, n=3))
    assert len({tuple(r.token_ids) for r in greedy}) == 1


# -- every drafter kind, the prefix cache on ------------------------------------------------


def _kind_pair(kind: str, tmp):
    from drafter_checks import family_target
    from test_dflash2 import dflash2_config, write_drafter
    from tiny_families import build_model, tokenizer_dir
    from tiny_heads import add_mtp_head, build_eagle3

    if kind == "dflash":
        return engine.load_pair(
            draft=engine.loading.DEMO_DIR / "dflash", prefix_cache_bytes=1 << 24
        )
    if kind == "dflash2":
        target, vocab, layers = family_target(tmp, "llama")
        write_drafter(tmp / "d2", dflash2_config(vocab, layers, sliding_window=6), seed=3)
        return engine.load_pair(target, tmp / "d2", prefix_cache_bytes=1 << 24)
    tok, vocab = tokenizer_dir(tmp)
    if kind == "mtp":
        target = build_model(tmp / "q", "qwen3_5", vocab_size=vocab, tokenizer_from=tok)
        add_mtp_head(target)
        return engine.load_pair(target, "mtp", prefix_cache_bytes=1 << 24)
    target = build_model(tmp / "llama", "llama", vocab_size=vocab, tokenizer_from=tok)
    head = build_eagle3(tmp / "e3", target, aux_ids=[1, 2, 2], draft_vocab=list(range(0, vocab, 2)))
    return engine.load_pair(target, head, prefix_cache_bytes=1 << 24)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mtp", "eagle3"])
def test_every_drafter_kind_is_exact_under_constraints_with_the_prefix_cache(kind, tmp_path):
    pair = _kind_pair(kind, tmp_path)
    mixed = [CONSTRAINTS["person"], None, CONSTRAINTS["regex"], CONSTRAINTS["nested"]]
    for k in (3, "auto"):
        reqs = _requests(
            "model", k, mixed, max_tokens=30, frequency_penalty=0.3, logprobs=True, top_logprobs=2
        )
        results = _check_exact(pair, reqs, max_batch=3)
    assert {r.stats.drafter for r in results} == {kind}


def test_rows_started_from_the_prefix_cache_are_exact_under_constraints(pair):
    system = "You are a careful assistant who writes records. " * 6
    reqs = [
        GenerationRequest(
            prompt=system + p, max_tokens=30, constraint=c, drafter=d, num_draft_tokens=k
        )
        for p, c, (d, k) in zip(
            PROMPTS * 2,
            [CONSTRAINTS["person"], None, CONSTRAINTS["regex"]] * 2,
            [("model", 3), ("lookup", 2), ("model", "auto")] * 2,
            strict=True,
        )
    ]
    _check_exact(pair, reqs[:1])  # keeps the shared prefix
    results = _check_exact(pair, reqs, max_batch=4)
    assert all(r.usage["prompt_tokens_details"]["cached_tokens"] > 0 for r in results)


# -- sampling follows the processed target law ----------------------------------------------

V6 = ["<e>", "a", "b", "c", "d", "e"]
V6_REGEX = "(ab|c)[a-e][a-e]+"  # "b" forced after "a"; never complete in the 3 tokens drawn
V6_PARAMS = engine.sampling.SamplingParams(temperature=1.5)  # wide enough for many sequences
V6_EXTRA = dict(bias={2: 1.0, 5: -0.5}, frequency=0.6, presence=0.3, repetition=1.4)


@pytest.fixture(scope="module")
def v6(tmp_path_factory):
    import llguidance
    from test_engine_sampling import small_vocab_pair
    from tokenizers import Tokenizer, decoders, models

    pair = small_vocab_pair.__wrapped__(tmp_path_factory)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(V6)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<e>"])
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=6, eos_token=0)
    grammar = engine.grammars.constraints.grammar({"type": "regex", "pattern": V6_REGEX})
    proto = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not proto.is_error(), proto.get_error()
    return pair, proto, llguidance.LLExecutor()


def _v6_law(pair, proto, extra=V6_EXTRA) -> dict:
    from test_engine_sampling import LENGTH, PROMPT

    from engine import sampling

    law = {}
    for seq in __import__("itertools").product(range(6), repeat=LENGTH):
        p = 1.0
        for i in range(LENGTH):
            prefix = list(seq[:i])
            m = proto.deep_copy() if proto is not None else None
            if m is not None and not m.consume_tokens(prefix):
                p = 0.0
                break
            raw = np.array(pair.target(mx.array([PROMPT + prefix]))[0, -1])
            x = _penalised(
                raw,
                PROMPT,
                prefix,
                extra["bias"],
                extra["frequency"],
                extra["presence"],
                extra["repetition"],
            )
            if m is not None:
                bits = allocate_token_bitmask(1, 6)
                fill_next_token_bitmask(m, bits)
                x[~np.unpackbits(bits.view(np.uint8), bitorder="little")[:6].astype(bool)] = -np.inf
            p *= float(np.array(sampling.probs(mx.array(x), V6_PARAMS))[seq[i]])
        law[seq] = p
    return law


def _v6_draw(v6, n: int, seed0: int, grammar: bool = True, extra=V6_EXTRA) -> dict:
    from chisquare import ROWS, SETUPS
    from test_engine_sampling import LENGTH, PROMPT

    from engine.batch import BatchDecoder

    pair, proto, executor = v6
    pair._grammars = type("G", (), {"executor": executor})()
    batch = BatchDecoder(pair)
    counts: dict = {}
    running: dict = {}
    seeds = list(range(seed0, seed0 + n))
    taken = 0
    while taken < n or running:
        while taken < n and len(running) < ROWS:
            seed = seeds[taken]
            drafter, k = SETUPS[taken % len(SETUPS)]
            taken += 1
            row = processors.RowLogits(
                vocab=6,
                eos=(0,),
                matcher=proto.deep_copy() if grammar else None,
                prompt=PROMPT,
                **extra,
            )
            batch.add(
                seed,
                PROMPT,
                V6_PARAMS,
                seed=seed,
                drafter=drafter,
                num_draft_tokens=k,
                max_tokens=LENGTH,
                logits=row,
            )
            running[seed] = []
        for seed, step in batch.step().items():
            running[seed].extend(step.tokens)
            if len(running[seed]) >= LENGTH:
                seq = tuple(running.pop(seed)[:LENGTH])
                counts[seq] = counts.get(seq, 0) + 1
                batch.remove(seed)
    return counts


def test_sampling_under_a_grammar_and_penalties_follows_the_processed_law(v6):
    from chisquare import P_FAIL, chi_square_p

    law = _v6_law(v6[0], v6[1])
    assert sum(p > 0 for p in law.values()) >= 8  # the grammar leaves room to sample
    counts = _v6_draw(v6, 6000, 1000)
    assert chi_square_p(law, counts) > P_FAIL


# -- thinking models: reasoning apart, constraints after it ------------------------------

THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    import tiny_models

    tmp = tmp_path_factory.mktemp("thinker")
    specials = tiny_models.SPECIALS
    tiny_models.SPECIALS = [*specials, "<think>", "</think>"]
    try:
        tiny_models.build_tokenizer(tmp / "tok")
    finally:
        tiny_models.SPECIALS = specials
    config = json.loads((tmp / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    vocab = len(json.loads((tmp / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    tiny_models.build_llama(
        tmp / "t", vocab_size=vocab, hidden=64, seed=1, scale=3.0, tokenizer_from=tmp / "tok"
    )
    tiny_models.build_llama(
        tmp / "d",
        vocab_size=vocab,
        hidden=32,
        layers=1,
        seed=2,
        scale=3.0,
        tokenizer_from=tmp / "tok",
    )
    return engine.load_pair(tmp / "t", tmp / "d")


def _think_reference(pair, ids, max_tokens, bias, constraint=None) -> list[int]:
    """Target-only greedy with the bias, the constraint masking only after </think>."""
    end = pair.tokenizer.think_end_tokens[0]
    vocab = pair.target_vocab
    matcher = grammars(pair).matcher(constraint) if constraint else None

    def process(tokens, logits):
        out = tokens.tolist()[len(ids) :]
        x = np.array(logits[0].astype(mx.float32))
        for t, b in bias.items():
            x[t] += b
        if matcher is not None and end in out:
            m = matcher.deep_copy()
            assert m.consume_tokens(out[out.index(end) + 1 :])
            bits = allocate_token_bitmask(1, vocab)
            fill_next_token_bitmask(m, bits)
            x[~np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)] = -np.inf
        return mx.array(x)[None]

    out = []
    for token, _ in generate_step(
        mx.array(ids), pair.target, max_tokens=max_tokens, logits_processors=[process]
    ):
        if int(token) in pair.tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def _detokenize(pair, tokens) -> str:
    detok = pair.tokenizer.detokenizer
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def test_reasoning_is_split_from_the_answer_and_the_constraint_applies_after_it(thinker):
    pair = thinker
    assert pair.tokenizer.has_thinking
    end = pair.tokenizer.think_end_tokens[0]
    messages = [{"role": "user", "content": "def f"}]
    bias = {end: 8.0}  # ends the thinking after 6 tokens
    for constraint, drafter, k in (
        (None, "model", 3),
        (CONSTRAINTS["regex"], "model", 3),
        (CONSTRAINTS["regex"], "lookup", 2),
    ):
        req = GenerationRequest(
            messages=messages,
            max_tokens=40,
            logit_bias=bias,
            constraint=constraint,
            drafter=drafter,
            num_draft_tokens=k,
        )
        ids = list(pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert ids[-2] == pair.tokenizer.think_start_tokens[0]  # the template opened thinking
        ref = _think_reference(pair, ids, 40, bias, constraint)
        assert end in ref[1:], "the bias should end the thinking after a few tokens"
        for res in (engine.generate(pair, req), dict(engine.generate_many(pair, [req, req]))[1]):
            assert res.token_ids == ref
            text = _detokenize(pair, ref)
            at = text.index("</think>")
            assert res.reasoning == text[:at].strip("\n") and "</think>" not in res.reasoning
            assert res.text == text[at + len("</think>") :].lstrip("\n")
            if constraint is not None:
                assert __import__("re").fullmatch(constraint["pattern"], res.text)
                assert res.finish_reason == "stop"


def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_refused(thinker):
    pair = thinker
    messages = [{"role": "user", "content": "def f"}]
    on = engine.generate(pair, GenerationRequest(messages=messages, max_tokens=5))
    off = engine.generate(
        pair,
        GenerationRequest(
            messages=messages, max_tokens=5, chat_template_kwargs={"enable_thinking": False}
        ),
    )
    # The template closed the thinking section: "\n\n</think>\n\n" more prompt tokens.
    assert off.usage["prompt_tokens"] > on.usage["prompt_tokens"]
    assert off.reasoning is None
    with pytest.raises(
        engine.InvalidRequestError, match="chat_template_kwargs.enable_thinkin: not a variable"
    ):
        engine.generate(
            pair,
            GenerationRequest(
                messages=messages, max_tokens=5, chat_template_kwargs={"enable_thinkin": False}
            ),
        )


def test_the_draft_model_drafts_only_what_the_grammar_allows(pair, monkeypatch):
    """A draft that is the target itself, under the grammar's mask, drafts exactly the
    target's masked choices: every draft passes. Without the mask its drafts would be
    the unconstrained text, cut at the grammar's first refusal."""
    twin = dataclasses.replace(pair, draft=pair.target)
    reqs = _requests("model", 4, [CONSTRAINTS["person"], CONSTRAINTS["nested"]], max_tokens=40)
    results = _check_exact(twin, reqs)
    spec = [r.stats for r in results]
    assert sum(s.num_draft_tokens for s in spec) > 10
    assert all(s.num_accepted_draft_tokens == s.num_draft_tokens for s in spec)
    from engine.drafters import ModelProposer

    monkeypatch.setattr(ModelProposer, "masks_drafts", False)
    unmasked = [engine.generate(twin, r).stats for r in reqs]
    assert sum(s.num_accepted_draft_tokens for s in unmasked) < sum(
        s.num_accepted_draft_tokens for s in spec
    )


def test_each_draft_depth_sees_the_processors_and_the_drafts_before_it():
    """The draft model's pass at depth i is processed as the target's verify pass will
    process that position: bias, and penalties over the output so far plus the drafts of
    depths before i (rows without processors, and rows that do not draft, untouched)."""
    from types import SimpleNamespace

    from engine.drafters import DraftLogits

    rng = np.random.default_rng(5)
    vocab, bias = 16, {3: 2.0, 5: -1.0}
    rows = {
        "a": processors.RowLogits(
            vocab=vocab, eos=(0,), bias=bias, frequency=0.5, presence=0.25, repetition=1.5,
            prompt=[1, 2],
        ),
        "c": processors.RowLogits(vocab=vocab, eos=(0,), frequency=-0.7, presence=1.0),
        "d": processors.RowLogits(vocab=vocab, eos=(0,), frequency=0.9),
    }  # fmt: skip
    rows["a"].commit([4, 4])
    rows["c"].commit([5])
    members = [
        SimpleNamespace(key="a", used=True),
        SimpleNamespace(key="b", used=True),  # no processors
        SimpleNamespace(key="c", used=True),
        SimpleNamespace(key="d", used=False),  # not drafting this step
    ]
    walk = DraftLogits(members, rows, vocab)
    drafted = {"a": [], "c": []}
    for _depth in range(4):
        logits = rng.normal(size=(4, vocab)).astype(np.float32)
        got = np.array(walk.apply(mx.array(logits)))
        want_a = _penalised(logits[0], [1, 2], [4, 4] + drafted["a"], bias, 0.5, 0.25, 1.5)
        want_c = _penalised(logits[2], [], [5] + drafted["c"], {}, -0.7, 1.0, 1.0)
        np.testing.assert_allclose(got[0], want_a, rtol=1e-6)
        np.testing.assert_allclose(got[2], want_c, rtol=1e-6)
        assert np.array_equal(got[1], logits[1]) and np.array_equal(got[3], logits[3])
        tokens = [4, 9, 5, 6]  # repeats, so the step's own drafts change the counts
        walk.walk(mx.array(tokens))
        drafted["a"].append(tokens[0])
        drafted["c"].append(tokens[2])


def test_the_draft_model_drafts_under_the_rows_penalties_and_bias(pair, monkeypatch):
    """A draft that is the target itself, drafting under the rows' logit_bias and
    penalties, drafts exactly the processed target's choices: every draft of a row that
    runs to its length passes, with and without a grammar. Drafting from the raw logits
    loses drafts."""
    from engine.drafters import ModelProposer

    twin = dataclasses.replace(pair, draft=pair.target)
    extra = dict(
        frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.3, logit_bias={7: 2.0}
    )
    reqs = _requests("model", 4, [None, None, CONSTRAINTS["person"]], max_tokens=40, **extra)

    def accepted(results) -> tuple[int, int]:
        return (
            sum(r.stats.num_accepted_draft_tokens for r in results),
            sum(r.stats.num_draft_tokens for r in results),
        )

    results = _check_exact(twin, reqs)
    # (A row that ends on EOS or its grammar's end loses the drafts past its end.)
    ok, drafted = accepted([r for r in results if r.finish_reason == "length"])
    assert drafted > 30 and ok == drafted
    plain = reqs[:2]  # no grammar: what the penalties and the bias alone do to drafts
    full, _ = accepted([engine.generate(twin, r) for r in plain])
    monkeypatch.setattr(ModelProposer, "masks_drafts", False)  # the raw logits
    raw, _ = accepted([engine.generate(twin, r) for r in plain])
    assert raw < full, (raw, full)


def test_a_position_where_the_grammar_allows_nothing_allows_only_eos():
    """Where a row's bitmask allows no token of the vocabulary (bits past its end do not
    count), the position allows the row's EOS tokens, so the row ends instead of sampling
    from nothing; other positions are the bitmask's bits."""
    from types import SimpleNamespace

    vocab = 40  # two words, the second with 8 bits inside the vocabulary
    bitmask = np.array(
        [[0, 0], [0, 1 << 9], [1 << 5, 0], [-1, -1]], dtype=np.int32
    )  # row 0: positions 0, 1; row 1: positions 0, 1
    procs = [SimpleNamespace(eos=(0, 3)), SimpleNamespace(eos=(2,))]
    got = np.array(processors._allowed(bitmask, procs, 2, vocab))
    assert got.shape == (2, 2, vocab)
    assert np.flatnonzero(got[0, 0]).tolist() == [0, 3]
    assert np.flatnonzero(got[0, 1]).tolist() == [0, 3]  # token 41 is past the vocabulary
    assert np.flatnonzero(got[1, 0]).tolist() == [5]
    assert got[1, 1].all()
