"""LXD's envelopes as a client sees them on the wire, written out for tests to compare with."""

from __future__ import annotations

from typing import Any


def sync_envelope(metadata: Any) -> dict[str, Any]:
    """LXD's success envelope around ``metadata``."""
    return {
        "type": "sync",
        "status": "Success",
        "status_code": 200,
        "operation": "",
        "error_code": 0,
        "error": "",
        "metadata": metadata,
    }


def error_envelope(code: int, message: str) -> dict[str, Any]:
    """LXD's error envelope: ``code`` is also the HTTP status."""
    return {
        "type": "error",
        "status": "",
        "status_code": 0,
        "operation": "",
        "error_code": code,
        "error": message,
        "metadata": None,
    }
