"""What a replay's core is built from: the transcript's header, checked.

Host side, the header says it all (the instance's name, uuid, config, the
daemon's port, whether the session began with a running VM).  Agent side, the
header does not say how the instance was configured: the host's recorded
answers do.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from typing import Any

import attrs

from vmready.agentlink import PollIntervals
from vmready.domain import VMReadyError, validate_config, validate_name
from vmready.hypervisor import CURRENT_LAYOUT, SERIAL_LAYOUTS, SerialLayout
from vmready.protocols import TranscriptError
from vmready.protocols.transcriptreader import Transcript
from vmready.record.replayinputs import first_agent_port

FIXED_UUID = "00000000-0000-4000-8000-000000000000"
_CONFIG_PREFIX = "/1.0/config/"
_META_DATA_PATH = "/1.0/meta-data"


@attrs.frozen
class ReplaySetup:
    """The recorded session's instance and daemon, as the replayed core is built."""

    side: str
    name: str
    uuid: str
    config: dict[str, str]
    layout: SerialLayout
    intervals: PollIntervals
    # The daemon's guest port when the session began.
    port: int
    # Host side: the session began with a running VM (from a daemon start), not a create.
    adopts: bool


def replay_setup(transcript: Transcript) -> ReplaySetup:
    """The setup of ``transcript``'s replay; TranscriptError if it cannot be replayed."""
    header = transcript.header
    side = transcript.side
    name = str(header["instance"])
    _check_records(transcript)
    config = _checked_header(transcript, name)
    uuid = str(header.get("uuid") or FIXED_UUID)
    if side == "agent":
        name, uuid, config = _primed_from_answers(transcript, name, uuid)
        port = first_agent_port(transcript.entries)
    else:
        port = int(header.get("host_port") or 0)
    layout = str(header.get("layout", CURRENT_LAYOUT.name))
    return ReplaySetup(
        side=side,
        name=name,
        uuid=uuid,
        config=config,
        layout=SERIAL_LAYOUTS.get(layout, CURRENT_LAYOUT),
        intervals=_intervals(header),
        port=port,
        adopts=side == "host" and header.get("origin", "create") != "create",
    )


def _intervals(header: dict[str, Any]) -> PollIntervals:
    poll = header.get("poll")
    if not isinstance(poll, dict):
        return PollIntervals()
    # A transcript from before the link was event-driven names other intervals: defaults.
    return PollIntervals.from_mapping(poll)


def _bad_header(transcript: Transcript, message: str) -> TranscriptError:
    return TranscriptError(transcript.source, 1, message)


def _checked_header(transcript: Transcript, name: str) -> dict[str, str]:
    """The header's fields the core is built from, checked: TranscriptError if not usable."""
    header = transcript.header
    if transcript.side == "host":
        try:
            validate_name(name)
        except VMReadyError as e:
            raise _bad_header(transcript, f'"instance": {e}') from None
    config = header.get("config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise _bad_header(transcript, f'"config" must be an object, got {config!r}')
    port = header.get("host_port")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 2**32
    ):
        raise _bad_header(transcript, f'"host_port" must be a port number, got {port!r}')
    for field in ("uuid", "origin", "layout"):
        value = header.get(field)
        if value is not None and not isinstance(value, str):
            raise _bad_header(transcript, f'"{field}" must be a string, got {value!r}')
    wanted = {str(k): v for k, v in config.items() if not str(k).startswith("vmready.")}
    try:
        return validate_config(wanted)
    except VMReadyError as e:
        raise _bad_header(transcript, f'"config": {e}') from None


def _primed_from_answers(
    transcript: Transcript, name: str, uuid: str
) -> tuple[str, str, dict[str, str]]:
    """Agent side: the instance (name, uuid, config) as the host's recorded answers show it.

    The agent's header does not say how the instance was configured: its
    successful ``GET /1.0/config/<key>`` answers give those values (keys only
    listed by ``GET /1.0/config`` are set empty), its ``GET /1.0/meta-data``
    answer the uuid, the name and ``user.meta-data``.  Everything else the
    host answers is still compared as recorded.
    """
    requests = {e.fields["id"]: e for e in transcript.entries if e.kind == "host-request"}
    config: dict[str, str] = {}
    listed: set[str] = set()
    for entry in transcript.entries:
        request = requests.get(entry.fields.get("id"))
        if entry.kind != "host-response" or request is None:
            continue
        if entry.fields["status"] != 200 or request.fields["method"] != "GET":
            continue
        if entry.fields.get("truncated") or not isinstance(entry.fields.get("body"), str):
            continue
        try:
            metadata = json.loads(entry.fields["body"]).get("metadata")
        except (ValueError, AttributeError):
            continue
        path = urllib.parse.urlsplit(str(request.fields["path"])).path
        if path.startswith(_CONFIG_PREFIX) and isinstance(metadata, str):
            config[urllib.parse.unquote(path[len(_CONFIG_PREFIX) :])] = metadata
        elif path == "/1.0/config" and isinstance(metadata, list):
            listed.update(
                str(url)[len(_CONFIG_PREFIX) :]
                for url in metadata
                if str(url).startswith(_CONFIG_PREFIX)
            )
        elif path == _META_DATA_PATH and isinstance(metadata, str):
            head, _, extra = metadata.partition("\n")
            host, _, extra = extra.partition("\n")
            if head.startswith("instance-id: ") and host.startswith("local-hostname: "):
                uuid = head[len("instance-id: ") :]
                name = host[len("local-hostname: ") :]
                if extra:
                    config["user.meta-data"] = extra
    for key in listed:
        config.setdefault(key, "")
    try:
        primed = validate_config(
            {k: v for k, v in config.items() if k.startswith(("user.", "cloud-init."))}
        )
    except VMReadyError as e:
        raise _bad_header(
            transcript, f"the recorded config answers cannot be replayed: {e}"
        ) from None
    return name, uuid, primed


def _check_records(transcript: Transcript) -> None:
    """What the reader lets through but a replay cannot use: a time that is not a number."""
    for entry in transcript.entries:
        if not math.isfinite(entry.t):
            raise TranscriptError(
                transcript.source,
                entry.line,
                f'"t" must be seconds (0 or more), got {entry.t!r}',
            )
