"""The trust store shared by members on a real PostgreSQL: a change through one reaches all.

Two sites, "one" and "two", as two members serve them: each its own
Lifecycle, ``TrustRegistry``, operator API on a unix socket and remote API
over real mutual TLS on 127.0.0.1, each its own connections to one
PostgreSQL database, and each a ``NotificationListener`` on
``vmready_trust`` that refreshes its registry (as the daemon wires it).  The
client is the real CLI with a config dir of its own.  No test waits a fixed
time: each waits for the refresh a notification caused, or for the event
stream to be subscribed.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.fixtures import make_lifecycle
from tests.postgres import postgres_location
from tests.reactor import reactor
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.cli.main import run
from vmready.lifecycle.core import Lifecycle
from vmready.store.notifications import TRUST_CHANNEL, NotificationListener
from vmready.trust.certs import CertificatePair, generate


@attrs.define
class Site:
    """One member's APIs and trust registry; ``refreshes`` counts the refreshes done."""

    name: str
    lifecycle: Lifecycle
    trust: TrustRegistry
    server: CertificatePair
    socket: str
    url: str
    refreshes: int = 0
    waiting: list[tuple[int, Deferred[None]]] = attrs.Factory(list)

    def refreshed(self, _: object = None) -> None:
        self.refreshes += 1
        for count, done in list(self.waiting):
            if self.refreshes >= count:
                self.waiting.remove((count, done))
                done.callback(None)

    def refreshes_done(self, count: int) -> Deferred[None]:
        """Fires once ``count`` refreshes (one per notification heard) were applied."""
        done: Deferred[None] = Deferred()
        if self.refreshes >= count:
            done.callback(None)
        else:
            self.waiting.append((count, done))
        return done

    def subscribed(self) -> Deferred[None]:
        """Fires when the next event stream subscribes here."""
        events = self.lifecycle.events
        subscribe = events.subscribe
        done: Deferred[None] = Deferred()

        def observed(*args: Any, **kwargs: Any) -> Any:
            unsubscribe = subscribe(*args, **kwargs)
            del events.subscribe
            done.callback(None)
            return unsubscribe

        events.subscribe = observed  # type: ignore[method-assign]
        return done


class SharedTrustTests(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.location = postgres_location(self)
        self.dir = tempfile.mkdtemp(prefix="vmr-trust-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.config = os.path.join(self.dir, "laptop")
        self.one = await self.start_site("one")
        self.two = await self.start_site("two")

    async def start_site(self, name: str) -> Site:
        lifecycle = make_lifecycle(self, store_path=self.location, member=name)
        server = generate(f"vmready-{name}")
        trust = TrustRegistry(lifecycle.store, reactor.seconds, server.fingerprint)
        await trust.load()
        resource = OperatorAPI(lifecycle, "fakeqemu", trust).app.resource()
        socket = os.path.join(self.dir, f"{name}.sock")
        unix: Any = operator_site(resource)
        self.listening(reactor.listenUNIX(socket, unix))
        tls = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            remote_tls_factory(server, remote_site(resource, trust))
        )
        self.listening(tls)
        port = tls.getHost().port
        trust.addresses = [f"127.0.0.1:{port}"]
        site = Site(name, lifecycle, trust, server, socket, f"https://127.0.0.1:{port}")

        def heard(channel: str, payload: str) -> None:
            trust.refresh().addCallback(site.refreshed)

        listener = NotificationListener(
            reactor, self.location, [TRUST_CHANNEL], heard, lambda: heard("", "")
        )
        await listener.start()
        self.addCleanup(listener.stop)
        return site

    def listening(self, port: IListeningPort) -> None:
        async def stop() -> None:
            stopped = port.stopListening()
            if stopped is not None:
                await stopped
            await deferLater(reactor, 0, lambda: None)

        self.addCleanup(stop)

    async def cli(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = await run(reactor, list(argv), out, err, {"VMREADY_CONFIG_DIR": self.config})
        return code, out.getvalue(), err.getvalue()

    async def ok(self, *argv: str) -> str:
        code, out, err = await self.cli(*argv)
        self.assertEqual((code, err), (0, ""), out)
        return out

    async def trusted_through_one(self) -> None:
        """The laptop redeems a token of one's; two hears of it (no restart)."""
        out = await self.ok("--socket", self.one.socket, "config", "trust", "add", "laptop")
        token = out.splitlines()[1]
        heard = self.two.refreshes_done(self.two.refreshes + 1)
        await self.ok("remote", "add", "one", "--token", token)
        await heard
        # Pinned by fingerprint: only a client two trusts already is added this way.
        self.assertEqual(
            await self.ok(
                "remote", "add", "two", self.two.url, "--fingerprint", self.two.server.fingerprint
            ),
            f"Certificate fingerprint: {self.two.server.fingerprint}\n"
            f"Remote two added: {self.two.url}\n",
        )

    async def test_aTokenRedeemedThroughOneMemberIsTrustedByTheOther(self) -> None:
        code, _, err = await self.cli(
            "remote", "add", "two", self.two.url, "--fingerprint", self.two.server.fingerprint
        )
        self.assertEqual(code, 1)
        self.assertIn("does not trust this client's certificate", err)
        await self.trusted_through_one()
        self.assertEqual(await self.ok("list", "two:"), "NAME  STATUS  MEMORY  CPUS\n")
        self.assertIsNotNone(self.two.trust.trusted(self._laptop()))

    async def test_removalThroughOneMemberEndsTheClientsAccessOnTheOther(self) -> None:
        await self.trusted_through_one()
        monitor_err = io.StringIO()
        subscribed = self.two.subscribed()
        monitoring = Deferred.fromCoroutine(
            run(
                reactor,
                ["monitor", "two:"],
                io.StringIO(),
                monitor_err,
                {"VMREADY_CONFIG_DIR": self.config},
            )
        )
        await subscribed
        self.assertFalse(monitoring.called)
        heard = self.two.refreshes_done(self.two.refreshes + 1)
        out = await self.ok("--socket", self.one.socket, "config", "trust", "remove", "laptop")
        self.assertTrue(out.startswith("Removed laptop ("), out)
        await heard
        # Two ended the stream it had open, and refuses the client's next request.
        self.assertEqual(await monitoring, 1)
        self.assertIn("lost the connection to remote two", monitor_err.getvalue())
        code, _, err = await self.cli("list", "two:")
        self.assertEqual(code, 1)
        self.assertIn("is not trusted by the daemon", err)

    def _laptop(self) -> str:
        entries = self.successResultOf(Deferred.fromCoroutine(self.one.trust.certificates()))
        (entry,) = [entry for entry in entries if entry.name == "laptop"]
        return entry.fingerprint
