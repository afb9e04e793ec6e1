"""``twistd vmready``: the service, its options, and ``./dev run``."""

from vmready.daemon.service import VMReadyService
from vmready.daemon.tap import Options, makeService

__all__ = ["Options", "VMReadyService", "makeService"]
