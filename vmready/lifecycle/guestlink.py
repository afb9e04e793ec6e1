"""How guests reach the daemon's guest API: unknown until it listens."""

from __future__ import annotations

import attrs

from vmready.agentlink import PollIntervals


@attrs.frozen
class GuestLink:
    """How guests reach the daemon's guest API, known once it listens."""

    port: int
    server_cert_pem: bytes
    # What an agent is told to dial in its config drive: "vsock" or "hvsock:<path>".
    transport: str
    intervals: PollIntervals = attrs.field(factory=PollIntervals)
    # The unix socket the forward transport's guestfwd reaches (None: no forward).
    forward_socket: str | None = None


class GuestReach:
    """How guests reach this daemon: no link until its guest API listens (``listening``).

    Without a link no agent is followed and no agent identity is issued: a
    lifecycle without a guest API (a tool, a test) runs VMs all the same.
    """

    def __init__(self) -> None:
        self._link: GuestLink | None = None

    @property
    def link(self) -> GuestLink | None:
        """The guest API's link, or None while it does not listen."""
        return self._link

    def listening(self, link: GuestLink) -> None:
        """The guest API listens: agents are told ``link`` from now on (a new daemon's port)."""
        self._link = link
