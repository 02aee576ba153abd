"""OpenAI's completions and chat completions over the replica's generators: request bodies,
their checks, answers and server-sent event streams."""

from .routes import router

__all__ = ["router"]
