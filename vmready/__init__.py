"""vmready: honest virtual machine status — Ready, the agent link, truthful transitions."""

__version__ = "0.1.0"
