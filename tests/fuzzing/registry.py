"""Every fuzz target in the project, by name."""

from __future__ import annotations

from tests.fuzzing import web, wire
from tests.fuzzing.target import FuzzTarget


def all_targets() -> dict[str, FuzzTarget]:
    """Every target, by its unique name."""
    targets: dict[str, FuzzTarget] = {}
    for target in [*wire.TARGETS, *web.TARGETS]:
        if target.name in targets:
            raise ValueError(f"two fuzz targets named {target.name!r}")
        targets[target.name] = target
    return targets
