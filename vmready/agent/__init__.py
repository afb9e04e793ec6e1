"""The in-guest vmready agent: serial handshake with the host, and the guest API socket.

``vmready-agent`` (``vmready.agent.main``) or ``twistd vmready-agent``
(``vmready.agent.tap``) runs it.  One module per concern: ``core`` (the
handshake rules, without I/O), ``serial`` (the virtio port), ``host`` (mutual
TLS to the host's guest API), ``proxy`` (the devlxd socket), ``memory`` (the
workload's Ready for this boot), ``config`` (config drive and options),
``service`` (all of them wired together), ``notify`` (the ``notify`` command)
and ``testing`` (a fake host and a fake serial peer for tests).
"""

from vmready.agent.config import AgentConfig, ConfigError, load_config
from vmready.agent.core import AgentCore, HostAddress
from vmready.agent.service import AgentService, build_agent

__all__ = [
    "AgentConfig",
    "AgentCore",
    "AgentService",
    "ConfigError",
    "HostAddress",
    "build_agent",
    "load_config",
]
