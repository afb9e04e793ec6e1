"""The guest API ("devlxd") the daemon serves to each VM's agent over mutual TLS.

The caller is identified by its client certificate alone, checked again on
every request (``certificate_identifier``): an instance only ever sees and
changes itself.  Answers use LXD's envelope and, where LXD has one, its error
texts.  The routes, their answers and errors are in docs/guest-api.md.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, cast

import attrs
from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Site

from vmready.api.eventstream import EventStream
from vmready.api.limits import MAX_GUEST_CONNECTIONS, LimitedSite, PeerKey
from vmready.api.requestbody import parse_json, read_body
from vmready.api.web import (
    ErrorStyle,
    handle_error,
    literal_paths,
    local_site,
    sync_response,
)
from vmready.domain import BadRequest, Forbidden, InstanceRecord, NotFound
from vmready.hypervisor import meta_data as cloud_init_meta_data
from vmready.lifecycle import LIFECYCLE, Event, Lifecycle, rfc3339
from vmready.store import AgentLookup
from vmready.trust import (
    CertificatePair,
    MutualServerTLS,
    fingerprint,
    is_valid_at,
    peer_certificate_pem,
    server_tls_factory,
)

Identify = Callable[[IRequest], InstanceRecord | None]
Clock = Callable[[], datetime.datetime]

FORBIDDEN_MESSAGE = "Forbidden: unknown or revoked client certificate"
GUEST_EVENT_TYPES = frozenset({"config", "device"})
# The config keys a guest may read (LXD's rule).
_GUEST_PREFIXES = ("user.", "cloud-init.")
_READY = "Ready"
_STARTED = "Started"


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _guest_visible(key: str) -> bool:
    return key.startswith(_GUEST_PREFIXES)


# -- who is calling ----------------------------------------------------------


def instance_for_certificate(
    store: AgentLookup, cert_pem: bytes, when: datetime.datetime
) -> InstanceRecord | None:
    """The instance a client certificate identifies at ``when``, or None (unknown, revoked,
    outside its validity period, or not a certificate at all)."""
    try:
        if not is_valid_at(cert_pem, when):
            return None
        return store.instance_for_fingerprint(fingerprint(cert_pem))
    except ValueError:
        return None


def certificate_authorizer(store: AgentLookup, clock: Clock = _utcnow) -> Callable[[bytes], bool]:
    """For ``MutualServerTLS``: accept a client certificate iff it identifies an instance now."""

    def authorize(cert_pem: bytes) -> bool:
        return instance_for_certificate(store, cert_pem, clock()) is not None

    return authorize


def certificate_identifier(store: AgentLookup, clock: Clock = _utcnow) -> Identify:
    """The instance whose certificate the request's TLS peer presented, checked again now."""

    def identify(request: IRequest) -> InstanceRecord | None:
        cert_pem = peer_certificate_pem(getattr(request, "transport", None))
        if cert_pem is None:
            return None
        return instance_for_certificate(store, cert_pem, clock())

    return identify


# -- events, without I/O -----------------------------------------------------


@attrs.frozen
class GuestEvent(Event):
    """One ``/1.0/events`` line as the guest sees it (no project, unlike the operator's)."""

    def to_json(self) -> dict[str, Any]:
        """``{"type", "timestamp", "metadata"}``."""
        return {
            "type": self.type,
            "timestamp": rfc3339(self.timestamp),
            "metadata": self.metadata,
        }


class GuestEventFeed:
    """Turns the daemon's lifecycle events into one instance's guest events.

    Only ``instance-updated`` events of this instance produce anything: one
    ``config`` event per guest-visible key whose value really changed, with the
    value it had before (tracked here, since the lifecycle event carries only
    the new one).
    """

    def __init__(self, instance: InstanceRecord, types: frozenset[str]) -> None:
        self.source = f"/1.0/instances/{instance.name}"
        self.types = types
        self._config = {
            key: value for key, value in instance.config.items() if _guest_visible(key)
        }

    def concerns(self, event: Event) -> bool:
        """Whether ``event`` is a lifecycle event about this feed's instance."""
        return event.type == LIFECYCLE and event.metadata.get("source") == self.source

    def feed(self, event: Event) -> list[GuestEvent]:
        """The guest events ``event`` means for this instance (often none)."""
        if "config" not in self.types or not self.concerns(event):
            return []
        if event.metadata.get("action") != "instance-updated":
            return []
        changes = event.metadata.get("context", {}).get("config", {})
        produced = []
        for key in sorted(changes):
            if not _guest_visible(key):
                continue
            old = self._config.get(key, "")
            new = changes[key] or ""
            if new == old:
                continue
            if new:
                self._config[key] = new
            else:
                self._config.pop(key, None)
            produced.append(
                GuestEvent("config", event.timestamp, {"key": key, "old_value": old, "value": new})
            )
        return produced


# -- responses ---------------------------------------------------------------


def _error_envelope(code: int, message: str) -> dict[str, Any]:
    """LXD's error envelope, as devlxd sends it over vsock."""
    return {
        "type": "error",
        "status": "",
        "status_code": 0,
        "operation": "",
        "error_code": code,
        "error": message,
        "metadata": None,
    }


def _go_quote(text: str) -> str:
    """``text`` as Go's ``%q`` writes it (``strconv.Quote``), for LXD's error texts."""
    out = ['"']
    for char in text:
        if 0xD800 <= ord(char) <= 0xDFFF:
            # Go's JSON decoder turns a lone surrogate into U+FFFD.
            char = "\ufffd"
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif char in _GO_ESCAPES:
            out.append(_GO_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


GUEST_ERRORS = ErrorStyle(
    envelope=_error_envelope,
    method_not_allowed=lambda method: f"method {_go_quote(method)} not allowed",
    internal="internal server error",
    label="guest ",
)


_GO_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def _requested_state(raw: bytes) -> str:
    """The ``state`` a PATCH body asks for, decoded as Go decodes it into a string field."""
    body = parse_json(raw)
    state = body.get("state") if isinstance(body, dict) else None
    return state if isinstance(state, str) else ""


def _event_types(request: IRequest) -> frozenset[str]:
    """``?type=config,device`` (or repeated): the set asked for; every type when absent."""
    wanted: set[str] = set()
    for value in request.args.get(b"type", []):
        for part in value.decode("utf-8", errors="replace").split(","):
            if part == "":
                continue
            if part not in GUEST_EVENT_TYPES:
                raise BadRequest(f"Invalid event type {_go_quote(part)}")
            wanted.add(part)
    return frozenset(wanted) or GUEST_EVENT_TYPES


# -- the API -----------------------------------------------------------------


class GuestAPI:
    """The guest API over one ``Lifecycle``; serve it with ``guest_site`` + ``guest_tls_factory``.

    ``identify`` maps a request to the calling instance (None: refuse with 403);
    by default it reads the TLS peer certificate (``certificate_identifier``).
    ``location`` is what ``GET /1.0`` reports as the instance's location.
    """

    app = literal_paths(Klein())
    log = Logger()

    def __init__(
        self, lifecycle: Lifecycle, identify: Identify | None = None, location: str = "none"
    ) -> None:
        self.lifecycle = lifecycle
        self.identify = identify or certificate_identifier(lifecycle.store.view)
        self.location = location

    def caller(self, request: IRequest) -> InstanceRecord:
        """The calling instance, identified afresh; 403 for an unknown or revoked certificate."""
        record = self.identify(request)
        if record is None:
            raise Forbidden(FORBIDDEN_MESSAGE)
        return record

    # -- errors: the one place an exception becomes a response ------------

    @app.handle_errors(Exception)
    def _handle_error(self, request: IRequest, failure: Failure) -> bytes:
        """Errors as devlxd words them (``vmready.api.web.handle_error``)."""
        return handle_error(request, failure, GUEST_ERRORS, self.log)

    # -- routes -----------------------------------------------------------

    @app.route("/", methods=["GET"])
    def root(self, request: IRequest) -> bytes:
        """The API versions this server speaks."""
        self.caller(request)
        return sync_response(request, ["/1.0"])

    @app.route("/1.0", methods=["GET"])
    def get_state(self, request: IRequest) -> bytes:
        """The instance as its guest sees it: Ready once its workload said so, else Started."""
        record = self.caller(request)
        return sync_response(
            request,
            {
                "api_version": "1.0",
                "instance_type": "virtual-machine",
                "location": self.location,
                "state": _READY if record.ready else _STARTED,
            },
        )

    @app.route("/1.0", methods=["PATCH"])
    async def patch_state(self, request: IRequest) -> bytes:
        """The workload declares itself Ready, or withdraws that (Started)."""
        record = self.caller(request)
        state = _requested_state(read_body(request))
        if state not in (_READY, _STARTED):
            raise BadRequest(f"Invalid state {_go_quote(state)}")
        await self.lifecycle.guestside.set_ready(record.name, state == _READY)
        return sync_response(request, {})

    @app.route("/1.0/config", methods=["GET"])
    def list_config(self, request: IRequest) -> bytes:
        """The URLs of the config keys the guest may read."""
        record = self.caller(request)
        keys = sorted(key for key in record.config if _guest_visible(key))
        return sync_response(request, [f"/1.0/config/{key}" for key in keys])

    @app.route("/1.0/config/<path:key>", methods=["GET"])
    def get_config(self, request: IRequest, key: str) -> bytes:
        """One user.* or cloud-init.* value, as stored."""
        record = self.caller(request)
        if not _guest_visible(key):
            raise Forbidden("not authorized")
        value = record.config.get(key, "")
        if value == "":
            raise NotFound("not found")
        return sync_response(request, value)

    @app.route("/1.0/meta-data", methods=["GET"])
    def meta_data(self, request: IRequest) -> bytes:
        """cloud-init's meta-data: the instance's uuid and hostname, then user.meta-data."""
        record = self.caller(request)
        extra = record.config.get("user.meta-data", "")
        return sync_response(request, cloud_init_meta_data(record.uuid, record.name, extra))

    @app.route("/1.0/devices", methods=["GET"])
    def devices(self, request: IRequest) -> bytes:
        """The instance's devices."""
        record = self.caller(request)
        return sync_response(
            request, {name: dict(device) for name, device in record.devices.items()}
        )

    @app.route("/1.0/events", methods=["GET"])
    def events(self, request: IRequest) -> Deferred[None]:
        """This instance's config (and device) events as JSON lines, until it goes away."""
        record = self.caller(request)
        feed = GuestEventFeed(record, _event_types(request))
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/x-ndjson")

        # Klein hands us twisted.web's Request, which is also the connection's consumer.
        web_request = cast(http.Request, request)
        stream = EventStream(web_request)
        web_request.registerProducer(stream, True)

        def end() -> None:
            """The caller is no longer who it was: end the response (Klein finishes it)."""
            unsubscribe()
            stream.stopProducing()
            web_request.unregisterProducer()
            done.callback(None)

        def deliver(event: Event) -> None:
            if stream.closed:
                # Cut off for not reading (or going away): nothing more will be written.
                unsubscribe()
                return
            if not feed.concerns(event):
                return
            current = self.identify(request)
            if current is None or current.uuid != record.uuid:
                end()
                return
            for guest_event in feed.feed(event):
                stream.deliver(guest_event)

        unsubscribe = self.lifecycle.events.subscribe(deliver, frozenset({LIFECYCLE}))
        # Klein cancels this when the connection is lost; ``end`` fires it otherwise.
        done: Deferred[None] = Deferred(lambda _: unsubscribe())
        # Headers now: a guest that saw them knows it is subscribed.
        request.write(b"")
        return done


def guest_site(resource: IResource, reactor: IReactorTime | None = None) -> LimitedSite:
    """The HTTP site serving the guest API's ``resource`` (wrap it with ``guest_tls_factory``).

    ``resource`` is ``GuestAPI(...).app.resource()``, or that wrapped by a
    recorder (``vmready.record.recording.RecordingGuestResource``).  Its limits
    are ``vmready.api.limits``'s: ``guest_tls_factory`` tells it who each
    connection's guest is, for the bound of ``MAX_GUEST_CONNECTIONS`` per guest.
    """
    site = local_site(
        resource,
        GUEST_ERRORS,
        label="guest API",
        max_per_peer=MAX_GUEST_CONNECTIONS,
        reactor=reactor,
    )
    site.displayTracebacks = False
    return site


def peer_instance(store: AgentLookup, clock: Clock = _utcnow) -> PeerKey:
    """Who a guest API connection comes from, for the per-guest bound and its log line.

    The instance its TLS client certificate identifies (``instance 'web1'``);
    a certificate that no longer identifies one is counted by its fingerprint.
    """

    def key(transport: Any) -> str | None:
        cert_pem = peer_certificate_pem(transport)
        if cert_pem is None:
            return None
        record = instance_for_certificate(store, cert_pem, clock())
        if record is not None:
            return f"instance {record.name!r}"
        try:
            return f"certificate {fingerprint(cert_pem)}"
        except ValueError:
            return None

    return key


def guest_tls_factory(
    server: CertificatePair, store: AgentLookup, site: Site, clock: Clock = _utcnow
) -> TLSMemoryBIOFactory:
    """Server-side mutual TLS around ``site``: only certificates of live instances get through.

    A ``guest_site`` learns here who each connection's guest is (``peer_instance``).
    """
    if isinstance(site, LimitedSite) and site.peer_key is None:
        site.peer_key = peer_instance(store, clock)
    return server_tls_factory(MutualServerTLS(server, certificate_authorizer(store, clock)), site)
