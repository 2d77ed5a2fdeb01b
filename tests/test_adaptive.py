"""The "auto" controller's realized-speed guard: whatever its cost model predicts,
speculation that has measurably cost more seconds per emitted token than plain decoding
at a batch size is stopped there (probes aside), and allowed again once it pays."""

from __future__ import annotations

from engine.adaptive import (
    GUARD_MIN_STEPS,
    AutoRow,
    DraftController,
    PassCosts,
    static_costs,
)


def _controller() -> DraftController:
    # A model that thinks speculation is nearly free: verify costs barely grow with width.
    target = PassCosts({1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 64: 1.3})
    draft = PassCosts({1: 0.01, 4: 0.01, 16: 0.02})
    return DraftController(target, draft, static_costs(100, 10, on_gpu=False))


def _rows(n: int, acceptance: float = 0.9) -> list[AutoRow]:
    return [AutoRow(acceptance, 8, free=False) for _ in range(n)]


def _choices(ctl: DraftController, rows: int, steps: int = 40) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(ctl.choose_batch_k(_rows(rows), [], rows))
        if ctl.probing:
            ctl.probe_result(1, 0)  # probes fail: they come less and less often
    return out


def test_the_model_alone_would_draft():
    assert set(_choices(_controller(), 4)) != {0}


def test_speculation_that_cost_more_per_token_is_stopped_at_that_batch_size():
    ctl = _controller()
    for _ in range(GUARD_MIN_STEPS):
        # 4 rows: a plain step emits 4 tokens in 10 ms; a drafting step 6 tokens in 40 ms.
        ctl.observe_step(4, 1, 0.010, 0, 4, 0.0, emitted=4)
        ctl.observe_step(4, 4, 0.030, 3, 4, 0.010, emitted=6)
    got = _choices(ctl, 4, steps=64)
    assert got.count(0) >= 60 and max(got) <= 1  # plain, with the odd one-token probe
    assert set(_choices(ctl, 8)) != {0}  # another batch size has its own evidence


def test_speculation_that_pays_per_token_goes_on_and_a_lost_size_recovers():
    ctl = _controller()
    for _ in range(GUARD_MIN_STEPS):
        ctl.observe_step(4, 1, 0.010, 0, 4, 0.0, emitted=4)
        ctl.observe_step(4, 4, 0.012, 3, 4, 0.003, emitted=12)
    assert _choices(ctl, 4).count(0) == 0
    # Then drafting goes wrong (a shift in the workload), then right again.
    for _ in range(40):
        ctl.observe_step(4, 4, 0.040, 3, 4, 0.010, emitted=5)
    assert set(_choices(ctl, 4, steps=8)) <= {0, 1}
    for _ in range(60):
        ctl.observe_step(4, 2, 0.011, 1, 4, 0.001, emitted=8)
    assert _choices(ctl, 4).count(0) == 0
