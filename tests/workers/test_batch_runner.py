"""BatchRunner: ragged batched forwards, per-row rollback, evictions and the memory plan,
checked against the per-sequence ModelRunner (the reference) and full recomputes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from tests.conftest import embedded_dirs
from tests.tiny_models import FAMILIES, tiny_config
from workers.batch_runner import BatchRunner, CapacityError
from workers.model_runner import ModelRunner

TOL = 1e-5
MODES = ("all", "last", "none")


def _full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of a recompute without any cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def _expected(want: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "all":
        return want
    return want[-1:] if mode == "last" else want[:0]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    if got.numel():
        assert float((got - want).abs().max()) < TOL, what


class _Scenario:
    """Random admissions, ragged forwards, rollbacks and evictions on both runners at once."""

    def __init__(self, path, seed: int, max_num_seqs: int = 4) -> None:
        self.ref = ModelRunner(path)
        self.bat = BatchRunner(path, model=self.ref.model, max_num_seqs=max_num_seqs)
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens: dict[str, list[int]] = {}  # live id -> its tokens (for a full recompute)
        self.reserve: dict[str, int] = {}
        self.admitted = 0

    def rand(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def admit(self) -> None:
        seq_id = f"s{self.admitted}"
        self.admitted += 1
        self.reserve[seq_id] = self.rand(30, 120)  # crosses T = 64 -> 128: a live reallocation
        self.ref.start(seq_id)
        self.bat.start(seq_id, self.reserve[seq_id])
        self.tokens[seq_id] = []

    def evict(self) -> None:
        live = sorted(self.tokens)
        victim = live[self.rand(0, len(live) - 1)]
        assert self.ref.release(victim) and self.bat.release(victim)
        del self.tokens[victim]

    def rollbacks(self) -> None:
        for seq_id, toks in self.tokens.items():
            if toks and self.rand(0, 1):
                k = self.rand(1, min(len(toks), 5))
                self.ref.rollback(seq_id, k)
                self.bat.rollback(seq_id, k)
                del toks[-k:]

    def step(self) -> None:
        ids, blocks = [], []
        for seq_id, toks in self.tokens.items():
            if toks and self.rand(0, 3) == 0:
                continue  # not in this call: sits out if its row is inside the range
            room = self.reserve[seq_id] - len(toks)
            n = min(room, self.rand(2, 12) if not toks else self.rand(0, 5))
            ids.append(seq_id)
            blocks.append(torch.randint(0, self.ref.vocab_size, (n,), generator=self.gen).tolist())
        order = torch.randperm(len(ids), generator=self.gen).tolist()
        ids, blocks = [ids[i] for i in order], [blocks[i] for i in order]
        mode = MODES[self.rand(0, 2)]
        got = self.bat.forward(ids, blocks, logits=mode)
        assert len(got) == len(ids)
        for seq_id, block, logits in zip(ids, blocks, got, strict=True):
            want = self.ref.forward(seq_id, block) if block else torch.empty(0, logits.shape[1])
            _assert_close(logits, _expected(want, mode), f"{seq_id} {mode} {len(block)}")
            self.tokens[seq_id] += block
        for seq_id, toks in self.tokens.items():
            assert self.bat.length(seq_id) == self.ref.length(seq_id) == len(toks)
        assert self.bat.kv_slots <= self.bat.kv_budget_tokens

    def run(self, steps: int, admit_at: dict[int, int], evict_at: set[int]) -> None:
        for step in range(steps):
            if step in evict_at:
                self.evict()
            for _ in range(admit_at.get(step, 0)):
                self.admit()
            self.rollbacks()
            self.step()

    def check_full_recompute(self) -> None:
        seq_id = max(self.tokens, key=lambda s: len(self.tokens[s]))
        toks = self.tokens[seq_id]
        self.bat.rollback(seq_id, 1)
        (got,) = self.bat.forward([seq_id], [toks[-1:]], logits="all")
        _assert_close(got, _full_logits(self.bat.model, toks)[-1:], f"full recompute {seq_id}")


@pytest.mark.parametrize("family", FAMILIES)
def test_random_batched_steps_match_per_sequence_runner(family, tiny_checkpoints):
    sc = _Scenario(tiny_checkpoints[family], seed=FAMILIES.index(family))
    # 6 sequences through 4 rows: two evictions mid-way, later admissions reuse freed rows.
    sc.run(12, admit_at={0: 2, 1: 1, 3: 1, 6: 1, 9: 1}, evict_at={5, 8})
    assert sc.admitted == 6 and sc.bat.num_sequences == 4
    sc.check_full_recompute()
    for seq_id in list(sc.tokens):
        assert sc.bat.release(seq_id)
    assert sc.bat.num_sequences == 0


def test_embedded_verifier_batched_steps():
    verifier, _ = embedded_dirs()
    sc = _Scenario(verifier, seed=7)
    sc.run(6, admit_at={0: 3, 2: 1, 4: 1}, evict_at={3})
    sc.check_full_recompute()


def _sliding_checkpoint(tmp_path, tokenizer, family: str):
    config = tiny_config(family, len(tokenizer), tokenizer.eos_token_id)
    config.sliding_window = 6
    if family == "qwen2":  # one full and one sliding layer: the mask goes in as a dict
        config.use_sliding_window = True
        config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_layers_match_full_recompute(family, tmp_path, tiny_tokenizer):
    bat = BatchRunner(_sliding_checkpoint(tmp_path, tiny_tokenizer, family), max_num_seqs=3)
    assert bat.model.config.sliding_window == 6
    gen = torch.Generator().manual_seed(0)
    seqs = {s: [] for s in "abc"}
    for s in seqs:
        bat.start(s, 64)
    for step in range(4):
        blocks = [
            torch.randint(0, bat.vocab_size, (3 + 2 * i,), generator=gen).tolist() for i in range(3)
        ]
        if step % 2:
            bat.rollback("b", 2)
            del seqs["b"][-2:]
        got = bat.forward(list(seqs), blocks)
        for (s, toks), block, logits in zip(seqs.items(), blocks, got, strict=True):
            toks += block
            _assert_close(logits, _full_logits(bat.model, toks)[-len(block) :], f"{s} {step}")
    assert len(seqs["c"]) > 3 * 6  # well past the window


def test_transformers_uses_our_cache_mask_and_logits_to_keep(tiny_checkpoints, monkeypatch):
    """Pins what BatchRunner relies on in transformers 5.24."""
    bat = BatchRunner(tiny_checkpoints["llama"], max_num_seqs=2)
    model, layers = bat.model, bat.model.config.num_hidden_layers
    bat.start("a", 64)
    bat.start("b", 64)
    calls = []
    real_update = bat._cache.update

    def spy(key_states, value_states, layer_idx, *args, **kwargs):
        calls.append(layer_idx)
        return real_update(key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(bat._cache, "update", spy)
    bat.forward(["a", "b"], [[5, 6, 7, 8], [9, 10, 11]])
    assert calls == list(range(layers))

    # A 4-D mask goes through the mask factories unchanged ...
    embeds = torch.zeros(2, 1, model.config.hidden_size)
    mask = torch.zeros(2, 1, 1, 5)
    assert create_causal_mask(model.config, embeds, mask, bat._cache) is mask
    assert create_sliding_window_causal_mask(model.config, embeds, mask, bat._cache) is mask
    # ... and reaches attention: hiding slot 1 from row "a" changes only row "a".
    plain = bat.forward(["a", "b"], [[3], [4]])
    bat.rollback("a", 1)
    bat.rollback("b", 1)
    real_mask = bat._attention_mask

    def hide_slot(pos, kv_len):
        m = real_mask(pos, kv_len).clone()
        m[bat._row["a"], :, :, 1] = torch.finfo(m.dtype).min
        return m

    monkeypatch.setattr(bat, "_attention_mask", hide_slot)
    hidden = bat.forward(["a", "b"], [[3], [4]])
    assert float((hidden[0] - plain[0]).abs().max()) > 1e-4
    assert float((hidden[1] - plain[1]).abs().max()) < 1e-6

    # logits_to_keep: a 1-D index keeps those positions of every row (3-D, as DeepSpeed's
    # sharded LM head needs); an int keeps the last positions.
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        kept = model(input_ids=ids, logits_to_keep=torch.tensor([0, 2])).logits
        assert kept.shape == (2, 2, bat.vocab_size)
        assert torch.allclose(kept, full[:, [0, 2]], atol=1e-6)
        assert model(input_ids=ids, logits_to_keep=1).logits.shape == (2, 1, bat.vocab_size)


def test_memory_plan_capacity_and_bounds(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ref = ModelRunner(path)
    bat = BatchRunner(path, model=ref.model, max_num_seqs=3, kv_budget_tokens=200)
    assert bat.kv_slots == 0 and bat.kv_budget_tokens == 200
    for s in "abc":
        assert bat.fits(64)
        bat.start(s, 64)
        ref.start(s)
        assert bat.kv_slots <= 200
    assert (bat.rows_allocated, bat.t_capacity) == (3, 64)
    assert not bat.fits(1)
    with pytest.raises(CapacityError):
        bat.start("d", 1)
    prompts = {s: list(range(10 * i + 1, 10 * i + 9)) for i, s in enumerate("abc")}
    bat.forward(list(prompts), list(prompts.values()))
    for s, p in prompts.items():
        ref.forward(s, p)

    assert bat.release("b") and not bat.release("b")
    assert not bat.fits(70)  # 3 rows of 70 > 200
    with pytest.raises(CapacityError):
        bat.start("d", 70)
    assert bat.fits(66)
    bat.start("d", 66)  # T grows 64 -> 66 (capped by the budget), live rows are copied
    ref.start("d")
    assert bat.t_capacity == 66 and bat.kv_slots <= 200
    got = bat.forward(["c", "a", "d"], [[1], [2], [3, 4]])
    for s, block, logits in zip("cad", [[1], [2], [3, 4]], got, strict=True):
        _assert_close(logits, ref.forward(s, block), s)

    with pytest.raises(ValueError, match="'d'"):
        bat.forward(["a", "d"], [[1], list(range(65))])
    assert bat.length("d") == 2 and bat.length("a") == 9
    with pytest.raises(ValueError, match="num_tokens"):
        bat.rollback("a", 10)
    bat.rollback("a", 0)
    assert bat.length("a") == 9
    with pytest.raises(KeyError):
        bat.forward(["zz"], [[1]])
    with pytest.raises(ValueError):
        bat.start("e", 0)
    with pytest.raises(ValueError):
        bat.start("e", bat.max_context + 65)
    assert [x.shape for x in bat.forward(["a", "c"], [[], []], logits="last")] == [
        (0, bat.vocab_size)
    ] * 2
    bat.start("a", 8)  # re-starting a live id replaces it
    assert bat.length("a") == 0 and bat.num_sequences == 3
    for s in "acd":
        assert bat.release(s)
    assert bat.num_sequences == 0


def test_rows_grow_lazily(tiny_checkpoints):
    bat = BatchRunner(tiny_checkpoints["qwen3"], max_num_seqs=32)
    bat.start("only", 10)
    assert (bat.rows_allocated, bat.t_capacity) == (1, 64)
    bat.forward(["only"], [[1, 2, 3]])
    assert bat._cache.layers[0].keys.shape[0] == 1
    bat.start("two")  # reserve defaults to max_context (256)
    assert (bat.rows_allocated, bat.t_capacity) == (2, 256)
    assert bat._cache.layers[0].keys.shape[::2] == (2, 256)


def _runners_and_tokens(path, rows: int, seed: int):
    """The per-sequence reference, a BatchRunner of `rows` rows on the same weights, and
    a seeded draw of n random token ids."""
    ref = ModelRunner(path)
    bat = BatchRunner(path, model=ref.model, max_num_seqs=rows)
    gen = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(0, bat.vocab_size, (n,), generator=gen).tolist()

    return ref, bat, toks


@pytest.mark.parametrize("freed", ["hole", "last"])
def test_a_freed_rows_non_finite_kv_never_reaches_a_later_sequence(freed, tiny_checkpoints):
    """A sequence whose keys/values overflowed (NaN from slot 3 on, rolled-back slots too)
    ends. Its row's slots must not reach the sequence that gets the row next: the mask is
    additive, so a masked NaN slot still makes a row's attention NaN whenever the forward's
    kv_len reaches it (a longer row beside it). "hole": the last row moves into the freed
    row and keeps its tail; "last": the freed row is the last one and a new sequence gets it."""
    ref, bat, toks = _runners_and_tokens(tiny_checkpoints["llama"], rows=3, seed=5)

    order = ["long", "x", "short"] if freed == "hole" else ["long", "short", "x"]
    prompts = {"long": toks(40), "x": toks(30), "short": toks(6)}
    for s in order:
        bat.start(s, 64)
    bat.forward(order, [prompts[s] for s in order], logits="none")
    bat.rollback("x", 10)  # slots 20-29 stay written
    for s in ("long", "short"):
        ref.start(s)
        ref.forward(s, prompts[s])
    row = bat._row["x"]
    with torch.inference_mode():  # the buffers are inference tensors
        for layer in bat._cache.layers:
            layer.keys[row, :, 3:30] = float("nan")
            layer.values[row, :, 3:30] = float("nan")
    assert bat.release("x")
    assert all(
        torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        for layer in bat._cache.layers
    )
    bat.start("new", 64)
    ref.start("new")
    assert bat._row["new" if freed == "last" else "short"] == row
    blocks = {"long": toks(2), "short": toks(3), "new": toks(5)}
    got = bat.forward(list(blocks), list(blocks.values()))
    for s, logits in zip(blocks, got, strict=True):
        assert torch.isfinite(logits).all(), s
        _assert_close(logits, ref.forward(s, blocks[s]), s)


def test_a_forward_computes_its_rows_not_the_idle_rows_between_them(tiny_checkpoints, monkeypatch):
    """Rows drift apart (releases fill holes, admissions append): a prefill of rows 0 and
    7 must not also run rows 1-6 through the model, while a decode step with one row
    sitting out, or a drafting step over a few far rows, stays one model call."""
    ref, bat, toks = _runners_and_tokens(tiny_checkpoints["llama"], rows=8, seed=11)

    seqs = [f"s{i}" for i in range(8)]
    for s in seqs:
        bat.start(s, 128)
        ref.start(s)
    first = [toks(4) for _ in seqs]
    bat.forward(seqs, first, logits="none")
    for s, block in zip(seqs, first, strict=True):
        ref.forward(s, block)
    assert [bat._row[s] for s in seqs] == list(range(8))

    shapes = []
    real_forward = bat.model.forward

    def spy(*args, input_ids=None, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return real_forward(*args, input_ids=input_ids, **kwargs)

    def check(ids: list[str], blocks: list[list[int]], mode: str = "all") -> list[tuple]:
        shapes.clear()
        monkeypatch.setattr(bat.model, "forward", spy)
        got = bat.forward(ids, blocks, logits=mode)
        monkeypatch.undo()
        calls = list(shapes)
        for s, block, logits in zip(ids, blocks, got, strict=True):
            want = ref.forward(s, block) if block else torch.empty(0, bat.vocab_size)
            _assert_close(logits, _expected(want, mode), s)
        return calls

    # prefill chunks of the first and the last row (an idle row in the call: it sits out)
    chunks = [toks(12), [], toks(20)]
    calls = check(["s0", "s3", "s7"], chunks)
    computed = sum(b * q for b, q in calls)
    assert computed <= 2 * 32, calls  # the old single call: [8, 20] = 160 tokens
    assert sorted(calls) == [(1, 12), (1, 20)]

    # a burst admitted together (adjacent rows): short prompts' chunks beside a long
    # one's are not all padded to the long chunk (the step's token budget is what the
    # model computes): [7, 4] and [1, 100], not [8, 100]
    for burst in ([toks(4) for _ in range(7)] + [toks(100)], [toks(100)] + [toks(4)] * 7):
        calls = check(seqs, burst, mode="none")
        assert sorted(calls) == [(1, 100), (7, 4)], calls
        for s, block in zip(seqs, burst, strict=True):
            bat.rollback(s, len(block))  # back to the decode check's lengths
            ref.rollback(s, len(block))
    # decode: every row but one (prefilling, sits out), ragged K + 1: one call
    ids = [s for s in seqs if s != "s3"]
    calls = check(ids, [toks(1 + i % 3) for i in range(len(ids))], mode="last")
    assert calls == [(8, 3)]
    # a drafting step over three far rows: one call of 8 tokens rather than three
    assert check(["s0", "s4", "s7"], [toks(1), toks(1), toks(1)], mode="last") == [(8, 1)]
    for s in seqs:
        assert bat.length(s) == ref.length(s)


# ops that make a GPU stream wait for the host to read a result: a value read back
# (`item`, `tolist`), an output whose size depends on the data, and (below) indexing by
# a boolean mask, which counts the mask's true values first
_READS_BACK = frozenset({"aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense"})
_INDEXING = frozenset(
    {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
)


class _HostWaits:
    """Records, inside a TorchDispatchMode (`mode`), the ops that wait for the device."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name
                if name in _READS_BACK:
                    seen.append(name)
                elif name in _INDEXING and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in (args[1] if len(args) > 1 else None) or ()
                ):
                    seen.append(f"{name} by a mask")
                return func(*args, **(kwargs or {}))

        self.mode = Mode


def test_a_batched_forward_never_waits_for_the_device_inside_the_model(tiny_checkpoints):
    """The cache writes selected a step's real tokens with a boolean mask, twice a layer:
    on a GPU each waited for the device to count the mask's true values (the CUDA path has
    never run on a GPU here, so this is checked by the ops). The step's plan (which
    queries are real, their rows and slots) is now made on the host and the model call
    indexes with integers: no op in it reads the device back. Checked for a ragged decode
    step, a ragged prefill, and one row; logits as before (the other tests here)."""
    bat = BatchRunner(tiny_checkpoints["llama"], max_num_seqs=3)
    for s in "abc":
        bat.start(s, 64)
    waits = _HostWaits()
    real_forward = bat.model.forward

    def recorded(*args, **kwargs):
        with waits.mode():
            return real_forward(*args, **kwargs)

    bat.model.forward = recorded
    try:
        bat.forward(["a", "b", "c"], [[1, 2, 3, 4, 5], [6, 7], [8]], logits="none")
        bat.forward(["a", "b", "c"], [[9, 10, 11], [12], [13, 14]], logits="all")
        bat.forward(["a", "c"], [[15], [16, 17, 18, 19, 20]], logits="last")
        bat.forward(["b"], [[21, 22]], logits="last")
    finally:
        del bat.model.forward
    assert waits.seen == [], sorted(set(waits.seen))


def test_truncate_zeroes_what_the_row_wrote_past_the_length(tiny_checkpoints):
    """After a forward that failed part way (LocalDrafter puts its rows back so), the
    row's slots past the kept length are zeros, not whatever the failed call wrote (a
    NaN there would reach the row's attention), and the row goes on as a recompute."""
    bat = BatchRunner(tiny_checkpoints["llama"], max_num_seqs=2)
    bat.start("a", 64)
    bat.start("b", 64)
    bat.forward(["a", "b"], [[1, 2, 3, 4, 5, 6, 7], [8, 9]], logits="none")
    row = bat._row["a"]
    with torch.inference_mode():
        for layer in bat._cache.layers:  # what a failed call may leave
            layer.keys[row, :, 3:7] = float("nan")
    bat.truncate("a", 3)
    assert bat.length("a") == 3 and bat.length("b") == 2
    for layer in bat._cache.layers:
        assert not layer.keys[row, :, 3:].any() and not layer.values[row, :, 3:].any()
    (got,) = bat.forward(["a"], [[10, 11]], logits="all")
    _assert_close(got, _full_logits(bat.model, [1, 2, 3, 10, 11])[-2:], "after truncate")
    with pytest.raises(ValueError, match="length"):
        bat.truncate("a", 6)
