"""Example custom models for ``--model python:examples.<module>:<factory>``."""
