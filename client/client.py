"""Python client of the public gRPC API (cactus.v1)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from protos.cactus.v1 import cactus_pb2 as pb
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc


class CactusClient:
    """`CactusClient("127.0.0.1:9000").generate("def f(x):", max_tokens=32)`.

    Every call gets a deadline (`timeout`, seconds) unless given its own; `token` is sent
    as `authorization: Bearer <token>` metadata.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 60.0,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.CactusStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    @staticmethod
    def request(
        prompt: str | list[int],
        *,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] = (),
        stop_token_ids: list[int] = (),
        rule: str = "",
        delta: float | None = None,
        num_speculative_tokens: int = 0,
        max_divergence_nats: float | None = None,
        request_id: str = "",
        time_limit_s: float = 0.0,
    ) -> pb.GenerateRequest:
        msg = pb.GenerateRequest(request_id=request_id, time_limit_s=time_limit_s)
        if isinstance(prompt, str):
            msg.prompt = prompt
        else:
            msg.prompt_token_ids.ids.extend(prompt)
        s = msg.sampling
        s.max_tokens, s.top_k = max_tokens, top_k
        s.stop.extend(stop)
        s.stop_token_ids.extend(stop_token_ids)
        for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed)):
            if value is not None:
                setattr(s, name, value)
        sp = msg.speculation
        sp.rule, sp.num_speculative_tokens = rule, num_speculative_tokens
        if delta is not None:
            sp.delta = delta
        if max_divergence_nats is not None:
            sp.max_divergence_nats = max_divergence_nats
        return msg

    def generate(self, prompt, *, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        return self.stub.Generate(
            self.request(prompt, **kw), timeout=timeout or self.timeout, metadata=self.metadata
        )

    def stream(
        self, prompt, *, timeout: float | None = None, **kw
    ) -> Iterator[pb.GenerateResponse]:
        """Iterate response chunks; the call object is kept on `last_call` to cancel it."""
        call = self.stub.GenerateStream(
            self.request(prompt, **kw), timeout=timeout or self.timeout, metadata=self.metadata
        )
        self.last_call = call
        return call

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(
            pb.ModelInfoRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def health(self) -> str:
        reply = self.health_stub.Check(
            health_pb2.HealthCheckRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()
