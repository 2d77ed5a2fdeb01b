"""The "auto" controller's realized-speed guard: whatever its cost model predicts,
speculation that has measurably cost more seconds per emitted token than plain decoding
at a batch size is stopped there (probes aside), and allowed again once it pays."""

from __future__ import annotations

import pytest

import engine
from engine.adaptive import (
    AutoRow,
    DraftController,
    PassCosts,
    static_costs,
)
from engine.policy import (
    GUARD_MEDIAN_OF,
    GUARD_MIN_PLAIN,
    GUARD_MIN_STEPS,
    GUARD_SKIP,
    PROBE_FIRST,
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
    for _ in range(GUARD_SKIP + GUARD_MIN_STEPS):
        # 4 rows: a plain step emits 4 tokens in 10 ms; a drafting step 6 tokens in 40 ms.
        ctl.observe_realized(4, 0.010, 4, drafted=False)
        ctl.observe_realized(4, 0.040, 6, drafted=True)
    got = _choices(ctl, 4, steps=64)
    assert got.count(0) >= 60 and max(got) <= 1  # plain, with the odd one-token probe
    assert set(_choices(ctl, 8)) != {0}  # another batch size has its own evidence


def test_speculation_that_pays_per_token_goes_on_and_a_lost_size_recovers():
    ctl = _controller()
    for _ in range(GUARD_SKIP + GUARD_MIN_STEPS):
        ctl.observe_realized(4, 0.010, 4, drafted=False)
        ctl.observe_realized(4, 0.015, 12, drafted=True)
    assert _choices(ctl, 4).count(0) == 0
    # Then drafting goes wrong (a shift in the workload), then right again.
    for _ in range(40):
        ctl.observe_realized(4, 0.050, 5, drafted=True)
    assert set(_choices(ctl, 4, steps=8)) <= {0, 1}
    for _ in range(60):
        ctl.observe_realized(4, 0.012, 8, drafted=True)
    # Drafting again; one plain step first, the plain side of the evidence being 100 steps old.
    got = _choices(ctl, 4)
    assert got[0] == 0 and got.count(0) == 1


def test_one_paused_plain_step_does_not_make_losing_drafts_look_like_a_win():
    # The plain side hears a few plain checks where the drafting side hears hundreds of
    # steps; a pause of the process in one plain check (GC, the OS) weighed as much as a
    # run of drafting (measured at 4 demo rows: plain read 1.47 ms a token where plain
    # steps cost 0.78, and drafting that lost to plain ran on). The plain side is the
    # median of its newest steps where that is less. (Mutation: `plain` the decayed mean
    # alone -> drafting 5% dearer a token than plain looks 2x cheaper.)
    ctl = _controller()
    for _ in range(GUARD_SKIP + GUARD_MIN_STEPS):
        ctl.observe_realized(4, 0.0105, 4, drafted=True)  # 5% dearer a token than plain
    for _ in range(GUARD_SKIP + GUARD_MIN_PLAIN):
        ctl.observe_realized(4, 0.010, 4, drafted=False)
    ctl.observe_realized(4, 0.100, 4, drafted=False)  # a pause in one plain check
    for _ in range(8):
        ctl.observe_realized(4, 0.0105, 4, drafted=True)
    assert ctl.speculation_lost(4)
    # A plain cost that really moved is heard within GUARD_MEDIAN_OF steps.
    for _ in range(GUARD_MEDIAN_OF):
        ctl.observe_realized(4, 0.020, 4, drafted=False)
    assert not ctl.speculation_lost(4)


def test_a_verdict_needs_drafting_to_lose_by_more_than_its_noise():
    # At one row a drafting step emits one token or several, so its cost a token swings
    # by half from step to step. Drafting 4.5% dearer a token than plain on such steps is
    # within their noise: no verdict (a verdict on a swing stood for hundreds of steps:
    # measured at 1 demo row, 1 process in 3 ran the draft model on ~6% of its steps).
    # Drafting a third dearer is a verdict. (Mutation: GUARD_Z = 0 -> lost at 4.5%.)
    ctl = _controller()
    for _ in range(GUARD_SKIP + GUARD_MIN_PLAIN + 4):
        ctl.observe_realized(1, 0.0022, 1, drafted=False)  # 2.2 ms a token
    for i in range(60):
        ctl.observe_realized(1, 0.0046, 1 + i % 3, drafted=True)  # 2.3 ms a token
    assert not ctl.speculation_lost(1)
    for i in range(60):
        ctl.observe_realized(1, 0.0060, 1 + i % 3, drafted=True)  # 3.0 ms a token
    assert ctl.speculation_lost(1)


def test_where_speculation_lost_even_accepted_probes_come_less_and_less_often():
    ctl = _controller()
    for _ in range(GUARD_SKIP + GUARD_MIN_STEPS):
        ctl.observe_realized(4, 0.010, 4, drafted=False)
        ctl.observe_realized(4, 0.040, 6, drafted=True)
    probes = 0
    for _ in range(600):
        k = ctl.choose_batch_k(_rows(4), [], 4)
        if ctl.probing:
            probes += 1
            ctl.probe_result(1, 1)  # the draft was right, but drafting still costs more
    assert 0 < probes <= 7  # intervals 8, 16, ..., 256 (a reset to 8 would make ~75)
    assert k == 0


def test_sizes_share_the_guard_within_a_power_of_two():
    ctl = _controller()
    for _ in range(GUARD_SKIP + GUARD_MIN_STEPS):
        ctl.observe_realized(16, 0.010, 16, drafted=False)
        ctl.observe_realized(17, 0.060, 30, drafted=True)
    assert ctl.speculation_lost(31) and ctl.speculation_lost(16)
    assert not ctl.speculation_lost(15) and not ctl.speculation_lost(32)


def test_decoding_steps_feed_the_guard_with_wall_clock_time():
    demo_pair = engine.load_pair(calibrate=False)
    ctl = demo_pair.controller
    before = {k: (r.plain_steps, r.spec_steps) for k, r in ctl.realized.items()}
    requests = [
        engine.GenerationRequest(prompt_ids=[5 + i, 9, 11], max_tokens=6, drafter="none")
        for i in range(4)
    ]
    list(engine.generate_many(demo_pair, requests, max_batch=4))
    group = ctl.realized[DraftController.size_class(4)]
    plain_before = before.get(DraftController.size_class(4), (0, 0))[0]
    # 6 tokens a row: the first step admits the rows (not counted), five more each emit 4.
    assert group.plain_steps - plain_before == 5
    assert group.plain > 0


def test_waking_cold_rows_is_priced_over_the_tokens_they_have_left():
    ctl = _controller()
    ctl.draft = PassCosts({1: 0.2, 16: 0.4})
    ctl.observe_realized(4, 0.010, 4, drafted=False)  # a live plain step at this size
    rows = _rows(4, acceptance=0.8)
    assert ctl.choose_batch_k(rows, [], 4) > 0
    # The draft model would first read 4 rows of 5,000 tokens: worth it for rows with
    # 50,000 tokens to go, not for rows with 3 (then plain decoding, or a probe at most).
    assert ctl.choose_batch_k(rows, [], 4, warm=(20_000, 50_000.0)) > 0
    got = [ctl.choose_batch_k(rows, [], 4, warm=(20_000, 3.0)) for _ in range(40)]
    assert got.count(0) >= 35


def _probing_pair(monkeypatch):
    """The demo pair (uncalibrated) whose "auto" probes on every step."""
    pair = engine.load_pair(calibrate=False)
    ctl = pair.controller

    def probe_always(auto, fixed, drafted_rows, warm=(0, 1.0), **_):
        ctl.probing, ctl.probe_rows = True, len(auto) + len(fixed)
        return 1

    monkeypatch.setattr(ctl, "choose_batch_k", probe_always)
    return pair, ctl


def test_a_probe_drafts_for_one_row_and_wakes_no_other(monkeypatch):
    pair, ctl = _probing_pair(monkeypatch)
    from engine.batch import BatchDecoder
    from engine.sampling import SamplingParams

    dec = BatchDecoder(pair)
    for i in range(4):
        dec.add(
            i,
            list(range(20 * i + 3, 20 * i + 8 + 3 * i)),  # no repeats; row 0's is shortest
            SamplingParams(0.0),
            seed=0,
            drafter="model",
            num_draft_tokens="auto",
            max_tokens=8,
            plan=ctl.plan("model", greedy=True),
        )
    dec.step()
    assert sorted(dec.proposer.cold) == [1, 2, 3]  # the others were never read
    assert [m.key for m in dec.proposer.members] == [0]  # row 0: read, then drafted for
    dec.step()
    assert sorted(dec.proposer.cold) == [1, 2, 3]  # the warm row again


def test_a_probe_keeps_its_row_in_step_and_out_of_the_statistics(monkeypatch):
    # Rows with as many tokens left finish on one step under plain decoding; a probe that
    # kept its accepted draft would move its row ahead (then it leaves, and its successor
    # joins, on steps of their own). Its row emits what plain decoding emits, one token a
    # step, and the request's statistics show no draft.
    pair, ctl = _probing_pair(monkeypatch)
    from engine.batch import BatchDecoder
    from engine.sampling import SamplingParams

    ids = pair.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    plain = engine.generate(
        pair, engine.GenerationRequest(prompt_ids=ids, max_tokens=12, drafter="none")
    )
    dec = BatchDecoder(pair)
    dec.add(
        0,
        ids,
        SamplingParams(0.0),
        seed=0,
        drafter="model",
        num_draft_tokens="auto",
        max_tokens=12,
        plan=ctl.plan("model", greedy=True),
    )
    probed = []
    monkeypatch.setattr(
        dec.policy, "observe", lambda o: probed.append((o.drafts[0], o.accepted[0]))
    )
    out = []
    for _ in range(12):
        step = dec.step()[0]
        assert (len(step.tokens), step.proposed, step.accepted) == (1, 0, 0)
        out += step.tokens
    assert out == plain.token_ids
    # Every step but the last (no budget left) drafted one token for the policy.
    assert [len(d) for d, _ in probed] == [1] * 11 + [0]
    assert sum(n for _, n in probed) > 0  # and some were right: they were held back


def test_a_settled_plain_decision_is_reused_until_the_batch_or_its_free_drafts_change(
    monkeypatch,
):
    # Verifying 2 tokens costs twice a decode step: even perfect acceptance cannot pay.
    target = PassCosts({1: 1.0, 2: 2.0, 64: 64.0})
    ctl = DraftController(target, PassCosts({1: 0.01}), static_costs(100, 10, on_gpu=False))
    priced = []
    rates = ctl._rates
    monkeypatch.setattr(ctl, "_rates", lambda *a: priced.append(1) or rates(*a))
    got = [ctl.choose_batch_k(_rows(4), [], 4, key="batch 1") for _ in range(40)]
    assert got == [0] * 40 and len(priced) == 3  # steps 1, 1 + 17, 1 + 2 * 17
    ctl.choose_batch_k(_rows(4), [], 4, key="batch 2")  # rows joined or left
    assert len(priced) == 4
    with_free = [*_rows(3), AutoRow(0.9, 3, free=True)]
    ctl.choose_batch_k(with_free, [], 4, key="batch 2")  # a free draft: priced again
    ctl.choose_batch_k(with_free, [], 4, key="batch 2")  # the same offer: settled
    assert len(priced) == 5
    ctl.choose_batch_k(_rows(4), [], 4)  # no key: always priced
    assert len(priced) == 6


def test_a_settled_plain_decision_is_priced_again_only_when_free_drafts_grow_clearly(
    monkeypatch,
):
    target = PassCosts({1: 1.0, 2: 2.0, 64: 64.0})  # no K can pay: K = 0 is settled
    ctl = DraftController(target, PassCosts({1: 0.01}), static_costs(100, 10, on_gpu=False))
    priced = []
    rates = ctl._rates
    monkeypatch.setattr(ctl, "_rates", lambda *a: priced.append(1) or rates(*a))

    def offer(free_rows: int, tokens_each: int) -> list[AutoRow]:
        free = [AutoRow(0.9, tokens_each, free=True) for _ in range(free_rows)]
        return [*_rows(16 - free_rows), *free]

    ctl.choose_batch_k(offer(4, 3), [], 16, key="batch")  # priced: 4 rows, 12 tokens
    ctl.choose_batch_k(offer(5, 3), [], 16, key="batch")  # one row more: within the slack
    ctl.choose_batch_k(offer(4, 3), [], 16, key="batch")
    assert len(priced) == 1
    ctl.choose_batch_k(offer(8, 3), [], 16, key="batch")  # twice the rows: priced again
    assert len(priced) == 2
    ctl.choose_batch_k(offer(8, 5), [], 16, key="batch")  # 40 tokens against 24: again
    assert len(priced) == 3


def test_accepted_probes_where_drafting_still_does_not_pay_come_less_and_less_often():
    ctl = _controller()
    probes = 0
    for _ in range(600):
        # Acceptance 0: no K pays, though perfect acceptance would (so probes run).
        k = ctl.choose_batch_k(_rows(4, acceptance=0.0), [], 4, key="batch")
        if ctl.probing:
            probes += 1
            ctl.probe_result(1, 1)  # this probe's draft was right, by chance
    assert 0 < probes <= 7  # intervals 8, 16, ..., 256 (a reset to 8 would make ~75)
    assert k == 0


def test_probes_that_failed_at_one_batch_size_do_not_space_out_another():
    # A long stretch at 16 rows where no K pays stretches the probes there to PROBE_MAX;
    # then a single row with a low acceptance (two rejected drafts) still probes within
    # PROBE_FIRST steps, so it can find that its drafts pay. (Mutation: one interval for
    # the whole process -> no probe in 64 steps; measured: DFlash long context ran plain
    # for good after dflash_bench's 16-row section.)
    ctl = _controller()
    for _ in range(600):
        ctl.choose_batch_k(_rows(16, acceptance=0.0), [], 16, key="batch")
        if ctl.probing:
            ctl.probe_result(1, 0)
    probes = []
    for _ in range(64):
        ctl.choose_batch_k(_rows(1, acceptance=0.0), [], 1, key="one")
        probes.append(ctl.probing)
        if ctl.probing:
            ctl.probe_result(1, 0)
    assert probes.index(True) < PROBE_FIRST
    assert 2 <= probes.count(True) <= 4  # and failing there, they space out there too


def test_work_outside_the_passes_is_priced_per_step_kind():
    # The passes alone say drafting pays at 4 rows (test_the_model_alone_would_draft;
    # a pass costs about 1 unit there, and 8 drafts at acceptance 0.9 emit 6 tokens a
    # row); a drafting step that spends 4 units more per row outside its passes than a
    # plain one does not, whatever its passes cost.
    ctl = _controller()
    ctl.observe_overhead(4, 0.02, drafted=False)
    ctl.observe_overhead(4, 16.0, drafted=True)
    assert ctl.step_seconds(4, 2, 0, 0) - ctl.step_seconds(4, 1, 0, 0) > 4 * 3.9
    got = _choices(ctl, 4, steps=64)
    assert got.count(0) >= 60 and max(got) <= 1  # plain, with the odd one-token probe


def test_a_step_that_admitted_rows_prices_nothing():
    # Its wall clock and its first pass over the joined cache hold one-off work (the
    # prefill, the joining copy): folded in, they would price plain decoding at that
    # batch size by a copy, for as long as no other plain step runs there.
    from engine.policy import Choice, DraftPolicy, Outcome

    class Row:
        plan, fixed_k, greedy_auto = None, None, False

    ctl = _controller()
    policy = DraftPolicy(ctl, None)
    rows = [Row() for _ in range(4)]

    def outcome(joined: bool) -> Outcome:
        choices = [Choice() for _ in rows]
        return Outcome(rows, choices, [[]] * 4, [0] * 4, 1, 0.0, 0.5, 0.0, joined)

    policy.observe(outcome(joined=True))
    assert ctl.live_target == {} and ctl.overhead == {} and ctl.realized == {}
    policy.observe(outcome(joined=False))  # the shape's first pass prices nothing
    assert ctl.live_target == {} and ctl.realized
    policy.observe(outcome(joined=False))
    assert (4, 1) in ctl.live_target
    assert (DraftController.size_class(4), False) in ctl.overhead


def test_a_shape_s_first_pass_in_a_process_prices_nothing():
    # Measured at one demo row: each new (rows, width) ran its first pass 2-4x slow. Folded
    # in, that one step priced drafting out for as long as nothing ran it again (a
    # settled K = 0 then runs no drafting step). (Mutation: the first pass folded in ->
    # the 4x price stands.)
    def priced(first: float) -> float:
        ctl = _controller()
        ctl.observe_step(1, 1, 0.004, 0, 0, 0.0)
        ctl.observe_step(1, 1, 0.004, 0, 0, 0.0)
        ctl.observe_step(1, 3, first, 2, 1, 0.002)  # the first (1, 3) pass
        ctl.observe_step(1, 3, 0.0045, 2, 1, 0.001)
        return ctl._target_pass(1, 3)

    assert priced(0.016) == pytest.approx(priced(0.0045), rel=1e-9)  # 4x slow: no matter


def test_plain_steps_of_a_batch_are_priced_from_a_measured_batch_pass():
    # Rows of one position cost more than one row of as many positions; a batch size at
    # which "auto" has only drafted so far still has its plain step measured (at start-up).
    from engine.policy import BATCH_SIZES

    ctl = engine.load_pair().controller
    for b in BATCH_SIZES:
        factor = ctl.live_target[(b, 1)]
        assert factor > 0
        assert ctl._target_pass(b, 1) == ctl.target._curve(b) * factor


def test_a_drafting_pass_is_priced_by_how_plain_decoding_costs_now():
    # Passes grow slower as the rows' context grows. The drafting shape ran early (short
    # context), then only plain steps ran while plain steps doubled: drafting is priced at
    # its old share of a plain step, not at its old seconds (which would make it look
    # cheap against plain decoding, and "auto" draft at a loss).
    ctl = _controller()
    for _ in range(30):
        ctl.observe_step(16, 1, 0.010, 0, 0, 0.0)
        ctl.observe_step(16, 2, 0.015, 1, 16, 0.001)
    early = ctl._target_pass(16, 2) / ctl._target_pass(16, 1)
    for _ in range(60):
        ctl.observe_step(16, 1, 0.020, 0, 0, 0.0)
    assert ctl._target_pass(16, 1) == pytest.approx(0.020, rel=0.02)
    assert ctl._target_pass(16, 2) == pytest.approx(0.030, rel=0.05)
    assert ctl._target_pass(16, 2) / ctl._target_pass(16, 1) == pytest.approx(early, rel=0.05)
