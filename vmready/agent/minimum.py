"""What the agent needs of its interpreter, checked first: one line instead of a traceback.

A guest may run an older ``python3`` than the agent supports, or one built
without ``ssl``; the agent would then die on a ``SyntaxError`` or an
``ImportError`` deep in its modules.  ``vmready.agent`` calls
``require_supported_python`` before importing anything else, so such a guest
gets one line on stderr and exit status 1.  This module itself must run on
any Python 3: no ``from __future__ import annotations``, so the annotations
that need newer Pythons are strings.
"""

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # for mypy only: typing costs at every start under emulation
    from collections.abc import Sequence
    from typing import Optional

MINIMUM = (3, 9)


def _findable(name: str) -> bool:
    """Whether the top-level module ``name`` can be imported, without importing it.

    What ``importlib.util.find_spec`` does for a top-level name, without the
    import of ``importlib.util`` (and the dozens of modules it brings).
    """
    return any(finder.find_spec(name, None) is not None for finder in sys.meta_path)


def interpreter_problem(
    version: "Optional[Sequence[int]]" = None, has_ssl: "Optional[bool]" = None
) -> str:
    """Why this interpreter cannot run the agent, or "" if it can."""
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    if version[:2] < MINIMUM:
        return "needs Python {}.{} or newer, and this is Python {}".format(
            MINIMUM[0], MINIMUM[1], ".".join(str(part) for part in version)
        )
    if has_ssl is None:
        # Found, not imported: ``notify`` (started at boot) never loads ssl.
        has_ssl = all(_findable(name) for name in ("ssl", "_ssl"))
    if not has_ssl:
        return "needs Python's ssl module, and this Python was built without it"
    return ""


def require_supported_python() -> None:
    """Exit with status 1 and one line on stderr unless this interpreter can run the agent."""
    problem = interpreter_problem()
    if problem:
        sys.stderr.write("vmready-agent: " + problem + "\n")
        raise SystemExit(1)
