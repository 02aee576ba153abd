"""The Nginx front: render deploy/nginx/nginx.conf.template, check it, run it with a prefix.

One template serves both deployments: docker-compose (replica-N:8000, logs to the container's
stdout/stderr, the image's own temp paths) and ``batchfit up`` (loopback replicas, everything
under a temporary prefix, no root paths). ``python -m server.supervise.nginx`` rewrites the
compose rendering, deploy/nginx/nginx.conf, after the template changed (``--check``: exit 1 if
it is stale).
"""

from __future__ import annotations

import argparse
import math
import os
import pwd
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..public_api import nginx_location_regex
from ..settings import LauncherSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = ROOT / "deploy" / "nginx" / "nginx.conf.template"
COMPOSE_CONFIG_PATH = ROOT / "deploy" / "nginx" / "nginx.conf"
COMPOSE_UPSTREAMS = ("replica-0:8000", "replica-1:8000")
# uvicorn's keep-alive (server/cli.py uses this) and Nginx's upstream keep-alive below it: Nginx
# drops an idle upstream connection before the replica does, so a reused connection never races
# a closing socket.
UVICORN_KEEP_ALIVE_S = 75
UPSTREAM_KEEP_ALIVE_S = UVICORN_KEEP_ALIVE_S - 15
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


@dataclass(frozen=True, slots=True)
class NginxConfig:
    """What varies between renderings of the template."""

    upstreams: Sequence[str]
    listen: str
    max_body_bytes: int
    read_timeout_s: int
    rate_limit_rps: int
    rate_limit_burst: int
    # None: container paths (logs to stdout/stderr, the image's temp paths).
    prefix: Path | None = None
    max_fails: int = 2
    fail_timeout_s: int = 5

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("an Nginx config needs at least one upstream replica")


def render(config: NginxConfig, template: str | None = None) -> str:
    """The template with every placeholder filled; an unknown or missing one is an error."""
    template = TEMPLATE_PATH.read_text() if template is None else template
    values = {
        "upstream_servers": "\n".join(
            f"        server {address} max_fails={config.max_fails} "
            f"fail_timeout={config.fail_timeout_s}s;"
            for address in config.upstreams
        ),
        "listen": config.listen,
        "max_body_bytes": str(config.max_body_bytes),
        "read_timeout_s": str(config.read_timeout_s),
        "rate_limit_rps": str(config.rate_limit_rps),
        "rate_limit_burst": str(config.rate_limit_burst),
        "upstream_keepalive_s": str(UPSTREAM_KEEP_ALIVE_S),
        "api_location_regex": nginx_location_regex(),
        **_path_directives(config.prefix),
    }
    unknown = set(_PLACEHOLDER.findall(template)) - values.keys()
    if unknown:
        raise ValueError(f"the Nginx template has unknown placeholders: {sorted(unknown)}")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def read_timeout_for(max_timeout_s: float) -> int:
    """Longer than the replicas' request deadline cap, so a replica answers its own 504 first."""
    return math.ceil(max_timeout_s) + 5


def _path_directives(prefix: Path | None) -> dict[str, str]:
    if prefix is None:
        return {
            "main_directives": "error_log /dev/stderr warn;",
            "http_directives": "",
            "access_log": "/dev/stdout",
        }
    main = [f"pid {prefix}/nginx.pid;", f"error_log {prefix}/logs/error.log warn;"]
    if os.geteuid() == 0:
        # Started as root, Nginx would run its workers as `nobody`, who cannot write to a
        # private temporary prefix; keep them as the launching user.
        main.append(f"user {pwd.getpwuid(os.geteuid()).pw_name};")
    temp = "".join(f"    {kind}_temp_path {prefix}/temp/{kind};\n" for kind in TEMP_PATHS)
    return {
        "main_directives": "\n".join(main),
        "http_directives": temp,
        "access_log": f"{prefix}/logs/access.log",
    }


def compose_config() -> NginxConfig:
    """The rendering docker-compose uses: the two replicas, the default limits."""
    replica = Settings.model_fields
    up = LauncherSettings.model_fields
    return NginxConfig(
        upstreams=COMPOSE_UPSTREAMS,
        listen="80",
        max_body_bytes=replica["max_body_bytes"].default,
        read_timeout_s=read_timeout_for(replica["max_timeout_s"].default),
        rate_limit_rps=up["rate_limit_rps"].default,
        rate_limit_burst=up["rate_limit_burst"].default,
    )


def prepare_prefix(prefix: Path, config_text: str) -> Path:
    """Write the config and the directories Nginx needs under ``prefix``; return the conf path."""
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    (prefix / "temp").mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(config_text)
    return conf


def nginx_command(binary: str, prefix: Path, conf: Path, *extra: str) -> list[str]:
    # -e: Nginx opens its error log before reading the config; keep that out of /var/log too.
    return [binary, "-p", f"{prefix}/", "-e", str(prefix / "logs" / "error.log"), "-c", str(conf),
            *extra]  # fmt: skip


def check_config(binary: str, prefix: Path, conf: Path) -> None:
    """``nginx -t``; raises with Nginx's own message when the config is refused."""
    result = subprocess.run(
        nginx_command(binary, prefix, conf, "-t", "-q"),
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"nginx -t refused {conf}:\n{result.stderr}{result.stdout}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.supervise.nginx",
        description=f"Write {COMPOSE_CONFIG_PATH.relative_to(ROOT)}, the template rendered for "
        "docker-compose.",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render(compose_config())
    stale = not COMPOSE_CONFIG_PATH.exists() or COMPOSE_CONFIG_PATH.read_text() != text
    if args.check:
        print(f"{COMPOSE_CONFIG_PATH}: {'stale' if stale else 'up to date'}")
        return 1 if stale else 0
    if stale:
        COMPOSE_CONFIG_PATH.write_text(text)
        print(f"{COMPOSE_CONFIG_PATH}: rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
