"""Tests for vmready.agent.config: the config drive, agent.json and options."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import ssl
import tempfile
from typing import Any
from unittest import mock

from cryptography.hazmat.primitives import serialization
from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.config import DEFAULT_STATE_DIR, Transport, load_config, parse_transport
from vmready.agent.network import NetworkPlan
from vmready.agent.options import DEFAULT_SOCKET, ConfigError
from vmready.agent.ports import (
    DEFAULT_SYSFS_PORTS,
    DEFAULT_VIRTIO_PORTS,
    LEGACY_PORT_NAME,
    PORT_NAME,
)
from vmready.trust.certs import generate, write_config_drive

CLIENT = generate("demo")
SERVER = generate("vmready")


class ConfigDriveTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.drive = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.drive, True)
        write_config_drive(self.drive, CLIENT, SERVER.cert_pem)

    def settings(self, **values: Any) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            json.dump(values, f)

    def load(self, **options: Any) -> Any:
        return load_config({"config-drive": self.drive, **options})

    def test_certificatesAreRead(self) -> None:
        config = self.load()
        self.assertEqual(
            (config.client_cert, config.client_key),
            (os.path.join(self.drive, "agent.crt"), os.path.join(self.drive, "agent.key")),
        )
        self.assertEqual(config.server_cert_pem, SERVER.cert_pem)

    def test_theCertificatesAreParsedOnceIntoTheContextKept(self) -> None:
        # Under emulation every parse of a certificate or key costs: loading the drive
        # builds the one context the agent then uses, and parses nothing twice.
        parsed: list[str] = []
        verify, chain = ssl.SSLContext.load_verify_locations, ssl.SSLContext.load_cert_chain

        def counted_verify(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
            parsed.append("server.crt")
            verify(context, *args, **kwargs)

        def counted_chain(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
            parsed.append("agent.crt and agent.key")
            chain(context, *args, **kwargs)

        with (
            mock.patch.object(ssl.SSLContext, "load_verify_locations", counted_verify),
            mock.patch.object(ssl.SSLContext, "load_cert_chain", counted_chain),
        ):
            config = self.load()
        self.assertEqual(parsed, ["server.crt", "agent.crt and agent.key"])
        assert config.tls is not None
        self.assertEqual(config.tls.verify_mode, ssl.CERT_REQUIRED)

    def test_realGuestDefaultsWithoutAgentJson(self) -> None:
        config = self.load()
        self.assertEqual(
            (config.transport, config.socket, config.state_dir, config.virtio_ports),
            (Transport("vsock"), DEFAULT_SOCKET, DEFAULT_STATE_DIR, DEFAULT_VIRTIO_PORTS),
        )
        self.assertEqual((config.heartbeat, config.retries, config.serial), (5.0, 3, None))
        self.assertEqual(
            (config.virtio_sysfs, config.ports, config.tcp_sockets, config.network),
            (DEFAULT_SYSFS_PORTS, (PORT_NAME, LEGACY_PORT_NAME), None, None),
        )

    def test_agentJsonSettingsApply(self) -> None:
        self.settings(
            instance="demo",
            virtio_ports="/q/qmp.sock.guest/virtio-ports",
            transport="hvsock:/data/guest-api.sock",
            devlxd_socket="/q/guest/lxd.sock",
            state_dir="/q/guest/run",
        )
        config = self.load()
        self.assertEqual(config.instance, "demo")
        self.assertEqual(config.virtio_ports, "/q/qmp.sock.guest/virtio-ports")
        self.assertEqual(config.transport, Transport("hvsock", "/data/guest-api.sock"))
        self.assertEqual(config.socket, "/q/guest/lxd.sock")
        self.assertEqual(config.state_dir, "/q/guest/run")

    def test_optionsWinOverAgentJson(self) -> None:
        self.settings(devlxd_socket="/q/guest/lxd.sock", transport="hvsock:/data/g.sock")
        config = self.load(socket="/elsewhere/sock", transport="vsock")
        self.assertEqual(
            (config.socket, config.transport), ("/elsewhere/sock", Transport("vsock"))
        )

    def test_relativePathsAreRelativeToTheDrive(self) -> None:
        self.settings(state_dir="run")
        self.assertEqual(self.load().state_dir, os.path.join(self.drive, "run"))

    def test_unknownKeysAreIgnoredWithAWarning(self) -> None:
        self.settings(future_setting="x")
        with self.assertLogs("vmready.agent.config", logging.WARNING) as logged:
            self.assertEqual(self.load().instance, None)
        self.assertEqual(
            logged.records[0].getMessage(),
            f"ignoring unknown key 'future_setting' in {self.drive}/agent.json",
        )

    def test_wiredPortIsTriedFirst(self) -> None:
        self.settings(port=LEGACY_PORT_NAME)
        self.assertEqual(self.load().ports, (LEGACY_PORT_NAME, PORT_NAME))

    def test_portThatIsAPathIsRefused(self) -> None:
        self.settings(port="../x")
        self.assertIn(
            "port '../x' is not a port name", str(self.assertRaises(ConfigError, self.load))
        )

    def test_namedVirtioPortsDirectoryTurnsSysfsOff(self) -> None:
        # A fakeqemu guest is a host process: the host's own virtio ports are not its own.
        self.settings(virtio_ports="/q/qmp.sock.guest/virtio-ports")
        self.assertIsNone(self.load().virtio_sysfs)

    def test_virtioPortsOptionTurnsSysfsOffToo(self) -> None:
        self.assertIsNone(self.load(**{"virtio-ports": "/elsewhere"}).virtio_sysfs)

    def test_tcpSocketsDirectoryIsRelativeToTheDrive(self) -> None:
        self.settings(tcp_sockets="tcp")
        self.assertEqual(self.load().tcp_sockets, os.path.join(self.drive, "tcp"))

    def test_networkSettingsMakeAPlan(self) -> None:
        self.settings(network_mac="52:54:00:76:6D:01", network_address="10.0.2.15/24")
        self.assertEqual(
            self.load().network,
            NetworkPlan("52:54:00:76:6d:01", ipaddress.IPv4Interface("10.0.2.15/24")),
        )

    def test_networkMacWithoutAnAddressIsRefused(self) -> None:
        self.settings(network_mac="52:54:00:76:6d:01")
        error = self.assertRaises(ConfigError, self.load)
        self.assertIn("network_mac and network_address go together", str(error))

    def test_badMacIsRefused(self) -> None:
        self.settings(network_mac="52:54:00", network_address="10.0.2.15/24")
        error = self.assertRaises(ConfigError, self.load)
        self.assertIn("network_mac '52:54:00' is not a MAC address", str(error))

    def test_addressWithoutPrefixIsRefused(self) -> None:
        self.settings(network_mac="52:54:00:76:6d:01", network_address="10.0.2.15")
        error = self.assertRaises(ConfigError, self.load)
        self.assertIn("network_address '10.0.2.15' has no prefix length", str(error))

    def test_addressThatIsNotIPv4IsRefused(self) -> None:
        self.settings(network_mac="52:54:00:76:6d:01", network_address="fe80::1/64")
        error = self.assertRaises(ConfigError, self.load)
        self.assertIn("is not an IPv4 address/prefix", str(error))

    def test_missingCertificateIsOneLine(self) -> None:
        os.unlink(os.path.join(self.drive, "server.crt"))
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(
            str(error),
            f"cannot read {os.path.join(self.drive, 'server.crt')}: No such file or directory",
        )

    def test_keyOfAnotherCertificateIsRefused(self) -> None:
        write_config_drive(self.drive, CLIENT, SERVER.cert_pem)
        with open(os.path.join(self.drive, "agent.key"), "wb") as f:
            f.write(SERVER.key_pem)
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(str(error), f"agent.key does not belong to agent.crt in {self.drive}")

    def test_notAPemCertificateIsRefused(self) -> None:
        with open(os.path.join(self.drive, "agent.crt"), "wb") as f:
            f.write(b"hello")
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(str(error), f"{self.drive}/agent.crt is not a PEM certificate")

    def test_brokenPemCertificateIsRefused(self) -> None:
        with open(os.path.join(self.drive, "server.crt"), "wb") as f:
            f.write(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(str(error), f"{self.drive}/server.crt is not a PEM certificate")

    def test_serverCertificateMustBeExactlyOne(self) -> None:
        with open(os.path.join(self.drive, "server.crt"), "wb") as f:
            f.write(SERVER.cert_pem + CLIENT.cert_pem)
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(
            str(error),
            f"{self.drive}/server.crt holds 2 certificates; it must hold exactly one",
        )

    def test_keyThatIsNotAKeyIsRefused(self) -> None:
        with open(os.path.join(self.drive, "agent.key"), "wb") as f:
            f.write(b"not a key")
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(
            str(error), f"{self.drive}/agent.key is not an unencrypted PEM private key"
        )

    def test_encryptedKeyIsRefusedWithoutAsking(self) -> None:
        key = serialization.load_pem_private_key(CLIENT.key_pem, password=None)
        encrypted = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
        with open(os.path.join(self.drive, "agent.key"), "wb") as f:
            f.write(encrypted)
        error = self.assertRaises(ConfigError, self.load)
        self.assertEqual(
            str(error), f"{self.drive}/agent.key is not an unencrypted PEM private key"
        )

    def test_agentJsonThatIsNotJsonIsRefused(self) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            f.write("{")
        self.assertIn("is not valid JSON", str(self.assertRaises(ConfigError, self.load)))

    def test_nonStringSettingIsRefused(self) -> None:
        self.settings(state_dir=5)
        self.assertIn(
            "state_dir must be a non-empty string", str(self.assertRaises(ConfigError, self.load))
        )

    def test_missingDriveIsRefused(self) -> None:
        error = self.assertRaises(
            ConfigError, load_config, {"config-drive": os.path.join(self.drive, "nope")}
        )
        self.assertIn("is not a directory", str(error))

    def test_nonPositiveHeartbeatIsRefused(self) -> None:
        self.assertRaises(ConfigError, self.load, heartbeat="0")

    def test_negativeRetriesAreRefused(self) -> None:
        self.assertRaises(ConfigError, self.load, retries="-1")


class TransportTests(SynchronousTestCase):
    def test_vsock(self) -> None:
        self.assertEqual(parse_transport("vsock"), Transport("vsock"))

    def test_hybridVsockWithPath(self) -> None:
        self.assertEqual(parse_transport("hvsock:/d/g.sock"), Transport("hvsock", "/d/g.sock"))

    def test_hybridVsockWithoutPathIsRefused(self) -> None:
        self.assertRaises(ConfigError, parse_transport, "hvsock:")

    def test_unknownTransportIsRefused(self) -> None:
        error = self.assertRaises(ConfigError, parse_transport, "tcp")
        self.assertEqual(str(error), "transport 'tcp' is neither 'vsock' nor 'hvsock:<path>'")
