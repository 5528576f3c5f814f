"""Batched causal-LM runner: one KV buffer for many sequences, per-row lengths, cheap rollback.

Loads any local Hugging Face causal-LM folder (Llama, Qwen2, Qwen3, Mistral, ...) through the
Auto classes; nothing here branches on the model type. Each live sequence owns a row of a dense
per-layer buffer [rows, kv_heads, T, head_dim]; its length is plain bookkeeping, so a rejected
draft (rollback) costs nothing, as in vLLM / SGLang. One model call runs over a contiguous
range of rows with ragged per-row token counts; rows in the range that have no tokens sit out
(they are still computed). `forward` makes one such call for its rows, or several when its rows
lie far apart (a prefill of the first and the last row), so that idle rows between them cost
little, and for a prompt chunk longer than any decode block, so that short chunks beside it
are not padded to it: see `_groups`.

Why not transformers' own caches: `DynamicCache.crop` removes the same count from every row of
a batch (speculative decoding accepts a different count per row), and `StaticCache` keeps one
position counter for all rows. So `_RowCache` subclasses `transformers.Cache` (5.24 API): the
model calls `cache.update(k, v, layer_idx)` per layer; we scatter row i's new keys/values at
slots [len_i, len_i + n_i) and hand back views [rows, :, :kv_len]. Positions and an explicit
4-D additive mask [B, 1, Q, kv_len] (query t of row i sees slots [0, len_i + t], within the
sliding window for sliding layers) are passed in; `create_causal_mask` returns a 4-D mask
unchanged, and models with several layer types take a {layer_type: mask} dict.

Memory plan: at most `max_num_seqs` rows and `rows_allocated * t_capacity <= kv_budget_tokens`.
Rows in use are the dense prefix [0, n): releasing a row moves the last row's KV into the hole.

Slots past a row's length are masked, but the mask is additive: a NaN or inf key there still
makes the row's attention NaN (NaN + min is NaN; a zero weight times a NaN value is NaN). So a
row's slots past its length only ever hold what its own sequence wrote (rollback) or zeros:
`release` zeroes the slots the freed sequence wrote (`_high`), and the vacated last row, so a
sequence that overflowed cannot poison the next one given its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs
from transformers.utils import logging as hf_logging

from cactus import environment
from cactus.params import MAX_DRAFT_TOKENS
from workers.model_runner import LoadedModel

environment.apply()  # also in Ray workers: offline Hugging Face
hf_logging.disable_progress_bar()

SLOT_ROUND = 64  # T capacity is a multiple of this (unless the budget caps it)
# Idle tokens (rows that sit out, padding) one model call may compute to spare a second call:
# on a GPU a small forward costs about one read of the weights whatever its token count.
MERGE_SLACK_TOKENS = 64
# A chunk longer than any decode block (K + 1 <= MAX_DRAFT_TOKENS + 1) is a prompt's: a
# burst admitted together holds adjacent rows, and short chunks beside a long one in one
# call would each be padded to it ([9, 440] for 512 tokens of budget), so a long chunk
# starts a piece of its own, joined to its neighbours only where the merge rule allows.
LONG_CHUNK_TOKENS = MAX_DRAFT_TOKENS + 2
LOGIT_MODES = ("all", "last", "none")


class CapacityError(RuntimeError):
    """No free row, or the KV budget cannot hold one more sequence."""


@dataclass
class _Step:
    """Where one forward reads and writes: buffer rows [r0, r1), B = r1 - r0."""

    r0: int
    r1: int
    rows: torch.Tensor  # [N] long: buffer row of each real new token
    slots: torch.Tensor  # [N] long: its slot (= its position)
    b: torch.Tensor  # [N] long: its row in the forward's batch (rows - r0)
    q: torch.Tensor  # [N] long: its query index in that row
    valid: torch.Tensor  # [B, Q] bool, on the host: query t of row b is a real token
    kv_len: int  # slots [0, kv_len) are visible to this forward
    run: tuple[int, int] | None = None  # B == 1: (first slot, count), written as a slice


class _RowLayer(CacheLayerMixin):
    """One layer's dense KV buffer [rows_allocated, kv_heads, t_capacity, head_dim]."""

    is_sliding = False  # windows are applied by the mask; the buffer keeps every slot

    def __init__(self, owner: _RowCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Heads, head_dim, dtype and device come from the tensors (AutoTP ranks see fewer heads).
        rows, slots = self._owner.rows_allocated, self._owner.t_capacity
        _, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(rows, h, slots, d)
        self.values = value_states.new_zeros(rows, h, slots, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key/value_states [B, H, Q, D] for rows [r0, r1); returns views [B, H, kv_len, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self._owner.step
        if step.run is not None:  # one row: a plain slice copy (the single-stream path)
            start, n = step.run
            self.keys[step.r0, :, start : start + n] = key_states[0, :, :n]
            self.values[step.r0, :, start : start + n] = value_states[0, :, :n]
        else:  # only real tokens: [B, H, Q, D] at (b, :, q) -> [N, H, D] at (row, :, slot)
            # (integer indices made on the host: a boolean mask here made a GPU wait for
            # its count of true values, twice a layer)
            self.keys[step.rows, :, step.slots] = key_states[step.b, :, step.q]
            self.values[step.rows, :, step.slots] = value_states[step.b, :, step.q]
        rows = slice(step.r0, step.r1)
        return self.keys[rows, :, : step.kv_len], self.values[rows, :, : step.kv_len]

    def resize(self, rows: int, slots: int, live: int) -> None:
        """Reallocate to [rows, H, slots, D], copying the first `live` rows (zeros elsewhere)."""
        if not self.is_initialized:
            return
        keep = min(slots, self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(rows, old.shape[1], slots, old.shape[3])
            new[:live, :, :keep] = old[:live, :, :keep]
            setattr(self, name, new)

    def move_row(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def clear(self, row: int, start: int, end: int) -> None:
        """Zero slots [start, end) of one row."""
        if self.is_initialized and start < end:
            self.keys[row, :, start:end].zero_()
            self.values[row, :, start:end].zero_()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        step = self._owner.step
        return (step.kv_len if step else query_length), 0

    def get_seq_length(self) -> int:
        return self._owner.longest

    def get_max_length(self) -> int:
        return self._owner.t_capacity


class _RowCache(Cache):
    """A `transformers.Cache` of `_RowLayer`s sharing one row plan and one current step."""

    def __init__(self, num_layers: int) -> None:
        self.rows_allocated = 0
        self.t_capacity = 0
        self.longest = 0  # longest live row (for get_seq_length)
        self.step: _Step | None = None
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])

    def resize(self, rows: int, slots: int, live: int) -> None:
        for layer in self.layers:
            layer.resize(rows, slots, live)
        self.rows_allocated, self.t_capacity = rows, slots

    def move_row(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.move_row(src, dst, length)

    def clear(self, row: int, start: int, end: int) -> None:
        for layer in self.layers:
            layer.clear(row, start, end)


def _round_up(n: int) -> int:
    return -(-n // SLOT_ROUND) * SLOT_ROUND


class BatchRunner(LoadedModel):
    """A model, its tokenizer and a row of a shared KV buffer per sequence id."""

    def __init__(
        self,
        path: str,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        model=None,
        max_num_seqs: int = 32,
        kv_budget_tokens: int | None = None,
    ) -> None:
        super().__init__(path, dtype=dtype, device=device, model=model)
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.max_num_seqs = int(max_num_seqs)
        if kv_budget_tokens is None:
            kv_budget_tokens = self.max_num_seqs * self.max_context
        self.kv_budget_tokens = int(kv_budget_tokens)
        types, kwargs = get_layer_types_and_kwargs(self.model.config)
        unsupported = set(types) - {"full_attention", "sliding_attention"}
        if unsupported:
            raise ValueError(f"unsupported attention layer types: {sorted(unsupported)}")
        # layer_type -> sliding window (None: full causal)
        self._windows = {t: kw.get("sliding_window") for t, kw in zip(types, kwargs, strict=True)}
        self._cache = _RowCache(len(types))
        self._row: dict[str, int] = {}  # seq id -> buffer row; rows in use are [0, n)
        self._ids: list[str] = []  # per row
        self._lens: list[int] = []  # per row: tokens in the cache
        self._reserves: list[int] = []  # per row: most tokens it may hold
        # per row: slots [0, high) may hold data (written, maybe rolled back); zeros beyond
        self._high: list[int] = []

    @property
    def num_sequences(self) -> int:
        return len(self._ids)

    @property
    def rows_allocated(self) -> int:
        return self._cache.rows_allocated

    @property
    def t_capacity(self) -> int:
        return self._cache.t_capacity

    @property
    def kv_slots(self) -> int:
        """Token slots per layer in the buffer (never above kv_budget_tokens)."""
        return self._cache.rows_allocated * self._cache.t_capacity

    def length(self, seq_id: str) -> int:
        return self._lens[self._row[seq_id]]

    # ---- memory plan -------------------------------------------------------------------
    def _check_reserve(self, reserve_tokens: int | None) -> int:
        reserve = self.max_context if reserve_tokens is None else int(reserve_tokens)
        if not 1 <= reserve <= self.max_context + SLOT_ROUND:
            raise ValueError(
                f"reserve_tokens={reserve} outside [1, {self.max_context + SLOT_ROUND}]"
            )
        return reserve

    def _plan(self, rows_needed: int, max_reserve: int) -> tuple[int, int] | None:
        """(rows, T) holding `rows_needed` rows of `max_reserve` tokens, or None if impossible."""
        budget = self.kv_budget_tokens
        if rows_needed > self.max_num_seqs or rows_needed * max_reserve > budget:
            return None
        rows = self._cache.rows_allocated
        if rows < rows_needed:  # grow lazily, doubling
            rows = min(self.max_num_seqs, max(rows_needed, 2 * rows))
        rows = max(rows_needed, min(rows, budget // max_reserve))
        return rows, min(_round_up(max_reserve), budget // rows)

    def _plan_with(self, reserve: int, replacing: str | None = None):
        others = [r for i, r in zip(self._ids, self._reserves, strict=True) if i != replacing]
        return self._plan(len(others) + 1, max([reserve, *others]))

    def fits(self, reserve_tokens: int) -> bool:
        """Would `start(new_id, reserve_tokens)` succeed now (ValueError as start() for a bad
        reserve)."""
        return self._plan_with(self._check_reserve(reserve_tokens)) is not None

    def check_start(self, seq_id: str, reserve_tokens: int | None = None):
        """What start(seq_id, reserve_tokens) would refuse, refused (ValueError for a bad
        reserve, CapacityError when it does not fit), changing nothing; else its
        (reserve, plan). Rank 0 of a TP group asks it before the followers are told."""
        reserve = self._check_reserve(reserve_tokens)
        plan = self._plan_with(reserve, replacing=seq_id)
        if plan is None:
            raise CapacityError(
                f"cannot admit {seq_id!r} ({reserve} tokens): {self.num_sequences} rows of "
                f"{self.max_num_seqs} in use, KV budget {self.kv_budget_tokens} tokens"
            )
        return reserve, plan

    @torch.inference_mode()
    def start(self, seq_id: str, reserve_tokens: int | None = None) -> None:
        """Give a sequence an empty row able to hold `reserve_tokens` (None: max_context)."""
        reserve, plan = self.check_start(seq_id, reserve_tokens)
        self.release(seq_id)
        cache = self._cache
        if plan[0] > cache.rows_allocated or reserve > cache.t_capacity:
            cache.resize(*plan, live=self.num_sequences)
        self._row[seq_id] = len(self._ids)
        self._ids.append(seq_id)
        self._lens.append(0)
        self._reserves.append(reserve)
        self._high.append(0)

    @torch.inference_mode()
    def release(self, seq_id: str) -> bool:
        """Free a sequence's row (the last row moves into it); True if it existed. The
        slots the freed sequence wrote are zeroed (the module's docstring says why), at a
        cost proportional to them, not to the buffer."""
        row = self._row.pop(seq_id, None)
        if row is None:
            return False
        cache, last = self._cache, len(self._ids) - 1
        if row != last:
            moved = self._lens[last]
            cache.move_row(last, row, moved)
            cache.clear(row, moved, self._high[row])  # the freed sequence's tail
            for field in (self._ids, self._lens, self._reserves):
                field[row] = field[last]
            self._high[row] = moved
            self._row[self._ids[row]] = row
        cache.clear(last, 0, self._high[last])  # the vacated row
        for field in (self._ids, self._lens, self._reserves, self._high):
            field.pop()
        self._cache.longest = max(self._lens, default=0)
        return True

    @torch.inference_mode()
    def truncate(self, seq_id: str, length: int) -> None:
        """Roll the sequence back to `length` tokens and zero every slot past it that it
        wrote: after a forward that failed part way (a device error), whose writes there
        may be anything, NaN included (the module's docstring says why that matters)."""
        row = self._row[seq_id]
        if not 0 <= length <= self._lens[row]:
            raise ValueError(f"length: cannot truncate {self._lens[row]} tokens to {length}")
        self._lens[row] = length
        self._cache.clear(row, length, self._high[row])
        self._high[row] = length
        self._cache.longest = max(self._lens)

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (bookkeeping only; their slots get overwritten)."""
        row = self._row[seq_id]
        if num_tokens <= 0:
            return
        if num_tokens > self._lens[row]:
            raise ValueError(f"num_tokens: cannot roll back {num_tokens} of {self._lens[row]}")
        self._lens[row] -= num_tokens

    # ---- forward -----------------------------------------------------------------------
    def _rows_for(self, seq_ids, token_ids, logits: str) -> list[int]:
        if logits not in LOGIT_MODES:
            raise ValueError(f"logits must be one of {LOGIT_MODES}, not {logits!r}")
        if len(seq_ids) != len(token_ids):
            raise ValueError("seq_ids and token_ids differ in length")
        rows = [self._row[s] for s in seq_ids]  # KeyError for unknown ids
        if len(set(rows)) != len(rows):
            raise ValueError("a sequence id appears twice in one forward")
        for seq_id, row, toks in zip(seq_ids, rows, token_ids, strict=True):
            if self._lens[row] + len(toks) > self._reserves[row]:
                raise ValueError(
                    f"sequence {seq_id!r}: {self._lens[row]} + {len(toks)} tokens exceed its "
                    f"reserve of {self._reserves[row]}"
                )
        return rows

    def _step(self, rows: list[int], token_ids) -> tuple[_Step, torch.Tensor, torch.Tensor]:
        """The step plan, input ids [B, Q] and positions [B, Q] for rows [r0, r1)."""
        r0, r1 = min(rows), max(rows) + 1
        counts = [0] * (r1 - r0)
        padded = [[]] * (r1 - r0)
        for row, toks in zip(rows, token_ids, strict=True):
            counts[row - r0], padded[row - r0] = len(toks), list(toks)
        width = max(counts)
        # The plan is made on the host and goes to the device in one copy: the step's
        # data-dependent sizes (which queries are real) are known here, so neither the
        # cache writes nor the logits' selection wait for the device to count them.
        ids = torch.tensor([p + [0] * (width - len(p)) for p in padded])  # [B, Q]
        n = torch.tensor(counts)  # [B]
        lens = torch.tensor(self._lens[r0:r1])  # [B]
        kv_len = max(self._lens[r] + len(t) for r, t in zip(rows, token_ids, strict=True) if t)
        t = torch.arange(width)  # [Q]
        # Padding queries and idle rows get a clamped position so nothing exceeds kv_len.
        pos = (lens[:, None] + t).clamp(max=kv_len - 1)  # [B, Q]
        valid = t[None, :] < n[:, None]  # [B, Q]
        b, q = valid.nonzero(as_tuple=True)  # [N] each
        parts = (ids.flatten(), pos.flatten(), b + r0, pos[b, q], b, q)
        on_device = torch.cat(parts).to(self.device).split([len(x) for x in parts])
        ids, pos = on_device[0].view(ids.shape), on_device[1].view(pos.shape)
        run = (self._lens[r0], counts[0]) if r1 - r0 == 1 else None
        step = _Step(r0, r1, *on_device[2:], valid, kv_len, run)
        return step, ids, pos

    def _attention_mask(self, pos: torch.Tensor, kv_len: int):
        """Additive mask [B, 1, Q, kv_len] (or {layer_type: mask}): slot s visible to query
        at position p iff s <= p (and s > p - window on sliding layers). None when one query
        of one row sees every slot (a decode step of a single stream): the model's own
        causal mask then lets SDPA skip masking."""
        if pos.shape == (1, 1) and all(w is None for w in self._windows.values()):
            return None
        slots = torch.arange(kv_len, device=pos.device)  # [kv]
        p = pos[:, :, None]  # [B, Q, 1]
        dtype = self.model.dtype
        masks = {}
        for layer_type, window in self._windows.items():
            allowed = slots <= p if window is None else (slots <= p) & (slots > p - window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
            masks[layer_type] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        return next(iter(masks.values())) if len(masks) == 1 else masks

    @staticmethod
    def _keep(step: _Step, logits: str) -> torch.Tensor:
        """Bool [B, Q], on the host: positions that go through the LM head."""
        if logits == "all":
            return step.valid
        keep = torch.zeros_like(step.valid)
        if logits == "last":
            n = step.valid.sum(1)  # [B]
            has = n > 0
            keep[has, n[has] - 1] = True
        return keep

    @staticmethod
    def _groups(rows: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        """Indices of the rows with tokens, grouped into model calls over row ranges.

        One call computes every row of its range [r0, r1), [r1 - r0, widest] tokens, and
        rows drift apart (a release moves the last row into a hole, admissions append), so
        a prefill of rows 0 and 7 in one call would also compute rows 1-6. Pieces are runs
        of adjacent rows with tokens, with each prompt chunk longer than any decode block
        (LONG_CHUNK_TOKENS) a piece of its own (short chunks beside it would be padded to
        it); a piece joins the call before it while that call computes at most twice the
        tokens its pieces would alone, or at most MERGE_SLACK_TOKENS more (one call per
        decode or drafting step when its rows lie together; decode rows far apart among
        prefilling rows, say rows 0, 10, 20 and 30 at K + 1 = 9, take one each)."""
        active = sorted((row, len(token_ids[i]), i) for i, row in enumerate(rows) if token_ids[i])

        def dense(members) -> int:  # tokens a call over these rows' range computes
            return (members[-1][0] - members[0][0] + 1) * max(n for _, n, _ in members)

        runs: list[list[tuple[int, int, int]]] = []  # (row, tokens, index)
        for item in active:
            adjacent = runs and runs[-1][-1][0] == item[0] - 1
            long = item[1] >= LONG_CHUNK_TOKENS
            if adjacent and not long and runs[-1][-1][1] < LONG_CHUNK_TOKENS:
                runs[-1].append(item)
            else:
                runs.append([item])

        groups: list[tuple[list, int]] = []  # (members, tokens its runs compute alone)
        for run in runs:
            alone = dense(run)
            if groups:
                members, parts = groups[-1]
                merged = dense(members + run)
                if merged <= 2 * (parts + alone) or merged - parts - alone <= MERGE_SLACK_TOKENS:
                    groups[-1] = (members + run, parts + alone)
                    continue
            groups.append((run, alone))
        return [[i for _, _, i in members] for members, _ in groups]

    @torch.inference_mode()
    def forward(self, seq_ids, token_ids, *, logits: str = "all") -> list[torch.Tensor]:
        """Row i appends token_ids[i] (empty: it sits out), in one model call or, for rows
        far apart, a few (`_groups`). Returns float32 logits per row: "all" [n_i, V], "last"
        [1, V] ([0, V] if n_i == 0), "none" [0, V]."""
        token_ids = [list(t) for t in token_ids]
        rows = self._rows_for(list(seq_ids), token_ids, logits)
        result: list[torch.Tensor | None] = [None] * len(rows)
        for group in self._groups(rows, token_ids):
            toks = [token_ids[i] for i in group]
            got = self._forward_rows([rows[i] for i in group], toks, logits)
            for i, row_logits in zip(group, got, strict=True):
                result[i] = row_logits
        return [
            torch.empty(0, self.vocab_size, device=self.device) if x is None else x for x in result
        ]

    def _forward_rows(self, rows: list[int], token_ids: list[list[int]], logits: str):
        """ONE model call over rows [min(rows), max(rows)]; every row given has tokens."""
        step, ids, pos = self._step(rows, token_ids)
        for row, toks in zip(rows, token_ids, strict=True):  # before: a failed call wrote some
            self._high[row] = max(self._high[row], self._lens[row] + len(toks))
        keep = self._keep(step, logits)  # [B, Q]
        # The LM head sees only the positions some row needs: a 1-D index keeps the
        # hidden states 3-D [B, C, H], which DeepSpeed's sharded LM head requires.
        cols = keep.any(0).nonzero().flatten()  # [C], on the host
        self._cache.step = step
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self._attention_mask(pos, step.kv_len),
                position_ids=pos,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=cols.to(self.device) if len(cols) else 1,
            )
        finally:
            self._cache.step = None
        for row, toks in zip(rows, token_ids, strict=True):
            self._lens[row] += len(toks)
        self._cache.longest = max(self._lens)
        return self._row_logits(out.logits, rows, step, cols.tolist(), logits)

    def _row_logits(self, out, rows, step: _Step, cols: list[int], logits: str):
        """Per-row logits as views of the model's output (no copy for float32): a row's
        real tokens are the first n_i positions, so "all" is out[b, :n_i] (cols is then
        0..Q-1) and "last" is the column holding position n_i - 1."""
        counts = step.valid.sum(1).tolist()  # [B]
        where = {c: j for j, c in enumerate(cols)}
        result = []
        for row in rows:
            b, n = row - step.r0, counts[row - step.r0]
            if logits == "all":
                result.append(out[b, :n].float())
            elif logits == "last" and n:
                j = where[n - 1]
                result.append(out[b, j : j + 1].float())
            else:
                result.append(out.new_empty(0, out.shape[-1], dtype=torch.float32))
        return result
