"""``twistd vmready``: the service, its options, and ``./dev run``."""
