"""Wire formats: the agent's ring-buffer line protocol, the QMP client, the transcript format.

The face names the two formats the guest agent shares (``ringbuffer``, ``transcript``:
standard library only, in its zipapp); ``qmp`` (Twisted), ``prometheus`` and
``transcriptreader`` are faces of their own, so the agent never loads them.
"""

# Each name is imported from its module when first asked for: the agent, which runs
# under emulation where every import costs, needs the ring buffer's names and not
# the transcript's (``datetime``, ``json``), unless it records. mypy reads them here.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from vmready.protocols.ringbuffer import (
        MAX_LINE_BYTES,
        AgentStatus,
        DiscardedFragment,
        HostEcho,
        Noise,
        OverlongLine,
        RingBufferReader,
        StatusLine,
        TcpHostEcho,
        UndecodableLine,
        connect_line_problem,
        format_connect,
        format_tcp_connect,
        parse_connect,
    )
    from vmready.protocols.transcript import (
        DEFAULT_KEEP,
        DEFAULT_MAX_BYTES,
        FORMAT,
        PemRedactor,
        TranscriptError,
        TranscriptWriter,
        body_fields,
        body_from_fields,
        data_fields,
        data_from_fields,
        looks_secret,
        redact_json,
    )

# The transcript's names; every other name of ``__all__`` is the ring buffer's.
_TRANSCRIPT = frozenset(
    (
        "DEFAULT_KEEP",
        "DEFAULT_MAX_BYTES",
        "FORMAT",
        "PemRedactor",
        "TranscriptError",
        "TranscriptWriter",
        "body_fields",
        "body_from_fields",
        "data_fields",
        "data_from_fields",
        "looks_secret",
        "redact_json",
    )
)


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = "transcript" if name in _TRANSCRIPT else "ringbuffer"
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_MAX_BYTES",
    "FORMAT",
    "MAX_LINE_BYTES",
    "AgentStatus",
    "DiscardedFragment",
    "HostEcho",
    "Noise",
    "OverlongLine",
    "PemRedactor",
    "RingBufferReader",
    "StatusLine",
    "TcpHostEcho",
    "TranscriptError",
    "TranscriptWriter",
    "UndecodableLine",
    "body_fields",
    "body_from_fields",
    "connect_line_problem",
    "data_fields",
    "data_from_fields",
    "format_connect",
    "format_tcp_connect",
    "looks_secret",
    "parse_connect",
    "redact_json",
]
