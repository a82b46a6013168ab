"""A loopback HTTP server of shard files with injected faults, for the remote-data tests.

It answers HEAD and GET (with byte ranges, as fsspec asks) for the files of one folder on 127.0.0.1. Faults are
queued per file and consumed one per *data* request (a GET with a Range header, what reading a shard sends), or per
request of any kind (HEAD and whole-file GETs too, what finding a file sends) with `on="any"` or for a fault written
`"any:<fault>"`:

- `"drop"`: send half of the answer's bytes, then close the connection;
- `"503"`: answer 503 Service Unavailable;
- `"stall"`: wait `stall_seconds` before answering (longer than the client's read timeout).

With `auth=(user, password)` it answers 401 to requests without that HTTP basic auth, and with `query="k=v"` 403 to
requests whose query string lacks it (a signed URL's signature), so that a test sees the real URL was used.
"""

import base64
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

    def _refused(self) -> bool:
        """Answer 401 or 403 (and say so) when the request lacks the credentials the server asks for."""
        state = self.state
        if state.auth is not None:
            expected = "Basic " + base64.b64encode(":".join(state.auth).encode()).decode()
            if self.headers.get("Authorization") != expected:
                self.send_error(401)
                return True
        if state.query is not None and state.query not in self.path.partition("?")[2].split("&"):
            self.send_error(403)
            return True
        return False

    @property
    def state(self) -> "ShardServer":
        return self.server.state

    def do_HEAD(self):
        name = self.path.split("?")[0]
        fault = self.state.next_fault(name, ranged=False)
        self.state.requests.append((name, None, fault))
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "stall":
            time.sleep(self.state.stall_seconds)
        if fault == "drop":
            self.connection.shutdown(2)
            return
        if self._refused():
            return
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
        if self._refused():
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

    `requests` records `(path, range header or None, fault)` per request. `stop()` closes the port for good
    (connections are refused); `start()` opens it again on the same port."""

    def __init__(self, directory: str | os.PathLike, faults: dict | None = None, on: str = "range",
                 stall_seconds: float = 3.0, port: int = 0, auth: tuple[str, str] | None = None,
                 query: str | None = None):  # fmt: skip
        self.directory = Path(directory)
        self.faults = {name: list(kinds) for name, kinds in (faults or {}).items()}
        self.on, self.stall_seconds, self.port = on, stall_seconds, port
        self.auth, self.query = auth, query
        self.requests: list[tuple] = []
        self._lock = threading.Lock()
        self._server = None

    def next_fault(self, name: str, ranged: bool) -> str | None:
        with self._lock:
            queue = self.faults.get(name)
            if queue and (ranged or self.on == "any" or queue[0].startswith("any:")):
                return queue.pop(0).removeprefix("any:")
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
