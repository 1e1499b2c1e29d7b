"""Logins and TLS against the real ``keratin`` binary: the admin's right password logs in
(and the node names the user), a wrong one and a missing one are 401 UnauthorizedError, an
API token logs in, a user without the permission gets 403 ForbiddenError and keeps its
connection; over TLS, the right CA connects, a wrong CA fails with TLSError, and a plaintext
client at a TLS port fails with a clear error within the connect bound."""

from __future__ import annotations

import os
import ssl
import subprocess
import tempfile
import time
import uuid
from typing import Any, Dict, Iterator

import pytest

import keratin

from .fake import run


def test_password_logins_and_permissions(start_broker: Any) -> None:
    node = start_broker({"KERATIN_SERVER__AUTH": "users"})
    admin_password = node.admin_password()
    orders = "orders.%s" % uuid.uuid4().hex[:6]
    node.cli("queue", "declare", orders)
    node.cli("queue", "declare", "billing")
    node.cli("user", "add", "app", "--new-password", "app-password-1")
    node.cli("user", "grant", "app", "orders.*", "publish,consume")

    async def go() -> None:
        async with await keratin.connect(node.address, user="admin", password=admin_password) as admin:
            assert admin.user == "admin"
            await admin.publish(orders, b"from admin")
        with pytest.raises(keratin.UnauthorizedError) as wrong:
            await keratin.connect(node.address, user="admin", password="not-the-password")
        assert wrong.value.code == 401
        with pytest.raises(keratin.UnauthorizedError):
            await keratin.connect(node.address)
        async with await keratin.connect(node.address, user="app", password="app-password-1") as app:
            assert app.user == "app"
            await app.publish(orders, b"from app")
            with pytest.raises(keratin.ForbiddenError) as forbidden:
                await app.publish("billing", b"not allowed")
            assert forbidden.value.code == 403 and "billing" in str(forbidden.value)
            with pytest.raises(keratin.ForbiddenError):
                await app.delete(orders)
            assert app.is_connected
            assert [q.queue for q in await app.list()] == [orders]
            async with app.consume(orders, prefetch=2) as consumer:
                seen = 0
                async for d in consumer:
                    await d.ack()
                    seen += 1
                    if seen == 2:
                        break

    run(go())


def test_token_login(start_broker: Any) -> None:
    node = start_broker({"KERATIN_SERVER__AUTH": "users"})
    created: Dict[str, Any] = node.cli("user", "token", "add", "admin", "py-test")
    token = created.get("token")
    assert isinstance(token, str) and token.startswith("kt_"), created

    async def go() -> None:
        async with await keratin.connect(node.address, token=token) as client:
            assert client.user == "admin"
            await client.declare("tokened")
        with pytest.raises(keratin.UnauthorizedError):
            await keratin.connect(node.address, token="kt_" + "0" * 64)

    run(go())


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: str, label: str) -> Dict[str, str]:
    key, cert = os.path.join(directory, label + "-ca.key"), os.path.join(directory, label + "-ca.pem")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
            "-days", "2", "-subj", "/CN=keratin test %s CA" % label)
    return {"key": key, "cert": cert}


@pytest.fixture(scope="module")
def certs() -> Iterator[Dict[str, str]]:
    if not os.path.exists("/usr/bin/openssl") and not any(
        os.access(os.path.join(p, "openssl"), os.X_OK) for p in os.environ.get("PATH", "").split(":")
    ):
        pytest.fail("the TLS tests need the openssl command to make certificates")
    with tempfile.TemporaryDirectory(prefix="keratin-py-tls-") as d:
        ca, other = make_ca(d, "right"), make_ca(d, "wrong")
        key, csr, cert = (os.path.join(d, n) for n in ("server.key", "server.csr", "server.pem"))
        ext = os.path.join(d, "ext.cnf")
        with open(ext, "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                    "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
        openssl("x509", "-req", "-in", csr, "-CA", ca["cert"], "-CAkey", ca["key"], "-CAcreateserial",
                "-out", cert, "-days", "2", "-extfile", ext)
        yield {"ca": ca["cert"], "wrong_ca": other["cert"], "cert": cert, "key": key}


def test_tls_right_ca_wrong_ca_and_plaintext(start_broker: Any, certs: Dict[str, str]) -> None:
    node = start_broker({"KERATIN_SERVER__TLS_CERT_FILE": certs["cert"], "KERATIN_SERVER__TLS_KEY_FILE": certs["key"]})

    async def go() -> None:
        tls = keratin.TLS(ca_file=certs["ca"])
        async with await keratin.connect(node.address, tls=tls) as client:
            await client.declare("secure")
            await client.publish("secure", b"over tls")
            assert (await client.info("secure")).ready == 1
        context = ssl.create_default_context(cafile=certs["ca"])
        async with await keratin.connect(node.address, tls=context) as client:
            assert (await client.info("secure")).ready == 1
        with pytest.raises(keratin.TLSError, match="certif"):
            await keratin.connect(node.address, tls=keratin.TLS(ca_file=certs["wrong_ca"]))
        with pytest.raises(keratin.TLSError):
            await keratin.connect(node.address, tls=keratin.TLS(ca_file=certs["ca"], server_name="elsewhere.example"))
        started = time.monotonic()
        with pytest.raises((keratin.ConnectError, keratin.KeratinTimeoutError, keratin.ProtocolError)):
            await keratin.connect(node.address, connect_timeout=3)
        assert time.monotonic() - started < 5
        with pytest.raises(keratin.TLSError, match="CA file"):
            keratin.TLS(ca_file=os.path.join(os.path.dirname(certs["ca"]), "missing.pem")).context()

    run(go())
