"""Each API operation once: its request, and how its answer is read. The sync and async clients
send the same operations (`_client.py`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union
from urllib.parse import quote

from ._types import (AgentInfo, Approval, CellInfo, Checkpoint, ExitInfo, FileInfo, JournalCheck,
                     JournalPage, PoolInfo, ProcessInfo, Snapshot, UsageHistory, _from)

Argv = Union[str, Iterable[str]]


@dataclass
class Op:
    method: str
    path: str
    json: Any = None
    params: Optional[Dict[str, Any]] = None
    content: Optional[bytes] = None
    #: How a successful answer is read: from its JSON (or its bytes, with `raw`).
    parse: Callable[[Any], Any] = lambda v: v
    raw: bool = False
    #: Server-sent events, read as they come.
    stream: bool = False


def default_socket() -> str:
    """Where the daemon listens, as `warden` finds it."""
    runtime = os.environ.get("WARDEN_RUNTIME_DIR")
    if not runtime:
        if os.geteuid() == 0:
            runtime = "/run/warden"
        elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
            runtime = os.path.join(os.environ["XDG_RUNTIME_DIR"], "warden")
        else:
            runtime = f"/tmp/warden-{os.geteuid()}"
    return os.path.join(runtime, "daemon.sock")


def seg(value: Any) -> str:
    return quote(str(value), safe="")


def argv_of(argv: Argv) -> List[str]:
    if isinstance(argv, str):
        return ["sh", "-c", argv]
    out = list(argv)
    if not out:
        raise ValueError("a command needs at least the program")
    return out


def list_of(cls):
    return lambda items: [_from(cls, item) for item in items]


def one(cls):
    return lambda item: _from(cls, item)


# Cells.

def cell_body(**kwargs: Any) -> Dict[str, Any]:
    """A create's body: the arguments given, `from_` as `from`."""
    body = {k: v for k, v in kwargs.items() if v is not None}
    if "from_" in body:
        body["from"] = body.pop("from_")
    return body


def create(**kwargs: Any) -> Op:
    return Op("POST", "/v1/cells", json=cell_body(**kwargs), parse=one(CellInfo))


def run(cell: Dict[str, Any], spec: Dict[str, Any]) -> Op:
    """One command in a cell made for it, deleted once it ends: a create's body and an exec's."""
    return Op("POST", "/v1/run", json={"cell": cell, "exec": spec}, stream=True)


def cells() -> Op:
    return Op("GET", "/v1/cells", parse=list_of(CellInfo))


def cell(name: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}", parse=one(CellInfo))


def control(name: str, action: str) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/{action}", parse=one(CellInfo))


def delete(name: str) -> Op:
    return Op("DELETE", f"/v1/cells/{seg(name)}")


# Exec and processes.

def exec_spec(argv: Argv, env=None, cwd=None, stdin=None, timeout=None, background=False,
              tty=None, output_limit=None) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"argv": argv_of(argv)}
    if env:
        spec["env"] = dict(env)
    if cwd is not None:
        spec["cwd"] = cwd
    if stdin is not None:
        spec["stdin"] = stdin if isinstance(stdin, str) else bytes(stdin).decode()
    if timeout is not None:
        spec["timeout_ms"] = int(timeout * 1000)
    if background:
        spec["background"] = True
    if tty is not None:
        rows, cols = tty
        spec["tty"] = {"rows": rows, "cols": cols}
    if output_limit is not None:
        spec["output_limit"] = output_limit
    return spec


def exec_(name: str, spec: Dict[str, Any]) -> Op:
    if spec.get("background"):
        return Op("POST", f"/v1/cells/{seg(name)}/exec", json=spec, parse=one(ProcessInfo))
    return Op("POST", f"/v1/cells/{seg(name)}/exec", json=spec, stream=True)


def processes(name: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/processes", parse=list_of(ProcessInfo))


def process(name: str, pid: int) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/processes/{pid}", parse=one(ProcessInfo))


def wait(name: str, pid: int) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/processes/{pid}/wait", parse=one(ExitInfo))


def output(name: str, pid: int, start: int = 0, follow: bool = True) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/processes/{pid}/output",
              params={"from": start, "follow": str(follow).lower()}, stream=True)


def stdin(name: str, pid: int, data: Union[str, bytes], close: bool) -> Op:
    body: Dict[str, Any] = {"close": close}
    if isinstance(data, str):
        body["data"] = data
    elif data:
        import base64
        body["data_base64"] = base64.b64encode(bytes(data)).decode()
    return Op("POST", f"/v1/cells/{seg(name)}/processes/{pid}/stdin", json=body)


def signal(name: str, pid: int, sig: Union[int, str]) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/processes/{pid}/signal", json={"signal": sig})


def resize(name: str, pid: int, rows: int, cols: int) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/processes/{pid}/resize",
              json={"rows": rows, "cols": cols})


# Files.

def read(name: str, path: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/files/content", params={"path": path}, raw=True)


def write(name: str, path: str, data: Union[str, bytes]) -> Op:
    content = data.encode() if isinstance(data, str) else bytes(data)
    return Op("PUT", f"/v1/cells/{seg(name)}/files/content", params={"path": path},
              content=content)


def archive(name: str, path: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/files/archive", params={"path": path}, raw=True)


def extract(name: str, path: str, tar: bytes) -> Op:
    return Op("PUT", f"/v1/cells/{seg(name)}/files/archive", params={"path": path},
              content=bytes(tar))


def listdir(name: str, path: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/files/list", params={"path": path},
              parse=list_of(FileInfo))


def stat(name: str, path: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/files/stat", params={"path": path},
              parse=one(FileInfo))


def mkdir(name: str, path: str, recursive: bool) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/files/mkdir",
              json={"path": path, "recursive": recursive})


def remove(name: str, path: str, recursive: bool) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/files/remove",
              json={"path": path, "recursive": recursive})


def move(name: str, source: str, dest: str) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/files/move", json={"from": source, "to": dest})


# Workspace.

def snapshot(name: str, as_name: Optional[str]) -> Op:
    body = {"as": as_name} if as_name else {}
    return Op("POST", f"/v1/cells/{seg(name)}/snapshot", json=body, parse=one(Snapshot))


def checkpoint(name: str, as_name: Optional[str]) -> Op:
    body = {"as": as_name} if as_name else {}
    return Op("POST", f"/v1/cells/{seg(name)}/checkpoint", json=body, parse=one(Checkpoint))


def pools() -> Op:
    return Op("GET", "/v1/pools", parse=list_of(PoolInfo))


def snapshots(name: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/snapshots", parse=list_of(Snapshot))


def remove_snapshot(name: str, snapshot: str) -> Op:
    snapshot_id = snapshot if "@" in snapshot else f"{name}@{snapshot}"
    return Op("DELETE", f"/v1/snapshots/{seg(snapshot_id)}")


def reset(name: str, to: Optional[str]) -> Op:
    return Op("POST", f"/v1/cells/{seg(name)}/reset", json={"to": to} if to else {})


def diff(name: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/diff")


def apply(name: str, paths=None, digest=None, dry_run=False, force=False,
          include_sensitive=False) -> Op:
    body: Dict[str, Any] = {"paths": list(paths or []), "dry_run": dry_run, "force": force,
                            "include_sensitive": include_sensitive}
    if digest:
        body["digest"] = digest
    return Op("POST", f"/v1/cells/{seg(name)}/apply", json=body)


def policy(name: str) -> Op:
    return Op("GET", f"/v1/cells/{seg(name)}/policy")


def set_policy(name: str, yaml: str) -> Op:
    return Op("PUT", f"/v1/cells/{seg(name)}/policy", json={"policy": yaml})


# Approvals and the journal.

def journal(before: Optional[int], limit: Optional[int], cell: Optional[str],
            kind: Optional[str], since_ms: Optional[int], until_ms: Optional[int]) -> Op:
    params = {k: v for k, v in [("before", before), ("limit", limit), ("cell", cell),
                                ("kind", kind), ("since_ms", since_ms), ("until_ms", until_ms)]
              if v is not None}
    return Op("GET", "/v1/journal", params=params, parse=one(JournalPage))


def verify_journal() -> Op:
    return Op("GET", "/v1/journal/verify", parse=one(JournalCheck))


def usage(cell: Optional[str]) -> Op:
    return Op("GET", "/v1/usage", params={"cell": cell} if cell else {},
              parse=list_of(UsageHistory))


def approvals() -> Op:
    return Op("GET", "/v1/approvals", parse=list_of(Approval))


def answer(name: str, qid: int, decision: str, scope: str) -> Op:
    if decision not in ("approve", "deny"):
        raise ValueError("decision is `approve` or `deny`")
    return Op("POST", f"/v1/approvals/{seg(name)}/{qid}",
              json={"decision": decision, "scope": scope})


def events(cell: Optional[str], after: Optional[int]) -> Op:
    params: Dict[str, Any] = {}
    if cell:
        params["cell"] = cell
    if after is not None:
        params["after"] = after
    return Op("GET", "/v1/events", params=params, stream=True)


def health() -> Op:
    return Op("GET", "/v1/health")


# Server-sent events.

class SseParser:
    """Turns lines of a `text/event-stream` into (event, data, id) triples."""

    def __init__(self) -> None:
        self.event = "message"
        self.data: List[str] = []
        self.id: Optional[str] = None

    def feed(self, line: str) -> Optional[Tuple[str, Any, Optional[str]]]:
        if line == "":
            if not self.data:
                self.event = "message"
                return None
            text = "\n".join(self.data)
            try:
                data: Any = json.loads(text)
            except ValueError:
                data = text
            out = (self.event, data, self.id)
            self.event, self.data, self.id = "message", [], None
            return out
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            self.event = value
        elif key == "data":
            self.data.append(value)
        elif key == "id":
            self.id = value
        return None


def chunk_text(data: Dict[str, Any]) -> str:
    """The text of a `stdout`/`stderr` event (`text`, or `base64` for bytes that are not
    UTF-8, decoded with replacement)."""
    if "text" in data:
        return data["text"]
    import base64
    return base64.b64decode(data.get("base64", "")).decode("utf-8", "replace")


# Agent sessions.

def start_agent(task: str, model: str, **kwargs: Any) -> Op:
    body = {k: v for k, v in dict(task=task, model=model, **kwargs).items() if v is not None}
    if "api_key" not in body:
        provider = model.split(":", 1)[0]
        variable = "ANTHROPIC_API_KEY" if provider == "anthropic" else "OPENAI_API_KEY"
        if os.environ.get(variable):
            body["api_key"] = os.environ[variable]
    return Op("POST", "/v1/agents", json=body, parse=one(AgentInfo))


def agents() -> Op:
    return Op("GET", "/v1/agents", parse=list_of(AgentInfo))


def agent(aid: str, then: str = "") -> Op:
    return Op("GET", f"/v1/agents/{seg(aid)}{then}", parse=one(AgentInfo))


def agent_transcript(aid: str) -> Op:
    return Op("GET", f"/v1/agents/{seg(aid)}/transcript")


def agent_action(aid: str, action: str, body: Any = None) -> Op:
    if action not in ("pause", "resume", "step", "stop", "say", "rewind", "fork"):
        raise ValueError(f"no agent action `{action}`")
    return Op("POST", f"/v1/agents/{seg(aid)}/{action}", json=body if body is not None else {},
              parse=one(AgentInfo))
