"""The two HTTP servers.

The operator API (``operator``) and the guest API (``guest``), on one request
class and one error handler (``web``).
"""
