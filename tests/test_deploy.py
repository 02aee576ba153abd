"""Static checks of the deployment files: no Docker engine runs here, so parse and verify."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from fastapi.routing import iter_route_contexts

from server import create_app
from server.errors import ERROR_TYPES, NGINX
from server.generate import router as generate_router
from server.public_api import is_public_api, nginx_location_regex, public_api_routes
from server.settings import LauncherSettings, Settings
from server.supervise.nginx import (
    CACHED_ROUTES,
    COMPOSE_CONFIG_PATH,
    GENERATION_ROUTES,
    TEMPLATE_PATH,
    UPSTREAM_KEEP_ALIVE_S,
    UVICORN_KEEP_ALIVE_S,
    NginxConfig,
    check_config,
    compose_config,
    exact_paths_regex,
    generation_read_timeout_for,
    read_timeout_for,
    render,
)
from server.supervise.nginx import main as nginx_main
from tests.ci import unavailable
from tests.launch import require_nginx

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
REPLICAS = ("replica-0", "replica-1")


class ComposeLoader(yaml.SafeLoader):
    """PyYAML plus Compose's merge tags (!reset, !override)."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(
        _tag,
        lambda loader, node, tag=_tag: (
            tag,
            loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
            else loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
            else loader.construct_scalar(node),
        ),
    )  # fmt: skip


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def compose():
    return load(COMPOSE)


@pytest.fixture(scope="module")
def nginx_conf():
    return COMPOSE_CONFIG_PATH.read_text()


def directive(conf: str, name: str) -> list[str]:
    return re.findall(rf"^[ \t]*{name}[ \t]+([^;{{\n]*);", conf, re.MULTILINE)


def uncommented(conf: str) -> str:
    return re.sub(r"^\s*#.*$", "", conf, flags=re.MULTILINE)


# A location block of ours: its pattern, then its body up to the brace that closes it, alone on
# a line at the server block's indentation (the error pages' bodies hold braces too).
_LOCATION = re.compile(
    r"^        location (?:~ |= |\^~ )?(\S+) \{\n(.*?)^        \}\n", re.S | re.M
)


def locations(conf: str) -> dict[str, str]:
    """Every location block's body, by its pattern, in order."""
    return {match.group(1): match.group(2) for match in _LOCATION.finditer(conf)}


def server_level(conf: str) -> str:
    """The config without its location blocks: what every location inherits."""
    return _LOCATION.sub("", conf)


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)?", value)
    assert match, value
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[match.group(2)]


# The Nginx config.


def test_checked_in_compose_config_is_the_template_rendered():
    assert COMPOSE_CONFIG_PATH.read_text() == render(compose_config()), (
        "deploy/nginx/nginx.conf drifted from the template: run python -m server.supervise.nginx"
    )
    assert nginx_main(["--check"]) == 0


def test_render_refuses_unknown_placeholders_and_empty_upstreams():
    config = compose_config()
    with pytest.raises(ValueError, match="unknown placeholders"):
        render(config, template="listen {{listen}}; {{nope}}")
    with pytest.raises(ValueError, match="at least one upstream"):
        dataclasses.replace(config, upstreams=[])


def test_launcher_rendering_keeps_everything_under_its_prefix(tmp_path):
    config = NginxConfig(
        upstreams=["127.0.0.1:9001", "127.0.0.1:9002"], listen="127.0.0.1:9000",
        max_body_bytes=4096, read_timeout_s=70, rate_limit_rps=5, rate_limit_burst=7,
        prefix=tmp_path,
    )  # fmt: skip
    conf = render(config)
    assert "{{" not in conf
    for name in ("pid", "error_log", "access_log", "client_body_temp_path", "proxy_temp_path"):
        (value,) = directive(conf, name)
        assert value.startswith(str(tmp_path)), (name, value)
    assert directive(conf, "client_max_body_size") == ["4096"]
    # No generation read timeout given: the generation routes wait as long as the others.
    assert directive(conf, "proxy_read_timeout") == ["70s", "70s"]
    assert "rate=5r/s" in conf and "burst=7" in conf
    assert directive(conf, "server") == [
        "127.0.0.1:9001 max_fails=2 fail_timeout=5s", "127.0.0.1:9002 max_fails=2 fail_timeout=5s",
    ]  # fmt: skip
    # Every directive that is not about paths or the values above is the compose config's.
    compose_lines = set(render(compose_config()).splitlines())
    differing = [line for line in conf.splitlines() if line not in compose_lines]
    for line in differing:
        assert re.search(r"_path|pid |error_log|access_log|user |server 127|listen|"
                         r"client_max_body_size|proxy_read_timeout|rate=|burst=|limit of 4096",
                         line), line  # fmt: skip


def test_balancing_keepalive_and_headers(nginx_conf):
    assert directive(nginx_conf, "least_conn") == [] and "least_conn;" in nginx_conf
    assert directive(nginx_conf, "keepalive") == ["32"]
    assert directive(nginx_conf, "proxy_http_version") == ["1.1"]
    assert 'Connection ""' in directive(nginx_conf, "proxy_set_header")
    (upstream_keepalive,) = directive(nginx_conf, "keepalive_timeout")
    assert seconds(upstream_keepalive) == UPSTREAM_KEEP_ALIVE_S < UVICORN_KEEP_ALIVE_S


def test_failover_policy(nginx_conf):
    (next_upstream,) = directive(nginx_conf, "proxy_next_upstream")
    conditions = next_upstream.split()
    # A connect timeout (`timeout`) is retried too: no replica has seen the request.
    assert {"error", "timeout", "http_503", "non_idempotent"} <= set(conditions)
    # Never on overload (429), nor on a replica's own deadline (504).
    assert not {"http_429", "http_504"} & set(conditions)
    assert directive(nginx_conf, "proxy_next_upstream_tries") == ["2"]
    (retry_time,) = directive(server_level(nginx_conf), "proxy_next_upstream_timeout")
    assert 0 < seconds(retry_time) <= 60
    # `timeout` names the read timeout too, which must never be retried (a slow batch must
    # not run twice): the retry window is over before it fires, and after the connect timeout.
    (connect_timeout,) = directive(nginx_conf, "proxy_connect_timeout")
    (read_timeout,) = directive(server_level(nginx_conf), "proxy_read_timeout")
    assert seconds(connect_timeout) < seconds(retry_time) < seconds(read_timeout)
    # A hung replica's requests are retried once batchfit up has found and killed it.
    up = LauncherSettings()
    found_s = up.liveness_failures * (up.liveness_period_s + up.liveness_timeout_s)
    assert found_s < seconds(retry_time)
    # A hung forward pass: the launcher's probe restarts the replica before it ends itself.
    served = Settings()
    assert served.forward_timeout_s + found_s < served.forward_exit_after_s
    for server in directive(nginx_conf, "server"):
        assert "max_fails=" in server and "fail_timeout=" in server
    # Nginx waits longer than any replica's own deadline.
    assert seconds(read_timeout) > Settings.model_fields["max_timeout_s"].default


@pytest.mark.parametrize("max_timeout_s", [0.5, 1, 20, 58, 300, 3600])
@pytest.mark.parametrize("asked_s", [2, 30, 3600, 7200])
def test_the_retry_window_ends_before_any_read_timeout(max_timeout_s, asked_s):
    """On the generation routes too, whatever --generation-read-timeout-s asks for."""
    read_timeout_s = read_timeout_for(max_timeout_s)
    generation_s = generation_read_timeout_for(asked_s, max_timeout_s)
    assert generation_s == max(asked_s, read_timeout_s)
    config = NginxConfig(
        upstreams=["127.0.0.1:1"], listen="127.0.0.1:2", max_body_bytes=1, rate_limit_rps=1,
        rate_limit_burst=1, read_timeout_s=read_timeout_s, generation_read_timeout_s=generation_s,
    )  # fmt: skip
    conf = render(config)
    (connect_timeout,) = directive(conf, "proxy_connect_timeout")
    generation = locations(conf)[exact_paths_regex(GENERATION_ROUTES)]
    for scope, timeout_s in ((server_level(conf), read_timeout_s), (generation, generation_s)):
        (read_timeout,) = directive(scope, "proxy_read_timeout")
        (retry_time,) = directive(scope, "proxy_next_upstream_timeout")
        assert seconds(read_timeout) == timeout_s
        assert seconds(connect_timeout) < seconds(retry_time) < timeout_s
        assert seconds(retry_time) == min(60, timeout_s - 1)
    with pytest.raises(ValueError, match="read_timeout_s must be at least 2"):
        dataclasses.replace(config, read_timeout_s=1)
    with pytest.raises(ValueError, match=rf"generation_read_timeout_s \({read_timeout_s - 1}\)"):
        dataclasses.replace(config, generation_read_timeout_s=read_timeout_s - 1)


def test_generation_routes_stream_unbuffered_with_a_long_read_timeout(nginx_conf):
    """The stream's events go out as the replica writes them (no buffering, cache or gzip);
    the read timeout outlasts a long non-streamed generation, the default of batchfit up's
    --generation-read-timeout-s; the retries are the server's, ending long before it."""
    blocks = locations(nginx_conf)
    generation = blocks[exact_paths_regex(GENERATION_ROUTES)]
    assert directive(generation, "proxy_buffering") == ["off"]
    assert directive(generation, "proxy_cache") == ["off"]
    assert directive(generation, "gzip") == ["off"]
    assert directive(generation, "proxy_pass") == ["http://batchfit_replicas"]
    (read_timeout,) = directive(generation, "proxy_read_timeout")
    (embedding_read_timeout,) = directive(server_level(nginx_conf), "proxy_read_timeout")
    default_s = LauncherSettings.model_fields["generation_read_timeout_s"].default
    assert seconds(read_timeout) == default_s >= 3600 > seconds(embedding_read_timeout)
    # Inherited from the server: the retry conditions, the headers (an add_header here would
    # drop X-Request-ID) and the rate limit.
    for inherited in ("proxy_next_upstream", "proxy_next_upstream_tries", "add_header",
                      "proxy_set_header", "limit_req", "proxy_intercept_errors"):  # fmt: skip
        assert directive(generation, inherited) == [], inherited
    (retry_time,) = directive(generation, "proxy_next_upstream_timeout")
    up = LauncherSettings()
    found_s = up.liveness_failures * (up.liveness_period_s + up.liveness_timeout_s)
    assert found_s < seconds(retry_time) < seconds(read_timeout)
    # Nginx takes the first regex location that matches: the generation routes' comes before
    # the one for the rest of the API; the output cache keeps to the embedding routes.
    order = list(blocks)
    assert order.index(exact_paths_regex(GENERATION_ROUTES)) < order.index(nginx_location_regex())
    assert not set(GENERATION_ROUTES) & set(CACHED_ROUTES)
    assert directive(server_level(nginx_conf), "proxy_buffering") == []


def test_generation_read_timeout_is_never_below_the_other_routes():
    assert generation_read_timeout_for(60, 300) == read_timeout_for(300) == 305
    assert generation_read_timeout_for(3600, 300) == 3600
    assert generation_read_timeout_for(3600, 7200) == 7205
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        LauncherSettings(generation_read_timeout_s=1)


def test_limits_errors_and_routes(nginx_conf):
    assert directive(nginx_conf, "client_max_body_size") == [
        str(Settings.model_fields["max_body_bytes"].default)
    ]
    assert directive(nginx_conf, "limit_req_status") == ["429"]
    assert len(directive(nginx_conf, "limit_req")) == 1
    assert set(directive(nginx_conf, "error_page")) == {
        "502 503 =503 @unavailable", "504 =504 @gateway_timeout", "429 =429 @rate_limited",
        "413 =413 @payload_too_large",
    }  # fmt: skip
    # Every Nginx-made error body has the app's shape.
    for body in re.findall(r"return \d+ '([^']*)'", nginx_conf):
        assert re.fullmatch(
            r'\{"error":"[^"]+","error_type":"[a-z_]+","request_id":"\$batchfit_request_id"\}\\n',
            body,
        ), body
    assert "/metrics" not in uncommented(nginx_conf)
    assert "/health" not in uncommented(nginx_conf)


def test_nginx_answers_only_registered_error_types(nginx_conf):
    """Nginx's own error bodies name exactly the error types server/errors.py lists as
    answered by Nginx, with the status each is registered with."""
    answered = dict(
        (kind, int(status)) for status, kind in
        re.findall(r"return (\d+) '\{[^']*\"error_type\":\"([a-z_]+)\"", nginx_conf)
    )  # fmt: skip
    registered = {name for name, kind in ERROR_TYPES.items() if NGINX in kind.answered_by}
    assert set(answered) == registered
    for name, status in answered.items():
        assert status in ERROR_TYPES[name].statuses, name


def test_nginx_routes_exactly_the_public_api(nginx_conf):
    """Two locations send paths to the replicas: the generation routes', then one whose
    pattern matches what server/public_api.py calls the public API: every route under /v1
    and /v2 the app serves, none of the operator routes."""
    routed = [pattern for pattern, body in locations(nginx_conf).items() if "proxy_pass" in body]
    assert routed == [exact_paths_regex(GENERATION_ROUTES), nginx_location_regex()]
    assert re.findall(r"location (~ |= |\^~ )?\S+ \{", nginx_conf).count("~ ") == 2
    generation = re.compile(routed[0])
    served = {route.path for route in generate_router.routes}
    assert served == set(GENERATION_ROUTES)
    for path in [*served, "/v1/completions/", "/v1/chat/completionsx", "/v1/chat",
                 "/v2/completions", "/v1/embeddings", "/x/v1/completions"]:  # fmt: skip
        assert bool(generation.search(path)) == (path in served), path
    pattern = re.compile(routed[1])
    app = create_app(Settings())
    app_paths = [route.path for route in iter_route_contexts(app.routes) if route.path]
    public = {route.path for route in public_api_routes(app)}
    assert {"/v1/infer", "/v1/rerank", "/v1/embeddings", "/v2/models/{name:path}/infer"} <= public
    assert {path for path in app_paths if is_public_api(path)} == public
    assert "/embed_sparse" in public
    for path in [*app_paths, "/v1", "/v2", "/v1x", "/v2x/models", "/", "/v3/models",
                 "/embed_sparse/x", "/embed_sparsex", "/x/embed_sparse"]:  # fmt: skip
        assert bool(pattern.search(path)) == is_public_api(path), path
    for operator_path in ("/metrics", "/health/ready", "/status", "/status.json", "/docs",
                          "/openapi.json", "/admin/profile", "/redoc"):  # fmt: skip
        assert not pattern.search(operator_path), operator_path


def test_no_plus_only_directives():
    template = TEMPLATE_PATH.read_text()
    for plus_only in ("health_check", "zone_sync", "sticky", "queue ", "ntlm", "status_zone",
                      "resolve", "api "):  # fmt: skip
        assert not re.search(rf"^\s*{plus_only}", template, re.MULTILINE), plus_only


@pytest.mark.integration
def test_nginx_accepts_the_compose_config(tmp_path):
    # The compose hostnames do not resolve outside Docker: the test copy differs from the
    # checked-in file only in those two addresses.
    text = COMPOSE_CONFIG_PATH.read_text()
    copy = text
    for replica in REPLICAS:
        copy = copy.replace(f"{replica}:8000", "127.0.0.1:8000")
    assert sum(a != b for a, b in zip(text.splitlines(), copy.splitlines(), strict=True)) == 2
    conf = tmp_path / "nginx.conf"
    conf.write_text(copy)
    (tmp_path / "logs").mkdir()
    check_config(require_nginx(), tmp_path, conf)


@pytest.mark.integration
def test_nginx_accepts_the_exact_compose_file_with_replica_names_resolving(tmp_path):
    """The checked-in file itself, with replica-0/replica-1 in a private /etc/hosts (a mount
    namespace, so the machine's own /etc/hosts is untouched)."""
    nginx = require_nginx()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    if probe.returncode:  # CI runs as root, where unshare -m works
        unavailable(f"no mount namespaces here (needs root or user namespaces): {probe.stderr}")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost " + " ".join(REPLICAS) + "\n")
    (tmp_path / "logs").mkdir()
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount --bind "{hosts}" /etc/hosts && exec "{nginx}" -p "{tmp_path}/" '
         f'-e "{tmp_path}/logs/error.log" -c "{COMPOSE_CONFIG_PATH}" -t'],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


# docker-compose.yml and the CPU override.


def test_services_and_published_ports(compose):
    services = compose["services"]
    assert set(services) == {*REPLICAS, "nginx", "prometheus", "grafana"}
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert list(published) == ["nginx"]
    assert published["nginx"] == ["8000:80"]


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_replica_image_is_tagged_with_the_project_version_never_latest(compose):
    images = {name: service["image"] for name, service in compose["services"].items()
              if name in REPLICAS}  # fmt: skip
    for name, image in images.items():
        repository, _, tag = image.partition(":")
        assert repository == "batchfit", name
        # ${BATCHFIT_IMAGE_TAG:-default}: the tag a user sets, else the project's version.
        match = re.fullmatch(r"\$\{BATCHFIT_IMAGE_TAG:-([^}]+)\}", tag)
        assert match, (name, image)
        assert match.group(1) == project_version() != "latest", (name, image)


def test_every_upstream_nginx_names_is_a_replica_service(compose, nginx_conf):
    upstreams = [s.split()[0] for s in directive(nginx_conf, "server")]
    assert upstreams == [f"{name}:8000" for name in REPLICAS]
    for upstream in upstreams:
        host, port = upstream.split(":")
        service = compose["services"][host]
        assert service["environment"]["BATCHFIT_PORT"] == port
        assert port in service["expose"]


def test_every_mounted_file_exists(compose):
    mounts = 0
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("./"), (name, volume)
            assert (ROOT / source).exists(), (name, source)
            mounts += 1
    assert mounts >= 5
    nginx_mount = compose["services"]["nginx"]["volumes"][0]
    assert nginx_mount == "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro"


def test_replicas_gpus_healthchecks_and_grace(compose):
    for index, name in enumerate(REPLICAS):
        service = compose["services"][name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "device_ids": [str(index)], "capabilities": ["gpu"]}
        health = service["healthcheck"]
        assert "/health/ready" in " ".join(health["test"])
        # Model load plus warm-up fit in the start period.
        assert seconds(health["start_period"]) >= 120
        env = service["environment"]
        assert env["BATCHFIT_METRICS_PORT"] == "8001"
        assert seconds(service["stop_grace_period"]) > float(env["BATCHFIT_DRAIN_TIMEOUT_S"])
        assert service["build"]["context"] == "."
    nginx = compose["services"]["nginx"]
    assert nginx["depends_on"] == {name: {"condition": "service_healthy"} for name in REPLICAS}


def test_prometheus_scrapes_replicas_directly_and_grafana_is_provisioned(compose):
    prometheus = load(ROOT / "deploy" / "prometheus" / "prometheus.yml")
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "batchfit"]
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"{name}:8001" for name in REPLICAS]
    grafana_mounts = {v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]}
    assert "/var/lib/grafana/dashboards" in grafana_mounts
    datasources = load(ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml")
    assert {"uid": "prometheus", "url": "http://prometheus:9090"}.items() <= (
        datasources["datasources"][0].items()
    )
    providers = load(ROOT / "deploy/grafana/provisioning/dashboards/batchfit.yml")
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert list((ROOT / "deploy/grafana/dashboards").glob("*.json"))


def test_cpu_override_drops_gpu_reservations():
    override = load(CPU_OVERRIDE)
    assert set(override["services"]) == set(REPLICAS)
    for service in override["services"].values():
        assert service["deploy"] == ("!reset", "null")
        assert service["environment"]["BATCHFIT_DEVICE"] == "cpu"
        assert "whl/cpu" in service["build"]["args"]["TORCH_INDEX_URL"]


# Dockerfile.


def test_dockerfile():
    text = DOCKERFILE.read_text()
    instructions = [line.split(None, 1) for line in text.splitlines()
                    if line and not line.startswith((" ", "#"))]  # fmt: skip
    keywords = [keyword for keyword, *_ in instructions]
    assert keywords[0] == "FROM" and "slim" in instructions[0][1]
    (user,) = [rest for keyword, rest in instructions if keyword == "USER"]
    assert user not in ("root", "0")
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert "useradd" in text
    (healthcheck,) = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    assert "--start-period" in healthcheck
    assert "/health/ready" in text[text.index("HEALTHCHECK") :]
    (entrypoint,) = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == '["batchfit", "serve"]'
    assert "torch==2.13.0" in text
    # Settings come from the environment.
    assert "BATCHFIT_HOST=0.0.0.0" in text


def test_the_image_installs_every_package_its_command_imports_and_their_data(tmp_path):
    """``pip install .`` in the image sees only what the Dockerfile copies: a package left out
    is missing from the installed ``batchfit``, whose command line imports them all. Build the
    wheel from exactly those files and import each of its modules with nothing else of the
    checkout on the path (the test environment's editable install included); the files the
    packages read (the Nginx template) must come with them."""
    text = DOCKERFILE.read_text()
    install = re.search(r"^RUN pip install .* \. ", text, re.MULTILINE).start()
    context = tmp_path / "context"
    copied = set()
    for sources in re.findall(r"^COPY (.+) \S+$", text[:install], re.MULTILINE):
        for source in sources.split():
            destination = context / source
            destination.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                copied.add(source)
                shutil.copytree(ROOT / source, destination, ignore=IGNORED)
            else:
                shutil.copy(ROOT / source, destination)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    assert packages <= copied, f"the image leaves out {sorted(packages - copied)}"

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(wheels), str(context)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    assert {p.name for p in installed.iterdir() if (p / "__init__.py").exists()} == packages

    # -I -S: neither the checkout nor site-packages' .pth files (the editable install's
    # finder) are on the path; the dependencies' own folder is added by hand.
    script = f"""
import importlib, pkgutil, sys
sys.path[:0] = [{str(installed)!r}]
sys.path.extend({[sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]!r})
for name in {sorted(packages)!r}:
    package = importlib.import_module(name)
    assert package.__file__.startswith({str(installed)!r}), package.__file__
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(module.name)
# batchfit up renders the Nginx template from the package, not from a checkout.
from server.supervise.nginx import TEMPLATE_PATH, compose_config, render
assert TEMPLATE_PATH.is_relative_to({str(installed)!r}), TEMPLATE_PATH
assert "proxy_next_upstream" in render(compose_config())
sys.argv = ["batchfit", "--help"]
from batchfit.__main__ import main
main()
"""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "serve" in result.stdout and "embed" in result.stdout


IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")
