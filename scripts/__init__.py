"""Measurement scripts (run as ``python -m scripts.<name>`` from the repository root)."""
