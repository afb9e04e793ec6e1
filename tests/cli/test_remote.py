"""Remote use: the operator API over real mutual TLS on loopback, and the CLI's remotes."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tempfile
from typing import Any

import yaml
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.cli.main import run
from vmready.trust.certs import fingerprint, generate


class RemoteTestCase(TestCase):
    """One daemon's operator API on a unix socket and over mutual TLS on 127.0.0.1."""

    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.lifecycle = make_lifecycle(self)
        self.server = generate("vmready")
        self.trust = TrustRegistry(self.lifecycle.store, reactor.seconds, self.server.fingerprint)
        await self.trust.load()
        resource = OperatorAPI(self.lifecycle, "fakeqemu", self.trust).app.resource()
        self.dir = tempfile.mkdtemp(prefix="vmr-remote-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.socket = os.path.join(self.dir, "vmready.sock")
        self.unix_site = operator_site(resource)
        self.tls_site = remote_site(resource, self.trust)
        unix: Any = self.unix_site
        self.ports: list[IListeningPort] = [reactor.listenUNIX(self.socket, unix)]
        tls = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            remote_tls_factory(self.server, self.tls_site)
        )
        self.ports.append(tls)
        self.port = tls.getHost().port
        self.url = f"https://127.0.0.1:{self.port}"
        self.trust.addresses = [f"127.0.0.1:{self.port}"]
        self.addCleanup(self._close)
        self.config = os.path.join(self.dir, "laptop")

    async def _close(self) -> None:
        for port in self.ports:
            stopped = port.stopListening()
            if stopped is not None:
                await stopped
        await deferLater(reactor, 0, lambda: None)

    async def cli(self, *argv: str, config: str | None = None) -> tuple[int, str, str]:
        """``vmready argv…`` with its config dir ``config`` (default: the laptop's)."""
        out, err = io.StringIO(), io.StringIO()
        environ = {"VMREADY_CONFIG_DIR": config or self.config, "VMREADY_SOCKET": self.socket}
        code = await run(reactor, list(argv), out, err, environ)
        return code, out.getvalue(), err.getvalue()

    async def ok(self, *argv: str, config: str | None = None) -> str:
        """A command that must succeed; its stdout."""
        code, out, err = await self.cli(*argv, config=config)
        self.assertEqual((code, err), (0, ""), out)
        return out

    async def token(self, name: str = "laptop") -> str:
        """``vmready config trust add NAME`` on the daemon's host (its unix socket)."""
        out = await self.ok("--socket", self.socket, "config", "trust", "add", name)
        first, token = out.splitlines()
        self.assertTrue(first.startswith(f"Client {name} certificate add token (valid until "))
        return token

    async def added(self, name: str = "prod") -> None:
        """The laptop trusted through a token, with remote ``name``."""
        out = await self.ok("remote", "add", name, "--token", await self.token())
        self.assertEqual(
            out,
            f"Client certificate trusted by {self.url} as laptop\n"
            f"Remote {name} added: {self.url}\n",
        )

    def remotes_file(self, config: str | None = None) -> dict[str, Any]:
        with open(os.path.join(config or self.config, "remotes.yaml")) as f:
            data: dict[str, Any] = yaml.safe_load(f)
        return data


class TokenFlowTests(RemoteTestCase):
    """trust add → remote add --token → every command works; the token works once."""

    async def test_tokenTrustsTheClientAndPinsTheServer(self) -> None:
        await self.added()
        remotes = self.remotes_file()
        self.assertEqual(
            remotes,
            {
                "default-remote": "local",
                "remotes": {"prod": {"url": self.url, "fingerprint": self.server.fingerprint}},
            },
        )
        key = os.path.join(self.config, "client.key")
        self.assertEqual(stat.S_IMODE(os.stat(key).st_mode), 0o600)
        with open(os.path.join(self.config, "client.crt"), "rb") as f:
            client_fingerprint = fingerprint(f.read())
        listed = json.loads(await self.ok("config", "trust", "list", "prod:", "--format", "json"))
        self.assertEqual(
            [(entry["name"], entry["fingerprint"]) for entry in listed],
            [("laptop", client_fingerprint)],
        )

    async def test_everyKindOfCommandWorksAgainstTheRemote(self) -> None:
        await self.added()
        self.assertEqual(await self.ok("launch", "prod:web1"), "Creating web1\nweb1: RUNNING\n")
        listed = await self.ok("list", "prod:")
        self.assertEqual(listed.splitlines()[1].split()[:2], ["web1", "RUNNING"])
        info = json.loads(await self.ok("info", "prod:web1", "--format", "json"))
        self.assertEqual((info["name"], info["status"]), ("web1", "Running"))
        # An event stream over TLS: wait subscribes, then the stop's events wake it.
        waiting = Deferred.fromCoroutine(self.cli("wait", "prod:web1", "status=stopped"))
        monitor_out = io.StringIO()
        monitoring = Deferred.fromCoroutine(
            run(
                reactor,
                ["monitor", "prod:", "--type", "lifecycle", "--format", "json"],
                monitor_out,
                io.StringIO(),
                {"VMREADY_CONFIG_DIR": self.config},
            )
        )
        await deferLater(reactor, 0.2, lambda: None)
        self.assertEqual(await self.ok("stop", "prod:web1", "--force"), "web1: STOPPED\n")
        self.assertEqual(await waiting, (0, "web1: STOPPED\n", ""))
        actions = [
            json.loads(line)["metadata"]["action"]
            for line in monitor_out.getvalue().split("\n")
            if line
        ]
        self.assertIn("instance-stopped", actions)
        monitoring.cancel()
        self.failureResultOf(monitoring, CancelledError)
        self.assertEqual(self.lifecycle.store.view.get_instance("web1").vm_state.value, "stopped")

    async def test_defaultRemote(self) -> None:
        await self.added()
        self.assertEqual(await self.ok("remote", "get-default"), "local\n")
        self.assertEqual(await self.ok("remote", "switch", "prod"), "Default remote: prod\n")
        self.assertEqual(await self.ok("remote", "get-default"), "prod\n")
        await self.ok("launch", "web2")  # no REMOTE: the default remote
        self.assertEqual(self.lifecycle.store.view.get_instance("web2").name, "web2")
        rows = json.loads(await self.ok("remote", "list", "--format", "json"))
        self.assertEqual(
            [(row["name"], row["url"], row["default"]) for row in rows],
            [("local", f"unix://{self.socket}", False), ("prod", self.url, True)],
        )
        table = await self.ok("remote", "list")
        self.assertEqual(table.splitlines()[0].split(), ["NAME", "URL", "FINGERPRINT", "DEFAULT"])
        self.assertEqual(
            table.splitlines()[2].split(),
            ["prod", self.url, self.server.fingerprint[:12], "yes"],
        )
        code, _, err = await self.cli("remote", "remove", "prod")
        self.assertEqual(
            (code, err),
            (
                1,
                "vmready: prod is the default remote: switch to another first "
                "(vmready remote switch local)\n",
            ),
        )
        await self.ok("remote", "switch", "local")
        self.assertEqual(await self.ok("remote", "remove", "prod"), "Remote prod removed\n")
        self.assertEqual(self.remotes_file()["remotes"], {})

    async def test_usedTokenIsRefused(self) -> None:
        token = await self.token()
        await self.ok("remote", "add", "prod", "--token", token)
        other = os.path.join(self.dir, "intruder")
        code, out, err = await self.cli("remote", "add", "prod", "--token", token, config=other)
        self.assertEqual(
            (code, out, err),
            (
                1,
                "",
                "vmready: not adding prod: the trust token is unknown: used already, revoked "
                "or never issued\n",
            ),
        )
        self.assertFalse(os.path.exists(os.path.join(other, "remotes.yaml")))
        self.assertEqual([e.name for e in await self.trust.certificates()], ["laptop"])

    async def test_malformedTokenIsAUsageError(self) -> None:
        code, _out, err = await self.cli("remote", "add", "prod", "--token", "bm90IGpzb24=")
        self.assertEqual(code, 2)
        self.assertEqual(
            err.splitlines()[-1],
            "vmready: error: invalid --token: not a trust token: its base64 does not hold JSON "
            "(was it copied whole?)",
        )

    async def test_tokenNeedsARemoteAPI(self) -> None:
        self.trust.addresses = []
        code, _out, err = await self.cli("--socket", self.socket, "config", "trust", "add", "x")
        self.assertEqual(code, 1)
        self.assertIn("this daemon serves no remote API: start it with --https-address", err)


class PinningTests(RemoteTestCase):
    """The server's certificate is pinned, never silently trusted."""

    async def test_withoutTokenTheFingerprintIsShownAndNothingIsAdded(self) -> None:
        code, out, err = await self.cli("remote", "add", "prod", self.url)
        self.assertEqual(code, 1)
        self.assertEqual(out, f"Certificate fingerprint: {self.server.fingerprint}\n")
        self.assertIn("vmready: not adding prod: check the fingerprint above", err)
        self.assertFalse(os.path.exists(os.path.join(self.config, "remotes.yaml")))

    async def test_fingerprintMismatchIsRefused(self) -> None:
        code, out, err = await self.cli(
            "remote", "add", "prod", self.url, "--fingerprint", "AB:" * 31 + "AB"
        )
        self.assertEqual(code, 1)
        self.assertEqual(
            err,
            f"vmready: not adding prod: the certificate of {self.url} has fingerprint "
            f"{self.server.fingerprint}, not {'ab' * 32} (the one you expected): is something "
            "between you and the daemon?\n",
        )
        self.assertNotIn("Traceback", out + err)

    async def test_pinnedFingerprintMismatchOnEveryCommand(self) -> None:
        await self.added()
        data = self.remotes_file()
        data["remotes"]["prod"]["fingerprint"] = "cd" * 32
        with open(os.path.join(self.config, "remotes.yaml"), "w") as f:
            yaml.safe_dump(data, f)
        code, out, err = await self.cli("list", "prod:")
        self.assertEqual(
            (code, out, err),
            (
                1,
                "",
                f"vmready: cannot reach remote prod ({self.url}): refused the server's "
                "certificate: the server's certificate has fingerprint "
                f"{self.server.fingerprint}, "
                f"not the pinned {'cd' * 32}\n",
            ),
        )

    async def test_acceptedCertificateOfAnUntrustedClientIsNotAdded(self) -> None:
        code, _out, err = await self.cli("remote", "add", "prod", self.url, "--accept-certificate")
        self.assertEqual(code, 1)
        self.assertIn(f"not adding prod: {self.url} does not trust this client's certificate", err)
        self.assertFalse(os.path.exists(os.path.join(self.config, "remotes.yaml")))

    async def test_alreadyTrustedClientIsAddedByFingerprint(self) -> None:
        await self.added()
        out = await self.ok(
            "remote", "add", "again", self.url, "--fingerprint", self.server.fingerprint
        )
        self.assertEqual(
            out,
            f"Certificate fingerprint: {self.server.fingerprint}\n"
            f"Remote again added: {self.url}\n",
        )


class UntrustedAndRevokedTests(RemoteTestCase):
    """An untrusted client certificate gets a 403; removing one revokes it at once."""

    def pin_untrusted(self) -> None:
        os.makedirs(self.config)
        with open(os.path.join(self.config, "remotes.yaml"), "w") as f:
            yaml.safe_dump(
                {
                    "default-remote": "local",
                    "remotes": {"prod": {"url": self.url, "fingerprint": self.server.fingerprint}},
                },
                f,
            )

    async def test_untrustedClientIsRefused(self) -> None:
        self.pin_untrusted()
        code, _out, err = await self.cli("list", "prod:")
        self.assertEqual(code, 1)
        self.assertTrue(
            err.startswith("vmready: Error: not authorized: this client's certificate ("), err
        )
        self.assertIn("is not trusted by the daemon", err)
        code, _, err = await self.cli("config", "trust", "add", "prod:me")
        self.assertEqual(code, 1)
        self.assertIn("not authorized", err)

    async def test_untrustedClientIsRefusedTheDaemonsConfig(self) -> None:
        self.pin_untrusted()
        await self.ok("remote", "switch", "prod")
        code, out, err = await self.cli("config", "show")
        self.assertEqual((code, out), (1, ""))
        self.assertIn("not authorized: the daemon does not trust this client's certificate", err)

    async def test_trustRemoveRevokes(self) -> None:
        await self.added()
        monitor_err = io.StringIO()
        monitoring = Deferred.fromCoroutine(
            run(
                reactor,
                ["monitor", "prod:"],
                io.StringIO(),
                monitor_err,
                {"VMREADY_CONFIG_DIR": self.config},
            )
        )
        await deferLater(reactor, 0.2, lambda: None)
        self.assertFalse(monitoring.called)
        out = await self.ok("--socket", self.socket, "config", "trust", "remove", "laptop")
        self.assertTrue(out.startswith("Removed laptop ("), out)
        # The revoked client's event stream ends at once; its next request is refused.
        self.assertEqual(await monitoring, 1)
        self.assertIn("lost the connection to remote prod", monitor_err.getvalue())
        code, _, err = await self.cli("list", "prod:")
        self.assertEqual(code, 1)
        self.assertIn("is not trusted by the daemon", err)

    async def test_clientRemovingItselfGetsItsAnswer(self) -> None:
        await self.added()
        out = await self.ok("config", "trust", "remove", "prod:laptop")
        self.assertTrue(out.startswith("Removed laptop ("), out)
        code, _, err = await self.cli("list", "prod:")
        self.assertEqual(code, 1)
        self.assertIn("not authorized", err)

    async def test_unknownRemoteAndBadPrefix(self) -> None:
        code, _, err = await self.cli("list", "nowhere:")
        self.assertEqual((code, err), (1, "vmready: unknown remote 'nowhere' (remotes: local)\n"))
        code, _, err = await self.cli("info", ":web")
        self.assertEqual(code, 2)
        self.assertIn("a remote name goes before the colon", err)
