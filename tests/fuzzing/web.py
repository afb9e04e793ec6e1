"""Fuzz targets for the HTTP side: API bodies and query strings, config, client certificates.

Each concern has its module: ``web_operator`` (the operator API), ``web_guest``
(the guest API), ``web_config`` (the daemon's config file, instance config
values), ``web_certs`` (client certificates), ``web_tokens`` (trust tokens);
``web_http`` is the in-memory daemon core and raw HTTP they share.
"""

from __future__ import annotations

from tests.fuzzing import web_certs, web_config, web_guest, web_operator, web_tokens
from tests.fuzzing.target import FuzzTarget

TARGETS: list[FuzzTarget] = [
    *web_operator.TARGETS,
    *web_guest.TARGETS,
    *web_config.TARGETS,
    *web_certs.TARGETS,
    *web_tokens.TARGETS,
]
