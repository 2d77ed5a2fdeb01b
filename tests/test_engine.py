"""The engine is lossless and behaves at the edges: greedy equality with mlx-lm,
cache rollback, stops, limits, tokenizer checks, and the acceptance it buys."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from tiny_models import build_llama, build_tokenizer, reference_greedy, tiny_pair

import engine
from engine import GenerationRequest
from engine.batch import SpeculativeDecoder
from engine.sampling import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "    return",
    "# Copyright",
    "def main():\n    parser = argparse.ArgumentParser(",
    "x = [",
    "if __name__ == '__main__':",
    "try:\n    import",
    "The quick brown fox",
    "while True:",
    "    def __repr__(self):",
    "from collections import",
    "raise ValueError(",
    "with open(path) as f:",
    "lambda x:",
    '"""Return the',
    "self.assertEqual(",
    "print(",
]
DRAFT_LENGTHS = [1, 2, 4, 8]
DRAFTERS = ["model", "lookup", "none"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def demo():
    return engine.load_pair()


def _check_greedy_equal(pair, max_tokens, prompts=PROMPTS):
    for prompt in prompts:
        ids = pair.tokenizer.encode(prompt)
        ref = reference_greedy(pair, ids, max_tokens)
        for drafter in DRAFTERS:
            for k in DRAFT_LENGTHS if drafter != "none" else DRAFT_LENGTHS[:1]:
                req = GenerationRequest(
                    prompt_ids=ids, max_tokens=max_tokens, drafter=drafter, num_draft_tokens=k
                )
                got = engine.generate(pair, req).token_ids
                assert got == ref, (prompt, drafter, k)


def test_greedy_equals_target_only_on_tiny_random_models(tiny):
    _check_greedy_equal(tiny, 24)


def test_greedy_equals_target_only_on_demo_pair(demo):
    _check_greedy_equal(demo, 24, PROMPTS[:12])


def test_greedy_auto_equals_target_only(demo):
    for prompt in PROMPTS[:5]:
        ids = demo.tokenizer.encode(prompt)
        ref = reference_greedy(demo, ids, 48)
        for drafter in DRAFTERS:
            req = GenerationRequest(prompt_ids=ids, max_tokens=48, drafter=drafter)
            assert engine.generate(demo, req).token_ids == ref, (prompt, drafter)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter,k", [("model", 4), ("model", 1), ("lookup", 3)])
def test_caches_hold_exactly_the_accepted_text_after_every_step(demo, temperature, drafter, k):
    ids = demo.tokenizer.encode("def parse(text):\n    for line in text.splitlines():")
    dec = SpeculativeDecoder(
        demo,
        ids,
        SamplingParams(temperature),
        seed=5,
        drafter=drafter,
        num_draft_tokens=k,
        max_tokens=60,
    )
    accepted = list(ids)
    rejections = 0
    for step in dec.steps():
        accepted += step.tokens
        rejections += step.accepted < step.proposed
        target_len, draft_len = dec.cache_lengths()
        # Everything accepted is cached except the newest token, fed by the next step.
        assert target_len == len(accepted) - 1
        if draft_len is not None:
            assert draft_len == len(accepted) - len(dec.draft_pending)
            assert dec.draft_pending[-1] == accepted[-1]
    assert rejections > 0, "the test must exercise rollback"
    # The rolled-back cache is the cache of the accepted text: logits match a fresh pass.
    fresh = demo.target(mx.array([accepted]))[0, -1]
    cached = demo.target(mx.array([[accepted[-1]]]), cache=dec.batch.t_cache)[0, -1]
    assert mx.allclose(fresh, cached, atol=1e-4).item()


def test_greedy_auto_drafts_by_lookup_where_text_repeats_and_stays_exact(demo, monkeypatch):
    # "auto" with the model drafter also takes free lookup drafts once the text repeats
    # itself; the draft model then owes those tokens and catches up on its next step.
    text = "def parse(text):\n    for line in text.splitlines():\n        yield line\n\n"
    ids = demo.tokenizer.encode(text * 3 + "def parse(text):\n    for")
    ref = reference_greedy(demo, ids, 120)
    # A policy of its own that has measured drafting paying here, and hears no more: this
    # is the hybrid's mechanism, not this machine's timings.
    monkeypatch.setattr(demo, "policy", paying_policy())
    monkeypatch.setattr(demo.policy, "observe", lambda step: None)
    dec = SpeculativeDecoder(demo, ids, SamplingParams(0.0), drafter="model", max_tokens=120)
    accepted, sources = list(ids), []
    for step in dec.steps():
        accepted += step.tokens
        sources.append(step.source)
        target_len, draft_len = dec.cache_lengths()
        assert target_len == len(accepted) - 1
        assert draft_len == len(accepted) - len(dec.draft_pending)
        assert dec.draft_pending[-1] == accepted[-1]
    assert accepted[len(ids) :] == ref
    assert "lookup" in sources and "model" in sources, sources


def paying_policy():
    """A draft-length policy that has heard drafting pay at one row: plain steps of 10 ms,
    drafting steps of 10.5 ms + 0.5 ms a draft, every draft passing at 0.9."""
    from engine.draft_length import DraftLengthPolicy, StepRecord

    policy = DraftLengthPolicy()
    for k in (0, 0, 0, 1, 1, 2, 2, 3, 3):
        policy.observe(StepRecord(1, [k], [k * 9 // 10], 0.010 + 0.0005 * k))
    for _ in range(50):
        policy.observe(StepRecord(1, [3], [3], 0.0115))
    return policy


def test_lookup_acceptance_is_heard_on_plain_steps_so_a_collapse_recovers(demo, monkeypatch):
    # Lookup proposals are free, so the target's own token judges a proposal the step did
    # not draft. A policy that heard lookup fail everywhere (as on text that never repeats)
    # still hears it pass on a text that does, and drafts it again. Mutant that judges only
    # what was drafted: the policy never drafts lookup again and this fails.
    from engine.draft_length import DraftLengthPolicy, PolicyConfig, StepRecord

    policy = DraftLengthPolicy(PolicyConfig(explore=0.0))  # no forced plays: only hearing
    for k in (0, 0, 0, 1, 1, 2, 2, 3, 3):
        policy.observe(StepRecord(1, [k], [0], 0.010 + 0.002 * k, free=k > 0, sources=["lookup"]))
    for _ in range(60):
        policy.observe(StepRecord(1, [4], [0], 0.018, free=True, sources=["lookup"]))
    assert policy.decide(1, 8, free=True, source="lookup") == 0
    observe = policy.observe

    def priced(step):  # this machine's timings replaced by the same synthetic costs
        depth = max(step.k, default=0)
        step.seconds = 0.010 + 0.002 * depth
        observe(step)

    monkeypatch.setattr(demo, "policy", policy)
    monkeypatch.setattr(policy, "observe", priced)
    text = "def parse(text):\n    for line in text.splitlines():\n        yield line\n\n"
    ids = demo.tokenizer.encode(text * 3 + "def parse(text):\n    for")
    ref = reference_greedy(demo, ids, 80)
    dec = SpeculativeDecoder(demo, ids, SamplingParams(0.0), drafter="lookup", max_tokens=80)
    steps = list(dec.steps())
    assert [t for s in steps for t in s.tokens] == ref
    drafted = [s.proposed for s in steps if s.source == "lookup"]
    assert sum(drafted) >= 10, [(s.source, s.proposed, s.accepted) for s in steps]
    assert "lookup-copying" in policy.positions, sorted(policy.positions)


def test_a_draft_that_stops_early_stays_exact_and_reports_every_draft_confidence(demo, monkeypatch):
    # A single greedy "auto" row: the draft model reads its confidence after each pass and
    # the policy ends the block early; the text is still the target's, and the policy hears
    # the draft's confidence in each draft it made, the last pass's included.
    policy = paying_policy()
    heard = []
    monkeypatch.setattr(demo, "policy", policy)
    monkeypatch.setattr(policy, "observe", heard.append)
    monkeypatch.setattr(policy, "decide", lambda *a, **kw: 4)
    monkeypatch.setattr(policy, "keep_drafting", lambda rows, cap, conf: len(conf[0]) < 2)
    ids = demo.tokenizer.encode("def fibonacci(n):")
    ref = reference_greedy(demo, ids, 40)
    dec = SpeculativeDecoder(demo, ids, SamplingParams(0.0), drafter="model", max_tokens=40)
    assert [t for s in dec.steps() for t in s.tokens] == ref
    model = [h for h in heard if h.k[0] and h.sources[0] == "model"]
    assert model and all(h.k == [2] for h in model), [h.k for h in heard]
    assert all(len(h.confidence[0]) == 2 for h in model), [h.confidence for h in model]
    assert all(0.0 < p <= 1.0 for h in model for p in h.confidence[0])


def test_stop_string_ends_text_before_it_even_across_blocks(demo):
    base = GenerationRequest(prompt="def fibonacci(n):", max_tokens=60, num_draft_tokens=4)
    full = engine.generate(demo, base).text
    assert len(full) > 20
    # A stop that starts in one verify block and ends in a later one.
    stop = full[10:16]
    for drafter in DRAFTERS:
        got = engine.generate(
            demo,
            GenerationRequest(
                prompt="def fibonacci(n):",
                max_tokens=60,
                num_draft_tokens=4,
                drafter=drafter,
                stop=[stop, "@@@"],
            ),
        )
        assert got.text == full[: full.index(stop)]
        assert got.finish_reason == "stop"


def test_stream_pieces_join_to_the_text(demo):
    req = GenerationRequest(prompt="import os\n", max_tokens=40, stop="\n\n\n")
    items = list(engine.stream(demo, req))
    # Only the last item carries the result; the pieces join to its text.
    assert [i.result is not None for i in items] == [False] * (len(items) - 1) + [True]
    result = items[-1].result
    assert "".join(i.text for i in items) == result.text
    assert len(items) > 2


def test_max_tokens_one(demo):
    ids = demo.tokenizer.encode("def main():")
    ref = reference_greedy(demo, ids, 1)
    for drafter in DRAFTERS:
        r = engine.generate(demo, GenerationRequest(prompt_ids=ids, max_tokens=1, drafter=drafter))
        assert r.token_ids == ref and r.finish_reason == "length"
        assert r.usage["completion_tokens"] == 1
        assert r.metrics["speculative_decoding"]["num_draft_tokens"] == 0


def test_max_tokens_can_end_output_inside_a_block(demo):
    ids = demo.tokenizer.encode("def fibonacci(n):")
    for n in (2, 3, 5, 7):
        ref = reference_greedy(demo, ids, n)
        got = engine.generate(
            demo, GenerationRequest(prompt_ids=ids, max_tokens=n, num_draft_tokens=8)
        )
        assert got.token_ids == ref and len(got.token_ids) == n


def test_empty_lookup_proposal_falls_back_to_plain_decoding(demo):
    ids = demo.tokenizer.encode("xyz")  # nothing earlier to match
    dec = SpeculativeDecoder(
        demo, ids, SamplingParams(), drafter="lookup", num_draft_tokens=4, max_tokens=1
    )
    step = dec.step()
    assert step.proposed == 0 and len(step.tokens) == 1
    assert step.tokens == reference_greedy(demo, ids, 1)


def test_prompt_longer_than_context_is_a_clear_error(demo):
    prompt = "x = 1\n" * (demo.context_length)
    with pytest.raises(
        engine.ContextLengthError, match=r"exceeds the context of demo \(\d+ tokens\)"
    ):
        engine.generate(demo, GenerationRequest(prompt=prompt, max_tokens=8))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_tokens", 0, "max_tokens: must be >= 1, got 0"),
        ("temperature", -0.5, "temperature: must be >= 0, got -0.5"),
        ("top_p", 0.0, "top_p: must be in (0, 1], got 0.0"),
        ("num_draft_tokens", 17, "num_draft_tokens: must be 'auto' or 1..16, got 17"),
        ("drafter", "ngram", "drafter: must be one of model, lookup, none, got 'ngram'"),
    ],
)
def test_bad_request_values_name_field_and_value(demo, field, value, message):
    with pytest.raises(engine.InvalidRequestError) as err:
        engine.generate(demo, GenerationRequest(prompt="a", **{field: value}))
    assert str(err.value) == message


def test_model_drafter_without_draft_is_a_clear_error(tmp_path):
    pair = engine.load_pair(engine.loading.DEMO_TARGET)
    assert pair.draft is None
    with pytest.raises(engine.InvalidRequestError, match="needs a draft model"):
        engine.generate(pair, GenerationRequest(prompt="a", drafter="model"))
    # The target alone still speculates with prompt lookup.
    r = engine.generate(
        pair, GenerationRequest(prompt="a = a + a + a", drafter="lookup", max_tokens=8)
    )
    assert r.usage["completion_tokens"] == 8


def test_chat_messages_render_with_the_target_template(demo):
    msgs = [{"role": "user", "content": "Write a function 世界 🎉"}]
    ids = demo.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    a = engine.generate(demo, GenerationRequest(messages=msgs, max_tokens=12))
    b = engine.generate(demo, GenerationRequest(prompt_ids=ids, max_tokens=12))
    assert a.token_ids == b.token_ids and a.usage["prompt_tokens"] == len(ids)


def test_tokenizer_mismatch_names_both_models_and_the_id(tmp_path):
    build_tokenizer(tmp_path / "tok_a", vocab_size=320)
    (tmp_path / "tok_b").mkdir()
    shutil.copy(tmp_path / "tok_a" / "tokenizer_config.json", tmp_path / "tok_b")
    data = json.loads((tmp_path / "tok_a" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    # Swap the strings of two ids: same size, different meaning.
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "tok_b" / "tokenizer.json").write_text(json.dumps(data))
    n = len(vocab)
    build_llama(tmp_path / "t", vocab_size=n, tokenizer_from=tmp_path / "tok_a")
    build_llama(tmp_path / "d", vocab_size=n, tokenizer_from=tmp_path / "tok_b")
    with pytest.raises(engine.TokenizerMismatchError) as err:
        engine.load_pair(tmp_path / "t", tmp_path / "d")
    msg = str(err.value)
    assert str(tmp_path / "t") in msg and str(tmp_path / "d") in msg and "id 300" in msg


def test_padded_vocabularies_are_fine_and_lossless(tmp_path):
    build_tokenizer(tmp_path / "tok", vocab_size=320)
    n = len(json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    # Target padded by 64 rows, draft by 16: like Qwen's 152064 vs 151936.
    build_llama(
        tmp_path / "t", vocab_size=n + 64, seed=1, scale=3.0, tokenizer_from=tmp_path / "tok"
    )
    build_llama(
        tmp_path / "d", vocab_size=n + 16, seed=1, scale=3.0, tokenizer_from=tmp_path / "tok"
    )
    pair = engine.load_pair(tmp_path / "t", tmp_path / "d")
    assert (pair.target_vocab, pair.draft_vocab) == (n + 64, n + 16)
    ids = pair.tokenizer.encode("def fibonacci(n):")
    ref = reference_greedy(pair, ids, 20)
    for k in (1, 4):
        got = engine.generate(
            pair, GenerationRequest(prompt_ids=ids, max_tokens=20, num_draft_tokens=k)
        )
        assert got.token_ids == ref
    sampled = engine.generate(
        pair, GenerationRequest(prompt_ids=ids, max_tokens=20, temperature=1.0, seed=1)
    )
    assert len(sampled.token_ids) == 20 or sampled.finish_reason == "stop"


def test_statistics_follow_their_definitions(demo):
    r = engine.generate(
        demo, GenerationRequest(prompt="def fibonacci(n):", max_tokens=64, num_draft_tokens=4)
    )
    s = r.metrics["speculative_decoding"]
    assert s["num_spec_steps"] == sum(s["acceptance_histogram"])
    assert s["num_accepted_draft_tokens"] == sum(
        i * c for i, c in enumerate(s["acceptance_histogram"])
    )
    assert s["draft_acceptance_rate"] == round(
        s["num_accepted_draft_tokens"] / s["num_draft_tokens"], 4
    )
    assert s["mean_acceptance_length"] == round(
        r.usage["completion_tokens"] / s["num_spec_steps"], 4
    )
    assert s["num_draft_tokens"] == sum(s["draft_tokens_per_position"])
    assert len(s["per_position_acceptance"]) == 4
    assert s["per_position_acceptance"][0] >= s["per_position_acceptance"][-1]


def test_acceptance_at_temperature_one_beats_mlx_lm(demo):
    """Proper speculative sampling accepts more than mlx-lm's 'draft == sampled' rule."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    k, n_tokens = 4, 64
    ours_tokens = ours_steps = mlx_tokens = mlx_steps = 0
    mx.random.seed(3)
    for i, prompt in enumerate(PROMPTS[:8]):
        ids = demo.tokenizer.encode(prompt)
        r = engine.generate(
            demo,
            GenerationRequest(
                prompt_ids=ids, max_tokens=n_tokens, temperature=1.0, seed=i, num_draft_tokens=k
            ),
        )
        ours_tokens += r.usage["completion_tokens"]
        ours_steps += r.metrics["speculative_decoding"]["num_spec_steps"]
        gen = speculative_generate_step(
            mx.array(ids),
            demo.target,
            demo.draft,
            num_draft_tokens=k,
            max_tokens=n_tokens,
            sampler=make_sampler(1.0),
        )
        for token, _, from_draft in gen:
            if token in demo.tokenizer.eos_token_ids:
                break
            mlx_tokens += 1
            mlx_steps += not from_draft
    ours, theirs = ours_tokens / ours_steps, mlx_tokens / mlx_steps
    print(f"\nmean acceptance length at T=1, K={k}: specfleet {ours:.3f}, mlx-lm {theirs:.3f}")
    assert ours > theirs


def _check_batched_equals_single(pair, max_batch):
    requests = []
    for j, prompt in enumerate(PROMPTS):
        drafter = DRAFTERS[j % 3]
        k = [1, 2, 4, 8, "auto"][j % 5]
        # Different lengths so rows leave at different steps and new ones join.
        requests.append(
            GenerationRequest(
                prompt=prompt, max_tokens=12 + 3 * j, drafter=drafter, num_draft_tokens=k
            )
        )
    requests.append(GenerationRequest(prompt="x" * 10_000, max_tokens=4))  # refused, others go on
    single = [engine.generate(pair, r).token_ids for r in requests[:-1]]
    got = dict(engine.generate_many(pair, requests, max_batch=max_batch))
    assert isinstance(got.pop(len(requests) - 1), engine.ContextLengthError)
    assert {i: r.token_ids for i, r in got.items()} == dict(enumerate(single))


def test_batched_greedy_rows_equal_single_requests_tiny(tiny):
    _check_batched_equals_single(tiny, max_batch=6)


def test_batched_greedy_rows_equal_single_requests_demo(demo):
    _check_batched_equals_single(demo, max_batch=8)


def test_batched_sampled_rows_equal_single_requests(demo):
    requests = [
        GenerationRequest(
            prompt=p,
            max_tokens=20,
            temperature=0.9,
            top_p=0.95,
            seed=i,
            drafter=("model", "lookup")[i % 2],
            num_draft_tokens=1 + i % 4,
        )
        for i, p in enumerate(PROMPTS[:10])
    ]
    single = [engine.generate(demo, r).token_ids for r in requests]
    got = dict(engine.generate_many(demo, requests, max_batch=4))
    assert [got[i].token_ids for i in range(len(requests))] == single


def test_ragged_cache_keeps_each_row_exactly_its_accepted_tokens(demo):
    from engine.batch import BatchDecoder

    batch = BatchDecoder(demo)
    prompts = {i: demo.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:6])}
    for i, ids in prompts.items():
        batch.add(
            i,
            ids,
            SamplingParams(0.0 if i % 2 else 1.0),
            seed=i,
            drafter="model",
            num_draft_tokens=1 + i,
            max_tokens=40,
        )
    accepted = {i: list(ids) for i, ids in prompts.items()}
    for _ in range(8):
        for key, step in batch.step().items():
            accepted[key] += step.tokens
        for row in batch.rows:
            tl, dl = batch.cache_lengths(row.key)
            assert tl == len(accepted[row.key]) - 1
            assert dl == len(accepted[row.key]) - len(batch.proposer.pending(row.key))
    # The next step, run on the rolled-back caches, agrees with a fresh pass over the text.
    fresh = {
        row.key: mx.argmax(demo.target(mx.array([accepted[row.key]]))[0, -1]).item()
        for row in batch.rows
        if row.params.greedy
    }
    steps = batch.step()
    assert fresh and all(steps[key].tokens[0] == tok for key, tok in fresh.items())
