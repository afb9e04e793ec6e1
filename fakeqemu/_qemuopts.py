"""QEMU's option syntax (QemuOpts and keyval strings) and the errors it reports.

Every module that checks part of the command line parses with these helpers
and refuses with :class:`CommandLineError`, whose text is QEMU's own.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

SIZE_ERROR = (
    "Parameter 'size' expects a non-negative number below 2^64\n"
    "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"
    "and exabytes, respectively."
)
IDENTIFIER_ERROR = (
    "Parameter 'id' expects an identifier\n"
    "Identifiers consist of letters, digits, '-', '.', '_', starting with a letter."
)
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# qapi_bool_parse's spellings.
_TRUE = frozenset({"on", "yes", "true", "y"})
_FALSE = frozenset({"off", "no", "false", "n"})


class CommandLineError(Exception):
    """The command line is refused; ``str(e)`` is QEMU's text without the program prefix.

    ``warnings`` are the messages QEMU printed before it gave up (an accelerator
    that failed to initialize, a deprecated topology), in order.
    """

    def __init__(self, message: str, warnings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.warnings = tuple(warnings)

    @property
    def messages(self) -> list[str]:
        """Everything QEMU prints for this refusal: the warnings, then the error."""
        return [*self.warnings, str(self)]


def split_options(text: str) -> list[str]:
    """Split a QemuOpts string on commas, with ``,,`` standing for a literal comma."""
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == ",":
            if text[i + 1 : i + 2] == ",":
                current.append(",")
                i += 2
                continue
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    return parts


def parse_options(text: str, implied_key: str | None) -> dict[str, str]:
    """Parse ``a,b=c`` into a dict; a bare first item is ``implied_key``'s value."""
    return dict(parse_option_list(text, implied_key))


def parse_option_list(text: str, implied_key: str | None) -> list[tuple[str, str]]:
    """Like :func:`parse_options`, keeping repeated keys (``guestfwd=…,guestfwd=…``)."""
    result: list[tuple[str, str]] = []
    for index, part in enumerate(split_options(text)):
        if "=" in part:
            key, value = part.split("=", 1)
        elif index == 0 and implied_key is not None:
            key, value = implied_key, part
        elif part.startswith("no") and len(part) > 2:
            key, value = part[2:], "off"
        else:
            key, value = part, "on"
        result.append((key, value))
    return result


def parse_size(value: str, default_unit: int) -> int:
    """Parse a QEMU size (``64``, ``64M``, ``1G``); a bare number is in ``default_unit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bBkKmMgGtT]?)", value.strip())
    if match is None:
        raise ValueError(value)
    number, suffix = match.groups()
    unit = _SIZE_SUFFIX[suffix.upper()] if suffix else default_unit
    return int(float(number) * unit)


def parse_bool(key: str, value: str) -> bool:
    """A boolean option as QEMU parses it (measured: ``Parameter 'readonly' expects …``)."""
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CommandLineError(f"Parameter '{key}' expects 'on' or 'off'")


def is_identifier(text: str) -> bool:
    """Whether ``text`` is a QEMU identifier (IDs of chardevs, devices, netdevs…)."""
    return _IDENTIFIER.fullmatch(text) is not None


def check_identifier(opts: dict[str, str]) -> None:
    """Refuse an ``id=`` that is not an identifier, with QEMU's two lines."""
    if "id" in opts and not is_identifier(opts["id"]):
        raise CommandLineError(IDENTIFIER_ERROR)


def parse_c_integer(text: str) -> int:
    """An integer as C's strtoull with base 0 reads it: ``0x`` hex, a leading ``0`` octal."""
    body = text.strip()
    sign = -1 if body.startswith("-") else 1
    digits = body.lstrip("+-")
    if digits[:2].lower() == "0x":
        return sign * int(digits[2:], 16)
    if len(digits) > 1 and digits.startswith("0"):
        return sign * int(digits[1:], 8)
    return sign * int(digits, 10)


def uint32_property(key: str, value: str) -> int:
    """A ``uint32`` device property (decimal, ``0x`` hex or ``0`` octal), with QEMU's errors."""
    try:
        number = parse_c_integer(value)
    except ValueError:
        raise CommandLineError(f"Parameter '{key}' expects integer") from None
    if not 0 <= number < 1 << 32:
        raise CommandLineError(f"Parameter '{key}' expects uint32_t")
    return number


def uint64_property(key: str, value: str) -> int:
    """A ``uint64`` device property as QEMU's string visitor parses it (``-1`` wraps)."""
    try:
        number = parse_c_integer(value)
    except ValueError:
        raise CommandLineError(f"Parameter '{key}' expects integer") from None
    if not -(1 << 64) < number < 1 << 64:
        raise CommandLineError(f"Parameter '{key}' expects uint64")
    return number % (1 << 64)


def program_name() -> str:
    """The name QEMU-style messages start with: the basename of argv[0], as QEMU does."""
    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not base or base in ("__main__.py", "-c", "trial", "python", "python3"):
        return "fakeqemu"
    return base


# QEMU's own fprintf lines (the x86 kernel loader's) start with this, not the program.
_UNPREFIXED = "qemu: "


def unprefixed(line: str) -> str:
    """Mark ``line`` as one QEMU prints as is (it starts with ``qemu:``), not program-prefixed."""
    if not line.startswith(_UNPREFIXED):
        raise ValueError(f"not a line QEMU prints unprefixed: {line!r}")
    return line


def format_messages(prog: str, messages: Sequence[str]) -> str:
    """QEMU's stderr form: each message prefixed with the program, continuation lines bare.

    A message that starts with ``qemu:`` (see :func:`unprefixed`) is printed as is.
    """
    text = ""
    for message in messages:
        first, *rest = message.split("\n")
        head = first if first.startswith(_UNPREFIXED) else f"{prog}: {first}"
        text += head + "\n" + "".join(line + "\n" for line in rest)
    return text
