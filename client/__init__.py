"""gRPC client library for the Cactus server."""

from client.client import CactusClient

__all__ = ["CactusClient"]
