"""Where and how a command prints: stdout and stderr, as a table, JSON or YAML."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import IO, Any

import yaml

__all__ = ["FORMATS", "Output", "to_yaml"]

FORMATS = ("table", "json", "yaml")


def to_yaml(value: Any) -> str:
    """JSON data as block-style YAML, keys in their order, no line folding."""
    text: str = yaml.safe_dump(
        value,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=math.inf,
    )
    return text


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
