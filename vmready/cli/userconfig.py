"""The CLI's own config dir: its client certificate and its remotes (``remotes.yaml``).

``$VMREADY_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/vmready``, else
``~/.config/vmready``, as ``incus`` keeps ``~/.config/incus``.  The client's
key pair (``client.crt``, ``client.key`` 0600) is made at the first remote
use; it is what the daemons this user reaches trust.  ``remotes.yaml`` names
each remote's URL and the fingerprint its server certificate is pinned to,
and which remote commands go to by default.  Nothing is written for local
use: a user who never adds a remote has no config dir.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Mapping
from urllib.parse import urlsplit

import attrs
import yaml

from vmready.cli.errors import EXIT_FAILED, CommandError, UsageError
from vmready.trust import (
    CertificateError,
    CertificatePair,
    TokenError,
    ensure_certificate_pair,
    normalize_fingerprint,
)

LOCAL = "local"
REMOTES_FILE = "remotes.yaml"
CLIENT_CERT = "client.crt"
CLIENT_KEY = "client.key"
DEFAULT_PORT = 8443
_REMOTE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@attrs.frozen
class Remote:
    """A daemon reached over its remote API: where, and the server certificate pinned."""

    url: str
    fingerprint: str

    @property
    def host(self) -> str:
        """The URL's host (an IPv6 address without brackets)."""
        return str(urlsplit(self.url).hostname)

    @property
    def port(self) -> int:
        """The URL's port (8443 if it names none)."""
        return urlsplit(self.url).port or DEFAULT_PORT


@attrs.frozen
class Remotes:
    """``remotes.yaml``: the remotes by name, and the default one (``local`` is built in)."""

    default: str = LOCAL
    remotes: Mapping[str, Remote] = attrs.field(factory=dict)


def config_dir(environ: Mapping[str, str]) -> str:
    """The CLI's config dir."""
    explicit = environ.get("VMREADY_CONFIG_DIR")
    if explicit:
        return os.path.abspath(explicit)
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "vmready")


def validate_remote_name(name: str) -> str:
    """A remote's name; UsageError for one that could not be written before a colon."""
    if name == LOCAL:
        raise UsageError(f"{LOCAL!r} is the built-in remote (this host's unix socket)")
    if not _REMOTE_NAME.fullmatch(name):
        raise UsageError(
            f"invalid remote name {name!r}: use 1-63 letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def parse_remote_url(text: str) -> str:
    """``https://host[:port]``, checked and without a trailing slash; UsageError otherwise."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as e:
        raise UsageError(f"invalid remote URL {text!r}: {e}") from None
    if parts.scheme != "https":
        raise UsageError(f"invalid remote URL {text!r}: expected https://HOST[:PORT]")
    if not parts.hostname:
        raise UsageError(f"invalid remote URL {text!r}: it names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise UsageError(f"invalid remote URL {text!r}: expected https://HOST[:PORT] only")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"https://{host}:{port or DEFAULT_PORT}"


def load_remotes(directory: str) -> Remotes:
    """The remotes in ``directory``'s ``remotes.yaml`` (none if it does not exist)."""
    path = os.path.join(directory, REMOTES_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        return Remotes()
    except OSError as e:
        raise CommandError(f"cannot read {path}: {e.strerror or e}", EXIT_FAILED) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problem = " ".join(str(e).split())
        raise CommandError(f"{path} is not valid YAML: {problem}", EXIT_FAILED) from None
    if data is None:
        return Remotes()

    def broken(problem: str) -> CommandError:
        return CommandError(f"{path}: {problem}", EXIT_FAILED)

    if not isinstance(data, dict):
        raise broken("expected a mapping with default-remote and remotes")
    entries = data.get("remotes") or {}
    if not isinstance(entries, dict):
        raise broken("remotes must be a mapping of names to url and fingerprint")
    remotes: dict[str, Remote] = {}
    for name, entry in entries.items():
        if not isinstance(name, str) or not isinstance(entry, dict):
            raise broken(f"remote {name!r} must be a mapping with url and fingerprint")
        url, pinned = entry.get("url"), entry.get("fingerprint")
        if not isinstance(url, str) or not isinstance(pinned, str):
            raise broken(f"remote {name}: url and fingerprint must be text")
        try:
            remotes[name] = Remote(parse_remote_url(url), normalize_fingerprint(pinned))
        except (UsageError, TokenError) as e:
            raise broken(f"remote {name}: {e}") from None
    default = data.get("default-remote", LOCAL)
    if not isinstance(default, str) or (default != LOCAL and default not in remotes):
        raise broken(f"default-remote {default!r} is not a remote listed there")
    return Remotes(default, remotes)


def save_remotes(directory: str, remotes: Remotes) -> None:
    """Write ``remotes.yaml`` atomically (owner-only config dir)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    body = {
        "default-remote": remotes.default,
        "remotes": {
            name: {"url": remote.url, "fingerprint": remote.fingerprint}
            for name, remote in sorted(remotes.remotes.items())
        },
    }
    text = yaml.safe_dump(body, default_flow_style=False, sort_keys=False)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, os.path.join(directory, REMOTES_FILE))
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def client_identity(directory: str) -> CertificatePair:
    """The CLI's client certificate and key, made on first use (key 0600, dir 0700)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return ensure_certificate_pair(
            os.path.join(directory, CLIENT_CERT),
            os.path.join(directory, CLIENT_KEY),
            f"vmready-client@{socket.gethostname()}",
            "the remotes trust this certificate",
        )
    except CertificateError as e:
        raise CommandError(str(e), EXIT_FAILED) from None
    except OSError as e:
        raise CommandError(
            f"cannot keep the client certificate in {directory}: {e.strerror or e}", EXIT_FAILED
        ) from None
