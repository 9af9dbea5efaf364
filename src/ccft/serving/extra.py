"""The ``serve`` extra: one message for a missing dependency of the HTTP server (fastapi, pydantic,
prometheus-client, uvicorn)."""

from __future__ import annotations

__all__ = ["serve_extra_missing"]


def serve_extra_missing(e: ImportError) -> ImportError:
    """The ``ImportError`` to raise (``from e``) when a module of the ``serve`` extra is not installed."""
    return ImportError(
        f"ccft's HTTP server needs the `serve` extra ({e.name} is missing): pip install 'ccft[serve]'"
    )
