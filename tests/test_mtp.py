"""Native MTP heads (`--draft mtp`): the target drafts with the `mtp.*` weights of its
own checkpoint. Loads from the published names, drafts for real, greedy output equals
target-only output single and batched, each step drafts what the plainest loop over the
head's definition drafts, sampling follows the target's law (chi-square) with rows
rolled back per row on a hybrid target, and checkpoints without a head are refused in
one line."""

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
    six_token_target,
    spec_run_drafters,
    write_greedy_jobs,
)
from test_engine_sampling import P_FAIL, chi_square_p, exact_law
from tiny_families import build_model, tokenizer_dir
from tiny_heads import add_mtp_head, to_hf_layout, to_shards

import engine
from engine import GenerationRequest, heads, mtp
from engine.loading import ModelPair
from engine.types import ModelLoadError

N_DRAWS = 10_000
N_EQUAL = 200
N_MUTANT = 6_000


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp")
    tok, vocab = tokenizer_dir(tmp)
    target = build_model(tmp / "qwen3_5", "qwen3_5", vocab_size=vocab, tokenizer_from=tok)
    add_mtp_head(target)
    return target


@pytest.fixture(scope="module")
def mtp_pair(tiny_dir):
    return engine.load_pair(tiny_dir, "mtp")


def test_the_head_loads_from_its_published_names(tiny_dir, mtp_pair):
    names = set(mx.load(str(tiny_dir / "model.safetensors")))
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
        assert name in names
    assert "mtp.layers.0.self_attn.q_proj.weight" in names
    assert mtp_pair.dflash.kind == "mtp"
    assert mtp_pair.info()["drafter"] == "mtp" and mtp_pair.draft_path == "mtp"
    # The head's tensors are the file's, not fresh random ones.
    file_fc = mx.load(str(tiny_dir / "model.safetensors"))["mtp.fc.weight"]
    assert mx.array_equal(mtp_pair.dflash.head.fc.weight, file_fc)


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equals_target_only_single_and_batched(mtp_pair, k):
    requests = greedy_requests(PROMPTS, k, 20)
    check_greedy_exact(mtp_pair, requests, "mtp", max_batch=3, drafted=k != "auto")


# -- the head's definition, step by step ------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab_mtp(tmp_path_factory) -> ModelPair:
    """A 6-token hybrid qwen3_5 target (gated delta-net + full attention) with an MTP head."""
    target = six_token_target(tmp_path_factory.mktemp("v6mtp"), "qwen3_5")
    add_mtp_head(target, seed=23, scale=1.0)
    return bound_pair(
        target,
        "mtp",
        "m6",
        lambda model, config: mtp.load_mtp(str(target), model, config),
    )


def test_each_step_drafts_what_the_definition_drafts(small_vocab_mtp, monkeypatch):
    prompt = [1, 4, 2, 2, 5, 3, 0, 1]
    seen, accepted = recorded_drafts(small_vocab_mtp, prompt, 12, 3, monkeypatch)
    assert seen == head_reference(small_vocab_mtp, prompt, 12, 3)
    assert accepted > 0  # the head's drafts pass, so this compares more than first drafts


def test_a_head_that_keeps_its_chained_entries_fails_the_step_test(small_vocab_mtp, monkeypatch):
    # Mutation: the chained passes stay in the head's cache instead of being read again
    # with the target's hidden states (lossless, but not the head's definition).
    original = heads.HeadProposer.commit

    def keep_chained(self, emitted, accepted):
        drop = self.rows.drop_last
        self.rows.drop_last = lambda counts: None
        try:
            original(self, emitted, accepted)
        finally:
            self.rows.drop_last = drop

    monkeypatch.setattr(heads.HeadProposer, "commit", keep_chained)
    prompt = [1, 4, 2, 2, 5, 3, 0, 1]
    seen, _ = recorded_drafts(small_vocab_mtp, prompt, 12, 3, monkeypatch)
    monkeypatch.undo()
    assert seen != head_reference(small_vocab_mtp, prompt, 12, 3)


# -- the sampling law --------------------------------------------------------------------
@pytest.mark.slow
def test_mtp_sampling_follows_the_target_law(small_vocab_mtp):
    check_sampling_law(small_vocab_mtp, N_DRAWS, 11_000_000, N_EQUAL, 12_000_000)


def test_an_mtp_law_at_the_wrong_temperature_fails_the_test(small_vocab_mtp, monkeypatch):
    sharpen_head_laws(monkeypatch)
    law = exact_law(small_vocab_mtp)
    assert chi_square_p(law, draw(small_vocab_mtp, N_MUTANT, seed0=13_000_000)) < P_FAIL


# -- refusals and the command line -------------------------------------------------------
def _copy(src, dst, config_edit=None, drop=()):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        w = mx.load(str(dst / "model.safetensors"))
        w = {k: v for k, v in w.items() if not any(k.startswith(d) for d in drop)}
        mx.save_safetensors(str(dst / "model.safetensors"), w)
    return dst


def test_checkpoints_without_a_head_are_refused_in_one_line(tiny_dir, tmp_path):
    cases = [
        (
            _copy(tiny_dir, tmp_path / "a", lambda c: c.pop("mtp_num_hidden_layers")),
            "config has no text_config.mtp_num_hidden_layers: this checkpoint has no MTP "
            "head (use --draft DIR with a draft model or drafter)",
        ),
        (
            _copy(tiny_dir, tmp_path / "b", drop=("mtp.",)),
            "config says mtp_num_hidden_layers 1 but the safetensors hold no mtp.* tensors "
            "(mlx-lm conversions drop them; use the original checkpoint)",
        ),
        (
            _copy(tiny_dir, tmp_path / "c", drop=("mtp.fc.",)),
            "mtp.* tensors do not match the config: Missing 1 parameters: fc.weight.",
        ),
    ]
    for path, message in cases:
        with pytest.raises(ModelLoadError) as info:
            engine.load_pair(path, "mtp")
        assert str(info.value) == f"--draft mtp: target {path}: {message}"


def test_a_target_family_without_mtp_heads_is_refused(tmp_path):
    tok, vocab = tokenizer_dir(tmp_path)
    target = build_model(tmp_path / "llama", "llama", vocab_size=vocab, tokenizer_from=tok)
    with pytest.raises(ModelLoadError) as info:
        engine.load_pair(target, "mtp")
    assert str(info.value) == (
        f"--draft mtp: target {target}: model_type 'llama' has no MTP head this engine "
        "reads (it reads qwen3_5)"
    )


def test_spec_run_with_draft_mtp_names_the_drafter(tiny_dir, tmp_path):
    assert spec_run_drafters(tiny_dir, "mtp", PROMPTS[:2], tmp_path) == ["mtp", "mtp"]


def test_a_hugging_face_layout_checkpoint_drafts_the_same(tiny_dir, mtp_pair, tmp_path):
    # Published Qwen3.5 files store RMSNorm weights as offsets from 1, the head's too.
    hf = engine.load_pair(to_hf_layout(tiny_dir, tmp_path / "hf"), "mtp")
    prompt = mtp_pair.tokenizer.encode(PROMPTS[0])
    ours = head_reference(mtp_pair, prompt, 3, 3)
    assert head_reference(hf, prompt, 3, 3) == ours
    h = mx.random.normal((1, 4, mtp_pair.dflash.head.hidden_size), key=mx.random.key(0))
    x = mx.array([prompt[:4]])
    assert mx.allclose(hf.dflash.step(x, h, None), mtp_pair.dflash.step(x, h, None), atol=1e-5)


# Sharded checkpoints: the target in the first shard, the head alone in the last
# ("alone"), or the head split over two shards of its own ("split").
SHARDINGS = {
    "alone": lambda key: 1 if key.startswith("mtp.") else 0,
    "split": lambda key: (2 if ".layers." in key else 1) if key.startswith("mtp.") else 0,
}


@pytest.mark.parametrize(
    "layout, sharding",
    [("hugging-face", "alone"), ("hugging-face", "split"), ("converted", "alone")],
)
def test_a_sharded_checkpoint_is_read_in_the_whole_checkpoints_layout(
    tiny_dir, mtp_pair, tmp_path, layout, sharding
):
    # The layout is decided from every shard (the target's conv1d kernels), never from the
    # head's shards alone: a Hugging Face head is shifted once, a converted one never.
    src = to_hf_layout(tiny_dir, tmp_path / "hf") if layout == "hugging-face" else tiny_dir
    path = to_shards(src, tmp_path / "sharded", SHARDINGS[sharding])
    files = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    head_files = {f for k, f in files.items() if k.startswith("mtp.")}
    assert not any("conv1d" in k for k, f in files.items() if f in head_files)
    pair = engine.load_pair(path, "mtp")
    read = pair.info()["draft_layout"]
    if layout == "hugging-face":
        assert read.startswith("Hugging Face (norms stored as offsets from 1, shifted; ")
        assert "conv1d.weight in model-00001-of-" in read
    else:
        assert read.startswith("converted (norms used as stored; ")
    # The head's norms are the converted file's (about 1 here), whichever file it came from.
    stored = mx.load(str(tiny_dir / "model.safetensors"))
    head = pair.dflash.head
    for name, loaded in (
        ("norm", head.norm),
        ("layers.0.input_layernorm", head.layers[0].input_layernorm),
    ):
        assert mx.allclose(loaded.weight, stored[f"mtp.{name}.weight"], atol=1e-6), name
    h = mx.random.normal((1, 4, head.hidden_size), key=mx.random.key(0))
    x = mx.array([mtp_pair.tokenizer.encode(PROMPTS[0])[:4]])
    assert mx.allclose(pair.dflash.step(x, h, None), mtp_pair.dflash.step(x, h, None), atol=1e-5)


def test_a_shard_the_index_names_but_that_is_missing_is_named(tiny_dir, tmp_path):
    path = to_shards(tiny_dir, tmp_path / "sharded", SHARDINGS["alone"])
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError) as info:
        mtp.load_mtp(str(path), None, json.loads((path / "config.json").read_text()))
    assert str(info.value).startswith(
        f"--draft mtp: target {path}: cannot read the safetensors header of "
        f"{path / 'model-00002-of-00002.safetensors'}: "
    )


def test_spec_doctor_names_the_mtp_head(tiny_dir):
    from click.testing import CliRunner

    from worker.doctor import main

    env = {"SPEC_REDIS_URL": None, "REDIS_URL": None}
    res = CliRunner().invoke(
        main, ["--target", str(tiny_dir), "--draft", "mtp", "--no-bench"], env=env
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    pair = next(ln for ln in lines if ln.startswith("OK   pair:"))
    assert "drafter mtp: the target's own MTP head, 1 layer(s), 0.0495M parameters, " in pair
    assert pair.endswith(
        ", layout converted (norms used as stored; language_model.model.layers.0.linear_attn"
        ".conv1d.weight in model.safetensors has shape [64, 4, 1], as mlx-lm converts it)"
    )
    memory = next(ln for ln in lines if " memory:" in ln)
    assert memory.startswith("OK") and "draft" not in memory  # the head is in the target
    assert "; draft: mtp head, 1 layer(s)" in next(ln for ln in lines if " features:" in ln)


def test_spec_worker_with_draft_mtp_serves_a_batch(tiny_dir, redis_env, start_worker, tmp_path):
    jobs = write_greedy_jobs(tmp_path / "jobs.jsonl", PROMPTS[:3], max_tokens=8)
    batch = redis_env.batch_id()
    assert redis_env.run("spec-submit", str(jobs), "--batch-id", batch).returncode == 0
    worker = start_worker("--burst", "--target", str(tiny_dir), "--draft", "mtp", "--alias", "demo")
    assert worker.wait(timeout=300) == 0, worker.log
    assert "'draft': 'mtp', 'drafter': 'mtp'" in worker.log  # the start-up line names it
    assert "'draft_layout': 'converted (norms used as stored; " in worker.log  # and its layout
    out = tmp_path / "out.jsonl"
    assert redis_env.run("spec-collect", batch, "-o", str(out)).returncode == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [ln["custom_id"] for ln in lines] == ["r0", "r1", "r2"]
    spec = [ln["response"]["body"]["metrics"]["speculative_decoding"] for ln in lines]
    assert {s["drafter"] for s in spec} == {"mtp"}
    ids = [mtp_tokens(tiny_dir, p) for p in PROMPTS[:3]]
    assert [ln["response"]["body"]["choices"][0]["text"] for ln in lines] == ids


def mtp_tokens(target_dir, prompt: str) -> str:
    """Target-only greedy text of 8 tokens, for comparison with the worker's results."""
    pair = engine.load_pair(target_dir, use_draft=False)
    req = GenerationRequest(prompt=prompt, max_tokens=8, temperature=0.0, drafter="none")
    return engine.generate(pair, req).text


def test_a_prompt_longer_than_a_chunk_is_read_ahead_exactly(mtp_pair, monkeypatch):
    # Pending pairs past PREFILL_CHUNK are read in chunks before the drafting pass.
    import random

    vocab = mtp_pair.target_vocab
    prompt = [random.Random(3).randrange(vocab) for _ in range(heads.PREFILL_CHUNK + 90)]
    seen, _ = recorded_drafts(mtp_pair, prompt, 4, 3, monkeypatch)
    assert seen == head_reference(mtp_pair, prompt, 4, 3)
