"""A local stand-in of the Hugging Face Hub's HTTP API (test code; no Hub is reachable from this machine).

It serves, on 127.0.0.1, the endpoints ``huggingface_hub.HfApi`` calls to create a model repository and commit files
to it (``create_repo``, ``upload_folder``/``create_commit`` with small files), with the Hub's documented request and
response shapes: ``POST /api/repos/create`` (409 when the repository exists, 401 without a token),
``POST /api/models/{repo}/preupload/{revision}`` (every file "regular": its content travels in the commit) and
``POST /api/models/{repo}/commit/{revision}`` (an NDJSON body: a header, then one line per file, base64 content) and
``POST /api/validate-yaml`` (a README's metadata block: 400 with the errors when it is not a YAML mapping).
Repositories live in a folder (``<root>/<namespace>/<name>/<path in repo>``) and every commit is recorded, so tests can
read what a trainer pushed. Requests to any other endpoint are answered 404 and recorded in ``unknown``, so a test
sees exactly which part of the API was used. Point a client at it with ``HF_ENDPOINT`` (and ``HF_HUB_OFFLINE=0``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

USER = "standin-user"
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_PREUPLOAD = re.compile(rf"^/api/models/{_REPO}/preupload/(?P<revision>[^/?]+)")
_COMMIT = re.compile(rf"^/api/models/{_REPO}/commit/(?P<revision>[^/?]+)")


class HubStandIn:
    """The server and what it holds: ``repos`` (repo id -> {"private": bool}), ``commits`` (dicts with repo, revision,
    summary, files), ``unknown`` (method and path of unsupported requests)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.repos: dict[str, dict[str, Any]] = {}
        self.commits: list[dict[str, Any]] = []
        self.unknown: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def clear(self, root: Path) -> None:
        """Start over empty, repositories kept in ``root`` from now: a new Hub at the same address (a client reads
        ``HF_ENDPOINT`` once, at import), so that one process can push the same repositories again."""
        with self.lock:
            self.root = Path(root)
            self.repos.clear()
            self.commits.clear()
            self.unknown.clear()

    def files(self, repo_id: str) -> dict[str, bytes]:
        """Every file of ``repo_id`` as it stands after the commits, ``path in repo -> content``."""
        base = self.root / repo_id
        return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}

    # ---- request handling --------------------------------------------------------------------------------------
    def _create_repo(self, body: dict[str, Any], authorised: bool) -> tuple[int, dict[str, Any]]:
        if not authorised:
            return 401, {"error": "Invalid username or password."}
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        with self.lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
            self.repos[repo_id] = {"private": body.get("visibility") == "private" or bool(body.get("private"))}
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id}

    def _preupload(self, repo_id: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if repo_id not in self.repos:
            return 404, {"error": f"Repository not found: {repo_id}"}
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body.get("files", [])]
        return 200, {"files": files, "commitOid": None}

    def _validate_yaml(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        import yaml

        content = body.get("content", "")
        block = content.split("---", 2)[1] if content.startswith("---") and content.count("---") >= 2 else ""
        try:
            metadata = yaml.safe_load(block) if block.strip() else {}
        except yaml.YAMLError as err:
            return 400, {"error": "Invalid metadata", "errors": [{"message": str(err)}]}
        if not isinstance(metadata, dict):
            return 400, {"error": "Invalid metadata", "errors": [{"message": "the metadata is not a YAML mapping"}]}
        return 200, {"warnings": [] if metadata else [{"message": "empty or missing yaml metadata in repo card"}]}

    def _commit(self, repo_id: str, revision: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        if repo_id not in self.repos:
            return 404, {"error": f"Repository not found: {repo_id}"}
        lines = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line.get("key") == "header"), {})
        written = []
        for line in lines:
            if line.get("key") != "file":
                continue
            value = line["value"]
            target = self.root / repo_id / value["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(base64.b64decode(value["content"]))
            written.append(value["path"])
        oid = hashlib.sha1(raw).hexdigest()
        with self.lock:
            self.commits.append({"repo": repo_id, "revision": revision, "summary": header.get("summary"),
                                 "files": sorted(written)})  # fmt: skip
        return 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("X-Error-Message", payload.get("error", ""))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                authorised = self.headers.get("Authorization", "").startswith("Bearer ")
                if path == "/api/repos/create":
                    self._reply(*hub._create_repo(json.loads(raw), authorised))
                elif match := _PREUPLOAD.match(path):
                    self._reply(*hub._preupload(match["repo"], json.loads(raw)))
                elif match := _COMMIT.match(path):
                    self._reply(*hub._commit(match["repo"], match["revision"], raw))
                elif path == "/api/validate-yaml":
                    self._reply(*hub._validate_yaml(json.loads(raw)))
                else:
                    hub.unknown.append(f"POST {path}")
                    self._reply(404, {"error": f"the stand-in does not serve POST {path}"})

            def do_GET(self) -> None:  # noqa: N802
                hub.unknown.append(f"GET {self.path}")
                self._reply(404, {"error": f"the stand-in does not serve GET {self.path}"})

            do_HEAD = do_GET

        return Handler
