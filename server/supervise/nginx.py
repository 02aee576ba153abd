"""The Nginx front: render nginx.conf.template (beside this module, so that an installed
``batchfit up`` has it), check it, run it with a prefix.

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

# The checkout's root: the compose rendering is written into it, never read by a replica.
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = Path(__file__).resolve().with_name("nginx.conf.template")
COMPOSE_CONFIG_PATH = ROOT / "deploy" / "nginx" / "nginx.conf"
COMPOSE_UPSTREAMS = ("replica-0:8000", "replica-1:8000")
# uvicorn's keep-alive (server/cli.py uses this) and Nginx's upstream keep-alive below it: Nginx
# drops an idle upstream connection before the replica does, so a reused connection never races
# a closing socket.
UVICORN_KEEP_ALIVE_S = 75
UPSTREAM_KEEP_ALIVE_S = UVICORN_KEEP_ALIVE_S - 15
RETRY_WINDOW_S = 60
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
    cache_bytes: int = 0
    """Most bytes of whole answers Nginx keeps for the embedding routes (0: no cache)."""
    cache_valid_s: int = 60
    cache_body_bytes: int = 131072
    """Request bodies up to this size are read into memory and can be cached; larger ones
    always go to a replica."""
    generation_read_timeout_s: int | None = None
    """The read timeout of the generation routes (None: ``read_timeout_s``); see
    ``generation_read_timeout_for``."""

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("an Nginx config needs at least one upstream replica")
        if self.read_timeout_s < 2:
            raise ValueError(
                f"read_timeout_s must be at least 2 (got {self.read_timeout_s}): the retry "
                "window ends a second before it"
            )
        if self.generation_read_timeout_s is not None and (
            self.generation_read_timeout_s < self.read_timeout_s
        ):
            raise ValueError(
                f"generation_read_timeout_s ({self.generation_read_timeout_s}) is below "
                f"read_timeout_s ({self.read_timeout_s}): a generation waits for its first "
                "token as long as any request waits for its answer"
            )

    @property
    def generation_timeout_s(self) -> int:
        """The generation routes' read timeout, resolved."""
        return self.generation_read_timeout_s or self.read_timeout_s


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
"""Answered by generators, as server-sent event streams when the request asks."""


def exact_paths_regex(paths: Sequence[str]) -> str:
    """The Nginx ``location ~`` pattern that matches exactly ``paths``."""
    return "^(" + "|".join(re.escape(path) for path in paths) + ")$"


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
        "retry_window_s": str(retry_window_for(config.read_timeout_s)),
        "generation_read_timeout_s": str(config.generation_timeout_s),
        "generation_retry_window_s": str(retry_window_for(config.generation_timeout_s)),
        "generation_location_regex": exact_paths_regex(GENERATION_ROUTES),
        "rate_limit_rps": str(config.rate_limit_rps),
        "rate_limit_burst": str(config.rate_limit_burst),
        "upstream_keepalive_s": str(UPSTREAM_KEEP_ALIVE_S),
        "api_location_regex": nginx_location_regex(),
        **_path_directives(config.prefix),
        **_cache_directives(config),
    }
    unknown = set(_PLACEHOLDER.findall(template)) - values.keys()
    if unknown:
        raise ValueError(f"the Nginx template has unknown placeholders: {sorted(unknown)}")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def read_timeout_for(max_timeout_s: float) -> int:
    """Longer than the replicas' request deadline cap, so a replica answers its own 504 first."""
    return math.ceil(max_timeout_s) + 5


def generation_read_timeout_for(generation_read_timeout_s: int, max_timeout_s: float) -> int:
    """The generation routes' read timeout: the one asked for, but never below the other
    routes' (``read_timeout_for``), since a generation's first token may take as long as
    ``max_timeout_s`` too."""
    return max(generation_read_timeout_s, read_timeout_for(max_timeout_s))


def retry_window_for(read_timeout_s: int) -> int:
    """How long after a request's start Nginx may still pass it to another replica: long
    enough to outlast a hung replica's discovery and kill (whose connections are then reset),
    and over before ``read_timeout_s``, so that a read timeout (``timeout`` in
    ``proxy_next_upstream``, as is a connect timeout) is never retried. At least 1 s (0 would
    mean no limit)."""
    return max(1, min(RETRY_WINDOW_S, read_timeout_s - 1))


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


CACHED_ROUTES = ("/v1/embeddings", "/v1/infer")
"""Answered by the embedding models: the same body always gets the same answer."""
CACHE_KEY = "$request_method|$request_uri|$http_authorization|$content_type|$request_body"


def _cache_directives(config: NginxConfig) -> dict[str, str]:
    """The answer cache, or nothing at all when it is off."""
    if not config.cache_bytes:
        return {"cache_http": "", "cache_locations": ""}
    path = f"{config.prefix}/cache" if config.prefix is not None else "/var/cache/nginx/batchfit"
    http = f"""    # The answer cache for the embedding routes (off unless asked). The key holds the
    # request's body and its Authorization header, so a different body or another API key
    # is another entry. A body larger than client_body_buffer_size is kept in a file, where
    # $request_body is empty: such requests always go to a replica, never into the cache.
    proxy_cache_path {path} levels=1:2 keys_zone=batchfit_cache:10m
                     max_size={config.cache_bytes} inactive={config.cache_valid_s}s
                     use_temp_path=off;
    map $request_body $batchfit_no_cache {{
        "" 1;
        default 0;
    }}
"""
    locations = f"""        # Whole answers of the embedding routes, cached (POST included) for
        # {config.cache_valid_s}s; X-Cache-Status says HIT, MISS or BYPASS.
        location ~ {exact_paths_regex(CACHED_ROUTES)} {{
            client_body_buffer_size {config.cache_body_bytes};
            proxy_cache batchfit_cache;
            proxy_cache_methods POST;
            proxy_cache_key "{CACHE_KEY}";
            proxy_cache_valid 200 {config.cache_valid_s}s;
            proxy_cache_bypass $batchfit_no_cache;
            proxy_no_cache $batchfit_no_cache;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 5s;
            add_header X-Cache-Status $upstream_cache_status always;
            proxy_pass http://batchfit_replicas;
        }}
"""
    return {"cache_http": http, "cache_locations": locations}


def compose_config() -> NginxConfig:
    """The rendering docker-compose uses: the two replicas, the default limits."""
    replica = Settings.model_fields
    up = LauncherSettings.model_fields
    max_timeout_s = replica["max_timeout_s"].default
    return NginxConfig(
        upstreams=COMPOSE_UPSTREAMS,
        listen="80",
        max_body_bytes=replica["max_body_bytes"].default,
        read_timeout_s=read_timeout_for(max_timeout_s),
        rate_limit_rps=up["rate_limit_rps"].default,
        rate_limit_burst=up["rate_limit_burst"].default,
        generation_read_timeout_s=generation_read_timeout_for(
            up["generation_read_timeout_s"].default, max_timeout_s
        ),
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
