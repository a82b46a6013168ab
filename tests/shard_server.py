"""A loopback HTTP server of shard files with injected faults, for the remote-data tests.

It answers HEAD and GET (with byte ranges, as fsspec asks) for the files of one folder on 127.0.0.1. Faults are
queued per file and consumed one per *data* request (a GET with a Range header, what reading a shard sends), or per
request of any kind with `on="any"`:

- `"drop"`: send half of the answer's bytes, then close the connection;
- `"503"`: answer 503 Service Unavailable;
- `"stall"`: wait `stall_seconds` before answering (longer than the client's read timeout).
"""

import functools
import http.server
import os
import re
import threading
import time
from pathlib import Path


class _Handler(http.server.BaseHTTPRequestHandler):
    server_state: "ShardServer"

    def log_message(self, *args):  # quiet
        pass

    def _file(self) -> Path | None:
        path = self.state.directory / self.path.split("?")[0].lstrip("/")
        return path if path.is_file() else None

    @property
    def state(self) -> "ShardServer":
        return self.server.state

    def do_HEAD(self):
        file = self._file()
        if file is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(file.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self):
        name = self.path.split("?")[0]
        ranged = self.headers.get("Range") is not None
        fault = self.state.next_fault(name, ranged)
        self.state.requests.append((name, self.headers.get("Range"), fault))
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        file = self._file()
        if file is None:
            self.send_error(404)
            return
        data = file.read_bytes()
        start, end = 0, len(data) - 1
        if ranged:
            match = re.match(r"bytes=(\d+)-(\d*)", self.headers["Range"])
            start = int(match.group(1))
            end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start : end + 1]
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if fault == "stall":
            time.sleep(self.state.stall_seconds)
        if fault == "drop":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


class ShardServer:
    """`with ShardServer(folder, faults={"/a.parquet": ["drop"]}) as server: server.url("a.parquet")`.

    `stop()` closes the port for good (connections are refused); `start()` opens it again on the same port."""

    def __init__(self, directory: str | os.PathLike, faults: dict | None = None, on: str = "range",
                 stall_seconds: float = 3.0, port: int = 0):  # fmt: skip
        self.directory = Path(directory)
        self.faults = {name: list(kinds) for name, kinds in (faults or {}).items()}
        self.on, self.stall_seconds, self.port = on, stall_seconds, port
        self.requests: list[tuple] = []
        self._lock = threading.Lock()
        self._server = None

    def next_fault(self, name: str, ranged: bool) -> str | None:
        with self._lock:
            queue = self.faults.get(name)
            if queue and (ranged or self.on == "any"):
                return queue.pop(0)
        return None

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> "ShardServer":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), functools.partial(_Handler))
        server.daemon_threads = True
        server.state = self
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "ShardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
