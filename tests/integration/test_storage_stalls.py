"""An S3 endpoint that stops answering in the middle of a download body is a `StorageError`
(storage_transient, retried by the stage's backoff), never an unclassified error.

boto3's managed download (`download_file`) retries a body read itself and then raises boto3's own
`RetriesExceededError`, which is neither a botocore error nor a `ClientError`: a transcode whose
source download met a paused S3 failed with error class `unknown` (tests/faults/test_storage_outage.py,
seen once in CI). The endpoint here is a fault, not a fake of S3: it answers the HEAD the transfer
asks first, then sends the head and the first bytes of the GET and goes silent, as a paused server
does after its kernel took part of the response."""

from __future__ import annotations

import socket
import threading
from email.utils import formatdate

import pytest

from domain.errors import StorageError
from tapeline.objectstore import ObjectStore
from tapeline.settings import Settings

pytestmark = pytest.mark.integration
SIZE = 200_000


class GoesSilentMidBody(threading.Thread):
    """A TCP server: each request's head is answered as S3 would (HEAD: the size; GET: 200 and the
    first 100 bytes of `SIZE`), then the connection stays open and silent until `stop`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped, self.held, self.gets = threading.Event(), [], 0

    def run(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:  # closed by stop()
                return
            self.held.append(conn)
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        buffer = b""
        while not self.stopped.is_set():
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            buffer += data
            while b"\r\n\r\n" in buffer:
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                method = head.split(b" ", 1)[0]
                headers = (f"HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\nContent-Type: video/mp4\r\n"
                           f'ETag: "0123456789abcdef0123456789abcdef"\r\nLast-Modified: {formatdate(usegmt=True)}\r\n'
                           "Accept-Ranges: bytes\r\n\r\n").encode()
                if method == b"HEAD":
                    conn.sendall(headers)
                else:
                    self.gets += 1
                    conn.sendall(headers + b"\0" * 100)  # then nothing: the body stops mid-way

    def stop(self) -> None:
        self.stopped.set()
        for conn in self.held:
            conn.close()
        self.listener.close()


def test_a_download_whose_body_stops_is_a_storage_error(tmp_path):
    server = GoesSilentMidBody()
    server.start()
    try:
        settings = Settings(s3_endpoint=f"http://127.0.0.1:{server.port}", s3_read_timeout_s=0.5,
                            s3_connect_timeout_s=2.0, s3_max_attempts=1)
        with pytest.raises(StorageError, match="download of uploads/u/source.mp4 failed") as caught:
            ObjectStore(settings).download("uploads/u/source.mp4", tmp_path / "source")
        assert caught.value.error_class == "storage_transient"
        assert server.gets >= 1  # the body was asked for: it stopped mid-way, not at the HEAD
    finally:
        server.stop()
