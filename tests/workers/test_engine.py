"""The in-process speculative engine on the embedded models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cactus.errors import InvalidRequestError, RequestCancelledError
from cactus.params import GenerationRequest, SamplingParams, SpeculationParams
from tests.conftest import request_state
from workers.engine import SpeculativeEngine
from workers.request import RequestState

RULES = ("sps", "cactus", "cactus_exact", "tas")


def _req(prompt, *, rule="cactus", delta=1.0, k=4, **sampling):
    sampling.setdefault("max_tokens", 32)
    return GenerationRequest(
        prompt=prompt,
        sampling=SamplingParams(**sampling),
        speculation=SpeculationParams(rule=rule, delta=delta, num_speculative_tokens=k),
    )


def test_greedy_every_rule_equals_verifier_only(embedded_engine, heldout_prompts):
    """Temperature 0: 4 prompts (every fourth held-out one) x 48 tokens, every rule, one
    request at a time, token for token (test_batched_engine checks a batch of every rule
    on more prompts)."""
    accepted = {}
    for prompt in heldout_prompts[::4]:
        want = embedded_engine.generate(_req(prompt, rule="none", temperature=0.0, max_tokens=48))
        for rule in RULES:
            got = embedded_engine.generate(
                _req(prompt, rule=rule, delta=2.0, temperature=0.0, max_tokens=48)
            )
            assert got.token_ids == want.token_ids, (rule, prompt)
            assert got.text == want.text
            accepted[rule] = accepted.get(rule, 0) + got.stats.num_accepted_tokens
    assert all(n > 0 for n in accepted.values()), accepted  # speculation really happened


@pytest.mark.parametrize("rule", ["cactus", "cactus_exact"])
def test_delta_zero_equals_sps_under_a_seed(embedded_engine, heldout_prompts, rule):
    for i, prompt in enumerate(heldout_prompts[:6]):
        kw = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 100 + i}
        sps = embedded_engine.generate(_req(prompt, rule="sps", **kw))
        ours = embedded_engine.generate(_req(prompt, rule=rule, delta=0.0, **kw))
        assert ours.token_ids == sps.token_ids
        assert ours.stats.divergence_nats == 0.0


def test_seed_reproducible_and_different_seeds_differ(embedded_engine, heldout_prompts):
    prompt = heldout_prompts[3]
    kw = {"temperature": 1.0, "max_tokens": 40}
    a = embedded_engine.generate(_req(prompt, seed=7, **kw))
    b = embedded_engine.generate(_req(prompt, seed=7, **kw))
    c = embedded_engine.generate(_req(prompt, seed=8, **kw))
    assert a.token_ids == b.token_ids and a.seed == 7
    assert a.token_ids != c.token_ids
    unseeded = embedded_engine.generate(_req(prompt, **kw))
    again = embedded_engine.generate(_req(prompt, seed=unseeded.seed, **kw))
    assert again.token_ids == unseeded.token_ids  # the echoed seed reproduces the output


def test_stats_are_consistent(embedded_engine, heldout_prompts):
    res = embedded_engine.generate(
        _req(heldout_prompts[0], temperature=0.6, top_k=20, top_p=0.95, seed=1, max_tokens=40, k=4)
    )
    st = res.stats
    assert st.num_drafts > 0 and st.num_draft_tokens <= 4 * st.num_drafts
    assert sum(st.accepted_per_position) == st.num_accepted_tokens
    assert st.accepted_per_position == sorted(st.accepted_per_position, reverse=True)
    assert st.mean_acceptance_length == pytest.approx(1 + st.num_accepted_tokens / st.num_drafts)
    assert st.divergence_nats > 0  # cactus at delta 1 moved away from q somewhere
    assert len(res.token_ids) == 40 and res.finish_reason == "LENGTH"


def test_divergence_ceiling_holds(embedded_engine, heldout_prompts):
    req = _req(
        heldout_prompts[1], rule="cactus_exact", delta=2.0, temperature=1.0, seed=3, max_tokens=48
    )
    free = embedded_engine.generate(req)
    capped_req = replace(req, speculation=replace(req.speculation, max_divergence_nats=0.5))
    capped = embedded_engine.generate(capped_req)
    assert free.stats.divergence_nats > 0.5
    assert capped.stats.divergence_nats <= 0.5 + 1e-9


def test_stop_string_is_cut_and_never_streamed(embedded_engine, heldout_prompts):
    base = embedded_engine.generate(_req(heldout_prompts[2], temperature=0.0, max_tokens=48))
    text = base.text
    stop = text[20:23]
    assert len(stop) == 3 and text.find(stop) >= 0
    want = text[: text.find(stop)]
    req = _req(heldout_prompts[2], temperature=0.0, max_tokens=48, stop=(stop, "\x00never"))
    chunks = list(embedded_engine.stream(req))
    result = chunks[-1].result
    assert result.finish_reason == "STOP_SEQUENCE" and result.text == want
    assert "".join(c.text for c in chunks) == want
    assert base.token_ids[: len(result.token_ids)] == result.token_ids


# 1 = "ab", 2 = "X" + the first byte of "中", 3 = its other two bytes
_BYTES = {1: b"ab", 2: b"X\xe4", 3: b"\xb8\xad", 4: b"cd"}


class _ByteTokenizer:
    """A byte-level vocabulary as GPT-2's and Qwen's: a token's bytes may end inside a
    UTF-8 character."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return b"".join(_BYTES.get(t, b"") for t in ids).decode("utf-8", "replace")


@pytest.mark.parametrize("ending", ["LENGTH", "EOS", "TIME_LIMIT"])
def test_a_stop_string_in_text_the_detokenizer_held_back_is_still_cut(ending):
    """ "X" arrives in a token that ends inside a character, so the detokenizer holds it
    back until the character completes; a request that ended there (max_tokens, EOS, its
    time limit) flushed that text unsearched, and the stop string "bX" leaked into the
    text (unary and streamed: "abX\ufffd"). It is now searched at the flush and cut."""
    req = GenerationRequest(
        prompt_token_ids=(4, 4),
        sampling=SamplingParams(max_tokens=2 if ending == "LENGTH" else 8, stop=("bX",)),
        speculation=SpeculationParams(rule="none"),
    )
    state = request_state(req)
    state.detok._tok = _ByteTokenizer()
    state.eos = frozenset({9})
    if ending == "TIME_LIMIT":
        state.emit([1, 2])
        assert state.finish_reason is None
        state.time_limit()
    else:
        state.emit([1, 2, 9] if ending == "EOS" else [1, 2])
    assert state.finish_reason == "STOP_SEQUENCE"
    assert state.result().text == "a" and state.releasable() == "a"
    # streamed: "b" was held back (it could begin the stop string), so the cut at the
    # flush never takes back text a chunk already sent
    state = request_state(req)
    state.detok._tok = _ByteTokenizer()
    state.eos = frozenset({9})
    state.emit([1])
    assert state.releasable() == "a"
    if ending == "TIME_LIMIT":
        state.emit([2])
        state.time_limit()
    else:
        state.emit([2, 9] if ending == "EOS" else [2])
    assert state.finish_reason == "STOP_SEQUENCE"
    assert state.releasable() == "" and state.result().text == "a"
    # the character completes: the stop string is found as before (no flush)
    state = request_state(req)
    state.detok._tok = _ByteTokenizer()
    state.emit([1, 2, 3])
    assert state.finish_reason == "STOP_SEQUENCE" and state.result().text == "a"


def test_stop_token_id_and_eos(embedded_engine, heldout_prompts):
    base = embedded_engine.generate(_req(heldout_prompts[4], temperature=0.0, max_tokens=30))
    stop_id = base.token_ids[10]
    first = base.token_ids.index(stop_id)
    res = embedded_engine.generate(
        _req(heldout_prompts[4], temperature=0.0, max_tokens=30, stop_token_ids=(stop_id,))
    )
    assert res.finish_reason == "STOP" and res.token_ids == base.token_ids[: first + 1]
    assert res.text == embedded_engine.tokenizer.decode(base.token_ids[:first])
    # EOS: an engine over the same workers whose EOS id is the token greedy decoding
    # produces 6th must stop right there, keep the id and leave its text out.
    eos = base.token_ids[5]
    first = base.token_ids.index(eos)
    eos_engine = SpeculativeEngine(
        embedded_engine.drafter,
        embedded_engine.verifier,
        embedded_engine.tokenizer,
        eos_token_id=eos,
    )
    res = eos_engine.generate(_req(heldout_prompts[4], temperature=0.0, max_tokens=30))
    assert res.finish_reason == "EOS" and res.token_ids == base.token_ids[: first + 1]
    assert res.text == embedded_engine.tokenizer.decode(base.token_ids[:first])


def test_every_eos_id_of_the_generation_config_ends_the_text(
    embedded_engine, heldout_prompts, tmp_path
):
    """A checkpoint whose generation_config.json lists several eos_token_id values (as
    many instruct ones do) stops at any of them, as vLLM does, not only at the
    tokenizer's one: a copy of the embedded pair listing [EOS, the 6th greedy token]."""
    import json
    import shutil

    from tests.conftest import embedded_dirs
    from workers.local import local_engine
    from workers.scheduler import SchedulerConfig

    prompt = heldout_prompts[4]
    base = embedded_engine.generate(_req(prompt, rule="none", temperature=0.0, max_tokens=30))
    extra = base.token_ids[5]
    first = base.token_ids.index(extra)
    eos = embedded_engine.tokenizer.eos_token_id
    assert extra != eos and base.finish_reason == "LENGTH"
    dirs = []
    for src in embedded_dirs():
        dst = tmp_path / src.rstrip("/").rsplit("/", 1)[-1]
        shutil.copytree(src, dst)
        gen = json.loads((dst / "generation_config.json").read_text())
        (dst / "generation_config.json").write_text(
            json.dumps({**gen, "eos_token_id": [eos, extra]})
        )
        dirs.append(str(dst))
    engine = local_engine(*dirs, scheduler=SchedulerConfig(policy="fixed"))
    assert engine.eos_token_ids == {eos, extra}
    for rule in ("none", "cactus"):
        res = engine.generate(_req(prompt, rule=rule, temperature=0.0, max_tokens=30))
        assert res.finish_reason == "EOS" and res.token_ids == base.token_ids[: first + 1], rule
    # the shipped checkpoints list one EOS, the tokenizer's
    assert embedded_engine.eos_token_ids == {eos}


def test_max_tokens_and_streaming_reassemble(embedded_engine, heldout_prompts):
    chunks = list(
        embedded_engine.stream(
            _req(heldout_prompts[5], temperature=0.7, seed=4, max_tokens=17, k=6)
        )
    )
    result = chunks[-1].result
    assert result.finish_reason == "LENGTH" and len(result.token_ids) == 17
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
    assert "".join(c.text for c in chunks) == result.text


def test_multibyte_output_is_never_split(embedded_engine):
    """The embedded models almost never sample non-ASCII text, so the request's emission
    path (stop checks, held-back text, release) is driven with the byte-level tokens of
    a multi-byte string, several of which hold only part of a character."""
    tok = embedded_engine.tokenizer
    text = "s = 'café — naïve 日本語 🙂'\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([t]) for t in ids) >= 4
    chunks = []
    state = RequestState(
        _req("x = 1\n", max_tokens=len(ids), stop=("ZZZ",)),
        [1],
        seed=0,
        eos=None,
        tokenizer=tok,
        max_context=embedded_engine.limits.max_context,
        sink=chunks.append,
    )
    pieces = []
    for t in ids:
        state.emit([t])
        pieces.append(state.releasable())
    assert state.finish_reason == "LENGTH"
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_time_limit_ends_the_request(embedded_engine, heldout_prompts):
    req = replace(_req(heldout_prompts[0], max_tokens=200), time_limit_s=1e-6)
    res = embedded_engine.generate(req)
    assert res.finish_reason == "TIME_LIMIT" and len(res.token_ids) < 200
    assert embedded_engine.verifier.runner.num_sequences == 0


def test_cancel_frees_caches(embedded_engine, heldout_prompts):
    """Cancelled after its first chunk, the request ends at the next step. (It used to
    be cancelled at the third step and was unseeded: a sampled EOS in the first steps
    ended it first, once in a full run. Seeded, the first chunk is never the last.)"""
    cancel = []
    with pytest.raises(RequestCancelledError):
        for _ in embedded_engine.stream(
            _req(heldout_prompts[0], max_tokens=64, seed=3), cancelled=lambda: bool(cancel)
        ):
            cancel.append(True)
    assert embedded_engine.verifier.runner.num_sequences == 0
    assert embedded_engine.drafter.runner.num_sequences == 0


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("prompt", {"prompt": ""}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": 10**6}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": -1.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_k", {"top_k": -5}),
        ("delta", {"delta": -1.0}),
        ("delta", {"delta": float("nan")}),
        ("num_speculative_tokens", {"k": 0}),
        ("rule", {"rule": "bogus"}),
    ],
)
def test_invalid_fields_raise_the_domain_error(embedded_engine, field, kwargs):
    prompt = kwargs.pop("prompt", "def f():")
    with pytest.raises(InvalidRequestError) as err:
        embedded_engine.generate(_req(prompt, **kwargs))
    assert err.value.field == field
    assert embedded_engine.verifier.runner.num_sequences == 0


def test_rollback_on_embedded_verifier(embedded_engine):
    runner = embedded_engine.verifier.runner
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    ids = embedded_engine.tokenizer.encode(text)
    assert len(ids) >= 14
    runner.start("r", 32)
    runner.forward(["r"], [ids[:8]])
    runner.forward(["r"], [ids[8:13]])
    runner.rollback("r", 4)
    (got,) = runner.forward(["r"], [ids[9:14]])
    with torch.inference_mode():
        full = runner.model(input_ids=torch.tensor([ids[:14]]), use_cache=False).logits[0]
    runner.release("r")
    assert float((got - full[-5:].float()).abs().max()) < 1e-5


def _row(prompt_len, max_tokens, max_context, *, k=4, rule="cactus", resumed=0):
    req = GenerationRequest(
        prompt_token_ids=tuple(range(1, prompt_len + 1)),
        request_id="row",
        sampling=SamplingParams(max_tokens=max_tokens),
        speculation=SpeculationParams(rule=rule, num_speculative_tokens=k),
        resume_token_ids=tuple(range(50, 50 + resumed)),
    )
    return request_state(req, max_context=max_context)


def _ks_to_the_end(state, max_context):
    """The K a row may draft at each step until max_tokens or the context ends it, one
    token a step; checks that no step could draft (k) and emit (k + 1) past either."""
    ks = []
    while state.finish_reason is None:
        k = state.num_draft_tokens()
        left = state.request.sampling.max_tokens - state.num_generated
        assert 0 <= k <= state.request.speculation.num_speculative_tokens
        assert k + 1 <= left and state.committed + k + 1 <= max_context, (k, left)
        assert state.committed + k + 1 <= state.reserve_tokens  # its KV reservation
        ks.append(k)
        state.emit([7])
    return ks


def test_drafted_tokens_shrink_near_max_tokens_and_the_context_end():
    """README: a row's K shrinks near max_tokens and the end of the context (a step
    drafts k tokens and emits up to k + 1); rule none and a degraded row draft none."""
    # prompt + max_tokens reaching max_context exactly (the most the validator allows)
    assert _ks_to_the_end(_row(20, 10, 30), 30) == [4] * 6 + [3, 2, 1, 0]
    # far from the context end: max_tokens alone shrinks it
    assert _ks_to_the_end(_row(20, 8, 512), 512) == [4] * 4 + [3, 2, 1, 0]
    # the row's own guard when the context ends first (prompt + max_tokens beyond it)
    assert _ks_to_the_end(_row(20, 40, 26), 26) == [4, 4, 3, 2, 1, 0]
    # a resumed row: the tokens sent before count towards max_tokens and the context
    assert _ks_to_the_end(_row(20, 10, 30, resumed=6), 30) == [3, 2, 1, 0]
    # a K smaller than the room is kept until the room is smaller
    assert _ks_to_the_end(_row(5, 6, 11, k=2), 11) == [2, 2, 2, 2, 1, 0]
    assert _ks_to_the_end(_row(20, 10, 30, rule="none"), 30) == [0] * 10
    degraded = _row(20, 10, 30)
    degraded.drafting = False  # the drafter failed
    assert _ks_to_the_end(degraded, 30) == [0] * 10
