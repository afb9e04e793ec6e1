"""Mutual TLS to the host with the standard library's ``ssl``: our certificate, theirs pinned.

The agent presents its instance's certificate and key (``agent.crt``,
``agent.key``) and accepts exactly one server: ``server.crt`` is loaded as the
only trusted certificate, so OpenSSL refuses any other (and one outside its
validity period), and after the handshake the peer's DER certificate is also
compared byte for byte with it.  Certificates are self-signed and carry no
host name the agent could check, so there is no host name check.
"""

from __future__ import annotations

import re
import ssl
from typing import Callable, NoReturn

_BEGIN_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
_OPENSSL_DETAIL = re.compile(r"^\[[A-Z0-9_]+: [A-Z0-9_]+\] (.*?)(?: \(_ssl\.c:\d+\))?$")


class TLSConfigError(Exception):
    """The certificate files cannot work; the message names the file and why."""


class KeyMismatch(TLSConfigError):
    """The private key is not the certificate's."""


def _pem_text(pem: bytes, where: str) -> str:
    try:
        return pem.decode("ascii")
    except UnicodeDecodeError:
        raise TLSConfigError(f"{where} is not a PEM certificate") from None


def certificate_text(pem: bytes, where: str) -> str:
    """The PEM text of exactly one certificate, by its shape (ssl does not parse it here)."""
    text = _pem_text(pem, where)
    count = text.count(_BEGIN_CERTIFICATE)
    if count == 0:
        raise TLSConfigError(f"{where} is not a PEM certificate")
    if count > 1:
        raise TLSConfigError(f"{where} holds {count} certificates; it must hold exactly one")
    return text


def check_certificate(pem: bytes, where: str) -> str:
    """The PEM text of exactly one certificate that ssl parses; TLSConfigError otherwise."""
    text = certificate_text(pem, where)
    try:
        ssl.create_default_context(cadata=text)
    except (ssl.SSLError, ValueError):
        raise TLSConfigError(f"{where} is not a PEM certificate") from None
    return text


def pinned_der(server_cert_pem: bytes) -> bytes:
    """The DER form of the pinned certificate, to compare the peer's with.

    Its shape is checked here; ``client_context`` is what parses it.
    """
    text = certificate_text(server_cert_pem, "server.crt")
    try:
        return ssl.PEM_cert_to_DER_cert(text)
    except ValueError:
        raise TLSConfigError("server.crt is not a PEM certificate") from None


def _refuse_password() -> NoReturn:
    # Called only for an encrypted key: the agent has no one to ask for its password.
    raise TLSConfigError("encrypted")


def client_context(
    cert_path: str, key_path: str, server_cert_pem: bytes, server_cert_path: str = "server.crt"
) -> ssl.SSLContext:
    """The context for every connection to the host; TLSConfigError saying what is wrong.

    Each file is parsed once, by the context itself (under emulation every
    parse costs); only when ssl refuses one is each looked at to say which.
    """
    with open(cert_path, "rb") as f:
        certificate_text(f.read(), cert_path)
    server_text = certificate_text(server_cert_pem, server_cert_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # self-signed, pinned: there is no name to check
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_verify_locations(cadata=server_text)
    except (ssl.SSLError, ValueError):
        raise TLSConfigError(f"{server_cert_path} is not a PEM certificate") from None
    password: Callable[[], NoReturn] = _refuse_password
    try:
        context.load_cert_chain(cert_path, key_path, password=password)
    except TLSConfigError:
        raise TLSConfigError(f"{key_path} is not an unencrypted PEM private key") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise KeyMismatch(f"{key_path} does not belong to {cert_path}") from None
        with open(cert_path, "rb") as f:
            check_certificate(f.read(), cert_path)  # the certificate, if it is the one
        raise TLSConfigError(f"{key_path} is not an unencrypted PEM private key") from None
    return context


def describe_ssl_error(error: ssl.SSLError) -> str:
    """OpenSSL's words for a failed handshake, without the library's decoration."""
    if isinstance(error, ssl.SSLCertVerificationError) and error.verify_message:
        return f"certificate verify failed: {error.verify_message}"
    text = str(error.args[1]) if len(error.args) > 1 else str(error)
    match = _OPENSSL_DETAIL.match(text)
    detail = match.group(1) if match else text
    return detail or (error.reason or type(error).__name__).lower().replace("_", " ")
