"""Policy checks on rendered overlays: what the schemas cannot say about specd's deployment.

kubernetes-validate proves each object is well-formed; this proves the deployment means what the
design says: draft and verify are separate GPU workloads behind headless Services (or, on CPU, no
draft service and a verify with whole CPUs of its own, Guaranteed QoS), every specd
container has gRPC health probes (the plaintext gateway's readiness may be its HTTP GET /health) and resource requests and limits, only the gateway is reachable
from outside the namespace, metrics are scrapeable, traces have an OTLP endpoint, and the drain
timings fit together (SPECD_GRACE < terminationGracePeriodSeconds, liveness never fires while draining).
Security: no pod uses the host's network or ports, the model Services are never exposed outside the
cluster, TLS settings agree between the gateway and the model services, and a TLS port is probed
through the plaintext health port (Kubernetes' gRPC probes cannot speak TLS).

Usage: python deploy/lint_manifests.py RENDERED.yaml [...]   (exit status 1 on any finding)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

COMPONENTS = {"gateway": 50051, "draft": 50052, "verify": 50053}
HEALTH_SERVICES = {
    "gateway": "specd.v1.GenerateService",
    "draft": "specd.v1.DraftService",
    "verify": "specd.v1.VerifyService",
}
METRICS_PORT = 9464
GPU = "nvidia.com/gpu"


def find(objects: list, kind: str, name: str | None = None) -> list:
    return [o for o in objects if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels/matchExpressions) selects these labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def http_health_probe(probe: dict) -> bool:
    """A plaintext GET /health on the gateway's named 'http' port."""
    get = probe.get("httpGet") or {}
    return get.get("path") == "/health" and get.get("port") == "http" and get.get("scheme", "HTTP") == "HTTP"


def config_value(objects: list, env: list, env_from: list, name: str) -> str | None:
    """The value a container sees for env var `name` (literal env, configMapKeyRef or envFrom)."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in find(objects, "ConfigMap")}
    for var in env:
        if var["name"] == name:
            if "value" in var:
                return var["value"]
            ref = var.get("valueFrom", {}).get("configMapKeyRef")
            return maps.get(ref["name"], {}).get(ref["key"]) if ref else None
    for source in env_from:
        ref = source.get("configMapRef")
        if ref and name in maps.get(ref["name"], {}):
            return maps[ref["name"]][name]
    return None


def lint(path: Path) -> list:
    objects = [o for o in yaml.safe_load_all(path.read_text()) if o]
    problems = []

    def problem(message: str) -> None:
        problems.append(f"{path.name}: {message}")

    drafted = container_env(objects, "gateway", "SPECD_DRAFT_ADDRESS") != ""  # "" = no draft service
    if not drafted and find(objects, "Deployment", "specd-draft"):
        problem("specd-draft is deployed but the gateway's SPECD_DRAFT_ADDRESS is empty: it would never be asked")
    for component, port in COMPONENTS.items():
        name = f"specd-{component}"
        if component == "draft" and not drafted:
            continue
        deployments = find(objects, "Deployment", name)
        if len(deployments) != 1:
            problem(f"expected one Deployment {name}, found {len(deployments)}")
            continue
        deployment = deployments[0]
        pod = deployment["spec"]["template"]
        spec, labels = pod["spec"], pod["metadata"].get("labels", {})
        containers = spec["containers"]
        container = containers[0]
        env, env_from = container.get("env", []), container.get("envFrom", [])
        limits = container.get("resources", {}).get("limits", {})
        requests = container.get("resources", {}).get("requests", {})

        # Resources: requests and limits for CPU and memory; exactly one GPU for the model services,
        # or on CPU (SPECD_DEVICE=cpu) none and whole CPUs of their own.
        for kind in ("cpu", "memory"):
            if kind not in requests or kind not in limits:
                problem(f"{name}: {kind} request and limit are required")
        asks_gpu = GPU in limits or GPU in requests
        if component == "gateway":
            if asks_gpu:
                problem(f"{name}: the gateway must not ask for a GPU")
        elif config_value(objects, env, env_from, "SPECD_DEVICE") == "cpu":
            # Guaranteed QoS with whole CPUs: the static CPU manager then gives the pod cores of its
            # own, and the service measures its threads on exactly those (specd_engine/autotune.py).
            if asks_gpu:
                problem(f"{name}: a model service on CPU must not ask for a GPU")
            if any(str(requests.get(kind)) != str(limits.get(kind)) for kind in ("cpu", "memory")):
                problem(f"{name}: on CPU, requests must equal limits (Guaranteed QoS: cores of its own)")
            if not str(limits.get("cpu", "")).isdigit():
                problem(f"{name}: on CPU, limits.cpu must be whole CPUs, got {limits.get('cpu')!r}")
        else:
            if str(limits.get(GPU)) != "1" or str(requests.get(GPU, limits.get(GPU))) != "1":
                problem(f"{name}: must request exactly one {GPU}")
            node_selector = spec.get("nodeSelector", {})
            node_affinity = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
            if not node_selector and not node_affinity:
                problem(f"{name}: no nodeSelector/required node affinity placing it on GPU nodes")
            if not any(t.get("key") == GPU for t in spec.get("tolerations", [])):
                problem(f"{name}: no toleration for the {GPU} taint of GPU nodes")

        # Ports and gRPC health probes against grpc.health.v1.
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        if ports.get("grpc") != port:
            problem(f"{name}: container port 'grpc' should be {port}")
        if ports.get("metrics") != METRICS_PORT:
            problem(f"{name}: container port 'metrics' should be {METRICS_PORT}")
        if config_value(objects, env, env_from, "SPECD_PORT") != str(port):
            problem(f"{name}: SPECD_PORT should be {port}")
        if config_value(objects, env, env_from, "SPECD_HOST") != "0.0.0.0":
            problem(f"{name}: SPECD_HOST should be 0.0.0.0")
        tls_on = bool(config_value(objects, env, env_from, "SPECD_TLS_CERT"))
        health_port = int(config_value(objects, env, env_from, "SPECD_HEALTH_PORT") or -1)
        probe_port = health_port if health_port >= 0 else port
        if tls_on and health_port < 0:
            problem(f"{name}: TLS on {port} needs SPECD_HEALTH_PORT: Kubernetes' gRPC probes cannot speak TLS")
        if health_port >= 0 and ports.get("health") != health_port:
            problem(f"{name}: container port 'health' should be SPECD_HEALTH_PORT {health_port}")
        http_port = int(config_value(objects, env, env_from, "SPECD_HTTP_PORT") or 0) if component == "gateway" else 0
        if http_port and ports.get("http") != http_port:
            problem(f"{name}: container port 'http' should be SPECD_HTTP_PORT {http_port}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe == "readinessProbe" and http_port and not tls_on and http_health_probe(container.get(probe, {})):
                continue  # GET /health: GenerateService's gRPC health status, and proof the HTTP API answers
            grpc_probe = container.get(probe, {}).get("grpc")
            if not grpc_probe or grpc_probe.get("port") != probe_port:
                problem(f"{name}: {probe} must be a grpc probe on port {probe_port}")
        readiness = container.get("readinessProbe", {}).get("grpc", {})
        if readiness and readiness.get("service") != HEALTH_SERVICES[component]:
            problem(f"{name}: readinessProbe should check the health of {HEALTH_SERVICES[component]}")

        # Drain timing: preStop + SPECD_GRACE fits in the termination grace; liveness outlasts the drain.
        grace = float(config_value(objects, env, env_from, "SPECD_GRACE") or 10)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        termination = spec.get("terminationGracePeriodSeconds", 30)
        if termination <= grace + pre_stop:
            problem(f"{name}: terminationGracePeriodSeconds {termination} <= preStop {pre_stop} + SPECD_GRACE {grace:g}")
        liveness = container.get("livenessProbe", {})
        if liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3) <= grace:
            problem(f"{name}: livenessProbe could kill a pod that is draining for SPECD_GRACE {grace:g} s")

        # Security: nothing bound on the node's interfaces, past Services and NetworkPolicies.
        if spec.get("hostNetwork"):
            problem(f"{name}: hostNetwork exposes every port on the node")
        for c in containers:
            if any("hostPort" in p for p in c.get("ports", [])):
                problem(f"{name}/{c['name']}: hostPort exposes the port on the node")

        # Security: non-root, no privilege escalation, no API token.
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            problem(f"{name}: pod securityContext.runAsNonRoot must be true")
        for c in containers:
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problem(f"{name}/{c['name']}: allowPrivilegeEscalation must be false")
        if spec.get("automountServiceAccountToken") is not False:
            problem(f"{name}: automountServiceAccountToken should be false")
        if spec.get("enableServiceLinks") is not False:
            problem(f"{name}: enableServiceLinks must be false (service env vars collide with SPECD_*)")

        # Images: pinned, never :latest.
        for c in containers:
            image = c["image"]
            if ":" not in image.rsplit("/", 1)[-1] and "@" not in image or image.endswith(":latest"):
                problem(f"{name}/{c['name']}: image {image!r} has no pinned tag")

        # Observability: Prometheus scrape annotations and an OTLP endpoint.
        annotations = pod["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != str(METRICS_PORT):
            problem(f"{name}: pod needs prometheus.io/scrape=true and prometheus.io/port={METRICS_PORT}")
        if config_value(objects, env, env_from, "SPECD_METRICS_PORT") != str(METRICS_PORT):
            problem(f"{name}: SPECD_METRICS_PORT should be {METRICS_PORT}")
        endpoint = config_value(objects, env, env_from, "OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            problem(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT is not set")
        if not config_value(objects, env, env_from, "OTEL_SERVICE_NAME"):
            problem(f"{name}: OTEL_SERVICE_NAME is not set")

        # Service: headless for the model services (the gateway pins sessions to pod IPs).
        services = find(objects, "Service", name)
        if len(services) != 1:
            problem(f"expected one Service {name}")
        else:
            service = services[0]["spec"]
            if not selects({"matchLabels": service.get("selector", {})}, labels):
                problem(f"Service {name} does not select its pods")
            headless = service.get("clusterIP") == "None"
            if component != "gateway" and not headless:
                problem(f"Service {name} must be headless (clusterIP: None)")
            if component != "gateway" and service.get("publishNotReadyAddresses"):
                problem(f"Service {name} must not publish unready pods")
            if component != "gateway" and (service.get("type", "ClusterIP") != "ClusterIP" or service.get("externalIPs")):
                problem(f"Service {name} must stay inside the cluster (ClusterIP, no externalIPs): only the gateway is public")

        # Disruption budget.
        if not any(selects(p["spec"]["selector"], labels) for p in find(objects, "PodDisruptionBudget")):
            problem(f"{name}: no PodDisruptionBudget selects its pods")

        # Network: who may reach this pod's gRPC port.
        policies = [p for p in find(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)]
        if not any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies):
            problem(f"{name}: no default-deny ingress NetworkPolicy covers it")
        rules = [r for p in policies for r in p["spec"].get("ingress", [])]
        grpc_rules = [r for r in rules if any(x.get("port") in (port, "grpc") for x in r.get("ports", [])) or not r.get("ports")]
        if component == "gateway":
            if not grpc_rules:
                problem(f"{name}: no NetworkPolicy admits clients on {port}")
        else:
            for rule in grpc_rules:
                sources = rule.get("from")
                gateway_only = sources and all(
                    set(s) == {"podSelector"} and selects(s["podSelector"], {**labels, "app.kubernetes.io/component": "gateway"})
                    and not selects(s["podSelector"], labels)
                    for s in sources
                )
                if not gateway_only:
                    problem(f"{name}: a NetworkPolicy admits {port} from other than gateway pods: {rule}")
            if not grpc_rules:
                problem(f"{name}: no NetworkPolicy admits the gateway on {port}")

    problems += [f"{path.name}: {message}" for message in tls_agreement(objects)]
    hpas = [h for h in find(objects, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == "specd-gateway"]
    if not hpas:
        problem("no HorizontalPodAutoscaler for specd-gateway")
    return problems


def container_env(objects: list, component: str, name: str) -> str | None:
    """A SPECD_* setting of the component's container (env or its ConfigMaps), None when unset or no such Deployment."""
    deployments = find(objects, "Deployment", f"specd-{component}")
    if not deployments:
        return None
    container = deployments[0]["spec"]["template"]["spec"]["containers"][0]
    return config_value(objects, container.get("env", []), container.get("envFrom", []), name)


def tls_agreement(objects: list) -> list:
    """The gateway dials draft and verify the way they listen: TLS to TLS, a client cert where one is required."""
    problems = []
    gateway_tls = bool(container_env(objects, "gateway", "SPECD_TLS_CA"))
    gateway_cert = bool(container_env(objects, "gateway", "SPECD_TLS_CLIENT_CERT"))
    for component in ("draft", "verify"):
        if not find(objects, "Deployment", f"specd-{component}"):
            continue  # none deployed (no draft service): nothing to dial
        server_tls = bool(container_env(objects, component, "SPECD_TLS_CERT"))
        mutual = bool(container_env(objects, component, "SPECD_TLS_CLIENT_CA"))
        if server_tls != gateway_tls:
            problems.append(f"specd-{component} TLS {'on' if server_tls else 'off'} but the gateway's SPECD_TLS_CA is "
                            f"{'set' if gateway_tls else 'unset'}: the gateway could not connect")
        if mutual and not gateway_cert:
            problems.append(f"specd-{component} requires client certificates but the gateway has no SPECD_TLS_CLIENT_CERT")
    return problems


def main(argv: list) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    problems = [p for name in argv[1:] for p in lint(Path(name))]
    for line in problems:
        print(f"ERROR {line}")
    if not problems:
        print(f"OK policy checks on {len(argv) - 1} rendered overlay(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
