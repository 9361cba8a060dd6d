"""Throwaway certificates for the TLS tests, made with the `cryptography` package: a CA,
a server certificate (for localhost) and a client certificate it signs, and a second,
unrelated CA."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _certificate(name: str, key, issuer_name: str, issuer_key, ca: bool, san: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(out: Path) -> dict[str, Path]:
    """PEM files in `out`: ca, server_cert/server_key, client_cert/client_key and
    other_client_cert/other_client_key (both signed by ca), other_ca."""
    files = {}

    def write(name: str, data: bytes) -> None:
        files[name] = out / f"{name}.pem"
        files[name].write_bytes(data)

    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    write("ca", _certificate("test CA", ca_key, "test CA", ca_key, ca=True).public_bytes(serialization.Encoding.PEM))
    write("other_ca", _certificate("other CA", other_key, "other CA", other_key, ca=True).public_bytes(serialization.Encoding.PEM))
    for role in ("server", "client", "other_client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"test {role}", key, "test CA", ca_key, ca=False, san=role == "server")
        write(f"{role}_cert", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{role}_key", _pem_key(key))
    return files
