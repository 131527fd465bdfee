"""The operator's custom.metrics.k8s.io server: selectors, values read from a stage pod's real exposition,
the answer's shape, and who may call it (real TLS over a loopback socket, certificates made here).

The HPA's end of it (an aggregation layer, the HPA controller, stage pods) runs in
tests/realnode/test_autoscaling.py.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from omnifleet_operator import metricsapi as M
from omnifleet_runtime.metrics import StageMetrics, merge

from .test_operator_metrics import free_port

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)


def test_selectors_in_the_apiservers_text_form():
    reqs = M.parse_selector("stage=talker,app.kubernetes.io/name==omnifleet,tier!=gpu,zone in (a, b),"
                            "role notin (x),omnifleet.dev/stage,!canary")
    assert reqs == [("stage", "=", frozenset({"talker"})), ("app.kubernetes.io/name", "=", frozenset({"omnifleet"})),
                    ("tier", "!=", frozenset({"gpu"})), ("zone", "in", frozenset({"a", "b"})),
                    ("role", "notin", frozenset({"x"})), ("omnifleet.dev/stage", "exists", frozenset()),
                    ("canary", "!exists", frozenset())]
    labels = {"stage": "talker", "app.kubernetes.io/name": "omnifleet", "zone": "b", "omnifleet.dev/stage": "t"}
    assert M.selector_matches(reqs, labels)
    assert not M.selector_matches(reqs, labels | {"canary": "1"})
    assert not M.selector_matches(reqs, labels | {"zone": "c"})
    assert not M.selector_matches(reqs, labels | {"tier": "gpu"})
    assert M.parse_selector("") == []


@pytest.mark.parametrize("bad", ["stage=a=b", "!stage=a", "zone in a", "a b", "stage=(x)"])
def test_a_selector_that_does_not_parse_says_which_part(bad):
    with pytest.raises(M.SelectorError, match="cannot parse label selector requirement"):
        M.parse_selector(bad)


def exposition(values: dict[str, dict[str, float]]) -> str:
    """What a stage pod serves: its workers' series merged (the runtime's own code), one worker per stage."""
    parts = [({}, StageMetrics(stage, lambda v=v: v).render().decode()) for stage, v in values.items()]
    return merge(parts).decode()


def test_a_pods_value_is_its_matching_stages_largest():
    state = {"inflight": 0, "queue_depth": 0, "early_data": 0, "realtime_factor": 0}
    text = exposition({"thinker": state | {"inflight": 5, "queue_depth": 2},
                       "talker": state | {"inflight": 3, "realtime_factor": 0.4}})
    inflight = "omnifleet_worker_inflight"
    assert M.pod_value(text, inflight, M.parse_selector("stage=thinker")) == 5
    assert M.pod_value(text, inflight, M.parse_selector("stage=talker")) == 3
    assert M.pod_value(text, inflight, []) == 5
    assert M.pod_value(text, "omnifleet_worker_realtime_factor", M.parse_selector("stage=talker")) == 0.4
    assert M.pod_value(text, inflight, M.parse_selector("stage=code2wav")) is None


def test_the_answer_is_a_metric_value_list_in_milli_units():
    body = M.metric_value_list("ns", {"b": 2.5, "a": 0.0004}, "omnifleet_worker_inflight", "stage=llm", NOW)
    assert body["kind"] == "MetricValueList" and body["apiVersion"] == "custom.metrics.k8s.io/v1beta2"
    assert [(i["describedObject"]["name"], i["value"]) for i in body["items"]] == [("a", "0m"), ("b", "2500m")]
    item = body["items"][1]
    assert item["describedObject"] == {"kind": "Pod", "namespace": "ns", "name": "b", "apiVersion": "/v1"}
    assert item["metric"] == {"name": "omnifleet_worker_inflight", "selector": {"matchLabels": {"stage": "llm"}}}
    assert item["timestamp"] == "2026-12-01T12:00:00Z"
    served = {r["name"] for r in M.resource_list()["resources"]}
    assert served == {f"pods/{m}" for m in M.POD_METRICS} | {"services/omnifleet_stage_demand"}


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(NOW - datetime.timedelta(days=1))
            .not_valid_after(NOW + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _client_cert(ca: x509.Certificate, ca_key, cn: str, d: Path) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=1)).not_valid_after(NOW + datetime.timedelta(days=3650))
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = d / f"{cn}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return _client_context(d, pem)


def _client_context(d: Path, pem: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "serving.pem"))
    ctx.check_hostname = False  # the Service's name is not 127.0.0.1; the CA is still checked
    if pem is not None:
        ctx.load_cert_chain(str(pem))
    return ctx


async def _get(port: int, ctx: ssl.SSLContext, path: str) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    if not raw:  # TLS 1.3: a refused client certificate shows after the handshake, as a closed connection
        raise ConnectionResetError("closed without an answer")
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_only_the_front_proxys_certificate_is_served():
    front_ca, front_key = _ca("front-proxy-ca")
    other_ca, other_key = _ca("some-other-ca")
    cert_pem, key_pem = M.self_signed("omnifleet-system", datetime.datetime.now(datetime.timezone.utc))
    server = M.MetricsApi(None, "omnifleet-system", free_port())  # these routes never call the apiserver
    server.allowed_names = frozenset({"front-proxy-client"})
    await server.serve(M.server_context(cert_pem, key_pem, front_ca.public_bytes(serialization.Encoding.PEM).decode()),
                       host="127.0.0.1")
    path = "/apis/custom.metrics.k8s.io/v1beta2"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "serving.pem").write_bytes(cert_pem)
            code, body = await _get(server.port, _client_cert(front_ca, front_key, "front-proxy-client", d), path)
            assert code == 200 and body["kind"] == "APIResourceList", body
            code, body = await _get(server.port, _client_cert(front_ca, front_key, "someone-else", d), path)
            assert code == 403 and "front proxy" in body["message"], body
            code, body = await _get(server.port, _client_cert(front_ca, front_key, "front-proxy-client", d),
                                    f"{path}/namespaces/ns/pods/*/process_cpu_seconds_total")
            assert code == 404 and "is not served here" in body["message"], body
            for ctx in (_client_context(d, None), _client_cert(other_ca, other_key, "front-proxy-client", d)):
                with pytest.raises((ssl.SSLError, ConnectionResetError, asyncio.IncompleteReadError)):
                    await _get(server.port, ctx, path)
    finally:
        await server.close()
