"""argparse for ``vmready-agent`` and ``vmready-agent notify``: errors as ``UsageError``.

Imported only where a command line needs argparse (``--help``, a usage error,
``notify``): argparse brings ``re`` and ``enum``, 0.3 s under emulation, and
the agent's own command line, as its loader and the demo guest's initramfs
write it, is parsed without it before the agent says its first ``STARTED``
(``main.parse_options``).
"""

from __future__ import annotations

import argparse
import os
import sys

from vmready.agent.options import UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


class OptionParser(argparse.ArgumentParser):
    """argparse's parser, raising UsageError; its help sized without ``shutil``.

    argparse's own help formatter, made for every ``add_argument``, imports
    ``shutil`` for the terminal's width, and ``shutil`` loads ``zlib``, ``bz2``
    and ``lzma`` (shared libraries, under emulation slow to load) into every
    start of the agent and of ``notify``.
    """

    def __init__(self, prog: str, description: str, usage: str | None = None) -> None:
        super().__init__(prog=prog, usage=usage, description=description, formatter_class=_help)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _help(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=_columns() - 2)  # as argparse sizes it


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it: $COLUMNS, stdout, 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.__stdout__
    try:
        return (os.get_terminal_size(stdout.fileno()).columns if stdout else 0) or 80
    except (ValueError, OSError):
        return 80
