"""A small Hugging Face Hub on 127.0.0.1 for tests (`HF_ENDPOINT=server.url`): the endpoints `snapshot_download`,
`hf_hub_download`, `HfFileSystem`, `create_repo`, `create_branch` and `upload_folder` call, over repositories held
in memory as {revision: {path: bytes}}. Every request is recorded in `requests` as (method, path), and every GET of
a file's content in `reads` as (path, its Range header or None); a Range is answered with 206 and those bytes.
`delays` makes the GETs of some files slow."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import threading
import time
from urllib.parse import parse_qs, unquote, urlparse


def _sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, files: dict[str, bytes]):
        self.branches: dict[str, dict[str, bytes]] = {"main": dict(files)}
        self.history: dict[str, dict[str, bytes]] = {}  # commit -> files, of commits no branch points at now

    def commit_of(self, revision: str) -> str | None:
        if revision in self.branches:
            files = self.branches[revision]
            return hashlib.sha1(json.dumps({k: _sha(v) for k, v in sorted(files.items())}).encode()).hexdigest()
        known = revision in self.history or any(self.commit_of(b) == revision for b in self.branches)
        return revision if known else None

    def files_at(self, revision: str) -> dict[str, bytes] | None:
        for branch, files in self.branches.items():
            if revision in (branch, self.commit_of(branch)):
                return files
        return self.history.get(revision)

    def update(self, branch: str, files: dict[str, bytes]) -> str:
        """A new commit on `branch` that adds or replaces `files`; the one before stays readable by its sha."""
        self.history[self.commit_of(branch)] = dict(self.branches[branch])
        self.branches[branch] = {**self.branches[branch], **files}
        return self.commit_of(branch)


class MockHub:
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}  # (kind "models"/"datasets", repo id) -> Repo
        self.requests: list[tuple[str, str]] = []
        self.reads: list[tuple[str, str | None]] = []
        self.delays: dict[str, float] = {}  # file-name suffix -> seconds a GET of such a file takes (a slow download)
        hub = self
        handler = type("Handler", (_Handler,), {"hub": hub})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo_id: str, files: dict[str, bytes | str], kind: str = "models") -> Repo:
        repo = Repo({k: v.encode() if isinstance(v, str) else v for k, v in files.items()})
        self.repos[(kind, repo_id)] = repo
        return repo

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


REPO = r"(?P<repo>[^/]+/[^/]+)"


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: MockHub

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, data, status: int = 200) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, kind: str, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
        return repo

    def _files(self, repo: Repo, revision: str) -> dict[str, bytes] | None:
        files = repo.files_at(unquote(revision))
        if files is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return files

    def do_HEAD(self):
        self._get(head=True)

    def do_GET(self):
        self._get(head=False)

    def _get(self, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self.hub.requests.append((self.command, path))
        m = re.fullmatch(rf"/api/(?P<kind>models|datasets)/{REPO}(?:/revision/(?P<rev>.+))?", path)
        if m:
            return self._info(m["kind"], m["repo"], m["rev"] or "main")
        m = re.fullmatch(rf"/api/(?P<kind>models|datasets)/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", path)
        if m:
            return self._tree(m["kind"], m["repo"], m["rev"], m["sub"] or "", parse_qs(url.query))
        m = re.fullmatch(rf"/(?P<kind>datasets/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if m:
            return self._resolve("datasets" if m["kind"] else "models", m["repo"], m["rev"], m["file"], head)
        self._error(404, "EntryNotFound", f"no route {path}")

    def _info(self, kind: str, repo_id: str, revision: str) -> None:
        repo = self._repo(kind, repo_id)
        files = repo and self._files(repo, revision)
        if files is not None:
            self._json({"id": repo_id, "sha": repo.commit_of(unquote(revision)), "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(files)]})

    def _tree(self, kind: str, repo_id: str, revision: str, sub: str, query: dict) -> None:
        repo = self._repo(kind, repo_id)
        files = repo and self._files(repo, revision)
        if files is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        entries, dirs = [], set()
        for name in sorted(files):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            for i, part in enumerate(rest.split("/")[:-1]):
                dirs.add(prefix + "/".join(rest.split("/")[:i + 1]))
            entries.append({"type": "file", "oid": _sha(files[name]), "size": len(files[name]), "path": name})
        if prefix and not entries and not dirs:
            return self._error(404, "EntryNotFound", f"{sub} does not exist")
        self._json([{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)] + entries)

    def _resolve(self, kind: str, repo_id: str, revision: str, name: str, head: bool) -> None:
        repo = self._repo(kind, repo_id)
        files = repo and self._files(repo, revision)
        if files is None:
            return
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        data = files[name]
        if not head:
            self.hub.reads.append((name, self.headers.get("Range")))
            time.sleep(max((t for suffix, t in self.hub.delays.items() if name.endswith(suffix)), default=0.0))
        headers = {"X-Repo-Commit": repo.commit_of(unquote(revision)), "ETag": f'"{_sha(data)}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if ranged:
            start = int(ranged[1])
            end = min(int(ranged[2]) if ranged[2] else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, data[start:end + 1], headers, head)
        self._send(200, data, headers, head)

    def do_POST(self):
        url = urlparse(self.path)
        path = unquote(url.path)
        self.hub.requests.append(("POST", path))
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        if path == "/api/repos/create":
            spec = json.loads(body)
            repo_id = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
            kind = {"dataset": "datasets"}.get(spec.get("type"), "models")
            if (kind, repo_id) in self.hub.repos:
                return self._error(409, "RepoExists", "You already created this model repo")
            self.hub.add(repo_id, {}, kind)
            return self._json({"url": f"{self.hub.url}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body)["content"])
        m = re.fullmatch(rf"/api/(?P<kind>models|datasets)/{REPO}/preupload/(?P<rev>.+)", path)
        if m:
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        m = re.fullmatch(rf"/api/(?P<kind>models|datasets)/{REPO}/branch/(?P<branch>.+)", path)
        if m:
            return self._branch(m["kind"], m["repo"], m["branch"], json.loads(body or b"{}"))
        m = re.fullmatch(rf"/api/(?P<kind>models|datasets)/{REPO}/commit/(?P<rev>.+)", path)
        if m:
            return self._commit(m["kind"], m["repo"], m["rev"], body)
        self._error(404, "EntryNotFound", f"no route {path}")

    def _validate_yaml(self, card: str) -> None:
        import yaml

        front = card.split("---\n")[1] if card.startswith("---\n") else ""
        try:
            yaml.safe_load(front)
        except yaml.YAMLError as e:
            return self._json({"errors": [{"message": str(e)}]}, 400)
        self._json({"errors": [], "warnings": []})

    def _branch(self, kind: str, repo_id: str, branch: str, spec: dict) -> None:
        repo = self._repo(kind, repo_id)
        if repo is None:
            return
        if branch in repo.branches:
            return self._error(409, "BranchExists", f"Reference already exists: refs/heads/{branch}")
        start = repo.files_at(spec.get("startingPoint") or "main")
        repo.branches[branch] = dict(start or {})
        self._json({})

    def _commit(self, kind: str, repo_id: str, revision: str, body: bytes) -> None:
        repo = self._repo(kind, repo_id)
        if repo is None:
            return
        if revision not in repo.branches:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.branches[revision]
        for line in body.decode().splitlines():
            op = json.loads(line)
            if op["key"] == "file":
                files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            elif op["key"] == "deletedFile":
                files.pop(op["value"]["path"], None)
        commit = repo.commit_of(revision)
        self._json({"commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit}", "commitOid": commit,
                    "pullRequestUrl": None})
