"""The ``vsock:`` and ``hvsock:`` endpoint strings, for servers and clients.

Registered as Twisted plugins in ``twisted/plugins/vmready_endpoints.py``:
``vsock:port=0:cid=any`` and ``hvsock:path=/run/vm/v.sock:port=0:mode=600``
for servers, ``vsock:cid=2:port=1234`` and
``hvsock:path=/run/vm/v.sock:port=1234`` for clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFDSet,
    IReactorUNIX,
    IStreamClientEndpointStringParserWithReactor,
    IStreamServerEndpointStringParser,
)
from twisted.plugin import IPlugin
from zope.interface import implementer

from vmready.agentlink.hvsock import HybridVSockClientEndpoint, HybridVSockServerEndpoint
from vmready.agentlink.vsock import VSockClientEndpoint, VSockServerEndpoint
from vmready.agentlink.vsockaddress import (
    U32_MAX,
    VMADDR_CID_ANY,
    VMADDR_CID_HOST,
    VMADDR_CID_LOCAL,
)


def _arguments(
    prefix: str, args: Iterable[object], kwargs: Mapping[str, object], names: tuple[str, ...]
) -> dict[str, str]:
    """Positional and keyword description arguments as one dict keyed by ``names``."""
    given: dict[str, str] = {}
    positional = list(args)
    if len(positional) > len(names):
        raise ValueError(
            f"{prefix}: too many positional arguments {positional!r} "
            f"(in order they are {', '.join(names)})"
        )
    for name, value in zip(names, positional, strict=False):
        if value != "":  # "vsock:" has one empty positional argument
            given[name] = str(value)
    for name, value in kwargs.items():
        if name not in names:
            raise ValueError(f"{prefix}: unknown parameter {name!r}; known: {', '.join(names)}")
        if name in given:
            raise ValueError(f"{prefix}: {name} given twice")
        given[name] = str(value)
    return given


def _integer(prefix: str, name: str, text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"{prefix} {name} must be an integer, got {text!r}") from None


def _u32_argument(prefix: str, name: str, text: str) -> int:
    value = _integer(prefix, name, text)
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{prefix} {name} must be from 0 to {U32_MAX}, got {text!r}")
    return value


def _cid_argument(prefix: str, text: str, words: Mapping[str, int]) -> int:
    word = text.strip().lower()
    if word in words:
        return words[word]
    if not word.isdigit():
        raise ValueError(
            f"{prefix} cid must be an integer or one of {', '.join(words)}, got {text!r}"
        )
    return _u32_argument(prefix, "cid", text)


def _positive_argument(prefix: str, name: str, text: str) -> int:
    value = _integer(prefix, name, text)
    if value <= 0:
        raise ValueError(f"{prefix} {name} must be greater than 0, got {text!r}")
    return value


def _timeout_argument(prefix: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{prefix} timeout must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"{prefix} timeout must be greater than 0, got {text!r}")
    return value


def _mode_argument(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise ValueError(f"hvsock mode must be octal like 600, got {text!r}") from None
    if not 0 <= value <= 0o7777:
        raise ValueError(f"hvsock mode must be octal from 0 to 7777, got {text!r}")
    return value


def _required(prefix: str, given: Mapping[str, str], name: str, example: str) -> str:
    if not given.get(name):
        raise ValueError(f"{prefix}: missing {name}= (for example {example})")
    return given[name]


_SERVER_CIDS = {"any": VMADDR_CID_ANY, "local": VMADDR_CID_LOCAL, "host": VMADDR_CID_HOST}
_CLIENT_CIDS = {"local": VMADDR_CID_LOCAL, "host": VMADDR_CID_HOST}


@implementer(IPlugin, IStreamServerEndpointStringParser)
class VSockServerParser:
    """``vsock:port=0:cid=any:backlog=50`` (or ``vsock:<port>``) → VSockServerEndpoint."""

    prefix = "vsock"

    def parseStreamServer(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> VSockServerEndpoint:
        given = _arguments("vsock", args, kwargs, ("port", "cid", "backlog"))
        return VSockServerEndpoint(
            IReactorFDSet(reactor),
            port=_u32_argument("vsock", "port", given.get("port", "0")),
            cid=_cid_argument("vsock", given.get("cid", "any"), _SERVER_CIDS),
            backlog=_positive_argument("vsock", "backlog", given.get("backlog", "50")),
        )


@implementer(IPlugin, IStreamClientEndpointStringParserWithReactor)
class VSockClientParser:
    """``vsock:cid=2:port=1234:timeout=30`` (or ``vsock:<cid>:<port>``) → VSockClientEndpoint."""

    prefix = "vsock"

    def parseStreamClient(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> VSockClientEndpoint:
        given = _arguments("vsock", args, kwargs, ("cid", "port", "timeout"))
        example = "vsock:cid=2:port=1234"
        return VSockClientEndpoint(
            IReactorFDSet(reactor),
            cid=_cid_argument("vsock", _required("vsock", given, "cid", example), _CLIENT_CIDS),
            port=_u32_argument("vsock", "port", _required("vsock", given, "port", example)),
            timeout=_timeout_argument("vsock", given.get("timeout", "30")),
        )


@implementer(IPlugin, IStreamServerEndpointStringParser)
class HybridVSockServerParser:
    """``hvsock:path=<base>:port=0:mode=600:backlog=50`` (or ``hvsock:<base>``)."""

    prefix = "hvsock"

    def parseStreamServer(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> HybridVSockServerEndpoint:
        given = _arguments("hvsock", args, kwargs, ("path", "port", "mode", "backlog"))
        return HybridVSockServerEndpoint(
            IReactorUNIX(reactor),
            path=_required("hvsock", given, "path", "hvsock:path=/run/vm/v.sock"),
            port=_u32_argument("hvsock", "port", given.get("port", "0")),
            mode=_mode_argument(given.get("mode", "600")),
            backlog=_positive_argument("hvsock", "backlog", given.get("backlog", "50")),
        )


@implementer(IPlugin, IStreamClientEndpointStringParserWithReactor)
class HybridVSockClientParser:
    """``hvsock:path=<base>:port=1234:timeout=30`` (or ``hvsock:<base>:<port>``)."""

    prefix = "hvsock"

    def parseStreamClient(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> HybridVSockClientEndpoint:
        given = _arguments("hvsock", args, kwargs, ("path", "port", "timeout"))
        example = "hvsock:path=/run/vm/v.sock:port=1234"
        return HybridVSockClientEndpoint(
            IReactorUNIX(reactor),
            path=_required("hvsock", given, "path", example),
            port=_u32_argument("hvsock", "port", _required("hvsock", given, "port", example)),
            timeout=_timeout_argument("hvsock", given.get("timeout", "30")),
        )
