"""The replica's output cache: outputs per input (a bounded LRU store with byte accounting),
keyed by what the model reads, and one computation per input in flight."""

from .flights import Flight
from .inputs import Admission, InputCache
from .key import CacheKey, cache_key, item_payload
from .metrics import CacheMetrics
from .sizing import default_cache_bytes, host_memory_bytes
from .store import ENTRY_OVERHEAD_BYTES, OutputStore, stored_value, value_bytes

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "Admission",
    "CacheKey",
    "CacheMetrics",
    "Flight",
    "InputCache",
    "OutputStore",
    "cache_key",
    "default_cache_bytes",
    "host_memory_bytes",
    "item_payload",
    "stored_value",
    "value_bytes",
]
