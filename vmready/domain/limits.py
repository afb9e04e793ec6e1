"""Process resource limits for programs that hold one connection per VM."""

from __future__ import annotations

import resource


def raise_file_limit() -> None:
    """Lift the soft open-file limit to the hard one: a QMP connection per running VM."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
