"""The in-guest vmready agent: serial handshake with the host, and the guest API socket.

``vmready-agent`` (``vmready.agent.main``) runs it, as an installed command,
as ``python -m vmready.agent.main``, or from the zipapp that
``vmready.hypervisor.agentbundle`` builds for real guests.  Standard library only, and
Python 3.9 syntax: the same code runs as a host process for fakeqemu guests
and inside a stock guest whose only Python is its own ``python3``.

One module per concern: ``core`` (the handshake rules, without I/O),
``serial`` (finding and keeping the virtio port), ``host`` (mutual TLS to the
host's guest API), ``tls`` (the pinned TLS context), ``network`` (the fallback
transport's NIC), ``httpwire`` (the HTTP/1.1 codec both ends use), ``proxy``
(the devlxd socket), ``memory`` (the workload's Ready for this boot),
``recording`` (``--record``), ``config`` (config drive and options),
``minimum`` (the interpreter it needs, checked first),
``service`` (all of them wired together on asyncio), ``notify`` (the
``notify`` command), ``options`` (what both share), ``boottimes`` (the boot's
dated console lines) and ``main`` (the command line).
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

from vmready.agent.minimum import require_supported_python

require_supported_python()  # before anything that needs a newer Python, or ssl

if TYPE_CHECKING:
    from vmready.agent.config import AgentConfig, Transport, load_config
    from vmready.agent.core import AgentCore, HostAddress, TcpAddress, VsockAddress
    from vmready.agent.host import HostConnector
    from vmready.agent.main import configure_logging
    from vmready.agent.options import ConfigError
    from vmready.agent.service import Agent, build_agent
    from vmready.agent.tls import client_context, pinned_der

# A library's manners: nothing printed unless the program (main) configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# The face's names are imported when first asked for: ``vmready-agent notify``, a
# second interpreter at every boot, imports this package and needs none of them.
_FACE = {
    "Agent": "service",
    "AgentConfig": "config",
    "AgentCore": "core",
    "ConfigError": "options",
    "HostAddress": "core",
    "HostConnector": "host",
    "TcpAddress": "core",
    "Transport": "config",
    "VsockAddress": "core",
    "build_agent": "service",
    "client_context": "tls",
    "configure_logging": "main",
    "load_config": "config",
    "pinned_der": "tls",
}


def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "Agent",
    "AgentConfig",
    "AgentCore",
    "ConfigError",
    "HostAddress",
    "HostConnector",
    "TcpAddress",
    "Transport",
    "VsockAddress",
    "build_agent",
    "client_context",
    "configure_logging",
    "load_config",
    "pinned_der",
]
