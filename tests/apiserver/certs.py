"""Throwaway TLS material for the API-server double: a CA and a server certificate.

The ``cryptography`` package is not a dependency of uproxy, so the ``openssl`` command is the
fallback; both produce the same layout (ca.crt, server.crt, server.key) so that clients
verify the server exactly as they would verify kube-apiserver against its cluster CA.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path


async def write_certificates(directory: Path, host: str, *, tool: str) -> None:
    """A throwaway CA (ca.crt) and a server certificate for ``host``, localhost and loopback."""
    if tool == "auto":
        try:
            import cryptography  # noqa: F401
        except ImportError:
            tool = "openssl"
        else:
            tool = "cryptography"
    if tool == "cryptography":
        _certificates_with_cryptography(directory, host)
    else:
        await _certificates_with_openssl(directory, host)


def _alt_names(host: str) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) the server certificate is valid for."""
    dns, ips = ["localhost"], {"127.0.0.1", "::1"}
    try:
        ips.add(str(ipaddress.ip_address(host)))
    except ValueError:
        dns.append(host)
    return dns, sorted(ips)


async def _certificates_with_openssl(directory: Path, host: str) -> None:
    dns, ips = _alt_names(host)
    san = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ips])
    (directory / "server.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        ["openssl", "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=uproxy-apiserver-double-ca",
         "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["openssl", "req", *ec, "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=kube-apiserver"],
        ["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "server.ext"],
    ]  # fmt: skip
    for cmd in commands:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=directory,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {err.decode(errors='replace')}")


def _certificates_with_cryptography(directory: Path, host: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("uproxy-apiserver-double-ca"))
        .issuer_name(name("uproxy-apiserver-double-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    dns, ips = _alt_names(host)
    alt_names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("kube-apiserver"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    (directory / "server.crt").write_bytes(cert.public_bytes(pem))
    (directory / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
