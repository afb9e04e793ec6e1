"""``VMReadyService`` as a cluster member, in-process, on a real PostgreSQL database.

What a daemon process does not show from outside: the order it joins in
(listening for notifications before it serves), its lease given up on a clean
stop, the store's member set, and a daemon that cannot join stopping.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from tests.daemon.test_daemon_service import StopRecordingReactor
from tests.postgres import postgres_location, postgres_server
from tests.reactor import reactor
from vmready.cli.client import Client
from vmready.daemon import clustermember
from vmready.daemon.daemonconfig import DaemonConfig
from vmready.daemon.service import VMReadyService
from vmready.domain.members import LeaseLost, MemberState
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.store.notifications import NotificationListener
from vmready.store.sqlite import Store


class MemberServiceTests(TestCase):
    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-ms-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.location = postgres_location(self)

    def service(self, name: str = "a", the_reactor: Any = reactor) -> VMReadyService:
        data_dir = os.path.join(self.directory, name)
        os.makedirs(data_dir)
        self.socket_path = os.path.join(data_dir, "api.sock")
        service = VMReadyService(
            the_reactor,
            DaemonConfig(
                data_dir=data_dir,
                listen=f"unix:{self.socket_path}",
                power_sync_interval=0,
                https_address="127.0.0.1:0",
                store=self.location,
                member_name=name,
                lease_seconds=30,
            ),
        )
        self.addCleanup(service.stopService)
        return service

    def members(self) -> Any:
        engine = Store.open(self.location)
        try:
            return engine.members.list_members()
        finally:
            engine.close()

    async def test_aMemberHoldsItsLeaseWhileItServesAndGivesItUpOnStop(self) -> None:
        service = self.service()
        service.startService()
        await service.serving
        # It serves once it holds its lease, at the address its remote API bound.
        assert service.https_port is not None and service.store is not None
        view = self.members()
        self.assertIs(view.state_of("a"), MemberState.ONLINE)
        member = view.find("a")
        bound = service.https_port.getHost()
        assert isinstance(bound, IPv4Address)
        self.assertEqual(member.address, f"127.0.0.1:{bound.port}")
        assert service.server_certificate is not None
        self.assertEqual(member.fingerprint, service.server_certificate.fingerprint)
        self.assertEqual(service.store.member, "a")
        config = (await Client(reactor, self.socket_path).get("/1.0"))["config"]
        self.assertEqual(
            (config["store"], config["member-name"], config["lease-seconds"], config["fence"]),
            (self.location, "a", "30", "none"),
        )
        await service.recovered
        await service.stopService()
        # A clean stop: the others see it unreachable at once, not 30 s later.
        self.assertIs(self.members().state_of("a"), MemberState.UNREACHABLE)

    async def startedAndStopped(self) -> VMReadyService:
        """A member started that stops the reactor before it serves."""
        stopper = StopRecordingReactor()
        service = self.service(the_reactor=stopper)
        service.startService()
        while not stopper.when_running:
            await _turn()
        self.assertEqual([f.__name__ for f in stopper.when_running], ["stop"])
        self.assertFalse(service.serving.called)
        return service

    async def test_aMemberThatCannotListenForNotificationsStops(self) -> None:
        class Refused(NotificationListener):
            """A real listener, on a database the server does not have: LISTEN fails."""

            def __init__(self, the_reactor: Any, location: str, *rest: Any) -> None:
                super().__init__(the_reactor, postgres_server().url("nowhere"), *rest)

        self.patch(clustermember, "NotificationListener", Refused)
        await self.startedAndStopped()
        # It never joined: no lease was taken.
        self.assertIsNone(self.members().find("a"))

    async def test_aMemberWhoseNameAnotherDaemonHoldsStopsTouchingNothing(self) -> None:
        engine = Store.open(self.location)
        self.addCleanup(engine.close)
        engine.members.renew_lease("a", "10.0.0.1:8443", "ff" * 32, 600.0)
        engine.instances.create_instance("web1", {}, {}, member="a")
        engine.instances.finish_task(
            "web1", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING, {READY_KEY: "true"}
        )
        (held,) = engine.members.list_members().members
        service = await self.startedAndStopped()
        # Nothing of the other daemon's: its lease, its instance's Ready key and task.
        self.assertEqual(engine.members.list_members().members, (held,))
        web1 = engine.instances.get_instance("web1")
        self.assertEqual((web1.ready, web1.task_state), (True, None))
        self.assertIsNone(service.membership and service.membership._loop)
        # Nor does it tell the others anything of the instances: asked for its views, it
        # sends none (they are the other daemon's to tell).
        assert service.parts is not None and service.parts.cluster is not None
        relay = service.parts.cluster.relay
        self.assertIsNotNone(service.parts.cluster.own_views)
        sent = relay.sent
        relay.on_event('{"v":1,"member":"b","seq":0,"resend":true}')
        self.assertEqual((relay.own, relay.sent), (None, sent))
        # Stopping gives up no lease: it holds none.
        await service.stopService()
        self.assertEqual(engine.members.list_members().members, (held,))

    async def test_aMemberWhoseLeaseWasTakenOverStops(self) -> None:
        stopper = StopRecordingReactor()
        service = self.service(the_reactor=stopper)
        service.startService()
        await service.recovered
        assert service.membership is not None and service.server_certificate is not None
        engine = Store.open(self.location)
        self.addCleanup(engine.close)
        # Its lease ran out (the store out of its reach, say); another daemon took "a" over.
        engine.members.give_up_lease("a", service.server_certificate.fingerprint)
        engine.members.renew_lease("a", "10.0.0.9:8443", "ff" * 32, 600.0)
        (taken,) = engine.members.list_members().members
        assert service.parts is not None and service.parts.cluster is not None
        self.assertIsNotNone(service.parts.cluster.relay.own)
        with self.assertRaises(LeaseLost):
            await service.membership.renew()
        self.assertEqual([f.__name__ for f in stopper.when_running], ["stop"])
        # What it knows of the instances named "a" is no longer told the others.
        self.assertIsNone(service.parts.cluster.relay.own)
        await service.stopService()
        # It stopped without giving up the new holder's lease.
        self.assertEqual(engine.members.list_members().members, (taken,))
        self.assertIs(engine.members.list_members().state_of("a"), MemberState.ONLINE)


async def _turn() -> None:
    waiting: Deferred[None] = Deferred()
    reactor.callLater(0.01, waiting.callback, None)
    await waiting
