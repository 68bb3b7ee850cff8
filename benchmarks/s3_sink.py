"""An S3 endpoint for `e2e.py store --s3-server sink`: it reads each PUT body into one
reused buffer, throws it away and answers as S3 does; GETs answer 404. moto stores every
object in memory on the memory bus the model's decode is bound by; against this sink,
what is left on the box is the writer's own cost (signing, checksum, socket copy).

    python benchmarks/s3_sink.py PORT [CPU,...]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 1 << 20


class SinkHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        left = int(self.headers.get("Content-Length", "0"))
        buffer = bytearray(min(left, CHUNK) or 1)
        view = memoryview(buffer)
        while left > 0:
            got = self.rfile.readinto(view[: min(left, CHUNK)])
            if not got:
                break
            left -= got
        self.send_response(200)
        # A fixed ETag: nothing reads it back, and hashing the body is the cost
        # this sink exists to leave out.
        self.send_header("ETag", '"%s"' % hashlib.md5(b"").hexdigest())
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        body = b"<Error><Code>NoSuchKey</Code></Error>"
        self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def running(cpus: set[int]) -> Iterator[str]:
    """This sink in a process of its own, on `cpus` (anywhere when empty); yields its
    endpoint URL."""
    from tiercache.ops.local_stack import _wait_port, free_port

    port = free_port()
    command = [sys.executable, __file__, str(port)] + ([",".join(map(str, sorted(cpus)))] if cpus else [])
    process = subprocess.Popen(command)
    try:
        _wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def main() -> None:
    port = int(sys.argv[1])
    if len(sys.argv) > 2:
        os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
    ThreadingHTTPServer(("127.0.0.1", port), SinkHandler).serve_forever()


if __name__ == "__main__":
    main()
