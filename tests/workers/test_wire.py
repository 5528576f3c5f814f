"""Draft blocks on the wire: dense and sparse encodings decode to the identical tensor,
and a malformed block is refused before anything is applied."""

import numpy as np
import pytest
import torch

from cactus.errors import StaleBlockError
from protos.cactus.internal.v1 import speculation_pb2 as pb
from workers.interfaces import DraftBlock
from workers.wire import decode_block, encode_block

K, V = 3, 50


def _decode(msg, **over):
    args = dict(expect_request="r", expect_epoch=7, last_seq=0, k=K, vocab=V) | over
    return decode_block(msg, **args)


def _block(probs):
    return DraftBlock("r", 7, (1, 2, 3), probs)


def test_truncated_distribution_goes_sparse_and_round_trips_exactly():
    gen = torch.Generator().manual_seed(0)
    probs = torch.zeros(K, V)
    for row, support in enumerate((5, 1, 12)):  # ragged supports, one a single token
        ids = torch.randperm(V, generator=gen)[:support]
        probs[row, ids] = torch.softmax(torch.randn(support, generator=gen), -1)
    msg = encode_block(_block(probs), block_seq=4)
    assert msg.WhichOneof("probs") == "sparse"
    assert list(msg.sparse.row_lengths) == [5, 1, 12]
    out = _decode(msg)
    assert torch.equal(out.probs, probs)
    assert out.token_ids == (1, 2, 3) and out.epoch == 7 and msg.block_seq == 4


def test_full_support_goes_dense_and_round_trips_exactly():
    probs = torch.softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(1)), -1)
    msg = encode_block(_block(probs), block_seq=1)
    assert msg.WhichOneof("probs") == "dense"
    assert len(msg.dense.float32_le) == 4 * K * V
    assert torch.equal(_decode(msg).probs, probs)


def test_the_sparse_threshold_is_a_third_of_the_entries():
    probs = torch.zeros(K, V)
    probs[:, : V // 3] = 1.0  # 48 of 150 entries: sparse
    assert encode_block(_block(probs), 1).WhichOneof("probs") == "sparse"
    probs[:, : V // 3 + 1] = 1.0  # 51 of 150: dense
    assert encode_block(_block(probs), 1).WhichOneof("probs") == "dense"


def _sparse(ids, vals, lengths):
    msg = pb.DraftBlock(request_id="r", epoch=7, block_seq=1, token_ids=[1, 2, 3], vocab_size=V)
    msg.sparse.row_lengths.extend(lengths)
    msg.sparse.ids_int32_le = np.asarray(ids, "<i4").tobytes()
    msg.sparse.probs_float32_le = np.asarray(vals, "<f4").tobytes()
    return msg


@pytest.mark.parametrize(
    "ids, vals, lengths, why",
    [
        ([0, 1, 2], [0.5, 0.5, 1.0], [1, 1], "inconsistent"),  # two rows for K = 3
        ([0, 1, 2], [0.5, 0.5], [1, 1, 1], "inconsistent"),
        ([0, V, 2], [1.0, 1.0, 1.0], [1, 1, 1], "outside"),
        ([0, -1, 2], [1.0, 1.0, 1.0], [1, 1, 1], "outside"),
        ([0, 1, 2], [1.0, float("nan"), 1.0], [1, 1, 1], "finite"),
        ([0, 1, 2], [1.0, -0.1, 1.0], [1, 1, 1], "non-negative"),
        ([0, 1, 2], [1.0, float("inf"), 1.0], [1, 1, 1], "finite"),
    ],
)
def test_malformed_sparse_blocks_are_refused(ids, vals, lengths, why):
    with pytest.raises(StaleBlockError, match=why):
        _decode(_sparse(ids, vals, lengths))


def test_malformed_dense_blocks_are_refused():
    msg = pb.DraftBlock(request_id="r", epoch=7, block_seq=1, token_ids=[1, 2, 3], vocab_size=V)
    msg.dense.float32_le = np.ones(K * V - 1, "<f4").tobytes()
    with pytest.raises(StaleBlockError, match="dense probs"):
        _decode(msg)
    bad = np.ones(K * V, "<f4")
    bad[7] = np.nan
    msg.dense.float32_le = bad.tobytes()
    with pytest.raises(StaleBlockError, match="finite"):
        _decode(msg)


@pytest.mark.parametrize("field", ["dense", "sparse ids", "sparse probs"])
def test_a_buffer_of_no_whole_number_of_values_is_refused_not_raised(field):
    """np.frombuffer raises ValueError on such a buffer: the engine, catching only
    StaleBlockError per row, would have ended every running request."""
    if field == "dense":
        msg = pb.DraftBlock(request_id="r", epoch=7, block_seq=1, token_ids=[1, 2, 3], vocab_size=V)
        msg.dense.float32_le = np.ones(K * V, "<f4").tobytes()[:-1]
    else:
        msg = _sparse([0, 1, 2], [1.0, 1.0, 1.0], [1, 1, 1])
        if field == "sparse ids":
            msg.sparse.ids_int32_le = msg.sparse.ids_int32_le[:-2]
        else:
            msg.sparse.probs_float32_le = msg.sparse.probs_float32_le + b"\0"
    with pytest.raises(StaleBlockError, match=f"{field}.* bytes"):
        _decode(msg)


@pytest.mark.parametrize("bad", [float("nan"), -0.5])
def test_nan_or_negative_draft_probabilities_travel_and_are_refused(bad):
    """The sparse encoder kept only the entries > 0: NaN and negative values vanished
    and the block decoded as a clean (all-zero) one."""
    assert encode_block(_block(torch.full((K, V), bad)), 1).WhichOneof("probs") == "dense"
    with pytest.raises(StaleBlockError, match="finite/non-negative"):
        _decode(encode_block(_block(torch.full((K, V), bad)), 1))
    probs = torch.zeros(K, V)
    probs[:, 0] = 1.0
    probs[1, 5] = bad  # a few entries: sparse, the bad one with them
    msg = encode_block(_block(probs), 1)
    assert msg.WhichOneof("probs") == "sparse" and list(msg.sparse.row_lengths) == [1, 2, 1]
    with pytest.raises(StaleBlockError, match="finite/non-negative"):
        _decode(msg)


def test_wrong_request_epoch_sequence_or_shape_is_refused():
    msg = encode_block(_block(torch.full((K, V), 1.0 / V)), block_seq=3)
    with pytest.raises(StaleBlockError, match="expected"):
        _decode(msg, expect_request="other")
    with pytest.raises(StaleBlockError, match="epoch"):
        _decode(msg, expect_epoch=8)
    with pytest.raises(StaleBlockError, match="already applied"):
        _decode(msg, last_seq=3)
    with pytest.raises(StaleBlockError, match="shape"):
        _decode(msg, k=4)
    msg.token_ids[1] = V
    with pytest.raises(StaleBlockError, match="outside"):
        _decode(msg)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_draft_server_binds_and_is_reached_on_ipv4_and_ipv6_hosts(host):
    """The draft actor serves on its node's Ray address, which may be IPv6: gRPC wants
    it in brackets, for the bind and for the address rank 0 dials."""
    import asyncio

    import grpc

    from protos.cactus.internal.v1 import speculation_pb2_grpc as pb_grpc
    from workers.draft_service import host_port, start_server

    async def run():
        server, port = await start_server(pb_grpc.SpeculationServicer(), host=host, port=0)
        try:
            assert port > 0
            async with grpc.aio.insecure_channel(host_port(host, port)) as channel:
                await asyncio.wait_for(channel.channel_ready(), 10)
        finally:
            await server.stop(None)

    asyncio.run(run())
    assert host_port("::1", 5) == "[::1]:5" and host_port("10.0.0.2", 5) == "10.0.0.2:5"
