"""Draft blocks on the wire: encoding draft probabilities dense or sparse, and checking
a received block before anything is applied.

Dense: [K, V] float32 little-endian bytes. Sparse (when top-k/top-p truncated the draft
distribution): per row, the ids and probabilities of its support. Sparse costs 8 bytes
per kept entry against 4 per vocabulary entry, so it is used when at most a third of
the entries are non-zero; the decoded tensor is identical either way.
"""

from __future__ import annotations

import grpc
import numpy as np
import torch

from cactus.errors import StaleBlockError
from protos.cactus.internal.v1 import speculation_pb2 as pb
from workers.interfaces import DraftBlock

SPARSE_MAX_FILL = 1 / 3
# gRPC's largest message (a signed 32-bit length): the internal channel's limit on both
# sides. The draft side keeps every reply under its own budget (at most this), failing
# only the rows that do not fit (workers/draft_service.py), so no batch fails whole.
MAX_MESSAGE_BYTES = (1 << 31) - 1
# Every call to the draft service carries its engine group's key under this metadata
# name (workers/draft_service.py start_server's `key`): the service listens on the
# node's address, so any host of the cluster network could otherwise open, close or
# draft from the sessions of other requests.
KEY_METADATA = "x-cactus-draft-key"
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """A RowError's code back to a grpc.StatusCode (UNKNOWN if out of range)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def encode_block(block: DraftBlock, block_seq: int) -> pb.DraftBlock:
    msg = pb.DraftBlock(block_seq=block_seq)
    fill_block(msg, block)
    return msg


def fill_block(msg: pb.DraftBlock, block: DraftBlock) -> None:
    """Write `block` into `msg` (a field of the reply, so nothing is copied twice).
    numpy rather than torch ops: a dozen small ops per row cost ~5x less there."""
    probs = block.probs.detach().to("cpu", torch.float32).numpy()  # [K, V]
    k, vocab = probs.shape
    msg.request_id = block.request_id
    msg.epoch = block.epoch
    msg.token_ids.extend(block.token_ids)
    msg.vocab_size = vocab
    # != 0, not > 0: NaN and negative values travel, so the receiver refuses the block
    flat = np.flatnonzero(probs != 0)  # (np.nonzero on the 2-D mask is 10x slower)
    if flat.size <= SPARSE_MAX_FILL * k * vocab:
        rows, cols = np.divmod(flat, vocab)
        msg.sparse.row_lengths.extend(np.bincount(rows, minlength=k).tolist())
        msg.sparse.ids_int32_le = cols.astype("<i4").tobytes()
        msg.sparse.probs_float32_le = probs.reshape(-1)[flat].astype("<f4").tobytes()
    else:
        msg.dense.float32_le = probs.astype("<f4", copy=False).tobytes()


def decode_block(
    msg: pb.DraftBlock, *, expect_request: str, expect_epoch: int, last_seq: int, k: int, vocab: int
) -> DraftBlock:
    """Check a received block against what the verifier expects; raise StaleBlockError
    (the block is dropped, nothing applied) if it is stale, a repeat or malformed."""
    if msg.request_id != expect_request:
        raise StaleBlockError(f"block for {msg.request_id!r}, expected {expect_request!r}")
    if msg.epoch != expect_epoch:
        raise StaleBlockError(
            f"{expect_request}: block epoch {msg.epoch}, committed {expect_epoch}"
        )
    if msg.block_seq <= last_seq:
        raise StaleBlockError(f"{expect_request}: block {msg.block_seq} already applied")
    ids = list(msg.token_ids)
    if len(ids) != k or msg.vocab_size != vocab:
        raise StaleBlockError(
            f"{expect_request}: block shape [{len(ids)}, {msg.vocab_size}], expected [{k}, {vocab}]"
        )
    if any(not 0 <= t < vocab for t in ids):
        raise StaleBlockError(f"{expect_request}: drafted token id outside [0, {vocab})")
    return DraftBlock(msg.request_id, msg.epoch, tuple(ids), _decode_probs(msg, k, vocab))


def _decode_probs(msg: pb.DraftBlock, k: int, vocab: int) -> torch.Tensor:
    """The [K, V] probabilities; only the values on the wire are checked (finite and
    non-negative), the zeros a sparse block leaves out need no check."""
    which = msg.WhichOneof("probs")
    if which == "dense":
        vals = _array(msg, msg.dense.float32_le, "<f4", "dense probs")
        if vals.size != k * vocab:
            raise StaleBlockError(f"{msg.request_id}: dense probs of {vals.size} values")
        _check_values(msg.request_id, vals)
        return torch.from_numpy(vals.astype(np.float32).reshape(k, vocab))
    if which == "sparse":
        lengths = np.asarray(msg.sparse.row_lengths, dtype=np.int64)
        ids = _array(msg, msg.sparse.ids_int32_le, "<i4", "sparse ids")
        vals = _array(msg, msg.sparse.probs_float32_le, "<f4", "sparse probs")
        if lengths.size != k or int(lengths.sum()) != ids.size or ids.size != vals.size:
            raise StaleBlockError(f"{msg.request_id}: sparse probs with inconsistent sizes")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise StaleBlockError(f"{msg.request_id}: sparse prob id outside [0, {vocab})")
        _check_values(msg.request_id, vals)
        probs = np.zeros((k, vocab), dtype=np.float32)
        probs[np.repeat(np.arange(k), lengths), ids] = vals
        return torch.from_numpy(probs)
    raise StaleBlockError(f"{msg.request_id}: block without probabilities")


def _array(msg: pb.DraftBlock, data: bytes, dtype: str, what: str) -> np.ndarray:
    """The bytes as an array; a length that is no whole number of items is malformed."""
    if len(data) % np.dtype(dtype).itemsize:
        raise StaleBlockError(f"{msg.request_id}: {what} of {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype)


def _check_values(request_id: str, vals: np.ndarray) -> None:
    if not np.isfinite(vals).all() or (vals < 0).any():
        raise StaleBlockError(f"{request_id}: draft probabilities not finite/non-negative")
