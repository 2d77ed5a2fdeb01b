"""What the drafter tests (test_dflash*, test_eagle3, test_mtp) share: tiny DFlash configs,
6-token pairs and the sampling-law test over them, the greedy-exactness check, the
plainest loop over a head's definition, and the spec-run and wrong-law checks, written
once so that each test file says only what is particular to its drafter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import chisquare
import mlx.core as mx
import mlx_lm
from conftest import script
from test_engine_sampling import LENGTH, P_FAIL, PARAMS, PROMPT, VOCAB, chi_square_p, exact_law
from tiny_families import build_model, six_token_model, tokenizer_dir
from tiny_models import reference_greedy

import engine
from engine import GenerationRequest, heads
from engine.batch import SpeculativeDecoder
from engine.dflash import DFlashConfig, DFlashModel, save_dflash
from engine.loading import ModelPair
from engine.sampling import SamplingParams

#: Draft lengths 1..3 mixed in one batch (chisquare's `setups`).
MIXED_K = (("model", 1), ("model", 2), ("model", 3))
#: Prompts of the heads' tests (test_mtp, test_eagle3).
PROMPTS = ["def parse(line):\n    ", "import os\n", "x = [", "for i in range(10):"]
TEXTS = ["def parse_header(line):\n    ", "import os\n", "class Stack:\n    def push(self):"]
#: The sizes of the drafters beside a 6-token target (the sampling-law tests).
SMALL = dict(
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=32,
    block_size=4,
)


def drafter_config(**over) -> DFlashConfig:
    """A tiny DFlash drafter for a 96-token, 64-wide, 3-layer target; `over` changes fields."""
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=96,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        block_size=5,
        mask_token_id=3,
        target_layer_ids=(0, 2),
        num_target_layers=3,
    )
    base.update(over)
    return DFlashConfig(**base)


def write_spread_drafter(path: Path, config: DFlashConfig, seed: int) -> None:
    """A drafter with random weights (`seed`) whose final norm is scaled down, which keeps
    its block laws spread out (far from one-hot), so that a wrong q shows in statistics."""
    mx.random.seed(seed)
    model = DFlashModel(config)
    model.norm.weight = model.norm.weight * 0.1
    save_dflash(model, path)


def family_target(tmp: Path, family: str, **kw) -> tuple[Path, int, int]:
    """A tiny target of `family` with the shared tokenizer: (path, vocabulary, layers)."""
    tok, vocab = tokenizer_dir(tmp)
    path = build_model(tmp / family, family, vocab_size=vocab, tokenizer_from=tok, **kw)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    return path, vocab, layers


def six_token_target(tmp: Path, family: str) -> Path:
    """A `six_token_model` target of `family` (seed 11) with the shared tokenizer."""
    tok, _ = tokenizer_dir(tmp)
    return six_token_model(tmp / "t", family, tok, seed=11)


def bound_pair(target: Path, draft: str, name: str, load) -> ModelPair:
    """A 6-token pair whose drafter reads the target: `load(target model, its config)`
    binds it."""
    t_model, config = mlx_lm.utils.load_model(target)
    pair = ModelPair(t_model, None, None, str(target), draft, 512, VOCAB, VOCAB, name)
    pair.dflash = load(t_model, config)
    return pair


def draw(pair: ModelPair, n: int, seed0: int, rows: int = chisquare.ROWS) -> dict:
    """n sequences of LENGTH tokens from a 6-token pair, draft lengths 1..3 mixed in one
    batch, rows joining as others end (`rows=1`: each alone)."""
    return chisquare.draw(pair, n, seed0, PROMPT, PARAMS, LENGTH, rows=rows, setups=MIXED_K)


def check_sampling_law(pair: ModelPair, n: int, seed0: int, n_equal: int, seed_equal: int):
    """A drafter's sampled rows follow the target's law: a chi-square test over n batched
    draws from seed0, and n_equal single requests from seed_equal that draw, seed for seed,
    what batched rows draw (so the single path's law is the batched path's)."""
    law = exact_law(pair)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    assert chi_square_p(law, draw(pair, n, seed0)) > P_FAIL
    chisquare.single_equals_batched(
        pair, n_equal, seed_equal, PROMPT, PARAMS, LENGTH, setups=MIXED_K
    )


def greedy_requests(prompts: list, k, max_tokens: int, grow: int = 0) -> list:
    """Greedy requests drafting `k`, prompt i (text, or token ids) for max_tokens +
    grow * i tokens."""
    return [
        GenerationRequest(
            **({"prompt": p} if isinstance(p, str) else {"prompt_ids": p}),
            max_tokens=max_tokens + grow * i,
            temperature=0.0,
            num_draft_tokens=k,
        )
        for i, p in enumerate(prompts)
    ]


def check_greedy_exact(pair, requests, drafter: str, max_batch: int, drafted: bool = True):
    """Each greedy request's tokens equal target-only tokens (mlx-lm's stream_generate),
    alone and batched `max_batch` rows at a time (rows join as others end); every result
    names `drafter` and, with `drafted`, some tokens were drafted. Returns the results of
    the requests run alone."""
    k = requests[0].num_draft_tokens
    ids = [r.prompt_ids if r.prompt is None else pair.tokenizer.encode(r.prompt) for r in requests]
    refs = [
        reference_greedy(pair, list(i), r.max_tokens) for i, r in zip(ids, requests, strict=True)
    ]
    single = [engine.generate(pair, r) for r in requests]
    batched = dict(engine.generate_many(pair, requests, max_batch=max_batch))
    for i, ref in enumerate(refs):
        assert single[i].token_ids == ref[: len(single[i].token_ids)], (k, i)
        assert batched[i].token_ids == single[i].token_ids, (k, i)
    stats = [r.metrics["speculative_decoding"] for r in single]
    assert {s["drafter"] for s in stats} == {drafter}
    if drafted:
        assert sum(s["num_draft_tokens"] for s in stats) > 0
    return single


# -- heads (MTP, EAGLE-3) ------------------------------------------------------------------
def head_reference(pair: ModelPair, prompt: list[int], steps: int, k: int) -> list[list[int]]:
    """The drafts of each verify step of greedy decoding, from the definition alone: no
    caches; the head reads (h_i, x_{i+1}) for every earlier position i, with h the
    target's features, then chains its own outputs for drafts 2..k."""
    drafter = pair.dflash
    text = list(prompt)
    seen = []
    while len(seen) < steps:
        with drafter.capture(pair.target) as cap:
            logits = pair.target(mx.array([text]))
            hidden = cap.features
        # Pairs (h_i, x_{i+1}) for i < len(text) - 1: up to the pending (newest) token.
        tokens, pairs_h = mx.array([text[1:]]), hidden[:, :-1]
        if drafter.kind == "eagle3":  # its fc projects target features, not chained ones
            pairs_h = drafter.head.fc(pairs_h)
        drafts = []
        for _ in range(k):
            out = drafter.step(tokens, pairs_h, None)[:, -1:]
            d = int(mx.argmax(drafter.logits(out[:, -1])[0]).item())
            drafts.append(d)
            tokens = mx.concatenate([tokens, mx.array([[d]])], axis=1)
            pairs_h = mx.concatenate([pairs_h, out], axis=1)
        seen.append(drafts)
        # Accept as the target would: its argmax after the pending token and each draft.
        with drafter.capture(pair.target):
            logits = pair.target(mx.array([text + drafts]))
        best = mx.argmax(logits[0, len(text) - 1 :], axis=-1).tolist()
        n = next((i for i, d in enumerate(drafts) if d != best[i]), k)
        text += drafts[:n] + [best[n]]
    return seen


def recorded_drafts(pair, prompt, steps, k, monkeypatch) -> tuple[list, int]:
    """The drafts a head's proposer made for row 0 in `steps` greedy steps of the decoder,
    and how many of them were accepted."""
    seen = []
    original = heads.HeadProposer.propose

    def record(self, want, positions, last=None):
        drafts, laws = original(self, want, positions, last)
        seen.append(drafts.get(0))
        return drafts, laws

    monkeypatch.setattr(heads.HeadProposer, "propose", record)
    dec = SpeculativeDecoder(
        pair, prompt, SamplingParams(0.0), num_draft_tokens=k, max_tokens=10_000
    )
    accepted = sum(dec.step().accepted for _ in range(steps))
    return seen, accepted


def sharpen_head_laws(monkeypatch) -> None:
    """Mutation: a head's proposer hands the acceptance rule a q that is not the law its
    drafts were drawn from (q^4 renormalised); the chi-square test must catch it."""
    original = heads.HeadProposer.propose

    def wrong_law(self, want, positions, last=None):
        found, laws = original(self, want, positions, last)
        return found, {k: q**4 / mx.sum(q**4, axis=-1, keepdims=True) for k, q in laws.items()}

    monkeypatch.setattr(heads.HeadProposer, "propose", wrong_law)


def write_greedy_jobs(path: Path, prompts: list[str], max_tokens: int) -> Path:
    """A JSONL job file of greedy requests r0, r1, ... for `prompts`."""
    path.write_text(
        "".join(
            json.dumps(
                {"custom_id": f"r{i}", "prompt": p, "max_tokens": max_tokens, "temperature": 0}
            )
            + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def spec_run_drafters(target, draft: str, prompts: list[str], tmp_path: Path) -> list[str]:
    """`spec-run` over greedy jobs of `prompts` with `--draft draft`: the drafter each
    result's statistics name."""
    jobs = write_greedy_jobs(tmp_path / "jobs.jsonl", prompts, max_tokens=12)
    out = tmp_path / "results.jsonl"
    command = [script("spec-run"), str(jobs), "--target", str(target), "--draft", draft]
    run = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return [ln["response"]["body"]["metrics"]["speculative_decoding"]["drafter"] for ln in lines]
