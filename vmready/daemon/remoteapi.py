"""The operator API over mutual TLS (``--https-address``): bound early, accepting only later.

A cluster member binds it before it takes its lease (its lease row gives
the address it was bound at), but no request is accepted until Ready is
cleared, as for the operator API on its unix socket: whoever dials waits in
the listen backlog meanwhile.
"""

from __future__ import annotations

from twisted.internet.abstract import FileDescriptor
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.web.resource import IResource

from vmready.api import TrustRegistry, remote_site, remote_tls_factory
from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.domain import IVMReadyReactor
from vmready.lifecycle import Membership
from vmready.trust import CertificatePair


class CannotServe(Exception):
    """The address cannot be listened on (something took it since the options were checked)."""


class RemoteAPI:
    """The operator API's resource served on ``address`` to clients ``trust`` knows."""

    log = Logger()

    def __init__(self, reactor: IVMReadyReactor, address: str, trust: TrustRegistry) -> None:
        self.reactor = reactor
        self.address = address
        self.trust = trust
        self.port: IListeningPort | None = None

    async def bind(
        self, api: IResource, server: CertificatePair, membership: Membership | None
    ) -> None:
        """Listen, but accept nobody until ``accept``; ``CannotServe`` if the address is taken.

        The trust store is read first, so the first client is judged by it;
        a member trusts the other members' certificates (``membership``).
        """
        address = HTTPSAddress.parse(self.address)
        self.trust.server_fingerprint = server.fingerprint
        await self.trust.load()
        factory = remote_tls_factory(server, remote_site(api, self.trust, membership))
        try:
            port = self.port = await serverFromString(self.reactor, address.endpoint()).listen(
                factory
            )
        except Exception as e:
            raise CannotServe(str(e)) from e
        # Called as ``listen`` returned, before the reactor runs again: no connection was
        # accepted in between (only the reactor accepts).
        assert isinstance(port, FileDescriptor), port
        port.stopReading()
        self.trust.addresses = address.advertised(port.getHost().port)
        self.log.info(
            "remote API (mutual TLS) on {address} (port {port}), certificate {fingerprint}",
            address=self.address,
            port=port.getHost().port,
            fingerprint=server.fingerprint,
        )

    def accept(self) -> None:
        """Accept from now on (those waiting in the backlog first); nothing if not bound."""
        if self.port is not None:
            assert isinstance(self.port, FileDescriptor), self.port
            self.port.startReading()

    async def stop(self) -> None:
        """Stop listening."""
        if self.port is not None:
            stopped = self.port.stopListening()
            if stopped is not None:
                await stopped
