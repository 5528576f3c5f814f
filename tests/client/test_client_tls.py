"""Both Python clients and `cactus client` over TLS, against a real gRPC server on
127.0.0.1 with a self-signed certificate made here (README: a TLS-terminating proxy in
front of the public ports; the bearer token then never travels in clear)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2_grpc

from client import NO_RETRY, AsyncCactusClient, CactusClient
from client.cli import main
from protos.cactus.v1 import cactus_pb2_grpc as pb_grpc
from tests.client.test_client_retry import Flaky, FlakyHealth


def _self_signed() -> tuple[bytes, bytes]:
    """A key and a certificate for localhost and 127.0.0.1, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def tls_server():
    key, cert = _self_signed()
    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CactusServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(FlakyHealth(servicer), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    yield servicer, f"127.0.0.1:{port}", cert
    server.stop(grace=None)


def test_both_clients_call_a_tls_server_with_its_root_certificate(tls_server):
    _, address, cert = tls_server
    creds = grpc.ssl_channel_credentials(root_certificates=cert)
    client = CactusClient(address, credentials=creds, timeout=10, token="secret")
    assert client.generate("x").text == "ok"
    assert [c.text for c in client.stream("x")] == ["a", "b"]
    assert client.health() == "SERVING"
    client.close()

    aclient = AsyncCactusClient(address, credentials=creds, timeout=10)  # outside a loop

    async def run():
        reply = await aclient.generate("x")
        texts = [c.text async for c in aclient.stream("x")]
        await aclient.close()
        return reply.text, texts

    assert asyncio.run(run()) == ("ok", ["a", "b"])


def test_a_plain_text_client_cannot_call_a_tls_server(tls_server):
    """The channel really is TLS: the same server refuses a plain-text client."""
    _, address, _ = tls_server
    client = CactusClient(address, retry=NO_RETRY, timeout=3)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client.close()


def test_credentials_that_are_not_channel_credentials_are_a_value_error():
    for bad in ("tls", True, b"-----BEGIN CERTIFICATE-----"):
        for cls in (CactusClient, AsyncCactusClient):
            with pytest.raises(ValueError, match=r"^credentials: must be grpc\.ChannelCredentials"):
                cls("127.0.0.1:1", credentials=bad)


def test_the_client_command_over_tls(tls_server, tmp_path, capsys):
    """`--ca-cert PEM` checks the server against that root (exit 0, the text); `--tls`
    alone checks it against the system's roots, which do not hold this self-signed
    certificate (exit 1); an unreadable or non-PEM file is exit 2 naming the flag."""
    _, address, cert = tls_server
    pem = tmp_path / "ca.pem"
    pem.write_bytes(cert)
    base = ["client", "--address", address, "--prompt", "x", "--timeout", "3"]
    assert main([*base, "--ca-cert", str(pem)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    assert main([*base, "--ca-cert", str(pem), "--stream"]) == 0
    assert capsys.readouterr().out.strip() == "ab"
    assert main([*base, "--tls"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main([*base, "--ca-cert", str(tmp_path / "missing.pem")]) == 2
    assert "--ca-cert: cannot read" in capsys.readouterr().err
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    assert main([*base, "--ca-cert", str(junk)]) == 2
    assert "--ca-cert" in (err := capsys.readouterr().err) and "no PEM certificate" in err
