"""The in-guest vmready agent: serial handshake with the host, and the guest API socket.

``vmready-agent`` (``vmready.agent.main``) runs it, as an installed command,
as ``python -m vmready.agent.main``, or from the zipapp that
``vmready.hypervisor.agentbundle`` builds for real guests.  Standard library only, and
Python 3.9 syntax: the same code runs as a host process for fakeqemu guests
and inside a stock guest whose only Python is its own ``python3``.

One module per concern: ``core`` (the handshake rules, without I/O),
``ports`` (finding the virtio ports), ``serial`` (keeping the status port),
``firstword`` (the first STARTED, said before the rest is imported),
``apisocket`` (the guest API's unix socket, bound with that STARTED),
``host`` (mutual TLS to the host's guest API), ``tls`` (the pinned TLS
context), ``network`` (the fallback transport's NIC), ``httpcodec`` and
``httpwire`` (the HTTP/1.1 codec all three ends use, and its asyncio
reading), ``records`` (value classes without dataclasses), ``proxy`` (the
devlxd socket), ``memory`` (the workload's Ready for this boot),
``recording`` (``--record``), ``config`` (config drive and options),
``minimum`` (the interpreter it needs, checked first), ``service`` (all of
them wired together on asyncio), ``notify`` (the ``notify`` command, a
blocking client), ``options`` (what both share), ``boottimes`` (the boot's
dated console lines), ``logs`` (its logging) and ``main`` (the command line).
"""

from vmready.agent.minimum import require_supported_python

require_supported_python()  # before anything that needs a newer Python, or ssl

# Only mypy reads typing here: ``vmready-agent notify`` and the agent's first
# STARTED import this package, and typing costs under emulation.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from vmready.agent.config import AgentConfig, Transport, load_config
    from vmready.agent.core import AgentCore, HostAddress, TcpAddress, VsockAddress
    from vmready.agent.host import HostConnector
    from vmready.agent.logs import configure_logging
    from vmready.agent.options import ConfigError
    from vmready.agent.service import Agent, build_agent
    from vmready.agent.tls import client_context, pinned_der

# The face's names are imported when first asked for: ``vmready-agent notify``, a
# second interpreter at every boot, and the agent's first STARTED import this
# package and need none of them.
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
    "configure_logging": "logs",
    "load_config": "config",
    "pinned_der": "tls",
}


def __getattr__(name: str) -> "Any":
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

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
