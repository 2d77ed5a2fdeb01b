"""A drafter that loads but never gets a draft accepted is named: by the engine's check on
a few greedy tokens, in the worker's start-up log (which goes on serving) and by
spec-doctor. The broken draft here is the target itself with its LM head's rows rolled by
one: it loads (same tokenizer, same shapes) and always drafts the token after the
target's choice, so not one draft is accepted; the target as its own draft is the
control, every draft accepted."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import random_pair

import engine
from engine import acceptance_check
from engine.acceptance_check import check_acceptance


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    random_pair(root, hidden=64, layers=2)
    rolled = root / "rolled"
    rolled.mkdir()
    for f in (root / "target").iterdir():
        (rolled / f.name).write_bytes(f.read_bytes())
    weights = dict(mx.load(str(rolled / "model.safetensors")))
    weights["lm_head.weight"] = mx.roll(weights["lm_head.weight"], 1, axis=0)
    mx.save_safetensors(str(rolled / "model.safetensors"), weights)
    return root


def test_a_draft_never_accepted_is_named_with_its_likely_causes(models):
    broken = engine.load_pair(models / "target", models / "rolled")
    found = check_acceptance(broken)
    assert (found.drafter, found.accepted, found.tokens) == ("model", 0, 32)
    assert found.drafted >= 16 and found.near_zero
    assert found.warning() == (
        f"drafter model: 0 of {found.drafted} drafts accepted (0.00) on a 32-token greedy "
        "check: the drafter loads but its drafts are (almost) never accepted; output stays "
        "exact but slower than plain. Likely causes: a draft of another family or training "
        "whose tokenizer agrees with the target's on the shared ids (e.g. a superset "
        "vocabulary), so it loads but predicts other text; or a wrong pair (a draft or head "
        "made for another target). Use a draft of the target's own family, or serve with "
        "drafter 'none' until it is fixed"
    )
    good = engine.load_pair(models / "target", models / "target")
    kept = good.prefix.info()
    found = check_acceptance(good)
    assert found.accepted == found.drafted > 0 and found.warning() is None
    assert good.prefix.info() == kept  # the check leaves the pair's prefix cache as it was


def test_a_pair_without_a_draft_has_nothing_to_check(models):
    assert check_acceptance(engine.load_pair(models / "target")) is None


def test_spec_worker_warns_at_start_up_and_serves_anyway(models, redis_env, start_worker):
    redis_env.env["SPEC_ACCEPTANCE_CHECK"] = "1"  # test workers skip it by default
    worker = start_worker(
        "--burst", "--target", str(models / "target"), "--draft", str(models / "rolled")
    )
    assert worker.wait(timeout=300) == 0, worker.log
    line = next(ln for ln in worker.log.splitlines() if "acceptance check:" in ln)
    assert " WARNING specfleet.worker: acceptance check: drafter model: 0 of " in line
    assert "Likely causes: a draft of another family" in line


def test_the_start_up_check_is_skippable_and_never_stops_the_worker(models, monkeypatch, caplog):
    from worker import cli

    def start() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specfleet.worker"):
            pair = cli._load_pair("spec-worker", str(models / "target"), str(models / "rolled"))
        assert pair.draft is not None
        return [r.getMessage() for r in caplog.records if "acceptance check" in r.getMessage()]

    monkeypatch.setenv("SPEC_ACCEPTANCE_CHECK", "0")
    assert start() == []

    def broken(pair, tokens=32):
        raise RuntimeError("no such kernel")

    monkeypatch.setenv("SPEC_ACCEPTANCE_CHECK", "1")
    monkeypatch.setattr(acceptance_check, "check_acceptance", broken)
    assert start() == [
        "acceptance check could not run (serving anyway): RuntimeError('no such kernel')"
    ]


def test_spec_doctor_warns_on_a_draft_never_accepted(models):
    from worker.doctor import main

    env = {"SPEC_REDIS_URL": None, "REDIS_URL": None}
    for draft, status in (("rolled", "WARN"), ("target", "OK  ")):
        args = ["--target", str(models / "target"), "--draft", str(models / draft), "--no-bench"]
        res = CliRunner().invoke(main, args, env=env)
        assert res.exit_code == 0, res.output
        line = next(ln for ln in res.stdout.splitlines() if " acceptance:" in ln)
        assert line.startswith(f"{status} acceptance: drafter model: "), line
