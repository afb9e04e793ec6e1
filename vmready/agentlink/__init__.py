"""The agent link.

Following each agent's ring buffer (``link``, sans-I/O; ``monitor``), writing
CONNECT to its ``vmready.connect`` port (``connectport``), and the guest API's
transports (``transport``: vsock, the forward, hybrid vsock; ``vsock``: their
Twisted endpoints).
"""
