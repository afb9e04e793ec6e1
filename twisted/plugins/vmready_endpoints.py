"""Registers the ``vsock:`` and ``hvsock:`` endpoint strings (servers and clients)."""

from vmready.agentlink import (
    HybridVSockClientParser,
    HybridVSockServerParser,
    VSockClientParser,
    VSockServerParser,
)

vsock_server = VSockServerParser()
vsock_client = VSockClientParser()
hvsock_server = HybridVSockServerParser()
hvsock_client = HybridVSockClientParser()
