"""Every model family the engine runs is exact: greedy output equals mlx-lm's
target-only output in every drafter mode, batched (rows joining mid-batch) and
single; each ragged cache kind holds, after advance/drop_last, exactly the state of
a fresh mlx-lm cache fed only the kept tokens; a layer kind the engine cannot keep
exact is refused at load time.

Tiny random models of each family come from tests/tiny_families.py (mlx-lm's own
model classes). The chi-square sampling tests for these families are in
tests/test_families_sampling.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_families import WINDOW, build_model, family_pair, tokenizer_dir
from tiny_models import reference_greedy

import engine
from engine.families import UnsupportedModelError, check_model, make_ragged_cache
from engine.recurrent import RecurrentLayerCache

# (target family, draft family, bits): a hybrid draft (qwen3_5) drafts for lfm2.
FAMILIES = {
    "llama": ("llama", "llama", None),
    "qwen3": ("qwen3", "llama", None),
    "qwen3_moe": ("qwen3_moe", "llama", None),
    "gemma3_text": ("gemma3_text", "gemma3_text", None),
    "qwen3_5": ("qwen3_5", "llama", None),
    "lfm2": ("lfm2", "qwen3_5", None),
    "qwen3_5_4bit": ("qwen3_5", "qwen3_5", 4),
}
# Every drafter mode, one request each, prompts of different lengths.
MODES = [
    ("none", 1),
    ("lookup", 1),
    ("lookup", 3),
    ("lookup", "auto"),
    ("model", 1),
    ("model", 3),
    ("model", "auto"),
]
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import os\nimport sys\nfor i in",
    "x",
    "for i in range(10):\n    print(i, sys.argv)\nfor i in range(10):",
    "The lazy dog",
    "def f(n):\n    return n",
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    target, draft, bits = FAMILIES[request.param]
    pair = family_pair(tmp_path_factory.mktemp(request.param), target, draft, bits=bits)
    requests, refs = [], []
    for j, ((drafter, k), prompt) in enumerate(zip(MODES, PROMPTS, strict=True)):
        ids = pair.tokenizer.encode(prompt)
        max_tokens = 12 + 2 * j  # rows finish at different steps, so others join
        requests.append(
            engine.GenerationRequest(
                prompt_ids=ids, max_tokens=max_tokens, drafter=drafter, num_draft_tokens=k
            )
        )
        refs.append(reference_greedy(pair, ids, max_tokens))
    return request.param, pair, requests, refs


@pytest.mark.parametrize("max_batch", [3, 1])
def test_batched_greedy_equals_target_only(family, max_batch):
    name, pair, requests, refs = family
    got = dict(engine.generate_many(pair, requests, max_batch=max_batch))
    assert {i: r.token_ids for i, r in got.items()} == dict(enumerate(refs))
    if name == "gemma3_text":  # the texts run well past the sliding window
        assert all(len(r.prompt_ids) + len(refs[i]) > 2 * WINDOW for i, r in enumerate(requests))


def test_rows_joining_where_rows_left_take_their_places_exactly(family, monkeypatch):
    # A row that joins on the step another leaves is written into the leaving row's place
    # (RaggedRows.place: only its own positions), where every layer is an attention
    # cache; recurrent layers join after the others. (Mutations: place writing the new
    # row from position 0, not right-aligned -> outputs differ; can_place always False
    # -> no place.)
    from engine import ragged

    name, pair, requests, refs = family
    placed = []
    place = ragged.RaggedRows.place
    monkeypatch.setattr(
        ragged.RaggedRows, "place", lambda self, *a: placed.append(a[0]) or place(self, *a)
    )
    got = dict(engine.generate_many(pair, requests, max_batch=3))
    assert {i: r.token_ids for i, r in got.items()} == dict(enumerate(refs))
    recurrent = name in ("qwen3_5", "lfm2", "qwen3_5_4bit")
    assert bool(placed) != recurrent


def test_single_greedy_equals_target_only(family):
    name, pair, requests, refs = family
    assert [engine.generate(pair, r).token_ids for r in requests] == refs


def test_features_name_drafters_batching_and_layer_kinds(tmp_path):
    pair = family_pair(tmp_path, "qwen3_5", "gemma3_text")
    assert pair.features().as_dict() == {
        "drafters": ["model", "lookup", "none"],
        "batching": True,
        "target_layers": {"recurrent": 2, "attention": 2},
        "draft_layers": {"sliding": 1, "attention": 1},
    }
    assert pair.info()["features"]["target_layers"] == {"recurrent": 2, "attention": 2}


# -- the cache kinds against mlx-lm's own caches ------------------------------------------
def _model(tmp_path, family: str):
    from mlx_lm.utils import load_model

    tok, vocab = tokenizer_dir(tmp_path)
    model, _ = load_model(
        build_model(tmp_path / family, family, vocab_size=vocab, tokenizer_from=tok)
    )
    return model


def _reference_logits(model, tokens: list[int]) -> mx.array:
    """Next-token logits after feeding `tokens` one chunk then one token, mlx-lm caches."""
    cache = model.make_cache()
    model(mx.array([tokens[:-1]]), cache=cache)
    return model(mx.array([tokens[-1:]]), cache=cache)[0, -1]


@pytest.mark.parametrize("family_name", ["qwen3_5", "lfm2", "gemma3_text"])
def test_cache_after_advance_and_drop_last_equals_a_fresh_cache(tmp_path, family_name):
    """Rows fed right-padded blocks keep only their first keep[i] positions, then drop
    some (a draft rollback): the next logits equal those of mlx-lm's own cache fed
    only the kept tokens, and recurrent state equals its state."""
    model = _model(tmp_path, family_name)
    prompts = [[5, 9, 13, 7, 22, 30, 11, 4, 8, 19, 3], [6, 2], [40, 41, 42, 43, 44, 45]]
    rows, cache = make_ragged_cache(model, 3)
    width = max(map(len, prompts))
    model(mx.array([p + [0] * (width - len(p)) for p in prompts]), cache=cache)
    rows.advance(width, [len(p) for p in prompts])
    rows.checkpoint()
    # A block of 4 where row 0 keeps 4, row 1 keeps 1 and row 2 keeps 0 ...
    block = [[50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]]
    model(mx.array(block), cache=cache)
    rows.advance(4, [4, 1, 0])
    kept = [prompts[0] + block[0], prompts[1] + block[1][:1], prompts[2]]
    # ... two single-token passes, then drop 3, 0 and 2 of the kept tokens.
    for tok in ([80, 81, 82], [90, 91, 92]):
        model(mx.array([[t] for t in tok]), cache=cache)
        rows.advance(1, [1, 1, 1])
        kept = [k + [t] for k, t in zip(kept, tok, strict=True)]
    rows.drop_last([3, 0, 2])
    kept = [kept[0][:-3], kept[1], kept[2][:-2]]
    nxt = [[33], [34], [35]]
    got = model(mx.array(nxt), cache=cache)[:, -1]
    rows.advance(1, [1, 1, 1])
    for i, k in enumerate(kept):
        want = _reference_logits(model, k + nxt[i])
        assert mx.allclose(got[i], want, atol=1e-4).item(), f"row {i}"
    # The recurrent state itself, row by row, against mlx-lm's ArraysCache.
    for i, k in enumerate(kept):
        ref = model.make_cache()
        model(mx.array([k + nxt[i]]), cache=ref)
        for mine, theirs in zip(cache, ref, strict=True):
            if isinstance(mine, RecurrentLayerCache):
                for a, b in zip(mine.cache, theirs.cache, strict=True):
                    assert mx.allclose(a[i], b[0], atol=1e-4).item()


def test_rows_joining_and_leaving_keep_recurrent_state(tmp_path):
    model = _model(tmp_path, "qwen3_5")
    rows, cache = make_ragged_cache(model, 0)
    for prompt in ([5, 9, 13, 7], [6, 2, 8]):
        fresh_rows, fresh = make_ragged_cache(model, 1)
        model(mx.array([prompt]), cache=fresh)
        fresh_rows.advance(len(prompt), [len(prompt)])
        rows.append(fresh_rows)
    rows.select([1])
    got = model(mx.array([[11]]), cache=cache)[0, -1]
    assert mx.allclose(got, _reference_logits(model, [6, 2, 8, 11]), atol=1e-4).item()


@pytest.mark.parametrize("family_name", ["llama", "gemma3_text"])
def test_a_row_placed_where_a_row_left_reads_as_if_alone(tmp_path, family_name):
    """Rows with holes (rejected drafts); one leaves and a fresh prefill takes its place,
    shorter than the cache: every row's next logits equal mlx-lm's cache fed only that
    row's kept tokens, past a sliding window too."""
    model = _model(tmp_path, family_name)
    rows, cache = make_ragged_cache(model, 3)
    kept = [[5, 9, 13, 7], [6, 2, 8, 1], [40, 41, 42, 43]]
    model(mx.array(kept), cache=cache)
    rows.advance(4, [4, 4, 4])
    for t in range(50, 50 + WINDOW):  # rows keep 1, 2 and 3 of each block of 3
        model(mx.array([[t, t + 1, t + 2]] * 3), cache=cache)
        rows.advance(3, [1, 2, 3])
        kept = [k + [t, t + 1, t + 2][:n] for k, n in zip(kept, (1, 2, 3), strict=True)]
    fresh_rows, fresh = make_ragged_cache(model, 1)
    prompt = [7, 7, 3, 30, 31]
    model(mx.array([prompt]), cache=fresh)
    fresh_rows.advance(len(prompt), [len(prompt)])
    assert rows.can_place(fresh_rows)
    rows.place([1], fresh_rows)
    kept[1] = prompt
    for step in range(2):
        nxt = [[20 + step], [21 + step], [22 + step]]
        got = model(mx.array(nxt), cache=cache)[:, -1]
        rows.advance(1, [1, 1, 1])
        for i, k in enumerate(kept):
            want = _reference_logits(model, k + nxt[i])
            assert mx.allclose(got[i], want, atol=1e-4).item(), f"row {i}, step {step}"
        kept = [k + n for k, n in zip(kept, nxt, strict=True)]


def test_sliding_window_mask_counts_true_positions_not_slots(tmp_path, monkeypatch):
    """Holes (rejected drafts) sit between a row's keys: a mask that counted slots
    would drop keys that are inside the window. Broken that way, the test fails."""
    from engine import ragged

    model = _model(tmp_path, "gemma3_text")

    def run():
        # Row 1 keeps every position, so row 0's rejected positions stay as holes.
        rows, cache = make_ragged_cache(model, 2)
        toks = [5, 9]
        model(mx.array([toks, toks]), cache=cache)
        rows.advance(2, [2, 2])
        for t in (40, 41, 42):  # three verify blocks where row 0 keeps 1 of 4
            model(mx.array([[t, 43, 44, 45]] * 2), cache=cache)
            rows.advance(4, [1, 4])
            toks.append(t)
        for t in range(60, 60 + WINDOW):  # then the window slides past the holes
            model(mx.array([[t]] * 2), cache=cache)
            rows.advance(1, [1, 1])
            toks.append(t)
        return model(mx.array([[50]] * 2), cache=cache)[0, -1], toks + [50]

    got, toks = run()
    assert mx.allclose(got, _reference_logits(model, toks), atol=1e-4).item()
    monkeypatch.setattr(
        ragged.RaggedRows,
        "positions",
        lambda self: mx.broadcast_to(mx.arange(self.length)[None], self.valid.shape),
    )
    broken, _ = run()
    assert not mx.allclose(broken, got, atol=1e-4).item()


# -- refusing what cannot be kept exact -------------------------------------------------
def test_a_layer_kind_without_an_exact_ragged_form_is_refused_at_load(tmp_path, monkeypatch):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import QuantizedKVCache

    tok, vocab = tokenizer_dir(tmp_path)
    target = build_model(tmp_path / "t", "qwen3", vocab_size=vocab, tokenizer_from=tok)
    draft = build_model(tmp_path / "d", "llama", vocab_size=vocab, tokenizer_from=tok)
    monkeypatch.setattr(
        llama.Model,
        "make_cache",
        lambda self: [QuantizedKVCache() for _ in self.layers],
        raising=False,
    )
    with pytest.raises(UnsupportedModelError) as err:
        engine.load_pair(target, draft)
    assert str(err.value) == (
        "draft model: model type 'llama': layer 0 keeps its state in a QuantizedKVCache, "
        "which this engine cannot batch or roll back exactly, so it would change the "
        "output; no speculation or batching runs on it here (or pick a model whose "
        "layers are full attention, sliding-window attention or ArraysCache recurrent "
        "state); load the target without this draft: drafters 'lookup' and 'none' still "
        "work"
    )
    assert isinstance(err.value, engine.ModelLoadError)
    pair = engine.load_pair(target, None)  # what still works, works
    assert pair.features().drafters == ("lookup", "none")


def test_a_recurrent_layer_whose_mixer_is_unknown_is_refused(tmp_path, monkeypatch):
    from engine import families

    model = _model(tmp_path, "lfm2")
    monkeypatch.setattr(families, "MIXER_NAMES", ("linear_attn",))
    with pytest.raises(UnsupportedModelError, match="target model: recurrent layer 0 does not"):
        check_model(model, "target")


# -- plain decoding for what the speculative decoder cannot keep exact --------------------
def test_a_target_without_an_exact_ragged_form_runs_plain_decoding(tmp_path, caplog):
    """falcon_h1 keeps each layer's state in a CacheList: no speculation or batching,
    but every request is answered with the target-only text, single and batched, in
    every drafter mode (statistics say "none"), and seeded sampling is reproducible."""
    with caplog.at_level("WARNING", logger="specfleet.engine"):
        pair = family_pair(tmp_path, "falcon_h1", None)
    assert "CacheList" in caplog.text and "plain decoding only" in caplog.text
    assert pair.features().drafters == ("none",) and pair.features().batching is False
    requests, refs = [], []
    for j, ((drafter, k), prompt) in enumerate(zip(MODES, PROMPTS, strict=True)):
        ids = pair.tokenizer.encode(prompt)
        requests.append(
            engine.GenerationRequest(
                prompt_ids=ids, max_tokens=10 + j, drafter=drafter, num_draft_tokens=k
            )
        )
        refs.append(reference_greedy(pair, ids, 10 + j))
    single = [engine.generate(pair, r) for r in requests]
    assert [r.token_ids for r in single] == refs
    assert {r.metrics["speculative_decoding"]["drafter"] for r in single} == {"none"}
    got = dict(engine.generate_many(pair, requests, max_batch=3))
    assert {i: r.token_ids for i, r in got.items()} == dict(enumerate(refs))
    sampled = [
        engine.GenerationRequest(prompt=p, max_tokens=8, temperature=0.9, seed=i)
        for i, p in enumerate(PROMPTS[:4])
    ]
    alone = [engine.generate(pair, r).token_ids for r in sampled]
    together = dict(engine.generate_many(pair, sampled, max_batch=4))
    assert [together[i].token_ids for i in range(4)] == alone


def test_such_a_target_with_a_draft_is_refused_naming_what_still_works(tmp_path):
    with pytest.raises(UnsupportedModelError) as err:
        family_pair(tmp_path, "falcon_h1", "llama")
    assert "target model: model type 'falcon_h1': layer 0 keeps its state in a CacheList" in str(
        err.value
    )
    assert str(err.value).endswith(
        "load it without a draft: plain decoding (drafter 'none') still works, one request "
        "at a time"
    )
