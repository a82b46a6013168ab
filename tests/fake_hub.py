"""A loopback stand-in for the Hugging Face Hub: just enough of its API for `create_repo` and `upload_folder`.

Point huggingface_hub at it with `HF_ENDPOINT=server.url` (and `HF_HUB_OFFLINE=0`) in the environment of a new
process: huggingface_hub reads both when it is imported. Every request is recorded (`requests`: method, path, headers,
body); the files of every commit are decoded (`commits`), since a commit carries their content base64-encoded and a
search of the raw body would miss what they hold. Requests it does not implement get a 404 and are listed in
`unhandled`.

- `POST /api/repos/create`: the repository `organization/name` of the JSON body, created (or already there);
- `POST /api/validate-yaml`: the README's metadata, valid;
- `POST /api/{type}s/{namespace}/{name}/preupload/{revision}`: `uploadMode: "regular"` for every file, so that its
  content comes inline in the commit (no LFS or Xet upload to stand in for);
- `POST /api/{type}s/{namespace}/{name}/commit/{revision}`: the NDJSON commit (a header line, then `file` lines).
"""

import base64
import functools
import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def decoded_parts(self) -> list[bytes]:
        """The base64 content of the body's JSON / NDJSON fields (`sample`, `content`), decoded: what the raw body
        hides."""
        parts = []
        for line in self.body.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            for text in _base64_fields(value):
                try:
                    parts.append(base64.b64decode(text, validate=True))
                except ValueError:  # a text field (e.g. the README of `validate-yaml`), searched in the raw body
                    pass
        return parts


@dataclass
class Commit:
    repo_id: str
    revision: str
    authorization: str | None
    summary: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)


def _base64_fields(value) -> list[str]:
    if isinstance(value, dict):
        found = [text for key, text in value.items() if key in ("sample", "content") and isinstance(text, str)]
        return found + [text for item in value.values() for text in _base64_fields(item)]
    if isinstance(value, list):
        return [text for item in value for text in _base64_fields(item)]
    return []


_REPO_ACTION = re.compile(r"/api/(?P<type>model|dataset|space)s/(?P<repo>[^/]+/[^/]+)/(?P<action>preupload|commit)/"
                          r"(?P<revision>[^/?]+)")  # fmt: skip


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    @property
    def hub(self) -> "FakeHub":
        return self.server.hub

    def _answer(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self) -> Request:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = Request(self.command, self.path, dict(self.headers.items()), body)
        with self.hub.lock:
            self.hub.requests.append(request)
        return request

    def do_GET(self):
        request = self._record()
        self._not_found(request)

    def do_HEAD(self):
        request = self._record()
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()
        with self.hub.lock:
            self.hub.unhandled.append(f"{request.method} {request.path}")

    def do_POST(self):
        request = self._record()
        path = request.path.split("?")[0]
        if path == "/api/repos/create":
            values = json.loads(request.body)
            repo_id = f"{values.get('organization') or 'me'}/{values['name']}"
            prefix = "" if values.get("type") in (None, "model") else f"{values['type']}s/"
            with self.hub.lock:
                self.hub.repos.add(repo_id)
            self._answer(200, {"url": f"{self.hub.url}/{prefix}{repo_id}", "name": repo_id, "id": repo_id})
            return
        if path == "/api/validate-yaml":
            self._answer(200, {"errors": [], "warnings": []})
            return
        match = _REPO_ACTION.fullmatch(path)
        if match is None:
            self._not_found(request)
        elif match["action"] == "preupload":
            files = json.loads(request.body)["files"]
            answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files]
            self._answer(200, {"files": answer, "commitOid": "0" * 40})
        else:
            commit = Commit(match["repo"], match["revision"], self.headers.get("Authorization"))  # any case
            for line in request.body.splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    commit.summary = item["value"].get("summary")
                elif item["key"] == "file":
                    commit.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            oid = hashlib.sha1(request.body).hexdigest()
            with self.hub.lock:
                self.hub.commits.append(commit)
            self._answer(
                200, {"commitUrl": f"{self.hub.url}/{commit.repo_id}/commit/{oid}", "commitOid": oid,
                      "pullRequestUrl": None}
            )  # fmt: skip

    def _not_found(self, request: Request) -> None:
        with self.hub.lock:
            self.hub.unhandled.append(f"{request.method} {request.path}")
        self._answer(404, {"error": f"{request.path} is not implemented by tests/fake_hub.py"})


class FakeHub:
    """`with FakeHub() as hub: ... env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"} ... hub.commits`."""

    def __init__(self):
        self.requests: list[Request] = []
        self.commits: list[Commit] = []
        self.unhandled: list[str] = []
        self.repos: set[str] = set()
        self.lock = threading.Lock()
        self.port = 0
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def clear(self) -> None:
        with self.lock:
            self.requests.clear(), self.commits.clear(), self.unhandled.clear(), self.repos.clear()

    def start(self) -> "FakeHub":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler))
        server.daemon_threads = True
        server.hub = self
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
