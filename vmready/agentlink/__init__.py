"""The agent link.

Following each agent's ring buffer (``link``, sans-I/O; ``monitor``), writing
CONNECT to its ``vmready.connect`` port (``connectport``), and the guest API's
transports (``transport``: vsock, the forward, hybrid vsock; ``vsock``: their
Twisted endpoints).

``transport`` is a face of its own: it reads QEMU's command line (the hypervisor),
which the ``vsock:`` endpoint plugin, loaded by every ``twistd``, does without.
"""

from vmready.agentlink.connectport import ConnectPort
from vmready.agentlink.endpointstrings import (
    HybridVSockClientParser,
    HybridVSockServerParser,
    VSockClientParser,
    VSockServerParser,
)
from vmready.agentlink.hvsock import HybridVSockClientEndpoint, HybridVSockServerEndpoint
from vmready.agentlink.link import AgentLink, PollIntervals, StatusChanged
from vmready.agentlink.monitor import AgentMonitor, RingBufferDevice
from vmready.agentlink.vsock import VSockServerEndpoint
from vmready.agentlink.vsockaddress import HybridVSockAddress

__all__ = [
    "AgentLink",
    "AgentMonitor",
    "ConnectPort",
    "HybridVSockAddress",
    "HybridVSockClientEndpoint",
    "HybridVSockClientParser",
    "HybridVSockServerEndpoint",
    "HybridVSockServerParser",
    "PollIntervals",
    "RingBufferDevice",
    "StatusChanged",
    "VSockClientParser",
    "VSockServerEndpoint",
    "VSockServerParser",
]
