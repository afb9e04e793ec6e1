"""Fuzz targets for the HTTP side.

API bodies and query strings, config values, client certificates.
"""

from __future__ import annotations

from tests.fuzzing.target import FuzzTarget

TARGETS: list[FuzzTarget] = []
