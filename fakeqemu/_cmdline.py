"""Parse the part of the ``qemu-system-x86_64`` command line fakeqemu emulates.

Errors carry QEMU's own wording (measured on QEMU 7.2) so a caller that handles
real QEMU's refusals handles fakeqemu's the same way.  Options QEMU knows but
fakeqemu does not emulate are refused, never ignored.

QEMU checks its command line in two passes, and where an error goes depends on
which pass finds it: errors in the option loop itself (an unknown option, a
malformed ``-m`` or ``-name``, a bad identifier, a duplicate ID) always go to
stderr; everything checked after the loop (the machine type, chardev backends,
accelerators, devices, the ``-incoming`` URI) is found only once the ``-D``
log file is open, and with ``-daemonize`` that file has replaced stderr.
:func:`parse_arguments` is the first pass (:mod:`fakeqemu._optionloop`),
:meth:`ParsedArguments.configure` the second (:mod:`fakeqemu._configure`),
each finding what QEMU's does, in QEMU's order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fakeqemu._blockdev import BlockdevSpec, DiskSpec
from fakeqemu._chardev import FileChardevSpec, RingbufSpec, SocketChardevSpec
from fakeqemu._config import MachineConfig
from fakeqemu._configure import configure
from fakeqemu._devices import PciDeviceSpec, SerialBusSpec, SerialPortSpec
from fakeqemu._fsdev import FsdevSpec, ShareSpec
from fakeqemu._kernel import KernelSpec
from fakeqemu._optionloop import OptionLoop, iterate_arguments
from fakeqemu._qemuopts import (
    IDENTIFIER_ERROR,
    SIZE_ERROR,
    CommandLineError,
    format_messages,
    parse_options,
    parse_size,
    program_name,
    split_options,
)
from fakeqemu._usernet import GuestForwardSpec, NetdevSpec, NicSpec

__all__ = [
    "IDENTIFIER_ERROR",
    "QEMU_PACKAGE",
    "QEMU_VERSION",
    "SIZE_ERROR",
    "BlockdevSpec",
    "CommandLineError",
    "DiskSpec",
    "FileChardevSpec",
    "FsdevSpec",
    "GuestForwardSpec",
    "KernelSpec",
    "MachineConfig",
    "NetdevSpec",
    "NicSpec",
    "ParsedArguments",
    "PciDeviceSpec",
    "RingbufSpec",
    "SerialBusSpec",
    "SerialPortSpec",
    "ShareSpec",
    "SocketChardevSpec",
    "format_messages",
    "parse_arguments",
    "parse_command_line",
    "parse_options",
    "parse_size",
    "program_name",
    "split_options",
]

QEMU_VERSION = (7, 2, 22)
QEMU_PACKAGE = "fakeqemu"


class ParsedArguments:
    """A command line through QEMU's option loop, not yet checked as a whole."""

    def __init__(self, loop: OptionLoop) -> None:
        self._loop = loop

    @property
    def show_version(self) -> bool:
        """``-version``: print it and exit, before anything else."""
        return self._loop.show_version

    @property
    def daemonize(self) -> bool:
        """``-daemonize``: with ``logfile``, the log file takes stderr's place."""
        return self._loop.daemonize

    @property
    def logfile(self) -> str | None:
        """``-D FILE`` (the last one given), which QEMU opens before ``configure``'s checks."""
        return self._loop.logfile

    def configure(self, cwd: str | None = None) -> MachineConfig:
        """QEMU's checks after the option loop; raises CommandLineError with its warnings.

        Files the command line names (chardev files, exports, images, kernels) are
        opened relative to ``cwd``, the launching process's directory (default: ours).
        """
        if self.show_version:
            return MachineConfig(show_version=True)
        return configure(self._loop, os.getcwd() if cwd is None else cwd)


def parse_arguments(argv: Sequence[str]) -> ParsedArguments:
    """QEMU's option loop: raises CommandLineError for what QEMU reports while parsing.

    HelpRequested when the command line asks for help (``-h``, ``-machine help``…).
    """
    loop = OptionLoop()
    # QEMU's first pass: every option known and given its argument, before any is acted on.
    for option, value in list(iterate_arguments(argv)):
        loop.option(option, value)
    loop.after_loop()
    return ParsedArguments(loop)


def parse_command_line(argv: Sequence[str], cwd: str | None = None) -> MachineConfig:
    """Turn QEMU arguments (without the program name) into a validated MachineConfig."""
    return parse_arguments(argv).configure(cwd)
