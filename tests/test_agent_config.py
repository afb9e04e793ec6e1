"""Tests for vmready.agent.config: the config drive, agent.json and options."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.config import (
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    DEFAULT_VIRTIO_PORTS,
    ConfigError,
    Transport,
    load_config,
    parse_transport,
)
from vmready.certs import generate, write_config_drive

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
        self.assertEqual(config.identity, CLIENT)
        self.assertEqual(config.server_cert_pem, SERVER.cert_pem)

    def test_realGuestDefaultsWithoutAgentJson(self) -> None:
        config = self.load()
        self.assertEqual(
            (config.transport, config.socket, config.state_dir, config.virtio_ports),
            (Transport("vsock"), DEFAULT_SOCKET, DEFAULT_STATE_DIR, DEFAULT_VIRTIO_PORTS),
        )
        self.assertEqual((config.heartbeat, config.retries, config.serial), (5.0, 3, None))

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

    def test_unknownKeysAreIgnored(self) -> None:
        self.settings(future_setting="x")
        self.assertEqual(self.load().instance, None)

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
        self.assertIn("agent.key does not belong to agent.crt", str(error))

    def test_notAPemCertificateIsRefused(self) -> None:
        with open(os.path.join(self.drive, "agent.crt"), "wb") as f:
            f.write(b"hello")
        error = self.assertRaises(ConfigError, self.load)
        self.assertIn("is not a PEM certificate", str(error))

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
