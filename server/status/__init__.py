"""The live status page of one replica: a ring buffer of samples and the page that draws it."""

from .history import SAMPLE_FIELDS, StatusHistory, percentile
from .routes import ASSETS_URL, make_status_router, status_assets

__all__ = [
    "ASSETS_URL",
    "SAMPLE_FIELDS",
    "StatusHistory",
    "make_status_router",
    "percentile",
    "status_assets",
]
