"""custom.metrics.k8s.io for the HPAs of autoscaled stages, served by the operator's replicas.

Why the operator: an HPA on a pods metric needs an adapter behind the aggregation layer, and the
stage pods already export the series it asks for on their `metrics` port. Reading those pods when
the HPA asks (every 15 s by default) needs no Prometheus, no KEDA and no Deployment of its own:
`kubectl apply -k manifests/autoscaling/` adds the APIService and starts this server in every operator
replica (leader or not: it writes nothing but its own TLS Secret and the APIService's caBundle).
Clusters that run Prometheus can serve the same names with prometheus-adapter instead
(manifests/monitoring/prometheus-adapter-rules.yaml); one APIService owns the group, so pick one.

Who may call: only the aggregation layer. The client must present a certificate from the
apiserver's front-proxy CA with an allowed name (kube-system/extension-apiserver-authentication);
kube-apiserver authenticates and authorizes the user of custom.metrics.k8s.io before it proxies.
Only omnifleet stage pods are read, only the autoscaling series are served.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import math
import os
import re
import ssl
from typing import Any, Iterable

import aiohttp
from aiohttp import web
from lightkube import ApiError, AsyncClient
from lightkube import operators as lk
from lightkube.resources.apiregistration_v1 import APIService
from lightkube.resources.core_v1 import ConfigMap, Pod, Secret, Service
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import AUTOSCALING_METRICS

log = logging.getLogger("omnifleet.metricsapi")

GROUP, VERSION = "custom.metrics.k8s.io", "v1beta2"
APISERVICE = f"{VERSION}.{GROUP}"
SERVICE = "omnifleet-metrics-api"  # the Service the APIService names (manifests/autoscaling/)
TLS_SECRET = "omnifleet-metrics-api-tls"
AUTH_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")
SCRAPE_TIMEOUT_S = 3.0  # one pod's /metrics; a pod that does not answer is left out, as the HPA expects
SCRAPES_AT_ONCE = 64  # per replica of the operator, over all HPAs asking at once
CERT_DAYS = 3650
POD_METRICS = frozenset(AUTOSCALING_METRICS.values())  # of stage pods, read from their `metrics` port
# Of a master Service, summed over its masters' /metrics: what a stage that scales to zero scales on.
SERVICE_METRICS = frozenset({C.STAGE_DEMAND_METRIC})
STAGE_PODS = f"{C.LABEL_OF_COMPONENT}={C.COMPONENT_STAGE}"
MASTERS = f"{C.LABEL_OF_COMPONENT}={C.COMPONENT_MASTER}"


class SelectorError(ValueError):
    pass


class NotInstalled(RuntimeError):
    pass


# --- label selectors (the apiserver's text form) ------------------------------------------------

_REQ = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def parse_selector(text: str) -> list[tuple[str, str, frozenset[str]]]:
    """`a=b,c!=d,e in (f,g),h,!i` as (key, op, values); op in =, !=, in, notin, exists, !exists."""
    out = []
    for part in re.split(r",(?![^()]*\))", text or ""):
        if not part.strip():
            continue
        m = _REQ.match(part)
        if not m:
            raise SelectorError(f"cannot parse label selector requirement {part.strip()!r}")
        neg, key, op, value, set_op, values = m.groups()
        if neg and (op or set_op):
            raise SelectorError(f"cannot parse label selector requirement {part.strip()!r}")
        if op:
            out.append((key, "!=" if op == "!=" else "=", frozenset([value])))
        elif set_op:
            out.append((key, set_op, frozenset(v.strip() for v in values.split(",") if v.strip())))
        else:
            out.append((key, "!exists" if neg else "exists", frozenset()))
    return out


def selector_matches(reqs: Iterable[tuple[str, str, frozenset[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in reqs:
        have = labels.get(key)
        ok = {"=": have in values, "in": have in values, "!=": have not in values, "notin": have not in values,
              "exists": have is not None, "!exists": have is None}[op]
        if not ok:
            return False
    return True


# --- values ----------------------------------------------------------------------------------------

def pod_value(exposition: str, metric: str, reqs: list[tuple[str, str, frozenset[str]]]) -> float | None:
    """The largest sample of `metric` whose labels match (a pod hosting several stages reports each);
    None when there is none."""
    best = None
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == metric and selector_matches(reqs, sample.labels) and not math.isnan(sample.value):
                best = sample.value if best is None else max(best, sample.value)
    return best


def quantity(v: float) -> str:
    """A Kubernetes quantity in milli-units (what the HPA compares against its target)."""
    return f"{max(0, round(v * 1000))}m"


def metric_value_list(namespace: str, values: dict[str, float], metric: str, metric_selector: str,
                      now: datetime.datetime, kind: str = "Pod") -> dict:
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    sel = {"matchLabels": {}}
    for key, op, vals in parse_selector(metric_selector):
        if op == "=":
            sel["matchLabels"][key] = next(iter(vals))
    return {
        "kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {},
        "items": [{
            "describedObject": {"kind": kind, "namespace": namespace, "name": name, "apiVersion": "/v1"},
            "metric": {"name": metric, "selector": sel},
            "timestamp": stamp,
            "value": quantity(v),
        } for name, v in sorted(values.items())],
    }


def resource_list() -> dict:
    return {
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
        "resources": [{"name": f"{res}/{m}", "singularName": "", "namespaced": True, "kind": "MetricValueList",
                       "verbs": ["get"]} for res, ms in (("pods", POD_METRICS), ("services", SERVICE_METRICS))
                      for m in sorted(ms)],
    }


def group_list() -> dict:
    gv = {"groupVersion": f"{GROUP}/{VERSION}", "version": VERSION}
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [{"name": GROUP, "versions": [gv], "preferredVersion": gv}]}


def status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


def _constant(body: dict):
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(body)
    return handler


# --- TLS -------------------------------------------------------------------------------------------

def self_signed(namespace: str, now: datetime.datetime) -> tuple[bytes, bytes]:
    """A serving certificate for the Service's DNS names (the aggregation layer checks them against
    the APIService's caBundle, which is this certificate)."""
    # Imported here: only an operator that serves the API makes a certificate, and the library's
    # OpenSSL would be in every operator's memory.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    host = f"{SERVICE}.{namespace}.svc"
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host), x509.DNSName(f"{host}.cluster.local")]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def server_context(cert_pem: bytes, key_pem: bytes, client_ca_pem: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl loads a key pair only from files: a memfd keeps it off the (read-only) filesystem.
    fd = os.memfd_create("omnifleet-metrics-api-tls")
    try:
        os.write(fd, cert_pem + b"\n" + key_pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    ctx.load_verify_locations(cadata=client_ca_pem)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_common_name(request: web.Request) -> str | None:
    cert = request.transport.get_extra_info("peercert") if request.transport else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


# --- the server ------------------------------------------------------------------------------------

class MetricsApi:
    """Serve custom.metrics.k8s.io on `port` (HTTPS, the front proxy's client certificate required)."""

    def __init__(self, client: AsyncClient, namespace: str, port: int):
        self.client, self.namespace, self.port = client, namespace, port
        self.allowed_names: frozenset[str] = frozenset()
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.scrapes = asyncio.Semaphore(SCRAPES_AT_ONCE)

    async def start(self) -> None:
        """Raises NotInstalled while manifests/autoscaling/ is not applied."""
        try:
            service = await self.client.get(APIService, APISERVICE)
        except ApiError as e:
            if e.status.code not in (403, 404):
                raise
            raise NotInstalled(f"APIService {APISERVICE} is not installed, or not readable by the operator "
                               f"(kubectl apply -k manifests/autoscaling/): {e.status.message}") from None
        client_ca, self.allowed_names = await self._front_proxy()
        cert_pem, key_pem = await self._serving_cert()
        await self._publish_ca(service, cert_pem)
        await self.serve(server_context(cert_pem, key_pem, client_ca))

    async def serve(self, ctx: ssl.SSLContext, host: str = "0.0.0.0") -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        app = web.Application(middlewares=[self._only_front_proxy])
        for path, body in (("/apis", group_list()),
                           (f"/apis/{GROUP}", group_list()["groups"][0] | {"kind": "APIGroup", "apiVersion": "v1"}),
                           (f"/apis/{GROUP}/{VERSION}", resource_list())):
            app.router.add_get(path, _constant(body))
        app.router.add_get(f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/pods/{{name}}/{{metric}}", self._pods)
        app.router.add_get(f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/services/{{name}}/{{metric}}",
                           self._service)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, self.port, ssl_context=ctx).start()
        log.info("serving %s on :%d for the HPAs of autoscaled stages", APISERVICE, self.port)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _front_proxy(self) -> tuple[str, frozenset[str]]:
        ns, name = AUTH_CONFIGMAP
        cm = await self.client.get(ConfigMap, name, namespace=ns)
        data = cm.data or {}
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise RuntimeError(f"{ns}/{name} has no requestheader-client-ca-file: the apiserver runs without the "
                               "aggregation layer (--requestheader-client-ca-file, --proxy-client-cert-file), "
                               f"so nothing can reach {APISERVICE}")
        try:
            names = frozenset(json.loads(data.get("requestheader-allowed-names") or "[]"))
        except ValueError:
            raise RuntimeError(f"{ns}/{name}: requestheader-allowed-names is not a JSON list") from None
        return ca, names

    async def _serving_cert(self) -> tuple[bytes, bytes]:
        """The Secret every replica serves with: the first replica creates it, the others read it."""
        try:
            s = await self.client.get(Secret, TLS_SECRET, namespace=self.namespace)
        except ApiError as e:
            if e.status.code != 404:
                raise
            cert, key = self_signed(self.namespace, datetime.datetime.now(datetime.timezone.utc))
            secret = Secret.from_dict({
                "metadata": {"name": TLS_SECRET, "namespace": self.namespace,
                             "labels": {C.LABEL_NAME: "omnifleet", C.LABEL_COMPONENT: "metrics-api"}},
                "type": "kubernetes.io/tls",
                "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()},
            })
            try:
                await self.client.create(secret)
                return cert, key
            except ApiError as e2:
                if e2.status.code != 409:  # another replica made it first: use theirs
                    raise
            s = await self.client.get(Secret, TLS_SECRET, namespace=self.namespace)
        data = s.data or {}
        return base64.b64decode(data["tls.crt"]), base64.b64decode(data["tls.key"])

    async def _publish_ca(self, service: APIService, cert_pem: bytes) -> None:
        bundle = base64.b64encode(cert_pem).decode()
        if service.spec.caBundle != bundle:
            await self.client.patch(APIService, APISERVICE, {"spec": {"caBundle": bundle}},
                                    patch_type=PatchType.MERGE)

    @web.middleware
    async def _only_front_proxy(self, request: web.Request, handler) -> web.StreamResponse:
        # The handshake proved the CA; the name says it is the apiserver's proxy client, not another
        # holder of a certificate from that CA.
        if self.allowed_names and peer_common_name(request) not in self.allowed_names:
            return status(403, "Forbidden", "only the aggregation layer's front proxy may call")
        return await handler(request)

    @staticmethod
    def _asked(request: web.Request, resource: str, served: frozenset[str]):
        """(namespace, name, metric, metric selector, object selector), or the error answer."""
        ns, name, metric = (request.match_info[k] for k in ("namespace", "name", "metric"))
        if metric not in served:
            return status(404, "NotFound", f"metric {metric!r} of {resource} is not served here; served: "
                                           f"{sorted(served)}")
        try:
            return (ns, name, metric, parse_selector(request.query.get("metricLabelSelector", "")),
                    parse_selector(request.query.get("labelSelector", "")))
        except SelectorError as e:
            return status(400, "BadRequest", str(e))

    async def _pods(self, request: web.Request) -> web.Response:
        asked = self._asked(request, "pods", POD_METRICS)
        if isinstance(asked, web.Response):
            return asked
        ns, name, metric, metric_reqs, pod_reqs = asked
        pods = await self._stage_pods(ns, name, request.query.get("labelSelector", ""))
        if name != "*" and not pods:
            return status(404, "NotFound", f"no omnifleet stage pod {ns}/{name}")
        pods = [p for p in pods if selector_matches(pod_reqs, p.metadata.labels or {})]
        got = await asyncio.gather(*(self._scrape(p, C.STAGE_METRICS_PORT, metric, metric_reqs) for p in pods))
        values = {p.metadata.name: v for p, v in zip(pods, got, strict=True) if v is not None}
        if name != "*" and not values:
            return status(404, "NotFound", f"{metric} not read from pod {ns}/{name}")
        return web.json_response(metric_value_list(ns, values, metric, request.query.get("metricLabelSelector", ""),
                                                   datetime.datetime.now(datetime.timezone.utc)))

    async def _stage_pods(self, ns: str, name: str, label_selector: str) -> list[Pod]:
        if name != "*":
            try:
                pod = await self.client.get(Pod, name, namespace=ns)
            except ApiError as e:
                if e.status.code == 404:
                    return []
                raise
            pods = [pod]
        else:
            sel = ",".join(s for s in (label_selector, STAGE_PODS) if s)
            pods = [p async for p in self.client.list(Pod, namespace=ns, labels=_lightkube_labels(sel))]
        stage_reqs = parse_selector(STAGE_PODS)
        return running([p for p in pods if selector_matches(stage_reqs, p.metadata.labels or {})])

    async def _service(self, request: web.Request) -> web.Response:
        """A master Service's metric: the sum over its ready masters (each holds its own requests)."""
        asked = self._asked(request, "services", SERVICE_METRICS)
        if isinstance(asked, web.Response):
            return asked
        ns, name, metric, metric_reqs, _ = asked
        try:
            svc = await self.client.get(Service, name, namespace=ns)
        except ApiError as e:
            if e.status.code == 404:
                return status(404, "NotFound", f"no Service {ns}/{name}")
            raise
        labels = svc.metadata.labels or {}
        if not selector_matches(parse_selector(MASTERS), labels) or not svc.spec.selector:
            return status(404, "NotFound", f"Service {ns}/{name} is not an omnifleet master Service")
        sel = ",".join(f"{k}={v}" for k, v in sorted(svc.spec.selector.items()))
        pods = [p async for p in self.client.list(Pod, namespace=ns, labels=_lightkube_labels(f"{sel},{MASTERS}"))]
        pods = running(pods)
        got = [v for v in await asyncio.gather(*(self._scrape(p, C.MASTER_API_PORT, metric, metric_reqs)
                                                  for p in pods)) if v is not None]
        if not got:  # no value: the HPA holds the replica count rather than act on a guess
            return status(503, "ServiceUnavailable", f"{metric} read from no master of Service {ns}/{name}")
        return web.json_response(metric_value_list(ns, {name: sum(got)}, metric,
                                                   request.query.get("metricLabelSelector", ""),
                                                   datetime.datetime.now(datetime.timezone.utc), kind="Service"))

    async def _scrape(self, pod: Pod, port: int, metric: str, reqs) -> float | None:
        assert self.session is not None
        url = f"http://{pod.status.podIP}:{port}/metrics"
        try:
            async with self.scrapes, self.session.get(url) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                text = await r.text()
            return pod_value(text, metric, reqs)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.info("left pod %s/%s out of %s: %s", pod.metadata.namespace, pod.metadata.name, metric, e or type(e))
            return None


def running(pods: list[Pod]) -> list[Pod]:
    """Pods that can be read: running, with an IP, not being deleted."""
    return [p for p in pods if p.status and p.status.phase == "Running" and p.status.podIP
            and not p.metadata.deletionTimestamp]


_LK_OPS = {"=": lambda v: next(iter(v)), "!=": lambda v: lk.not_equal(next(iter(v))),
           "in": lambda v: lk.in_(sorted(v)), "notin": lambda v: lk.not_in(sorted(v)),
           "exists": lambda v: lk.exists(), "!exists": lambda v: lk.not_exists()}


def _lightkube_labels(selector: str) -> dict[str, Any]:
    """lightkube's `labels=` form of a selector; a second requirement on a key is checked after listing."""
    out: dict[str, Any] = {}
    for key, kind, values in parse_selector(selector):
        out.setdefault(key, _LK_OPS[kind](values))
    return out
