"""Settings checked before the model loads, which takes a while: the addresses to
listen on and the TLS and token files. Each failure names the flag and what to do."""

from __future__ import annotations

import errno
import socket
import ssl

import grpc


class SettingsError(ValueError):
    """A setting the server cannot start with; the message names the flag."""


def check_listen_address(host: str, port: int, flag: str) -> None:
    """That `host` is an address of this machine and `port` is free on it (0: any port).

    A socket bound without SO_REUSEPORT fails on a port another server holds, with it
    or without: grpc itself would share the port with a server that set it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SettingsError(f"--host {host} is not an address ({e.strerror}): use an IP address or a name of this "
                            "machine, such as 0.0.0.0 (every interface) or 127.0.0.1") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # As grpc binds: a port whose old connections linger (TIME_WAIT, after a restart)
        # is free; one another server listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SettingsError(f"{flag} {port}: the port is in use on {host} (another server?): stop it or choose "
                                    f"another {flag}") from e
            if e.errno == errno.EADDRNOTAVAIL:
                raise SettingsError(f"--host {host} is not an address of this machine: use one of its addresses, "
                                    "or 0.0.0.0 for every interface") from e
            if e.errno == errno.EACCES:
                raise SettingsError(f"{flag} {port}: not allowed to listen there (ports below 1024 need privileges): "
                                    f"choose another {flag}") from e
            raise SettingsError(f"cannot listen on {host}:{port} ({e.strerror}): check --host and {flag}") from e


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SettingsError(f"{flag}: cannot read {path}: {e.strerror}") from e


def _require_pem(data: bytes, path: str, flag: str, kind: str) -> None:
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise SettingsError(f"{flag}: {path} is not a PEM file holding {kind.lower()} "
                            f"(a '-----BEGIN ...{kind}-----' block): convert it, e.g. with openssl")


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key, mutual when --tls-client-ca is given; None: plaintext.
    The files are checked here (PEM, the key matching the certificate): grpc would only
    say that it failed to bind."""
    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        raise SettingsError("TLS needs both --tls-cert and --tls-key (PEM files)")
    cert_pem, key_pem = _read(cert, "--tls-cert"), _read(key, "--tls-key")
    _require_pem(cert_pem, cert, "--tls-cert", "CERTIFICATE")
    _require_pem(key_pem, key, "--tls-key", "PRIVATE KEY")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise SettingsError(f"--tls-cert {cert} and --tls-key {key} are not a certificate chain and its private key "
                            f"({e.reason or e}): check that the key belongs to the certificate") from e
    ca_pem = None
    if client_ca:
        ca_pem = _read(client_ca, "--tls-client-ca")
        _require_pem(ca_pem, client_ca, "--tls-client-ca", "CERTIFICATE")
        try:
            ssl.create_default_context().load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise SettingsError(f"--tls-client-ca {client_ca} holds no usable CA certificate ({e.reason or e})") from e
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=ca_pem is not None)


def read_token(path: str) -> str:
    token = _read(path, "--auth-token-file").decode(errors="replace").strip()
    if not token:
        raise SettingsError(f"--auth-token-file: {path} is empty: put the bearer token in it")
    return token
