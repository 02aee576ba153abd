"""Causal LMs on torch: loading, the key/value store, the attention over packed sequences and
the sampler, behind the generation contract (``models/generative.py``)."""

from .loading import load_generator
from .model import CausalLM

__all__ = ["CausalLM", "load_generator"]
