"""``--https-address HOST:PORT``: where the remote operator API listens, and how it is named.

Incus's ``core.https_address`` spelling: ``HOST:PORT``, ``[IPv6]:PORT``,
``:PORT`` (every IPv4 interface), or a host alone (port 8443).  A wildcard
host is advertised in trust tokens as this machine's fully qualified name.
"""

from __future__ import annotations

import socket

import attrs

from vmready.api import OPERATOR_LISTEN_BACKLOG

DEFAULT_HTTPS_PORT = 8443
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


@attrs.frozen
class HTTPSAddress:
    """A host (an interface address or name; "" for all) and a TCP port (0: any free one)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HTTPSAddress:
        """The address ``text`` names; ValueError saying what is wrong with it."""
        value = text.strip()
        if value.startswith("["):
            host, bracket, rest = value[1:].partition("]")
            if not bracket or not host:
                raise ValueError(f"{text!r}: an IPv6 address goes in brackets, [::1]:8443")
            if rest and not rest.startswith(":"):
                raise ValueError(f"{text!r}: expected :PORT after ]")
            port_text = rest[1:] if rest else ""
        elif value.count(":") > 1:
            host, port_text = value, ""  # a bare IPv6 address
        else:
            host, _colon, port_text = value.partition(":")
        port = DEFAULT_HTTPS_PORT
        if port_text:
            if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
                raise ValueError(f"{text!r}: port {port_text!r} is not a number from 0 to 65535")
            port = int(port_text)
        if host == "*":
            host = ""
        if any(c.isspace() for c in host) or "/" in host:
            raise ValueError(f"{text!r}: {host!r} is not a host")
        return cls(host, port)

    @property
    def wildcard(self) -> bool:
        """Whether it listens on every interface."""
        return self.host in _WILDCARDS

    def endpoint(self) -> str:
        """The Twisted endpoint string to listen with (TLS is added around it)."""
        listen = f"tcp:port={self.port}:backlog={OPERATOR_LISTEN_BACKLOG}"
        if not self.host:
            return listen
        escaped = self.host.replace("\\", "\\\\").replace(":", "\\:")
        return f"{listen}:interface={escaped}"

    def advertised(self, port: int) -> list[str]:
        """``host:port`` strings a trust token names (``port``: the one actually bound)."""
        host = socket.getfqdn() if self.wildcard else self.host
        if ":" in host:
            host = f"[{host}]"
        return [f"{host}:{port}"]

    def url(self) -> str:
        """As a remote's URL, for the daemon's start-up line."""
        host = self.host or "0.0.0.0"
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{self.port}"
