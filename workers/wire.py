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
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """A RowError's code back to a grpc.StatusCode (UNKNOWN if out of range)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def encode_block(block: DraftBlock, block_seq: int) -> pb.DraftBlock:
    probs = block.probs.detach().to("cpu", torch.float32).contiguous()  # [K, V]
    k, vocab = probs.shape
    msg = pb.DraftBlock(
        request_id=block.request_id,
        epoch=block.epoch,
        block_seq=block_seq,
        token_ids=list(block.token_ids),
        vocab_size=vocab,
    )
    nonzero = probs > 0
    if int(nonzero.sum()) <= SPARSE_MAX_FILL * k * vocab:
        rows, cols = nonzero.nonzero(as_tuple=True)
        msg.sparse.row_lengths.extend(nonzero.sum(-1).tolist())
        msg.sparse.ids_int32_le = cols.to(torch.int32).numpy().astype("<i4").tobytes()
        msg.sparse.probs_float32_le = probs[rows, cols].numpy().astype("<f4").tobytes()
    else:
        msg.dense.float32_le = probs.numpy().astype("<f4").tobytes()
    return msg


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
    probs = _decode_probs(msg, k, vocab)
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise StaleBlockError(f"{expect_request}: draft probabilities not finite/non-negative")
    return DraftBlock(msg.request_id, msg.epoch, tuple(ids), probs)


def _decode_probs(msg: pb.DraftBlock, k: int, vocab: int) -> torch.Tensor:
    which = msg.WhichOneof("probs")
    if which == "dense":
        data = np.frombuffer(msg.dense.float32_le, dtype="<f4")
        if data.size != k * vocab:
            raise StaleBlockError(f"{msg.request_id}: dense probs of {data.size} values")
        return torch.from_numpy(data.astype(np.float32).reshape(k, vocab))
    if which == "sparse":
        lengths = list(msg.sparse.row_lengths)
        ids = np.frombuffer(msg.sparse.ids_int32_le, dtype="<i4")
        vals = np.frombuffer(msg.sparse.probs_float32_le, dtype="<f4")
        if len(lengths) != k or sum(lengths) != ids.size or ids.size != vals.size:
            raise StaleBlockError(f"{msg.request_id}: sparse probs with inconsistent sizes")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise StaleBlockError(f"{msg.request_id}: sparse prob id outside [0, {vocab})")
        probs = torch.zeros(k, vocab, dtype=torch.float32)
        rows = torch.repeat_interleave(torch.arange(k), torch.tensor(lengths, dtype=torch.long))
        probs[rows, torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(
            vals.astype(np.float32)
        )
        return probs
    raise StaleBlockError(f"{msg.request_id}: block without probabilities")
