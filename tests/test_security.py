"""Security: mutual TLS between the gateway and the model services, TLS and a bearer token on the public API,
and one bearer token for the whole stack (the model services check the token the gateway sends them).

Certificates are made here with `cryptography` (a throwaway CA, server and client certificates), so
nothing is checked in and nothing expires under the tests. One cluster runs everything hardened:
draft and verify require a client certificate from the internal CA, the gateway presents one, the
public port speaks TLS with a certificate for a name that is not the address (checked through
--tls-server-name), and the public API requires a bearer token. Another runs plaintext with the token
on all three services, as `specd up --auth-token-file` does.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_common.security import (
    BearerTokenInterceptor,
    ClientTLS,
    SecurityConfigError,
    ServerTLS,
    bearer_metadata,
    load_token,
    open_channel,
)
from gateway.app import http_server
from tests.conftest import Cluster, start_cluster
from tests.specd_stack import specd_up

TOKEN = "s3cret-token-for-tests"
GATEWAY_NAME = "specd-gateway.example"  # the public certificate's only name: clients dial 127.0.0.1 with an override
REPO = Path(__file__).resolve().parents[1]


# --- certificates --------------------------------------------------------------------------------


@dataclass
class Issuer:
    """A CA: its key and self-signed certificate, and the PEM file clients and servers trust."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    pem: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_ca(directory: Path, name: str) -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issuer(key, cert, _write(directory / f"{name}-ca.pem", cert.public_bytes(serialization.Encoding.PEM)))


def issue(issuer: Issuer, directory: Path, name: str, sans: list, client: bool = False) -> tuple[str, str]:
    """A leaf certificate for server (or client) authentication; returns (cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer.key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    cert_path = _write(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    key_path = _write(directory / f"{name}.key", key_pem)
    return str(cert_path), str(key_path)


LOOPBACK_SANS = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


@dataclass
class PKI:
    """Everything the hardened cluster and its clients need, as files."""

    internal_ca: Issuer  # signs the model services' and the gateway's internal certificates
    other_ca: Issuer  # an unrelated CA: its certificates must be refused everywhere
    model_server: tuple[str, str]
    gateway_client: tuple[str, str]
    rogue_client: tuple[str, str]  # a client certificate from other_ca
    public_ca: Issuer
    gateway_server: tuple[str, str]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    directory = tmp_path_factory.mktemp("pki")
    internal, other, public = (make_ca(directory, n) for n in ("internal", "other", "public"))
    return PKI(
        internal_ca=internal,
        other_ca=other,
        model_server=issue(internal, directory, "model-server", LOOPBACK_SANS),
        gateway_client=issue(internal, directory, "gateway-client", [], client=True),
        rogue_client=issue(other, directory, "rogue-client", [], client=True),
        public_ca=public,
        gateway_server=issue(public, directory, "gateway-server", [x509.DNSName(GATEWAY_NAME)]),
    )


# --- the hardened cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(tiny, pki: PKI) -> Iterator[Cluster]:
    """Draft + verify with required client certificates, the gateway with mTLS to them, TLS + token in front."""
    running = start_cluster(
        tiny.target,
        "model",
        tiny.draft_noisy,
        num_draft_tokens=3,
        model_tls=ServerTLS(*pki.model_server, client_ca=str(pki.internal_ca.pem)),
        backend_tls=ClientTLS.from_files(str(pki.internal_ca.pem), *pki.gateway_client),
        gateway_tls=ServerTLS(*pki.gateway_server),
        auth_token=TOKEN,
        http_port=0,
    )
    yield running
    running.stop()


def public_tls(pki: PKI) -> ClientTLS:
    return ClientTLS.from_files(str(pki.public_ca.pem), server_name=GATEWAY_NAME)


def public_stub(cluster: Cluster, pki: PKI) -> generate_pb2_grpc.GenerateServiceStub:
    return generate_pb2_grpc.GenerateServiceStub(open_channel(cluster.address, public_tls(pki)))


def request(**fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text="the quick brown", raw=True, max_new_tokens=6, **fields)


def model_health(address: str, tls: ClientTLS | None) -> int:
    """The verify service's health over the given client security; raises grpc.RpcError when refused."""
    with open_channel(address, tls) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


# --- tests ---------------------------------------------------------------------------------------


def test_generate_through_mutual_tls_equals_target_only(secure, pki):
    """Prefill, Propose and Verify all cross mTLS; greedy speculation still equals the target alone."""
    stub = public_stub(secure, pki)
    metadata = bearer_metadata(TOKEN)
    speculative = stub.Generate(request(), metadata=metadata, timeout=60)
    target_only = stub.Generate(request(disable_speculation=True), metadata=metadata, timeout=60)
    assert len(speculative.token_ids) > 0
    assert list(speculative.token_ids) == list(target_only.token_ids)
    assert speculative.stats.draft_tokens > 0  # the draft answered over mTLS too
    streamed = [t for m in stub.GenerateStream(request(), metadata=metadata, timeout=60) for t in m.token_ids]
    assert streamed == list(speculative.token_ids)


def test_model_service_refuses_clients_without_the_right_certificate(secure, pki):
    address = f"127.0.0.1:{secure.verify.port}"
    trusted = str(pki.internal_ca.pem)
    assert model_health(address, ClientTLS.from_files(trusted, *pki.gateway_client)) == health_pb2.HealthCheckResponse.SERVING
    refused = {
        "no client certificate": ClientTLS.from_files(trusted),
        "a certificate from another CA": ClientTLS.from_files(trusted, *pki.rogue_client),
        "plaintext": None,
    }
    for why, tls in refused.items():
        with pytest.raises(grpc.RpcError) as error:
            model_health(address, tls)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, why


def test_gateway_that_does_not_trust_the_services_cannot_connect(secure, pki):
    """A gateway with the wrong CA fails the handshake and refuses to start instead of serving half-connected."""
    from gateway.app import start_gateway_server
    from gateway.options import GatewayOptions
    from specd_common.config import ServerConfig
    from specd_common.errors import Unavailable

    wrong_ca = ClientTLS.from_files(str(pki.other_ca.pem), *pki.gateway_client)
    with pytest.raises(Unavailable):
        start_gateway_server(
            f"127.0.0.1:{secure.verify.port}", None, ServerConfig(port=0), GatewayOptions(connect_timeout_s=1.5), wrong_ca
        )


@pytest.mark.parametrize(
    "metadata, detail",
    [
        ((), "missing"),
        (bearer_metadata("wrong-token"), "invalid bearer token"),
        ((("authorization", f"Basic {TOKEN}"),), "Bearer <token>"),
    ],
    ids=["missing", "wrong", "not-bearer"],
)
def test_public_api_without_the_token_is_unauthenticated(secure, pki, metadata, detail):
    stub = public_stub(secure, pki)
    for call in (
        lambda: stub.Generate(request(), metadata=metadata, timeout=10),
        lambda: list(stub.GenerateStream(request(), metadata=metadata, timeout=10)),
    ):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert detail in error.value.details()
        assert TOKEN not in error.value.details()
    assert secure.open_sessions() == {"verify": 0, "draft": 0}  # refused before any work


def test_health_and_reflection_need_no_token(secure, pki):
    """Kubernetes probes and grpcurl carry no token; they must still work."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with open_channel(secure.address, public_tls(pki)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specd.v1.GenerateService"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "specd.v1.GenerateService" in names


def test_public_port_refuses_plaintext_and_unknown_names(secure, pki):
    attempts = {
        "plaintext": None,
        "the certificate's name is not the address": ClientTLS.from_files(str(pki.public_ca.pem)),
        "an untrusted CA": ClientTLS.from_files(str(pki.internal_ca.pem), server_name=GATEWAY_NAME),
    }
    for why, tls in attempts.items():
        stub = generate_pb2_grpc.GenerateServiceStub(open_channel(secure.address, tls))
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(request(), metadata=bearer_metadata(TOKEN), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, why


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")])}
    env.pop("SPECD_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "specd_app.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_specd_generate_over_tls_with_a_token(secure, pki):
    common = ["generate", "--gateway", secure.address, "--prompt", "the quick brown", "--raw", "--max-new-tokens", "6"]
    tls = ["--tls-ca", str(pki.public_ca.pem), "--tls-server-name", GATEWAY_NAME]
    result = run_cli(*common, *tls, "--token", TOKEN, "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    expected = public_stub(secure, pki).Generate(request(), metadata=bearer_metadata(TOKEN), timeout=60)
    assert answer["token_ids"] == list(expected.token_ids)

    refused = run_cli(*common, *tls, "--json")
    assert refused.returncode == 2
    assert "UNAUTHENTICATED" in refused.stderr


# --- plumbing: health port, certificate rotation, configuration errors ----------------------------


def test_health_port_is_plaintext_and_serves_only_health(pki):
    """Kubernetes' gRPC probes cannot do TLS: a TLS server can add a plaintext port with health and nothing else."""
    from specd_common.server import start_server

    tls = ServerTLS(*pki.model_server, client_ca=str(pki.internal_ca.pem))
    running = start_server(lambda server: None, ["specd.v1.VerifyService"], "127.0.0.1", 0, tls=tls, health_port=0)
    try:
        health_address = f"127.0.0.1:{running.health_port}"
        assert model_health(health_address, None) == health_pb2.HealthCheckResponse.SERVING
        running.set_serving(False)
        assert model_health(health_address, None) == health_pb2.HealthCheckResponse.NOT_SERVING
        with open_channel(health_address) as channel, pytest.raises(grpc.RpcError) as error:
            verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        running.stop(0)


def test_server_certificate_rotates_without_restart(pki, tmp_path):
    """Mounted Secrets change in place: new connections get the new certificate, no restart."""
    from specd_common.server import start_server

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(Path(pki.model_server[0]).read_bytes())
    key.write_bytes(Path(pki.model_server[1]).read_bytes())
    running = start_server(lambda server: None, ["x"], "127.0.0.1", 0, tls=ServerTLS(str(cert), str(key)))
    address = f"127.0.0.1:{running.port}"
    try:
        assert model_health(address, ClientTLS.from_files(str(pki.internal_ca.pem))) == health_pb2.HealthCheckResponse.SERVING
        new_cert, new_key = issue(pki.other_ca, tmp_path, "rotated", LOOPBACK_SANS)
        os.replace(new_key, key)
        os.replace(new_cert, cert)
        assert model_health(address, ClientTLS.from_files(str(pki.other_ca.pem))) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):
            model_health(address, ClientTLS.from_files(str(pki.internal_ca.pem)))
    finally:
        running.stop(0)


def test_incomplete_settings_fail_at_start(tmp_path):
    with pytest.raises(SecurityConfigError, match="go together"):
        ServerTLS(cert="server.crt")
    with pytest.raises(SecurityConfigError, match="needs --tls-cert"):
        ServerTLS(client_ca="ca.pem")
    with pytest.raises(SecurityConfigError, match="go together"):
        ClientTLS.from_files(cert="client.crt")
    with pytest.raises(SecurityConfigError, match="cannot read"):
        ServerTLS("missing.crt", "missing.key").credentials()
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match="empty"):
        load_token(token_file=str(empty))  # a broken Secret must not open the API
    (tmp_path / "good").write_text("abc\n")
    assert load_token(token_file=str(tmp_path / "good")) == "abc"
    with pytest.raises(SecurityConfigError, match="not both"):
        load_token("abc", str(tmp_path / "good"))


def test_specd_serve_gateway_with_an_empty_token_file_exits_before_serving(tmp_path):
    from specd_app.cli import main

    empty = tmp_path / "token"
    empty.write_text("")
    assert main(["serve", "gateway", "--port", "0", "--metrics-port", "-1", "--auth-token-file", str(empty)]) == 2


def test_bearer_check_accepts_only_the_exact_token():
    @dataclass
    class Metadatum:
        key: str
        value: str

    check = BearerTokenInterceptor(TOKEN)
    assert check.authorized([Metadatum("authorization", f"Bearer {TOKEN}")]) is None
    assert check.authorized([Metadatum("authorization", f"bearer {TOKEN}")]) is None  # the scheme is case-insensitive
    for value in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer ", TOKEN, ""):
        assert check.authorized([Metadatum("authorization", value)]) is not None, value
    with pytest.raises(SecurityConfigError):
        BearerTokenInterceptor("")


def https_request(port: int, pki: PKI, body: dict, token: str) -> tuple[int, dict]:
    """POST /v1/chat/completions over TLS, checking the gateway's certificate against the public CA."""
    context = ssl.create_default_context(cafile=str(pki.public_ca.pem))
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {GATEWAY_NAME}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname=GATEWAY_NAME) as connection:
            connection.sendall(head.encode() + payload)
            data = b""
            while chunk := connection.recv(65536):
                data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_http_api_speaks_tls_and_checks_the_token(secure, pki):
    """The HTTP port uses the gateway's certificate; the token is checked as on the gRPC port."""
    port = http_server(secure.gateway).port
    body = {"model": secure.gateway.servicer.backends.target_info.model_name,
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    status, answer = https_request(port, pki, body, TOKEN)
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    status, answer = https_request(port, pki, body, "not-the-token")
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:  # plaintext HTTP gets no answer
        plain.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not plain.recv(65536).startswith(b"HTTP/1.1 200")


# --- one token for the whole stack: the model services check what the gateway sends -----------------


@pytest.fixture(scope="module")
def token_stack(tiny) -> Iterator[Cluster]:
    """Plaintext draft, verify and gateway, all three started with the same bearer token (as `specd up
    --auth-token-file` starts them): the gateway sends it to draft and verify on its own."""
    from draft_service.app import make_drafter, start_draft_server
    from gateway.app import start_gateway_server
    from gateway.options import GatewayOptions
    from specd_common.config import ServerConfig
    from specd_engine.models import load_causal_lm
    from verify_service.app import start_verify_server

    config = ServerConfig(port=0, max_sessions=8)
    verify = start_verify_server(load_causal_lm(str(tiny.target)), config, auth_token=TOKEN)
    draft = start_draft_server(make_drafter("model", str(tiny.draft_noisy)), config, auth_token=TOKEN)
    gateway = start_gateway_server(f"127.0.0.1:{verify.port}", f"127.0.0.1:{draft.port}", config,
                                   GatewayOptions(num_draft_tokens=3, connect_timeout_s=30, auth_token=TOKEN))
    running = Cluster(verify, draft, gateway)
    yield running
    running.stop()


def model_calls(stubs: dict, session: str) -> dict:
    """Every session RPC of both model services, in an order that works when each is served: name → call(metadata)."""
    verify, draft = stubs["verify"], stubs["draft"]
    commit = common_pb2.Commit(prefix_length=3)
    return {
        "verify.Prefill": lambda md: verify.Prefill(verify_pb2.VerifyPrefillRequest(session_id=session, prompt_token_ids=[5, 6, 7]), metadata=md, timeout=30),
        "verify.Verify": lambda md: verify.Verify(verify_pb2.VerifyRequest(session_id=session, commit=commit, draft_token_ids=[8]), metadata=md, timeout=30),
        "verify.GetModelInfo": lambda md: verify.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=md, timeout=30),
        "verify.Release": lambda md: verify.Release(common_pb2.ReleaseRequest(session_id=session), metadata=md, timeout=30),
        "draft.Prefill": lambda md: draft.Prefill(draft_pb2.DraftPrefillRequest(session_id=session, prompt_token_ids=[5, 6, 7]), metadata=md, timeout=30),
        "draft.Propose": lambda md: draft.Propose(draft_pb2.ProposeRequest(session_id=session, commit=commit, num_draft_tokens=2), metadata=md, timeout=30),
        "draft.Release": lambda md: draft.Release(common_pb2.ReleaseRequest(session_id=session), metadata=md, timeout=30),
    }


def model_stubs(verify_address: str, draft_address: str) -> dict:
    return {"verify": verify_pb2_grpc.VerifyServiceStub(open_channel(verify_address)),
            "draft": draft_pb2_grpc.DraftServiceStub(open_channel(draft_address))}


def assert_model_services_need_the_token(stubs: dict, open_sessions=lambda: None) -> None:
    """Without the token, or with another, every call is UNAUTHENTICATED saying what to send, and
    opens nothing; with it, every call is served."""
    refused = {"missing": ((), "authorization: Bearer <token>"), "wrong": (bearer_metadata("wrong-token"), "invalid bearer token")}
    for why, (metadata, detail) in refused.items():
        for name, call in model_calls(stubs, "intruder").items():
            with pytest.raises(grpc.RpcError) as error:
                call(metadata)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, (why, name)
            assert detail in error.value.details(), (why, name)
            assert TOKEN not in error.value.details()
    assert open_sessions() in (None, {"verify": 0, "draft": 0})  # refused before any work
    served = {name: call(bearer_metadata(TOKEN)) for name, call in model_calls(stubs, "owner").items()}
    assert served["verify.Verify"].sequence_length == 3 and len(served["verify.Verify"].argmax_token_ids) == 2
    assert served["draft.Propose"].sequence_length == 3
    assert served["verify.Release"].released and served["draft.Release"].released


def test_model_services_with_a_token_refuse_calls_without_it(token_stack):
    """The issue's probe: with the token on, Prefill/Verify/Propose on the model ports answered anyone."""
    stubs = model_stubs(f"127.0.0.1:{token_stack.verify.port}", f"127.0.0.1:{token_stack.draft.port}")
    assert_model_services_need_the_token(stubs, token_stack.open_sessions)
    assert token_stack.open_sessions() == {"verify": 0, "draft": 0}


def test_model_services_keep_health_and_reflection_open(token_stack):
    """Kubernetes probes and grpcurl carry no token, on the model services too."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for server, name in ((token_stack.verify, "specd.v1.VerifyService"), (token_stack.draft, "specd.v1.DraftService")):
        address = f"127.0.0.1:{server.port}"
        assert model_health(address, None) == health_pb2.HealthCheckResponse.SERVING
        with open_channel(address) as channel:
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            assert name in {s.name for reply in replies for s in reply.list_services_response.service}


def test_gateway_sends_its_token_to_the_model_services(token_stack):
    """An authenticated Generate crosses token-protected draft and verify: speculation still runs and
    equals target-only, and the sessions are released (Release carries the token too)."""
    stub = generate_pb2_grpc.GenerateServiceStub(open_channel(token_stack.address))
    metadata = bearer_metadata(TOKEN)
    speculative = stub.Generate(request(), metadata=metadata, timeout=60)
    assert speculative.stats.draft_tokens > 0  # the draft answered: Prefill and Propose carried the token
    assert list(speculative.token_ids) == list(stub.Generate(request(disable_speculation=True), metadata=metadata, timeout=60).token_ids)
    streamed = [t for m in stub.GenerateStream(request(), metadata=metadata, timeout=60) for t in m.token_ids]
    assert streamed == list(speculative.token_ids)
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(request(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    deadline = time.monotonic() + 10
    while token_stack.open_sessions() != {"verify": 0, "draft": 0}:
        assert time.monotonic() < deadline, token_stack.open_sessions()
        time.sleep(0.1)


def test_bearer_client_channel_keeps_the_calls_own_metadata():
    """with_bearer_token adds the token to unary and streaming calls, keeps the call's other metadata
    and replaces a caller's own authorization."""
    from specd_common.security import with_bearer_token
    from specd_common.server import start_server

    seen = []

    class Record(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            seen.append(dict(details.invocation_metadata))
            return continuation(details)

    running = start_server(lambda server: None, ["x"], "127.0.0.1", 0, interceptors=[Record()])
    try:
        with with_bearer_token(open_channel(f"127.0.0.1:{running.port}"), TOKEN) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), metadata=(("x-trace", "1"), ("authorization", "Bearer other")), timeout=5)
            next(iter(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)))
    finally:
        running.stop(0)
    assert [m.get("authorization") for m in seen] == [f"Bearer {TOKEN}"] * 2
    assert seen[0]["x-trace"] == "1"


def test_specd_up_shares_the_token_through_the_environment_only(tmp_path, monkeypatch):
    """`specd up --auth-token-file F`: the children's command lines carry no token (`ps` shows them),
    their environment carries the file, and each child's flags read it back as the same token."""
    from specd_app.cli import build_parser
    from specd_app.stack import service_commands, share_stack_token

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    up = build_parser().parse_args(["up", "--auth-token-file", str(token_file)])
    environ = {"SPECD_AUTH_TOKEN": "stale", "PATH": "/bin"}
    assert share_stack_token(environ, up.auth_token, up.auth_token_file) == TOKEN
    assert environ == {"SPECD_AUTH_TOKEN_FILE": str(token_file.resolve()), "PATH": "/bin"}
    ports = {"gateway": 1, "draft": 2, "verify": 3, "http": 0}
    commands = service_commands("127.0.0.1", ports, "target", "ngram", "", 0, 3)
    assert not any(TOKEN in word or str(token_file) in word for command in commands.values() for word in command)
    monkeypatch.setenv("SPECD_AUTH_TOKEN_FILE", environ["SPECD_AUTH_TOKEN_FILE"])  # what each child inherits
    for name, command in commands.items():
        child = build_parser().parse_args(command[3:])  # after `python -m specd_app.cli`
        assert load_token(child.auth_token, child.auth_token_file) == TOKEN, name

    inline = {}
    assert share_stack_token(inline, "inline-token", "") == "inline-token"
    assert inline == {"SPECD_AUTH_TOKEN": "inline-token"}
    assert share_stack_token(inline, "", "") == "" and inline == {}  # no token: the children run open
    token_file.write_text("")
    with pytest.raises(SecurityConfigError, match="empty"):  # `up` stops before starting anything
        share_stack_token({}, "", str(token_file))


@pytest.mark.e2e
def test_specd_up_with_a_token_file_protects_all_three_services(tiny, tmp_path):
    """`specd up --auth-token-file F` over real sockets: the model services refuse calls without the
    token, the gateway serves an authenticated Generate through them, and no process shows the token."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    flags = ("--drafter", "model", "--draft-model", str(tiny.draft_noisy), "--auth-token-file", str(token_file))
    with specd_up(tiny.target, tmp_path / "up.log", drafter=flags) as stack:
        assert_model_services_need_the_token(model_stubs(stack.address("verify"), stack.address("draft")))
        gateway = generate_pb2_grpc.GenerateServiceStub(open_channel(stack.address("gateway")))
        reply = gateway.Generate(request(), metadata=bearer_metadata(TOKEN), timeout=60)
        assert len(reply.token_ids) > 0 and reply.stats.draft_tokens > 0
        with pytest.raises(grpc.RpcError) as error:
            gateway.Generate(request(), timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not any(TOKEN.encode() in line for line in process_tree_command_lines(stack.pid))


def process_tree_command_lines(root: int) -> list[bytes]:
    """The command lines of `root` and its children, from /proc."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            if stat and (int(entry.name) == root or int(stat.rsplit(")", 1)[1].split()[1]) == root):
                lines.append((entry / "cmdline").read_bytes())
        except OSError:
            continue
    return lines
