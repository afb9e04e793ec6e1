"""``--https-address``: the spellings Incus operators know, refused precisely otherwise."""

from __future__ import annotations

import socket

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.daemon.tap import Options


class HTTPSAddressTests(SynchronousTestCase):
    def test_spellings(self) -> None:
        cases = {
            "127.0.0.1:9443": ("127.0.0.1", 9443, "tcp:port=9443:backlog=256:interface=127.0.0.1"),
            ":8443": ("", 8443, "tcp:port=8443:backlog=256"),
            "10.0.0.5": ("10.0.0.5", 8443, "tcp:port=8443:backlog=256:interface=10.0.0.5"),
            "[::1]:9000": ("::1", 9000, "tcp:port=9000:backlog=256:interface=\\:\\:1"),
            "::": ("::", 8443, "tcp:port=8443:backlog=256:interface=\\:\\:"),
        }
        for text, (host, port, endpoint) in cases.items():
            address = HTTPSAddress.parse(text)
            self.assertEqual(
                (address.host, address.port, address.endpoint()), (host, port, endpoint)
            )

    def test_advertised(self) -> None:
        self.assertEqual(HTTPSAddress.parse("[::1]:0").advertised(4321), ["[::1]:4321"])
        self.assertEqual(
            HTTPSAddress.parse(":8443").advertised(8443), [f"{socket.getfqdn()}:8443"]
        )

    def test_refusals(self) -> None:
        for text, message in (
            ("host:http", "'host:http': port 'http' is not a number from 0 to 65535"),
            ("host:70000", "'host:70000': port '70000' is not a number from 0 to 65535"),
            ("[::1", "'[::1': an IPv6 address goes in brackets, [::1]:8443"),
            ("[::1]9000", "'[::1]9000': expected :PORT after ]"),
        ):
            error = self.assertRaises(ValueError, HTTPSAddress.parse, text)
            self.assertEqual(str(error), message)

    def test_optionRefusesABadAddress(self) -> None:
        options = Options()
        error = self.assertRaises(
            usage.UsageError,
            options.parseOptions,
            ["--config", "", "--data-dir", "/tmp/vmr-https", "--https-address", "h:x"],
        )
        self.assertEqual(
            str(error), "--https-address 'h:x': port 'x' is not a number from 0 to 65535"
        )
