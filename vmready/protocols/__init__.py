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

_FACE = {
    "MAX_LINE_BYTES": "ringbuffer",
    "AgentStatus": "ringbuffer",
    "DiscardedFragment": "ringbuffer",
    "HostEcho": "ringbuffer",
    "Noise": "ringbuffer",
    "OverlongLine": "ringbuffer",
    "RingBufferReader": "ringbuffer",
    "StatusLine": "ringbuffer",
    "TcpHostEcho": "ringbuffer",
    "UndecodableLine": "ringbuffer",
    "connect_line_problem": "ringbuffer",
    "format_connect": "ringbuffer",
    "format_tcp_connect": "ringbuffer",
    "parse_connect": "ringbuffer",
    "DEFAULT_KEEP": "transcript",
    "DEFAULT_MAX_BYTES": "transcript",
    "FORMAT": "transcript",
    "PemRedactor": "transcript",
    "TranscriptError": "transcript",
    "TranscriptWriter": "transcript",
    "body_fields": "transcript",
    "body_from_fields": "transcript",
    "data_fields": "transcript",
    "data_from_fields": "transcript",
    "looks_secret": "transcript",
    "redact_json": "transcript",
}


def __getattr__(name: str) -> object:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
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
