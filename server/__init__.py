"""HTTP front end, settings and wiring. The only package that composes the others."""

# First: sets OpenMP's wait policy before anything imports torch.
from . import openmp  # noqa: F401  # isort: skip
from .app import create_app
from .errors import ApiError
from .settings import ServerConfig, Settings

__all__ = ["ApiError", "ServerConfig", "Settings", "create_app"]
