"""Where and how a command prints: stdout and stderr, as a table, JSON or YAML."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import IO, Any

__all__ = ["FORMATS", "Output", "to_yaml"]

FORMATS = ("table", "json", "yaml")


_PLAIN = re.compile(r"[A-Za-z_/.][A-Za-z0-9_./ :@+-]*")
_YAML_WORDS = frozenset(
    {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~", ".inf", ".nan"}
)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list | tuple):
        return "[]"
    text = str(value)
    plain = (
        _PLAIN.fullmatch(text) is not None
        and text.lower() not in _YAML_WORDS
        and ": " not in text
        and not text.endswith((":", " "))
    )
    return text if plain else json.dumps(text, ensure_ascii=False)


def _is_block(value: Any) -> bool:
    return isinstance(value, dict | list | tuple) and len(value) > 0


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            if _is_block(item):
                lines.append(f"{pad}{_yaml_scalar(str(key))}:")
                lines.extend(_yaml_lines(item, indent + 2))
            else:
                lines.append(f"{pad}{_yaml_scalar(str(key))}: {_yaml_scalar(item)}")
        return lines
    if isinstance(value, list | tuple) and value:
        lines = []
        for item in value:
            if _is_block(item):
                nested = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0][indent + 2 :]}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
        return lines
    return [pad + _yaml_scalar(value)]


def to_yaml(value: Any) -> str:
    """A small YAML emitter for JSON data: block style, strings quoted JSON-style when needed."""
    return "\n".join(_yaml_lines(value, 0)) + "\n"


def _write(stream: IO[str], text: str) -> None:
    """Write and flush ``text``; what the stream cannot encode is written as escapes."""
    # JSON may decode to lone surrogates (a "\ud800" escape), argv holds undecodable bytes
    # as surrogates, and stdout may not be UTF-8: none of that may crash the output.
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    stream.flush()


class Output:
    """Where and how a command prints: stdout/stderr and the chosen format."""

    def __init__(self, out: IO[str], err: IO[str], format: str) -> None:
        self.out = out
        self.err = err
        self.format = format

    def text(self, text: str) -> None:
        """Text on stdout, as is."""
        _write(self.out, text)

    def line(self, text: str) -> None:
        """One line on stdout."""
        self.text(text + "\n")

    def data(self, value: Any, table: Callable[[Any], str]) -> None:
        """Data in the chosen format; ``table`` renders the table format."""
        if self.format == "json":
            self.text(json.dumps(value, indent=2) + "\n")
        elif self.format == "yaml":
            self.text(to_yaml(value))
        else:
            self.text(table(value))

    def raw(self, data: bytes) -> None:
        """Bytes on stdout, as the guest wrote them (through the text stream where it has none)."""
        buffer = getattr(self.out, "buffer", None)
        if buffer is None:
            self.text(data.decode("utf-8", "replace"))
            return
        self.out.flush()
        buffer.write(data)
        buffer.flush()

    def usage(self, usage: str) -> None:
        """A usage line on stderr, as is."""
        _write(self.err, usage)

    def error(self, message: str) -> None:
        """One line on stderr, prefixed ``vmready:``."""
        _write(self.err, f"vmready: {message}\n")
