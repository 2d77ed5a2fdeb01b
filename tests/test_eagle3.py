"""EAGLE-3 heads (`--draft DIR` of an EAGLE-3 checkpoint) on llama targets: load from the
published layout, draft for real through their own small vocabulary (d2t), greedy output
equals target-only output single and batched, each step drafts what the plainest loop over
the head's definition drafts, sampling follows the target's law (chi-square), and layouts we
do not know are refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from drafter_checks import (
    PROMPTS,
    bound_pair,
    check_greedy_exact,
    check_sampling_law,
    draw,
    greedy_requests,
    head_reference,
    recorded_drafts,
    sharpen_head_laws,
    spec_run_drafters,
)
from test_engine_sampling import P_FAIL, VOCAB, chi_square_p, exact_law
from tiny_families import build_model, tokenizer_dir
from tiny_heads import build_eagle3
from tiny_models import build_llama, reference_greedy

import engine
from engine import GenerationRequest
from engine.eagle3 import load_eagle3
from engine.loading import ModelPair
from engine.types import ModelLoadError

#: Target ids of the 6-token target's 4-token draft vocabulary (1 and 4 are never drafted).
SMALL_DRAFT_VOCAB = [0, 2, 3, 5]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3")
    tok, vocab = tokenizer_dir(tmp)
    target = build_model(tmp / "llama", "llama", vocab_size=vocab, tokenizer_from=tok)
    # A draft vocabulary of every other target id, as published heads keep the frequent ones.
    head = build_eagle3(
        tmp / "eagle3", target, aux_ids=[1, 2, 2], draft_vocab=list(range(0, vocab, 2))
    )
    return target, head


@pytest.fixture(scope="module")
def eagle_pair(dirs):
    target, head = dirs
    return engine.load_pair(target, head)


def test_the_head_loads_from_its_published_layout(dirs, eagle_pair):
    _, head = dirs
    names = set(mx.load(str(head / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "midlayer.self_attn.q_proj.weight" in names
    drafter = eagle_pair.dflash
    assert drafter.kind == "eagle3" and eagle_pair.info()["drafter"] == "eagle3"
    assert drafter.layer_ids == (0, 1, 1)  # id i is the input of layer i: layer i-1's output
    q = mx.load(str(head / "model.safetensors"))["midlayer.self_attn.q_proj.weight"]
    assert mx.array_equal(drafter.head.layers[0].self_attn.q_proj.weight, q)
    assert drafter.to_target.tolist()[:4] == [0, 2, 4, 6]


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equals_target_only_single_and_batched(eagle_pair, k):
    requests = greedy_requests(PROMPTS, k, 20)
    check_greedy_exact(eagle_pair, requests, "eagle3", max_batch=3, drafted=k != "auto")


@pytest.fixture(scope="module")
def small_vocab_eagle(tmp_path_factory) -> ModelPair:
    """A 6-token llama target with a 4-token-vocabulary EAGLE-3 head."""
    tmp = tmp_path_factory.mktemp("v6eagle")
    target = build_llama(tmp / "t", vocab_size=VOCAB, hidden=16, layers=1, seed=11, scale=6.0)
    head = build_eagle3(
        tmp / "h", target, aux_ids=[1, 1, 1], draft_vocab=SMALL_DRAFT_VOCAB, seed=32, scale=1.0
    )
    return bound_pair(target, str(head), "e6", lambda t, config: load_eagle3(head, t, config))


def test_each_step_drafts_what_the_definition_drafts(small_vocab_eagle, monkeypatch):
    prompt = [1, 4, 2, 2, 5, 3, 0, 1]
    seen, accepted = recorded_drafts(small_vocab_eagle, prompt, 12, 3, monkeypatch)
    assert seen == head_reference(small_vocab_eagle, prompt, 12, 3)
    assert accepted > 0
    drafted = {t for d in seen for t in d}
    assert drafted <= set(SMALL_DRAFT_VOCAB) and len(drafted) > 1


@pytest.mark.slow
def test_eagle3_sampling_follows_the_target_law(small_vocab_eagle):
    check_sampling_law(small_vocab_eagle, 10_000, 21_000_000, 200, 22_000_000)


def test_an_eagle3_law_at_the_wrong_temperature_fails_the_test(small_vocab_eagle, monkeypatch):
    sharpen_head_laws(monkeypatch)
    law = exact_law(small_vocab_eagle)
    assert chi_square_p(law, draw(small_vocab_eagle, 6_000, seed0=23_000_000)) < P_FAIL


def _edited(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_layouts_we_do_not_know_are_refused_in_one_line(dirs, tmp_path):
    target, head = dirs
    cases = [
        (lambda c: c.pop("hidden_size"), "EAGLE-3 config.json: missing field 'hidden_size'"),
        (
            lambda c: c.update(num_hidden_layers=2),
            "{p}: num_hidden_layers 2: only one-layer heads are read",
        ),
        (
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]),
            "{p}: eagle_aux_hidden_state_layer_ids [1, 2, 9] outside the target's layers 1..2",
        ),
        (
            lambda c: c.update(vocab_size=c["vocab_size"] + 1),
            "{p}: vocab_size {v} differs from the target's {w}",
        ),
        (
            lambda c: c.update(draft_vocab_size=c["draft_vocab_size"] + 1),
            "{p}: d2t does not map the {n} draft ids to distinct target ids in 0..{m}",
        ),
    ]
    vocab = json.loads((head / "config.json").read_text())["vocab_size"]
    n = json.loads((head / "config.json").read_text())["draft_vocab_size"] + 1
    for i, (edit, message) in enumerate(cases):
        path = _edited(head, tmp_path / f"h{i}", edit)
        with pytest.raises(ModelLoadError) as info:
            engine.load_pair(target, path)
        expected = message.format(p=f"EAGLE-3 head {path}", v=vocab + 1, w=vocab, n=n, m=vocab - 1)
        assert str(info.value) == expected


def test_spec_run_with_an_eagle3_head_names_the_drafter(dirs, tmp_path):
    target, head = dirs
    assert spec_run_drafters(target, str(head), PROMPTS[:2], tmp_path) == ["eagle3", "eagle3"]


def test_spec_doctor_names_the_eagle3_head(dirs):
    from click.testing import CliRunner

    from worker.doctor import main

    target, head = dirs
    env = {"SPEC_REDIS_URL": None, "REDIS_URL": None}
    res = CliRunner().invoke(
        main, ["--target", str(target), "--draft", str(head), "--no-bench"], env=env
    )
    assert res.exit_code == 0, res.output
    pair = next(ln for ln in res.stdout.splitlines() if ln.startswith("OK   pair:"))
    assert "; drafter eagle3: EAGLE-3 head, reads the outputs of target layers 0, 1, 1, " in pair
    assert pair.endswith("draft vocabulary 160 of 320, 0.0678M parameters")


def test_an_eagle3_head_on_a_hybrid_qwen3_5_target_is_exact(tmp_path):
    # qwen3_5: gated delta-net layers between full-attention ones (recurrent rollback).
    tok, vocab = tokenizer_dir(tmp_path)
    target = build_model(tmp_path / "qwen3_5", "qwen3_5", vocab_size=vocab, tokenizer_from=tok)
    head = build_eagle3(tmp_path / "h", target, aux_ids=[1, 2, 4], draft_vocab=list(range(vocab)))
    pair = engine.load_pair(target, head)
    assert pair.dflash.layer_ids == (0, 1, 3)
    requests = [
        GenerationRequest(prompt=p, max_tokens=16, temperature=0.0, num_draft_tokens=3)
        for p in PROMPTS
    ]
    refs = [reference_greedy(pair, pair.tokenizer.encode(p), 16) for p in PROMPTS]
    batched = dict(engine.generate_many(pair, requests, max_batch=3))
    for i, ref in enumerate(refs):
        assert batched[i].token_ids == ref[: len(batched[i].token_ids)], i
    assert sum(r.stats.to_dict()["num_draft_tokens"] for r in batched.values()) > 0
