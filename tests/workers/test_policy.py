"""The speculation policy (workers/policy.py): its models, its choice, and that the
engine consults it before anything of the step being decided exists."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import replace

import numpy as np
import pytest
import torch

from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from workers.policy import (
    AcceptanceModel,
    CostModel,
    PolicyConfig,
    PolicyRow,
    SpeculationPolicy,
    expected_tokens,
)
from workers.scheduler import SchedulerConfig


def test_expected_tokens_is_one_plus_the_reach_probabilities():
    a = np.array([0.8, 0.5, 0.25])
    e = expected_tokens(a)
    assert e.tolist() == pytest.approx([1.0, 1.8, 2.2, 2.3])


def test_acceptance_estimates_follow_each_group_and_each_request():
    model = AcceptanceModel(PolicyConfig())
    rng = np.random.default_rng(0)
    for step in range(400):  # group "hi" accepts each position w.p. 0.9, "lo" w.p. 0.3
        for group, p in (("hi", 0.9), ("lo", 0.3)):
            accepted = 0
            while accepted < 4 and rng.random() < p:
                accepted += 1
            model.observe(f"{group}-{step % 8}", group, 4, accepted)
    hi = model.alphas("hi-new", "hi", 4)  # a new request: the group's average
    lo = model.alphas("lo-new", "lo", 4)
    assert np.all(np.abs(hi - 0.9) < 0.06), hi
    assert np.all(np.abs(lo[:2] - 0.3) < 0.08), lo
    # a request's own counts pull it away from its group
    for _ in range(40):
        model.observe("odd", "hi", 4, 0)
    assert model.alphas("odd", "hi", 4)[0] < 0.15
    model.forget("odd")  # gone: back to the group's (which its 40 misses lowered a little)
    assert model.alphas("odd", "hi", 4) == pytest.approx(model.alphas("fresh", "hi", 4))
    assert model.alphas("odd", "hi", 4)[0] > 0.7


def test_a_position_not_drafted_for_a_while_keeps_its_estimate():
    # The group drafts 8 and accepts everything for a while, then only 2 (as a policy
    # that drafts shorter under load does): positions 3..8 get no new evidence, so
    # their estimates must stay where the evidence left them, not decay back to the
    # uninformed prior (0.5), which would make long drafts look ever worse.
    model = AcceptanceModel(PolicyConfig())
    for step in range(200):
        model.observe(f"a{step}", "g", 8, 8)
    before = model.alphas("new", "g", 8)
    for step in range(3000):
        model.observe(f"b{step}", "g", 2, 2)
    after = model.alphas("new", "g", 8)
    # (they move only by the group's pooled acceptance, two pseudo-counts against the
    # ~200 observations each: see the next test)
    assert after[2:] == pytest.approx(before[2:], abs=1e-3)
    assert np.all(after > 0.95), after
    # positions that keep being observed still forget: they follow a change
    for step in range(3000):
        model.observe(f"c{step}", "g", 2, 0)
    assert model.alphas("new", "g", 2)[0] < 0.1


def test_a_position_never_drafted_starts_at_the_groups_acceptance():
    # The group has only ever drafted 2 tokens, accepted 19 times in 20: positions 3..8
    # have no evidence of their own, so they start at the group's pooled acceptance
    # (about 0.95), not at the uninformed 0.5; otherwise a policy that learnt short
    # drafts (on another load or rule) would lengthen them one probed position at a time.
    model = AcceptanceModel(PolicyConfig())
    for step in range(400):
        model.observe(f"a{step}", "g", 2, 2 if step % 20 else 1)
    alphas = model.alphas("new", "g", 8)
    assert np.all(alphas[2:] > 0.9), alphas
    assert alphas[2:] == pytest.approx(alphas[0], abs=0.05)
    # a group that rejects half its drafts: its unseen positions start near 0.5 too
    for step in range(400):
        model.observe(f"b{step}", "h", 1, step % 2)
    assert model.alphas("new", "h", 8)[2:] == pytest.approx(0.5, abs=0.1)
    # and with no evidence at all, the uninformed rule_prior
    assert model.alphas("new", "none-yet", 4) == pytest.approx(PolicyConfig().rule_prior)


def _parts(ks):
    """A made-up machine that computes a step as a dense [rows, max k + 1] block: the
    draft pass (2 ms a call, 3 ms a forward, 0.4 ms per drafting row per forward), the
    verifier (15 ms, 1.5 ms a row, 0.3 ms per padded token) and the rest (3 ms, 0.5 ms
    a row, 0.2 ms per drafted token)."""
    ks = list(ks)
    b, kmax, drafting = len(ks), max(ks, default=0), sum(1 for k in ks if k)
    draft = 0.002 + 0.003 * kmax + 0.0004 * drafting * kmax if kmax else 0.0
    verify = 0.015 + 0.0015 * b + 0.0003 * b * (kmax + 1)
    rest = 0.003 + 0.0005 * b + 0.0002 * sum(ks)
    return draft, verify, rest


def _true_cost(ks):
    return sum(_parts(ks))


def _observe(cost: CostModel, ks):
    cost.observe(list(ks), [0] * len(ks), *_parts(ks))


def test_cost_model_recovers_a_linear_machine():
    cost = CostModel(window=256)
    rng = np.random.default_rng(1)
    for _ in range(200):
        b = int(rng.integers(1, 17))
        _observe(cost, rng.integers(0, 9, size=b).tolist())
    for ks in ([0], [4, 4, 4, 4], [8] * 16, [0, 2, 8]):
        assert cost.predict(ks, [0] * len(ks)) == pytest.approx(_true_cost(ks), rel=1e-3)


def test_per_k_windows_keep_every_k_the_fit_has_seen():
    """With `window_per_k`, a long stretch at one k (one rule's cells, one load) does
    not push the other k's steps out of the cost fit: the choice between k's needs
    them. On a machine whose verify time is not linear in k, the fit after 600 steps
    at k = 8 then still prices k = 2 from k = 2 steps; a single 256-step window has
    only k = 8 left and extrapolates. What a k left long ago still ages out."""

    def verify_s(ks):  # a forward that gets cheaper per token as it widens
        b, kmax = len(ks), max(ks)
        return 0.02 + 0.004 * b * (kmax + 1) ** 0.5

    def feed(cost, ks):
        cost.observe(ks, [0] * len(ks), 0.001 * max(ks), verify_s(ks), 0.001)

    one, per_k = CostModel(256), CostModel(256, per_k=96)
    rng = np.random.default_rng(4)
    for cost in (one, per_k):
        for _ in range(200):  # a mixed start: every k seen
            feed(cost, [int(rng.integers(1, 9))] * int(rng.integers(8, 17)))
        for _ in range(600):  # then one k for a long while
            feed(cost, [8] * int(rng.integers(8, 17)))
    assert sorted(per_k.verify.keyed) == list(range(1, 9))
    assert all(len(rows) <= 96 for rows in per_k.verify.keyed.values())
    assert len(one.verify) == 256 and set(one.verify.keyed) == {None}

    def error(cost, k):
        ks = [k] * 16
        return abs(cost.predict(ks, [0] * 16) - (0.001 * k + verify_s(ks) + 0.001))

    assert error(per_k, 2) < 0.5 * error(one, 2), (error(per_k, 2), error(one, 2))
    # 4 x 256 steps later, at k = 8 only, k = 2's steps have aged out
    for _ in range(1024):
        feed(per_k, [8] * 16)
    assert [k for k, rows in per_k.verify.keyed.items() if rows] == [8]


def _trained_policy(p_accept: dict[str, float], steps: int = 300, cost=_observe):
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=24))
    rows = [PolicyRow(f"{g}-{i}", g, 8) for g in p_accept for i in range(3)]
    _serve(policy, rows, p_accept, steps, seed=2, cost=cost)
    return policy


def test_warm_up_cycles_k_then_every_sixteenth_step_probes_one_either_way():
    """The README's schedule: the first warmup_steps steps cycle k through K, K/2, K/4
    (rounded up) and 0, so every cost coefficient is seen; afterwards every
    explore_every-th step moves the longest rows' k by one, up and down in turn, and
    the other steps take the plan unchanged."""
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=24, explore_every=16))
    rows = [PolicyRow(f"r{i}", "sps", ceiling) for i, ceiling in enumerate((8, 6))]
    chosen, explored = [], []
    for _ in range(24 + 64):
        plan = policy.plan(rows)
        chosen.append(plan.ks)
        explored.append(plan.explored)
        policy.observe_rows(rows, plan.ks, [k // 2 for k in plan.ks], plan.expected_tokens)
        _observe(policy.cost, plan.ks)
    # steps 1..24: K/2, K/4, 0, K in turn (step n takes the cycle's n % 4-th entry)
    cycle = {1: [4, 3], 2: [2, 2], 3: [0, 0], 0: [8, 6]}
    assert all(chosen[n - 1] == cycle[n % 4] for n in range(1, 25)), chosen[:24]
    assert all(explored[:24])
    probes = [n for n in range(25, 24 + 65) if explored[n - 1]]
    assert probes == [32, 48, 64, 80], probes  # every 16th step after the warm-up
    for n in probes:  # one k from the step before's plan: down at 32 and 64, up at 48, 80
        step = 1 if (n // 16) % 2 else -1
        assert max(chosen[n - 1]) == max(chosen[n - 2]) + step, (n, chosen[n - 2 : n])


def test_a_row_that_drafts_drafts_the_steps_k():
    """The step is a dense block: a row cut shorter than the others saves little, so
    every drafting row drafts the step's k, or its own ceiling where that is lower;
    the policy still leaves out rows whose drafts do not pay (k = 0)."""
    truth = {"hi": 0.9, "mid": 0.6, "lo": 0.05}

    def cheap_k(cost: CostModel, ks):  # drafting is cheap, each drafted token costs
        # 0.3 ms in the rest: the per-row saving that used to cut the "mid" row short
        b, kmax = len(ks), max(ks, default=0)
        draft, verify = 0.001 * kmax, 0.03 + 0.0001 * b * (kmax + 1)
        cost.observe(list(ks), [0] * b, draft, verify, 0.003 + 0.0003 * sum(ks))

    policy = _trained_policy(truth, steps=200, cost=cheap_k)
    rows = [
        PolicyRow("hi-0", "hi", 8),
        PolicyRow("hi-1", "hi", 1),  # near its max_tokens: ceiling 1
        PolicyRow("mid-0", "mid", 8),
        PolicyRow("lo-0", "lo", 8),
    ]
    for _ in range(5):
        plan = policy.plan(rows)
        if not plan.explored:
            break
    top = max(plan.ks)
    assert top >= 2, plan.ks
    assert plan.ks[0] == top and plan.ks[1] == 1, plan.ks
    assert plan.ks[2] in (0, top), plan.ks
    assert plan.ks[3] == 0, plan.ks  # accepts 5%: not worth a drafting row


def _goodput(p_accept, rows, ks):
    """True expected tokens per second of true step time."""
    gains = [expected_tokens(np.full(r.ceiling, p_accept[r.group])) for r in rows]
    return sum(g[k] for g, k in zip(gains, ks, strict=True)) / _true_cost(ks)


def test_the_choice_is_the_best_k_vector():
    """From a cold start, after 48 steps (24 of them warm-up) the policy's ks reach
    the brute-force best goodput (within 1%) on the machine's true costs, on a batch
    mixing a high- and a low-acceptance group."""
    truth = {"hi": 0.9, "lo": 0.35}
    policy = _trained_policy(truth, steps=48)
    rows = [PolicyRow("hi-0", "hi", 8), PolicyRow("hi-1", "hi", 8), PolicyRow("lo-0", "lo", 8)]
    plan = policy.plan(rows)
    best = max(_goodput(truth, rows, ks) for ks in itertools.product(range(9), repeat=len(rows)))
    assert _goodput(truth, rows, plan.ks) >= 0.99 * best, plan.ks
    assert plan.ks[0] > plan.ks[2]  # the group that accepts more drafts more


def test_plain_decoding_wins_where_drafting_does_not_pay():
    """Drafts that are rarely accepted, on a machine where a draft forward costs as much
    as the verifier: every row decodes plainly (k = 0)."""

    def expensive(cost: CostModel, ks):
        kmax = max(ks, default=0)
        draft = 0.030 * kmax + 0.001 * sum(1 for k in ks if k) * kmax
        cost.observe(list(ks), [0] * len(ks), draft, 0.02 + 0.002 * len(ks), 0.001)

    policy = _trained_policy({"a": 0.1}, cost=expensive)
    plan = policy.plan([PolicyRow(f"a-{i}", "a", 8) for i in range(3)])
    assert plan.ks == [0, 0, 0]
    # (here even drafts accepted 97% of the time do not pay: 23.6 tokens in 291 ms at
    # k = 8 against 3 in 27 ms) ...
    policy = _trained_policy({"a": 0.97}, cost=expensive)
    assert policy.plan([PolicyRow(f"a-{i}", "a", 8) for i in range(3)]).ks == [0, 0, 0]
    # ... while on the cheaper machine they do
    policy = _trained_policy({"a": 0.97})
    assert min(policy.plan([PolicyRow(f"a-{i}", "a", 8) for i in range(3)]).ks) >= 6


def test_fixed_takes_every_ceiling_and_promised_ks_are_kept():
    fixed = SpeculationPolicy(PolicyConfig(kind="fixed"))
    rows = [PolicyRow("a", "sps", 4), PolicyRow("b", "sps", 2), PolicyRow("c", "none", 0)]
    assert fixed.plan(rows).ks == [4, 2, 0]
    good = _trained_policy({"a": 0.9})
    plan = good.plan([PolicyRow("x", "a", 8, fixed=1), PolicyRow("y", "a", 8)])
    assert plan.ks[0] == 1
    with pytest.raises(ValueError, match=r"^kind: "):
        PolicyConfig(kind="sometimes")
    with pytest.raises(ValueError, match=r"^policy: "):
        SchedulerConfig(policy="always")


def _half_does_not_pay(cost: CostModel, ks):
    """A machine where drafting pays for rows accepting 95% (about 2.5x the tokens/s of
    plain decoding at k = 8) but not for one accepting 50%: each drafting row costs
    1 ms per drafted position, for at most one more token."""
    b, kmax = len(ks), max(ks, default=0)
    draft = 0.001 * kmax + 0.001 * sum(1 for k in ks if k) * kmax
    verify = 0.015 + 0.001 * b + 0.0001 * b * (kmax + 1)
    cost.observe(list(ks), [0] * b, draft, verify, 0.002)


def _serve(policy, rows, truth, steps, seed, cost=None):
    """`steps` planned and observed steps of `rows` (row i accepts each position with
    probability truth[group]), timed by `cost` (default: half the rows' drafting does
    not pay); the ks of each step."""
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(steps):
        plan = policy.plan(rows)
        accepted = []
        for r, k in zip(rows, plan.ks, strict=True):
            a = 0
            while a < k and rng.random() < truth[r.group]:
                a += 1
            accepted.append(a)
        policy.observe_rows(rows, plan.ks, accepted, plan.expected_tokens)
        (cost or _half_does_not_pay)(policy.cost, plan.ks)
        history.append(plan.ks)
    return history


def test_a_new_delta_starts_at_its_rules_acceptance_and_drafts():
    """A group not seen before (a delta no request used yet) starts at the acceptance of
    its rule's groups pooled, not at the uninformed rule_prior = 0.5: at 0.5 drafting
    would not pay here, the row would stay at k = 0 and never learn otherwise, and nor
    would any later request of its group."""
    truth = {"cactus:1": 0.95, "cactus:0.9": 0.95, "sps": 0.95}
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=24))
    trained = [PolicyRow(f"c1-{i}", "cactus:1", 8) for i in range(4)]
    _serve(policy, trained, truth, 300, seed=2)
    # the premise: a row at 0.5 (a rule with no data) does not pay
    assert policy.plan([*trained[:3], PolicyRow("s", "sps", 8)]).ks[3] == 0
    rows = [*trained[:3], PolicyRow("d09", "cactus:0.9", 8)]
    history = _serve(policy, rows, truth, 300, seed=5)
    drafted = sum(1 for ks in history if ks[3])
    assert drafted >= 250, drafted
    fresh = policy.acceptance.alphas("fresh", "cactus:0.9", 8)
    ref = policy.acceptance.alphas("fresh", "cactus:1", 8)
    assert fresh == pytest.approx(ref, abs=0.05), (fresh, ref)
    # a group with no data of its own starts at its rule's pooled acceptance
    assert policy.acceptance.alphas("x", "cactus:0.5", 8) == pytest.approx(0.95, abs=0.03)


def test_a_row_left_at_k_0_drafts_in_the_probes_up():
    """A row whose estimate says drafting does not pay (here a rule with no data: the
    0.5 prior) learns nothing at k = 0, so the probe steps that move the cap up let it
    draft too; once it has seen that it accepts 95%, it drafts at most steps. Plain
    decoding is still what it gets between probes while the estimate says so."""
    truth = {"cactus:1": 0.95, "sps": 0.95}
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=24, explore_every=16))
    trained = [PolicyRow(f"c1-{i}", "cactus:1", 8) for i in range(4)]
    _serve(policy, trained, truth, 300, seed=2)
    rows = [*trained[:3], PolicyRow("s", "sps", 8)]
    first = policy.stats.steps + 1
    history = _serve(policy, rows, truth, 300, seed=5)
    drafted = [first + i for i, ks in enumerate(history) if ks[3]]
    assert drafted, "the row left at k = 0 never drafted"
    # its first draft is a probe up (every other 16th step), at the step's k
    assert drafted[0] % 16 == 0 and (drafted[0] // 16) % 2 == 1, drafted[:3]
    probe = history[drafted[0] - first]
    assert probe[3] == max(probe), probe  # the step's new k (the cap + 1, or 8 at most)
    assert sum(1 for ks in history[-100:] if ks[3]) >= 95, history[-100:]
    assert policy.acceptance.alphas("fresh", "sps", 1)[0] > 0.85


def test_every_public_entry_point_of_the_policy_holds_its_lock():
    """The races a stress test meets only now and then (a fit's dict growing while
    describe() iterates it, a refit lost), shut out by construction: each entry point
    waits while another thread holds the policy's lock."""
    import threading

    policy = _trained_policy({"a": 0.9}, steps=40)
    rows = [PolicyRow("r0", "a", 8), PolicyRow("r1", "a", 8)]
    calls = {
        "plan": lambda: policy.plan(rows),
        "observe_rows": lambda: policy.observe_rows(rows, [4, 4], [2, 3], [3.0, 3.0]),
        "observe_time": lambda: policy.observe_time([4, 4], [0, 0], 0.01, 0.02, 0.01, 0.0),
        "predict_time": lambda: policy.predict_time([4, 4], [0, 0]),
        "forget": lambda: policy.forget("r0"),
        "describe": policy.describe,
    }
    for name, call in calls.items():
        finished = threading.Event()
        thread = threading.Thread(target=lambda c=call, f=finished: (c(), f.set()))
        with policy._lock:
            thread.start()
            assert not finished.wait(0.2), f"{name} ran while another thread held the lock"
        thread.join(5)
        assert finished.is_set(), name


def test_describe_is_safe_while_the_loop_learns():
    """`describe()` runs on another thread (the actor's control group, timings()) while
    the engine's loop plans and learns: with thread switches as often as possible, it
    never meets a dict changing size mid-iteration, and no refit is lost. Run in a fresh
    interpreter: at a 1 us switch interval every thread a test session leaves running
    (Ray's, gRPC's) takes its turns too, the likely reason this test took 45 s in one
    full run against 5.6 s in another."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from tests.workers.test_policy import _describe_race; _describe_race()"
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().startswith("reads "), done.stdout


def _describe_race() -> None:
    """The body of the test above (its own process): raises AssertionError on a failure."""
    import sys
    import threading

    policy = SpeculationPolicy(PolicyConfig(warmup_steps=4))
    errors: list[BaseException] = []
    done = threading.Event()
    reads = [0]

    def reader():
        try:
            while not done.is_set():
                policy.describe()
                reads[0] += 1
        except BaseException as err:  # reported below
            errors.append(err)

    rng = np.random.default_rng(6)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=reader)
    try:
        thread.start()
        for step in range(300):
            rows = [PolicyRow(f"r{step}-{i}", f"cactus:{step}.{i}", 8) for i in range(4)]
            ks = rng.integers(0, 9, size=4).tolist()
            policy.observe_rows(rows, ks, [k // 2 for k in ks], [1.0] * 4)
            # through the policy's locked entry points, as the engine's loop calls them
            draft, verify, rest = _parts(ks)
            policy.observe_time(ks, [0] * 4, draft, verify, rest, 0.0, tokens=sum(ks) / 2 + 4)
            policy.plan(rows)
            for r in rows:
                policy.forget(r.request_id)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert reads[0] > 0
    # no refit was lost: a fit that says it is up to date is its window's fit (a stale
    # one refits at its next read, so nothing of it can be lost)
    for fit in (policy.cost.draft, policy.cost.verify, policy.cost.rest):
        if not fit._stale:
            theta, fit._stale = fit.theta.copy(), True
            assert fit.coef() == pytest.approx(theta)
    assert policy.describe()["cost_model"]["verify"] == pytest.approx(
        policy.cost.verify.coef().tolist()
    )
    print(f"reads {reads[0]}")


def test_groups_are_bounded_whatever_deltas_clients_choose():
    """delta is the client's choice: 5,000 distinct values keep at most max_groups
    acceptance groups (the least recently observed go) and as many groups of
    statistics, the rest counted under one "<rule>:other"; describe() stays fast."""
    policy = SpeculationPolicy(PolicyConfig())
    cap = policy.config.max_groups
    assert cap == 64
    most = 0
    for i in range(5000):
        group = f"cactus:{i / 1000:g}"
        row = PolicyRow(f"r{i}", group, 4)
        policy.observe_rows([row], [4], [3], [3.5])
        policy.forget(row.request_id)
        most = max(most, len(policy.acceptance.groups))
    assert most == cap
    assert policy.acceptance.groups == [f"cactus:{i / 1000:g}" for i in range(5000 - cap, 5000)]
    assert not policy.acceptance._rows  # every request forgotten
    started = time.perf_counter()
    out = policy.describe()
    assert time.perf_counter() - started < 0.25
    groups = out["groups"]
    assert len(groups) == cap + 1 and "cactus:other" in groups
    assert groups["cactus:other"]["rows"] == 5000 - cap
    assert groups["cactus:other"]["chosen_k"] == {4: 5000 - cap}
    assert sum(g["rows"] for g in groups.values()) == 5000
    assert out["acceptance_groups"] == cap
    # the rule's pool is the groups kept, no more (3 of 4 reached accepted each time)
    pool = policy.acceptance._rules["cactus"]
    assert pool == pytest.approx(sum(g.sum(axis=1) for g in policy.acceptance._groups.values()))
    assert policy.acceptance.alphas("x", "cactus:99", 4) == pytest.approx(0.75, abs=0.01)
    with pytest.raises(ValueError, match="max_groups"):
        PolicyConfig(max_groups=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "sometimes"),
        ("warmup_steps", 0),
        ("warmup_steps", 2.5),
        ("explore_every", True),
        ("window", 100.5),  # would never fill (len(rows) == window) and grow for good
        ("window", float("nan")),
        ("window_per_k", -1),
        ("max_groups", "8"),
        ("prior_strength", 0.0),  # 0 / 0 for a position without data
        ("prior_strength", float("nan")),
        ("prior_strength", float("inf")),
        ("rule_prior", 1.5),
        ("rule_prior", float("nan")),
        ("rule_decay", 1.01),  # counts would grow until they overflow
        ("rule_decay", 0.0),
    ],
)
def test_every_policy_field_is_checked_naming_it(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        PolicyConfig(**{field: value})


def test_a_step_with_a_time_that_is_not_finite_is_left_out_of_the_cost_model():
    """One NaN in a fit's sums stayed there for good (subtracting it as it left the
    window gives NaN again): every coefficient NaN, and the choice then picked k = 0
    for every row for the rest of the engine's life. Such a step is now left out."""
    policy = _trained_policy({"a": 0.95})
    rows = [PolicyRow(f"r{i}", "a", 8) for i in range(4)]
    before = policy.plan(rows).ks
    assert max(before) > 0
    steps = policy.cost.steps
    policy.observe_time([8] * 4, [0] * 4, float("nan"), 0.03, 0.01, 0.0, tokens=20)
    policy.observe_time([8] * 4, [0] * 4, 0.02, float("inf"), 0.01, 0.0, tokens=20)
    assert policy.cost.steps == steps
    for fit in (policy.cost.draft, policy.cost.verify, policy.cost.rest):
        assert np.isfinite(fit.coef()).all()
    assert policy.plan(rows).ks == before


# ---- in the engine ---------------------------------------------------------------------


def _requests(n: int, *, rule="cactus", max_tokens=48, temperature=1.0, seed0=0):
    return [
        GenerationRequest(
            prompt=f"def function_{i}(value):\n    return",
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed0 + i),
            speculation=SpeculationParams(rule=rule, delta=1.0, num_speculative_tokens=8),
        )
        for i in range(n)
    ]


def _run(engine, requests):
    outs = [deque() for _ in requests]
    for r, q in zip(requests, outs, strict=True):
        engine.add_request(r, q.append)
    while engine.has_work():
        engine.step()
    return [q[-1].result for q in outs]


@pytest.fixture(scope="module")
def goodput_engine():
    from tests.conftest import embedded_dirs
    from workers.local import local_engine

    verifier, draft = embedded_dirs()
    return local_engine(verifier, draft, scheduler=SchedulerConfig(policy="goodput"))


def test_the_policy_decides_before_the_steps_draws_and_probabilities(goodput_engine, monkeypatch):
    """Every step's ks are chosen before its drafts, its verifier forward and its
    uniforms exist, and choosing them draws nothing from any request's generator."""
    engine = goodput_engine
    events: list[str] = []
    import workers.engine as engine_module

    real_plan, real_propose, real_score = (
        engine.policy.plan,
        engine.drafter.propose,
        engine.verifier.score,
    )
    real_uniforms = engine_module.padded_uniforms
    generators: list[torch.Generator] = []

    def plan(rows):
        states = [g.get_state() for g in generators]
        out = real_plan(rows)
        assert all(torch.equal(a, g.get_state()) for a, g in zip(states, generators, strict=True))
        events.append("plan")
        return out

    def propose(rows):
        events.append("propose")
        return real_propose(rows)

    def score(rows):
        events.append("score")
        return real_score(rows)

    def uniforms(gens, counts, **kw):
        events.append("uniforms")
        return real_uniforms(gens, counts, **kw)

    monkeypatch.setattr(engine.policy, "plan", plan)
    monkeypatch.setattr(engine.drafter, "propose", propose)
    monkeypatch.setattr(engine.verifier, "score", score)
    monkeypatch.setattr(engine_module, "padded_uniforms", uniforms)
    monkeypatch.setattr(
        engine_module.RequestState,
        "__init__",
        _recording_init(engine_module.RequestState.__init__, generators),
    )
    results = _run(engine, _requests(3, max_tokens=24))
    assert all(len(r.token_ids) == 24 for r in results)
    # within a step: propose (if any row drafts) -> score -> uniforms; a plan never
    # falls between a step's score and its uniforms
    steps = "".join({"plan": "P", "propose": "D", "score": "S", "uniforms": "U"}[e] for e in events)
    assert "S" in steps and "SPU" not in steps and "DP" not in steps
    for i, e in enumerate(steps):
        if e == "S":
            assert steps[i + 1] == "U"  # the uniforms follow the forward, with no plan
    assert steps.count("S") == steps.count("U")


def _recording_init(init, generators):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        generators.append(self.generator)

    return wrapped


def test_greedy_output_is_the_verifiers_whatever_k_the_policy_chooses(goodput_engine):
    from workers.local import local_engine

    fixed_engine = local_engine(*_dirs(), scheduler=SchedulerConfig(policy="fixed"))
    reqs = _requests(4, rule="cactus", temperature=0.0, max_tokens=40)
    plain = _run(fixed_engine, [_with_rule(r, "none") for r in reqs])
    good = _run(goodput_engine, reqs)
    assert [r.token_ids for r in good] == [r.token_ids for r in plain]


def test_varying_k_leaves_the_draft_state_right():
    """A draft cache left one token off by some sequence of ks (a short step, a k = 0
    step, a fully accepted one) would lower acceptance and leave outputs exact, so no
    output test would see it. Every row drafts a random k in 0..ceiling at every step;
    each block's first draft distribution must be the draft model's, computed afresh
    from the committed context without a cache."""
    import random

    from transformers import AutoModelForCausalLM

    from workers.local import local_engine
    from workers.policy import Plan

    verifier_dir, draft_dir = _dirs()
    engine = local_engine(verifier_dir, draft_dir, scheduler=SchedulerConfig(policy="goodput"))
    rng, used = random.Random(3), set()

    def plan(rows):
        ks = [r.fixed if r.fixed is not None else rng.randint(0, r.ceiling) for r in rows]
        used.update(ks)
        return Plan(ks, [1.0] * len(ks))

    seen = []  # (committed context, the block's first draft distribution)
    propose = engine.drafter.propose

    def recording(rows):
        states = {r.request_id: engine._live[r.request_id] for r in rows}
        contexts = {i: [*s.prompt_ids, *s.generated] for i, s in states.items()}
        out = propose(rows)
        for block in out:
            assert block.epoch == len(contexts[block.request_id])
            seen.append((contexts[block.request_id], block.probs[0].clone()))
        return out

    engine.policy.plan = plan
    engine.drafter.propose = recording
    results = _run(engine, _requests(6, rule="cactus", temperature=1.0, max_tokens=32))
    assert all(len(r.token_ids) == 32 for r in results)
    assert {0, 1, 8} <= used and len(used) >= 6, used  # plain, short and full steps
    assert len(seen) >= 30
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.inference_mode():
        for context, probs in seen:
            logits = model(input_ids=torch.tensor([context])).logits[0, -1].float()
            fresh = torch.softmax(logits, -1)[: probs.shape[0]]
            worst = max(worst, float((fresh - probs).abs().max()))
    # KV padding moves logits by ~3e-6 (the batching issue); a context off by one
    # token moves these probabilities by O(0.1)
    assert worst < 1e-4, worst


def _dirs():
    from tests.conftest import embedded_dirs

    return embedded_dirs()


def _with_rule(request, rule):
    from dataclasses import replace

    return replace(request, speculation=replace(request.speculation, rule=rule))


def _warm_up(engine):
    seed, start = 100, engine.policy.stats.steps
    while engine.policy.stats.steps < start + 2 * engine.policy.config.warmup_steps:
        _run(engine, _requests(2, max_tokens=32, seed0=seed))
        seed += 2


def test_an_expensive_drafter_makes_the_engine_decode_plainly():
    """A real engine whose draft model is slow (each draft forward takes four whole
    plain-decoding steps more, measured first, so that on any machine, even one whose
    load doubles after the measurement, a row drafting k tokens spends >= (2k + 1)
    steps' time for <= k + 1 tokens): after warm-up the policy
    stops drafting (>= 90% of rows k = 0), and the same engine with the normal draft
    model keeps drafting at batch 1."""
    from workers.local import local_engine

    engine = local_engine(*_dirs(), scheduler=SchedulerConfig(policy="goodput"))
    runner = engine.drafter.runner
    real = runner.forward
    _run(engine, _requests(2, rule="none", max_tokens=8))  # warm the kernels
    started = time.perf_counter()
    _run(engine, _requests(2, rule="none", max_tokens=32, seed0=50))
    extra = max(0.05, 4 * (time.perf_counter() - started) / 32)

    def slow(*args, **kwargs):
        time.sleep(extra)
        return real(*args, **kwargs)

    runner.forward = slow
    _warm_up(engine)
    before = dict(engine.policy.stats.chosen_k)
    _run(engine, _requests(2, max_tokens=64, seed0=10))
    after = engine.policy.stats.chosen_k
    rows = {k: after[k] - before.get(k, 0) for k in after}
    plain = sum(n for (_, k), n in rows.items() if k == 0)
    assert plain >= 0.9 * sum(rows.values()), (rows, extra)

    runner.forward = real
    engine.policy = SpeculationPolicy(PolicyConfig())
    _warm_up(engine)
    before = dict(engine.policy.stats.chosen_k)
    _run(engine, _requests(1, max_tokens=96, seed0=20))
    after = engine.policy.stats.chosen_k
    rows = {k: after[k] - before.get(k, 0) for k in after}
    mean_k = sum(k * n for (_, k), n in rows.items()) / sum(rows.values())
    assert mean_k >= 1.5, rows


def test_the_cost_model_learns_the_whole_busy_cycle():
    """What the caller's loop spends between two steps while requests are running
    (intake, metrics: here a 20 ms sleep) is a per-step cost, and the policy's step
    times include it; a long decode step's own phases are all there too."""
    from workers.local import local_engine

    engine = local_engine(*_dirs(), scheduler=SchedulerConfig(policy="goodput"))
    outs = [deque() for _ in range(2)]
    for r, q in zip(_requests(2, max_tokens=24), outs, strict=True):
        engine.add_request(r, q.append)
    t, st = engine.timing, engine.policy.stats

    def totals():
        decode = t.draft_s + t.verify_s + t.accept_s + t.bookkeeping_s
        return st.timed_steps, st.realised_time_s, decode, t.overhead_s, t.steps

    extra = []  # per timed decode step: its realised cost beyond its decode phases
    while engine.has_work():
        before = totals()
        engine.step()
        after = totals()
        if after[0] > before[0]:
            extra.append((after[1] - before[1]) - (after[2] - before[2]))
        if after[4] > before[4]:  # a decode step: the loop's 20 ms before it is overhead
            assert after[3] - before[3] >= 0.018, after[3] - before[3]
        time.sleep(0.02)
    assert len(extra) >= 3
    assert min(extra) >= 0.018, extra
    assert sum(st.step_max_k.values()) == st.steps == t.steps
    assert all(len(q[-1].result.token_ids) == 24 for q in outs)


def test_prefill_is_left_out_of_the_step_cost(monkeypatch):
    """A prompt prefilled during a decode step (here slowed by 150 ms) is the request's
    own work, not the step's: the policy's realised step time leaves it out (that the
    loop's other time stays in is test_the_cost_model_learns_the_whole_busy_cycle)."""
    from workers.local import local_engine

    engine = local_engine(*_dirs(), scheduler=SchedulerConfig(policy="goodput"))
    real = engine.verifier.prefill

    def slow(chunks):
        time.sleep(0.15)
        return real(chunks)

    monkeypatch.setattr(engine.verifier, "prefill", slow)
    t, st = engine.timing, engine.policy.stats
    first, second = _requests(2, max_tokens=24)
    outs = [deque(), deque()]
    engine.add_request(first, outs[0].append)
    while st.steps < 3:  # the first request decodes alone
        engine.step()
    engine.add_request(second, outs[1].append)
    prefilled, charged = [], []
    while engine.has_work():
        before = (st.timed_steps, st.realised_time_s, t.prefill_s)
        decode = t.draft_s + t.verify_s + t.accept_s + t.bookkeeping_s
        engine.step()
        decode = t.draft_s + t.verify_s + t.accept_s + t.bookkeeping_s - decode
        if st.timed_steps > before[0] and t.prefill_s - before[2] >= 0.15:
            prefilled.append(t.prefill_s - before[2])
            charged.append(st.realised_time_s - before[1] - decode)
    assert prefilled, "no prompt was prefilled during a timed decode step"
    assert max(charged) < 0.1, (charged, prefilled)
    assert all(len(q[-1].result.token_ids) == 24 for q in outs)


def test_a_failing_prefetch_costs_only_the_head_start(goodput_engine, monkeypatch):
    """A drafter whose prefetch raises (a closed channel, a bug): the step goes on, the
    next propose asks again, every request completes with all its tokens."""

    def broken(rows):
        raise RuntimeError("prefetch broke")

    monkeypatch.setattr(goodput_engine.drafter, "prefetch", broken)
    results = _run(goodput_engine, _requests(3, max_tokens=24))
    assert all(len(r.token_ids) == 24 for r in results)
    assert all(r.stats.draft_failures == 0 and r.stats.num_drafts > 0 for r in results)


def test_a_cost_per_emitted_token_is_fitted_apart_and_changes_no_choice():
    """A machine whose step also costs 0.4 ms per emitted token (detokenising,
    streaming), serving two groups in turn, as a served replica does: "hi" accepts 90%
    per position and drafts long, "lo" 40% and drafts short. With the per-token term
    the fit predicts both groups' steps (pooled, rules apart only by what they emit)
    and the plan reaches the true best goodput E / (T + c E)."""
    c = 0.0004
    truth = {"hi": 0.9, "lo": 0.4}
    rng = np.random.default_rng(3)

    def step(k_range, p, b=16):
        ks = rng.integers(*k_range, size=1).tolist() * b
        accepted = [int(min(k, rng.geometric(1 - p) - 1)) for k in ks]
        tokens = sum(a + 1 for a in accepted)
        draft, verify, rest = _parts(ks)
        return ks, draft, verify, rest + c * tokens, tokens

    cost = CostModel(256)
    for i in range(256):
        ks, draft, verify, rest, tokens = step(*(((5, 9), 0.9) if i % 2 else ((1, 5), 0.4)))
        cost.observe(ks, [0] * len(ks), draft, verify, rest, tokens=tokens)
    assert cost.per_token_s() == pytest.approx(c, rel=0.05)
    for group, k in (("hi", 8), ("lo", 2)):
        ks = [k] * 16
        e = 16 * expected_tokens(np.full(k, truth[group]))[k]
        real = _true_cost(ks) + c * e
        assert cost.predict(ks, [0] * 16, tokens=e) == pytest.approx(real, rel=0.01)
    # the choice: as good as the best dense k on the true costs, per-token work included
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=1))
    policy.cost = cost
    for group, p in truth.items():
        rows = [PolicyRow(f"{group}-{i}", group, 8) for i in range(16)]
        for i in range(200):  # the acceptance model learns the group
            policy.acceptance.observe(
                f"{group}-{i}", group, 8, int(min(8, rng.geometric(1 - p) - 1))
            )
        ks = policy._best(rows, policy._gains(rows))

        def goodput(k, p=p):
            e = 16 * expected_tokens(np.full(8, p))[k]
            return e / (_true_cost([k] * 16) + c * e)

        assert goodput(max(ks)) >= 0.99 * max(goodput(k) for k in range(9)), (group, ks)


def test_a_capped_row_is_filed_under_its_rules_delta_0_group(goodput_engine, monkeypatch):
    """Once a request's max_divergence_nats is spent it verifies with delta = 0: the
    policy then files its acceptance under "cactus:0", not its own "cactus:1" (it would
    drag that group towards sps acceptance), and its own counts at delta 1 are
    forgotten as it becomes capped."""
    engine = goodput_engine
    monkeypatch.setattr(engine, "policy", SpeculationPolicy(PolicyConfig()))
    observed = []  # (request id, group, capped before the step, k)
    forgotten = []  # (request id, still running)
    real_observe, real_forget = engine.policy.observe_rows, engine.policy.forget

    def observe_rows(rows, ks, accepted, expected):
        for r, k in zip(rows, ks, strict=True):
            capped = engine._live[r.request_id].stats.divergence_capped
            observed.append((r.request_id, r.group, capped, k))
        return real_observe(rows, ks, accepted, expected)

    def forget(request_id):
        forgotten.append((request_id, request_id in engine._live))
        return real_forget(request_id)

    monkeypatch.setattr(engine.policy, "observe_rows", observe_rows)
    monkeypatch.setattr(engine.policy, "forget", forget)
    requests = [
        replace(
            r,
            request_id=f"capped-{i}",
            speculation=replace(r.speculation, max_divergence_nats=0.05),
        )
        for i, r in enumerate(_requests(3, max_tokens=48))
    ]
    results = _run(engine, requests)
    capped = {
        req.request_id
        for req, res in zip(requests, results, strict=True)
        if res.stats.divergence_capped
    }
    assert capped, "no request spent its divergence budget"
    after = [(i, g, k) for i, g, was, k in observed if was]
    assert after and all(g == "cactus:0" for _, g, _ in after), after
    assert all(g == "cactus:1" for i, g, was, _ in observed if not was)
    assert any(k for _, _, k in after)  # it drafted, and learnt the delta-0 group
    assert "cactus:0" in engine.policy.acceptance.groups
    assert engine.policy.stats.rows["cactus:0"] == len(after)
    # forgotten while still running (as it became capped), and again as it ended
    assert {i for i, running in forgotten if running} == capped


def test_steps_where_no_row_could_draft_do_not_use_the_warm_up_up():
    """The warm-up (k cycled so every cost coefficient is seen) was counted in decode
    steps, drafting or not: a server whose first steps ran only rows that could not
    draft (rule none, rows without a draft actor yet) ended it with an empty draft fit,
    and its first real choices priced drafting at zero. It now lasts until rows have
    drafted in 3/4 of warmup_steps steps."""
    policy = SpeculationPolicy(PolicyConfig(warmup_steps=4, explore_every=1000))
    plain = [PolicyRow("n", "none", 0)]
    for _ in range(8):
        plan = policy.plan(plain)
        policy.observe_rows(plain, plan.ks, [0], plan.expected_tokens)
        _observe(policy.cost, plan.ks)
    assert len(policy.cost.draft) == 0 and policy.cost.steps == 8
    rows = [PolicyRow("a", "sps", 8)]
    cycled = []
    for _ in range(4):
        plan = policy.plan(rows)
        cycled.append((plan.ks, plan.explored))
        policy.observe_rows(rows, plan.ks, [k // 2 for k in plan.ks], plan.expected_tokens)
        _observe(policy.cost, plan.ks)
    assert all(explored for _, explored in cycled), cycled  # the warm-up's cycle
    assert sorted(ks[0] for ks, _ in cycled) == [0, 2, 4, 8], cycled  # K, K/2, K/4, 0
    assert len(policy.cost.draft) == 3 == policy.cost.drafted_steps
    assert not policy.plan(rows).explored  # then the cost model chooses


def test_a_promised_k_above_the_rows_room_is_cut_to_it():
    """A row promised k (a remote drafter is drafting it) whose room shrank below it: the
    plan takes its ceiling, where it raised IndexError (k past every row's ceiling) or
    planned k tokens the row has no room for."""
    good = _trained_policy({"a": 0.9})
    plan = good.plan([PolicyRow("x", "a", 2, fixed=3), PolicyRow("y", "a", 2)])
    assert plan.ks[0] == 2 and plan.ks[1] <= 2 and all(np.isfinite(plan.expected_tokens))
    plan = good.plan([PolicyRow("x", "a", 2, fixed=5), PolicyRow("y", "a", 8)])
    assert plan.ks[0] == 2 and np.isfinite(plan.expected_tokens[0])
