"""Speculation policy: how many tokens to draft for each row of the next step.

`fixed` drafts every row's own K (the request's `num_speculative_tokens`, cut near
max_tokens and the context end): right for one load only. `goodput` (the default)
chooses k_i in 0..K_i per row and per step to maximise the batch's expected emitted
tokens per second of step time, after SmartSpec (Liu et al., arXiv 2406.14066), with two
models it learns online from this engine's own steps:

- Acceptance (`AcceptanceModel`): the probability that drafted position j is accepted
  given that j - 1 were, per request, shrunk towards the running average of its group,
  its rule and delta (Cactus accepts more at a larger delta, so a delta = 0 row and a
  delta = 1 row of the same batch want different k). A position the group has not
  drafted yet starts at the group's acceptance over all positions, and a group with
  little data at the acceptance of all its rule's groups pooled (a new delta starts
  where the rule is, not at the uninformed `rule_prior`). At most `max_groups` groups
  are kept (delta is the client's choice), the least recently observed going first. A
  request whose max_divergence_nats is spent verifies with delta = 0 from then on and
  is filed under its rule's delta = 0 group (`group_of(..., capped=True)`). A row
  drafting k tokens emits E(k) = 1 + sum_{j<=k} prod_{m<=j} alpha_m tokens in
  expectation.
- Step cost (`CostModel`): three linear fits over the last 96 steps at each max k
  (none older than 1,024 steps; the draft fit counts the steps that drafted), each
  from the quantities that drive it. A step is a dense [rows, max k + 1] block, so:
  the draft pass [1, max k, drafting rows x max k, catch-up tokens], the verifier
  forward [1, rows, rows x (max k + 1)], acceptance plus bookkeeping [1, rows, drafted
  tokens, drafting rows x max k] (the last: a remote draft pass of the next step runs
  meanwhile and slows this side on a shared machine, in proportion to its own work,
  not to each row's k). The engine reports each step's whole busy cycle in wall-clock
  time but its prefill chunks, so the rest also holds admission, planning and the
  caller's loop. Prefill is each request's own work, done once whatever k the steps
  draft and arriving as requests finish (a cost in proportion to emitted tokens); in
  the step it tilted the k fits, because the steps it landed in were not a random
  draw of k (engine.step). The rest also has a cost per emitted token (detokenising, stop
  checks, streaming), fitted so that the other terms do not absorb it (Cactus emits
  about twice the tokens of sps per step) but left out of the choice, which it cannot
  change (`CostModel.coefs`). No offline profiling: the first `warmup_steps` steps
  cycle through k = K, K/2, K/4, 0 (rounded up; so every coefficient is seen; until
  rows drafted in 3/4 of that many steps, so steps where none could draft do not use
  the warm-up up), and
  afterwards every `explore_every`-th step moves the cap by one either way; in the
  steps that move it up, the rows the choice left at k = 0 draft too (the cap, or
  their ceiling where lower), so that a row whose estimate says drafting does not pay
  still learns whether it does (a row at k = 0 observes nothing).

The choice (`_best`) is one k per step (the cap) and which rows draft at all: a row
that drafts drafts the cap, or its own ceiling where that is lower (the step is a dense
block, so a row cut shorter saves little). It reads only what earlier steps left:
counts of accepted tokens and step timings. It never sees the current step's uniforms,
drafts or target probabilities, so it cannot bias any rule's output law; the kernel is
exact for every k (tests prove it).

The engine's loop thread plans and learns while another thread (the actor's control
group, `timings()`) reads `describe()`: every public entry point of
`SpeculationPolicy` holds one lock (uncontended but for those reads).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np

log = logging.getLogger(__name__)

POLICIES = ("fixed", "goodput")


@dataclass(frozen=True)
class PolicyConfig:
    kind: str = "goodput"  # fixed | goodput
    warmup_steps: int = 24  # steps cycling k before the cost model is used
    explore_every: int = 16  # then every n-th step probes the cap +-1
    window: int = 256  # steps the cost fits remember
    window_per_k: int = 96  # > 0: remember this many steps per max k instead (0: off)
    # pseudo-counts of the group's average in a row's estimate, and of the rule's (all
    # its groups pooled) in a group's
    prior_strength: float = 4.0
    rule_prior: float = 0.5  # acceptance per position before a rule has any data
    rule_decay: float = 0.998  # forgetting of a rule's average per observation of a position
    # acceptance groups kept (and given their own statistics): delta is the client's
    # choice, so each distinct value would otherwise be kept for good
    max_groups: int = 64

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"kind: must be one of {', '.join(POLICIES)}, got {self.kind!r}")
        for name in ("warmup_steps", "explore_every", "window", "window_per_k", "max_groups"):
            value, least = getattr(self, name), 0 if name == "window_per_k" else 1
            # a float window would never fill (len(rows) == window) and grow for good
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
            if value < least:
                raise ValueError(f"{name}: must be >= {least}, got {value}")
        # NaN fails every comparison below, so each check is written to pass only in range
        if not (0 < self.prior_strength < float("inf")):  # 0: 0 / 0 for an unseen position
            raise ValueError(f"prior_strength: must be finite and > 0, got {self.prior_strength}")
        if not (0 <= self.rule_prior <= 1):
            raise ValueError(f"rule_prior: must lie in [0, 1], got {self.rule_prior}")
        if not (0 < self.rule_decay <= 1):  # > 1: counts grow until they overflow
            raise ValueError(f"rule_decay: must lie in (0, 1], got {self.rule_decay}")


@dataclass(frozen=True)
class PolicyRow:
    """What the policy may know about a row: its identity, its acceptance group, the
    largest k it may draft, and how far its draft cache lags behind. Nothing from the
    step being decided."""

    request_id: str
    group: str  # rule and delta / threshold, e.g. "cactus:1"
    ceiling: int  # K_i after the request's own cuts (0: this row cannot draft)
    lag: int = 0  # committed tokens its draft cache has not seen beyond the usual one
    fixed: int | None = None  # k already promised (prefetched): not to be changed


@dataclass
class Plan:
    ks: list[int]
    expected_tokens: list[float]  # per row, E_i(k_i)
    explored: bool = False


@dataclass
class PolicyStats:
    """Per acceptance group: chosen k histogram, predicted and realised tokens."""

    steps: int = 0
    chosen_k: Counter = field(default_factory=Counter)  # (group, k) -> rows
    rows: Counter = field(default_factory=Counter)  # group -> rows
    predicted_tokens: Counter = field(default_factory=Counter)  # group -> sum E_i(k_i)
    realised_tokens: Counter = field(default_factory=Counter)  # group -> sum accepted + 1
    predicted_time_s: float = 0.0  # steps with a cost prediction only
    realised_time_s: float = 0.0
    timed_steps: int = 0
    step_max_k: Counter = field(default_factory=Counter)  # max k of a step -> steps
    # rows that drafted less than their step's max k although their ceiling allowed more
    # (in a dense step they pay for the max k: the policy should rarely do this)
    short_rows: int = 0

    def as_dict(self) -> dict:
        ks_of: dict[str, dict[int, int]] = {g: {} for g in self.rows}
        for (g, k), n in self.chosen_k.items():  # one pass, whatever the number of groups
            ks_of.setdefault(g, {})[k] = n
        out = {
            "steps": self.steps,
            "predicted_time_s": self.predicted_time_s,
            "realised_time_s": self.realised_time_s,
            "timed_steps": self.timed_steps,
            "step_max_k": dict(sorted(self.step_max_k.items())),
            "short_rows": self.short_rows,
            "groups": {},
        }
        for g in sorted(self.rows):
            ks = ks_of[g]
            rows = self.rows[g]
            out["groups"][g] = {
                "rows": rows,
                "chosen_k": dict(sorted(ks.items())),
                "mean_k": sum(k * n for k, n in ks.items()) / rows if rows else 0.0,
                "predicted_tokens": self.predicted_tokens[g],
                "realised_tokens": self.realised_tokens[g],
            }
        return out


def group_of(speculation, capped: bool = False) -> str:
    """The acceptance group of a request: rows in one group share a prior. `capped`: the
    request's max_divergence_nats is spent, so it verifies with delta = 0 from then on
    (workers/engine.py) and accepts as its rule's delta = 0 group does."""
    rule = speculation.rule
    if capped and rule in ("cactus", "cactus_exact"):
        speculation = replace(speculation, delta=0.0)
    if rule in ("cactus", "cactus_exact"):
        return f"{rule}:{speculation.delta:g}"
    if rule == "tas":
        alpha = speculation.tas_alpha
        return f"tas:{speculation.tas_threshold:g}" + ("" if alpha is None else f"/{alpha:g}")
    return rule


def rule_of(group: str) -> str:
    """The rule of an acceptance group ("cactus:1" -> "cactus", "tas:0.09/0.3" -> "tas")."""
    return group.split(":", 1)[0]


class AcceptanceModel:
    """Per-position conditional acceptance, per request, shrunk to its group's average,
    and a group's to its rule's (all the rule's groups pooled)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.c = config
        # [2, P]: reached, accepted (decayed); least recently observed first
        self._groups: dict[str, np.ndarray] = {}
        self._rules: dict[str, np.ndarray] = {}  # [2]: the sums of the rule's groups
        self._rows: dict[str, np.ndarray] = {}  # [2, P] per request

    @staticmethod
    def _grow(counts: np.ndarray | None, size: int) -> np.ndarray:
        if counts is None:
            return np.zeros((2, max(size, 8)))
        if counts.shape[1] < size:
            counts = np.concatenate([counts, np.zeros((2, size - counts.shape[1]))], axis=1)
        return counts

    def alphas(self, request_id: str, group: str, size: int) -> np.ndarray:
        """alpha_1..alpha_size for the request (posterior means)."""
        m = self.c.prior_strength
        g = self._grow(self._groups.get(group), size)
        # A position of the group is shrunk towards the group's acceptance over all
        # positions (about the same at every position: Cactus delta 1 accepts 0.94-0.97
        # at each of 1..8, sps 0.76-0.84), that towards the acceptance of all the
        # rule's groups pooled, and that towards rule_prior. A position the policy has
        # not drafted yet so starts where the others are, not at the uninformed prior:
        # otherwise a group whose drafts were short (the policy learnt on another load
        # or rule) lengthens them one probed position at a time. Likewise a new group
        # (a delta not seen before) starts where its rule is: at 0.5 it could look
        # not worth drafting, and a row that does not draft learns nothing.
        rule = self._rules.get(rule_of(group))
        rule_pooled = self.c.rule_prior
        if rule is not None:
            rule_pooled = (rule[1] + 2.0 * rule_pooled) / (rule[0] + 2.0)
        pooled = (g[1].sum() + m * rule_pooled) / (g[0].sum() + m)
        g = g[:, :size]
        prior = (g[1] + 2.0 * pooled) / (g[0] + 2.0)
        r = self._grow(self._rows.get(request_id), size)[:, :size]
        return (r[1] + m * prior) / (r[0] + m)

    def observe(self, request_id: str, group: str, k: int, accepted: int) -> None:
        """A step drafted k tokens for the request and accepted the first `accepted`."""
        if k <= 0:
            return
        reached = np.zeros(k)
        reached[: min(accepted + 1, k)] = 1.0  # position j was reached if j - 1 accepted
        took = np.zeros(k)
        took[:accepted] = 1.0
        g = self._groups.pop(group, None)  # back in last: the most recently observed
        before = g.sum(axis=1) if g is not None else 0.0
        g = self._grow(g, k)
        # Forget per position, as new evidence about it arrives: a position that is
        # not reached (the policy drafts shorter for a while) keeps its estimate
        # instead of sliding back to the uninformed prior, which would make long
        # drafts look worse the less they are tried.
        g[:, : min(accepted + 1, k)] *= self.c.rule_decay
        g[0, :k] += reached
        g[1, :k] += took
        self._groups[group] = g
        total = self._rules.setdefault(rule_of(group), np.zeros(2))
        total += g.sum(axis=1) - before
        while len(self._groups) > self.c.max_groups:
            self._evict(next(iter(self._groups)))
        r = self._grow(self._rows.get(request_id), k)
        r[0, :k] += reached
        r[1, :k] += took
        self._rows[request_id] = r

    def _evict(self, group: str) -> None:
        """Drop a group; its rule's pool is summed afresh from the groups left."""
        del self._groups[group]
        rule = rule_of(group)
        left = [g.sum(axis=1) for name, g in self._groups.items() if rule_of(name) == rule]
        if left:
            self._rules[rule] = np.sum(left, axis=0)
        else:
            self._rules.pop(rule, None)

    @property
    def groups(self) -> list[str]:
        """The groups kept, least recently observed first."""
        return list(self._groups)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


def expected_tokens(alphas: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..len(alphas): 1 + sum_{j<=k} prod_{m<=j} alpha_m."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(alphas))])


class _Fit:
    """Least squares over a sliding window, with a small ridge pull towards zero for the
    directions the window has not explored; coefficients are kept >= 0. The window's
    X^T X and X^T y are kept up to date as steps come and go, so a refit is a few
    n x n solves, not a pass over the window.

    With `per_key` > 0 the window is kept per key (the step's max k): each key's last
    `per_key` rows, none older than `max_age` rows in all. A stretch at one k then
    does not push every other k out of the fit (the rows the choice between k's
    needs), and what a k left long ago still ages out."""

    def __init__(self, n: int, window: int, per_key: int = 0, max_age: int = 0) -> None:
        self.per_key, self.max_age = per_key, max_age
        self.window = window
        self.keyed: dict = {}  # key -> deque of (t, x, y); one key when not per key
        self.t = 0  # rows added so far
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self.scale = np.full(n, 1e-9)  # largest |x| seen per feature (conditioning)
        self.theta = np.zeros(n)
        self._stale = False

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.keyed.values())

    def _drop(self, rows: deque) -> None:
        _, old_x, old_y = rows.popleft()
        self.xtx -= np.outer(old_x, old_x)
        self.xty -= old_x * old_y

    def add(self, x, y: float, key=None) -> None:
        x, y = np.asarray(x, dtype=float), float(y)
        key = key if self.per_key else None
        rows = self.keyed.setdefault(key, deque())
        if len(rows) == (self.per_key or self.window):
            self._drop(rows)
        if self.max_age:
            for old in self.keyed.values():
                while old and self.t - old[0][0] >= self.max_age:
                    self._drop(old)
        rows.append((self.t, x, y))
        self.t += 1
        self.xtx += np.outer(x, x)
        self.xty += x * y
        self.scale = np.maximum(self.scale, np.abs(x))
        self._stale = True

    def coef(self) -> np.ndarray:
        if self._stale and len(self):
            d = self.scale
            a, b = self.xtx / np.outer(d, d), self.xty / d  # the fit on scaled features
            keep = np.ones(len(d), dtype=bool)
            theta = np.zeros(len(d))
            for _ in range(len(d)):  # drop negative coefficients, refit the rest
                theta = np.zeros(len(d))
                if keep.any():
                    sub = a[np.ix_(keep, keep)] + 1e-3 * np.eye(int(keep.sum()))
                    theta[keep] = np.linalg.solve(sub, b[keep])
                if not (theta < 0).any():
                    break
                keep &= theta >= 0
            self.theta = np.maximum(theta, 0.0) / d
            self._stale = False
        return self.theta


class CostModel:
    """Decode step time as a function of the batch's k: draft + verify + rest.

    Our runners compute a step as a dense [rows, max k + 1] block (a row drafting less
    is padding), so the verifier forward follows rows x (max k + 1) and the draft pass
    drafting rows x max k; what grows with each row's own k is the vocabulary-sized
    work (sampling processing, the kernel, the draft probabilities' transport)."""

    def __init__(self, window: int, per_k: int = 0) -> None:
        fit = {"window": window, "per_key": per_k, "max_age": 4 * window if per_k else 0}
        self.draft = _Fit(4, **fit)  # [1, max k, drafting rows x max k, catch-up tokens]
        self.verify = _Fit(3, **fit)  # [1, rows, rows x (max k + 1)]
        # [1, rows, drafted tokens, drafting rows x max k, emitted tokens]
        self.rest = _Fit(5, **fit)
        self.steps = 0
        self.drafted_steps = 0  # the steps in which a row drafted (the draft fit's rows)

    @staticmethod
    def features(ks, lags):
        b, kmax = len(ks), max(ks, default=0)
        drafting = sum(1 for k in ks if k)
        catch = sum(lag for k, lag in zip(ks, lags, strict=True) if k > 0)
        draft = [1.0, kmax, drafting * kmax, catch] if kmax else None
        return draft, [1.0, b, b * (kmax + 1)], [1.0, b, sum(ks), drafting * kmax]

    def observe(
        self, ks, lags, draft_s: float, verify_s: float, rest_s: float, tokens: float = 0.0
    ) -> None:
        """`tokens`: what the step emitted (accepted + 1 per row)."""
        fd, fv, fr = self.features(ks, lags)
        key = max(ks, default=0)
        if fd is not None:
            self.draft.add(fd, draft_s, key)
            self.drafted_steps += 1
        self.verify.add(fv, verify_s, key)
        self.rest.add([*fr, tokens], rest_s, key)
        self.steps += 1

    def predict(self, ks, lags, tokens: float = 0.0) -> float:
        """Step time for these ks; `tokens`: the tokens it is expected to emit."""
        fd, fv, fr = self.features(ks, lags)
        t = float(np.dot(self.verify.coef(), fv) + np.dot(self.rest.coef(), [*fr, tokens]))
        return t + (float(np.dot(self.draft.coef(), fd)) if fd is not None else 0.0)

    def per_token_s(self) -> float:
        """The fitted cost of emitting one token."""
        return float(self.rest.coef()[4])

    def coefs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The coefficients the choice uses. A cost per emitted token is left out: with
        it a plan's goodput is E / (T + c E) = 1 / (T / E + c), whose best plan is the
        best plan of E / T, so it changes no choice. It is fitted all the same, so that
        the other coefficients do not absorb it: Cactus emits about twice the tokens of
        sps per step at the same k, and a fit without the term (rules pooled) charged
        that work to longer drafts."""
        return self.draft.coef(), self.verify.coef(), self.rest.coef()[:4]


class SpeculationPolicy:
    """Chooses k per row; `fixed` takes every ceiling, `goodput` maximises tokens/s.

    Thread-safe: plan, observe_rows, observe_time, forget and describe hold one lock
    (the engine's loop calls all but describe, which another thread reads)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.acceptance = AcceptanceModel(self.config)
        self.cost = CostModel(self.config.window, self.config.window_per_k)
        self.stats = PolicyStats()
        self._stats_groups: set[str] = set()  # groups with statistics of their own
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return self.config.kind

    # ---- choosing ------------------------------------------------------------------

    def plan(self, rows: list[PolicyRow]) -> Plan:
        """k for every row of the next step (rows with `fixed` keep theirs)."""
        with self._lock:
            return self._plan(rows)

    def _plan(self, rows: list[PolicyRow]) -> Plan:
        gains = self._gains(rows)
        if self.config.kind == "fixed":
            return self._planned(rows, [r.ceiling for r in rows], gains)
        if all(r.fixed is not None for r in rows):
            return self._planned(rows, [0] * len(rows), gains)
        n = self.stats.steps + 1  # the step being planned
        warm = self.config.warmup_steps
        # The warm-up also lasts until rows drafted in 3 of its 4 phases' worth of
        # steps: steps in which no row could draft (rule none, rows without a draft
        # actor yet) teach the draft fit nothing and must not use the warm-up up.
        if self.cost.steps < warm or n <= warm or self.cost.drafted_steps < (3 * warm) // 4:
            cycle = (1.0, 0.5, 0.25, 0.0)[n % 4]  # K, K/2, K/4 rounded up, 0
            ks = [int(np.ceil(r.ceiling * cycle)) for r in rows]
            return self._planned(rows, ks, gains, explored=True)
        ks = self._best(rows, gains)
        if n % self.config.explore_every == 0 and ks:
            # probe one step away from the choice, so the cost fits keep seeing how
            # time moves with k: every other probe the longest rows draft one more,
            # the others one less. In the steps up, the rows left at k = 0 draft the
            # step's new k too (1 where no row drafts; each row's ceiling where lower):
            # their estimate moves only if they draft, and one that started too low
            # would otherwise never draft again.
            top = max(ks)
            up = (n // self.config.explore_every) % 2 == 1
            if up:
                probe = [
                    min(top + 1, r.ceiling) if k in (top, 0) else k
                    for r, k in zip(rows, ks, strict=True)
                ]
            else:
                probe = [min(k, top - 1) for k in ks]
            probe = [
                k if r.fixed is None else min(r.fixed, r.ceiling)
                for r, k in zip(rows, probe, strict=True)
            ]
            probe = [max(k, 0) for k in probe]
            if probe != ks:
                return self._planned(rows, probe, gains, explored=True)
        return self._planned(rows, ks, gains)

    def _gains(self, rows: list[PolicyRow]) -> np.ndarray:
        """[rows, K + 1]: E_i(k), -inf beyond a row's ceiling (a fixed row: only its k)."""
        top = max((r.ceiling for r in rows), default=0)
        gains = np.full((len(rows), top + 1), -np.inf)
        gains[:, 0] = 1.0
        for i, r in enumerate(rows):
            if r.ceiling:
                a = self.acceptance.alphas(r.request_id, r.group, r.ceiling)
                gains[i, 1 : r.ceiling + 1] = 1.0 + np.cumsum(np.cumprod(a))
            if r.fixed is not None:
                fixed = min(r.fixed, r.ceiling)  # a promise above the room left: the room
                keep = gains[i, fixed]
                gains[i] = -np.inf
                gains[i, fixed] = keep
        return gains

    def _best(self, rows: list[PolicyRow], gains: np.ndarray, caps=None) -> list[int]:
        """The ks maximising sum E_i(k_i) / T(k): for every cap c on max k at once,
        Dinkelbach iterations over the per-row choices (E_i is concave in k; given the
        cap, T is a constant plus a cost per drafting row and per drafted token)."""
        d, v, r = (c.tolist() for c in self.cost.coefs())
        n, width = gains.shape
        floor = max((min(r_.fixed, r_.ceiling) for r_ in rows if r_.fixed is not None), default=0)
        caps = np.arange(floor, width) if caps is None else np.maximum(np.asarray(caps), floor)
        k = np.arange(width)
        lags = np.array([r_.lag for r_ in rows], dtype=float)
        # cost[c, i, k] of row i drafting k under cap c (= the step's max k)
        drafting = k[None, None, :] > 0
        cost = r[2] * k[None, None, :] + drafting * (
            (d[2] + r[3]) * caps[:, None, None] + d[3] * lags[None, :, None]
        )
        allowed = np.isfinite(gains)[None, :, :] & (k[None, None, :] <= caps[:, None, None])
        ks = np.where(allowed, k[None, None, :], -1).max(axis=2)  # [C, n]: largest allowed
        base = np.where(allowed, gains[None], -np.inf)
        # the step's cost outside the rows' own terms, for each possible max k
        shared = v[0] + r[0] + (v[1] + r[1]) * n + v[2] * n * (k + 1) + (k > 0) * (d[0] + d[1] * k)
        # Few numpy calls per iteration: on rank 0, beside the gRPC and Ray threads,
        # the search costs many times what it does in a plain process. Served at 16
        # clients it took 2.0 ms per step against 3.1 ms with about twice the calls
        # (side by side; 0.10 against 0.35 ms in a plain process; the same plans:
        # benchmarks/results/2026-12-01-vm-policy.md, "The plan's cost on rank 0").
        rows_at, idx = np.arange(len(caps))[:, None], np.arange(n)[None, :]
        g = np.zeros(len(caps))
        for _ in range(6):
            total = shared[ks.max(axis=1, initial=0)] + cost[rows_at, idx, ks].sum(axis=1)
            g_new = gains[idx, ks].sum(axis=1) / np.maximum(total, 1e-9)
            if (np.abs(g_new - g) <= 1e-9 * np.abs(g)).all():  # np.allclose(rtol=1e-9)
                break
            g = g_new
            ks = (base - g[:, None, None] * cost).argmax(axis=2)
        best = ks[int(np.argmax(g))].tolist()
        # A row that drafts at all drafts the step's k (its ceiling if lower): the step
        # is a dense block, so a row cut shorter than the others saves only its share
        # of the vocabulary-sized work per position while giving up its likeliest
        # extra tokens, and that saving is the cost the fits pin down least. Served,
        # the per-row cuts cost cactus at 16 clients about 10% against fixed K = 8
        # (benchmarks/results/2026-12-01-vm-policy.md, "Kept: a row that drafts drafts
        # the step's k").
        top = max(best, default=0)
        return [min(r_.ceiling, top) if k > 0 else 0 for r_, k in zip(rows, best, strict=True)]

    def _planned(self, rows, ks, gains: np.ndarray, explored: bool = False) -> Plan:
        ks = [
            min(r.fixed, r.ceiling) if r.fixed is not None else min(max(int(k), 0), r.ceiling)
            for r, k in zip(rows, ks, strict=True)
        ]
        expected = [float(gains[i, k]) for i, k in enumerate(ks)]
        # (the step's predicted time is the engine's to ask, predict_time: it is known
        # only once every row has its k, some planned a step ahead)
        return Plan(ks, expected, explored)

    # ---- learning ------------------------------------------------------------------

    def observe_rows(self, rows: list[PolicyRow], ks, accepted, expected) -> None:
        """What a step's acceptance gave, per row."""
        with self._lock:
            self._observe_rows(rows, ks, accepted, expected)

    def _stats_group(self, group: str) -> str:
        """The group's key in the statistics: its own for the first `max_groups` groups
        seen, then one "<rule>:other" per rule (counters only grow per key, so windows
        of them can be subtracted)."""
        if group in self._stats_groups:
            return group
        if len(self._stats_groups) < self.config.max_groups:
            self._stats_groups.add(group)
            return group
        return f"{rule_of(group)}:other"

    def _observe_rows(self, rows: list[PolicyRow], ks, accepted, expected) -> None:
        st = self.stats
        st.steps += 1
        top = max(ks, default=0)
        st.step_max_k[top] += 1
        st.short_rows += sum(1 for r, k in zip(rows, ks, strict=True) if k < top and k < r.ceiling)
        for r, k, a, e in zip(rows, ks, accepted, expected, strict=True):
            if k:
                self.acceptance.observe(r.request_id, r.group, k, a)
            g = self._stats_group(r.group)
            st.chosen_k[g, k] += 1
            st.rows[g] += 1
            st.predicted_tokens[g] += e
            st.realised_tokens[g] += a + 1

    def observe_time(
        self,
        ks,
        lags,
        draft_s: float,
        verify_s: float,
        rest_s: float,
        predicted_s: float,
        tokens: float = 0.0,
    ) -> None:
        """A step's times; `tokens`: what it emitted (accepted + 1 per row). A step with
        a time that is not finite is left out: in a fit's sums it would stay for good
        (subtracting it when it leaves the window gives NaN again) and no k would pay."""
        times = (draft_s, verify_s, rest_s, tokens)
        if not all(np.isfinite(t) for t in times):
            log.warning("speculation policy: a step timed %s left out of the cost model", times)
            return
        with self._lock:
            if predicted_s > 0:
                self.stats.predicted_time_s += predicted_s
                self.stats.realised_time_s += draft_s + verify_s + rest_s
                self.stats.timed_steps += 1
            self.cost.observe(ks, lags, draft_s, verify_s, rest_s, tokens=tokens)

    def predict_time(self, ks, lags, tokens: float = 0.0) -> float:
        """The cost model's step time for these ks (CostModel.predict), under the lock."""
        with self._lock:
            return self.cost.predict(ks, lags, tokens=tokens)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.acceptance.forget(request_id)

    def describe(self) -> dict:
        """The statistics, and the cost fits' current coefficients (seconds per unit of
        each feature, see CostModel), for reports and debugging. Safe from any thread."""
        with self._lock:
            out = self.stats.as_dict()
            d, v, r = self.cost.coefs()
            out["cost_model"] = {
                "draft": d.tolist(),
                "verify": v.tolist(),
                "rest": r.tolist(),
                "per_emitted_token": self.cost.per_token_s(),
            }
            out["acceptance_groups"] = len(self.acceptance.groups)
        return out
