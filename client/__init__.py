"""gRPC client library for the Cactus server: blocking and asyncio, with retries
before the first response."""

from client.client import NO_RETRY, AsyncCactusClient, CactusClient, RetryPolicy

__all__ = ["NO_RETRY", "AsyncCactusClient", "CactusClient", "RetryPolicy"]
