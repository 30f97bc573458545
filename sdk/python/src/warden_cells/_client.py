"""The clients: `Warden` (sync) and `AsyncWarden`, each sending the operations of `_ops`."""

from __future__ import annotations

import os
import socket as pysocket
import struct
import time
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Tuple, Union

import httpx

from . import _ops as ops
from ._errors import ConnectionFailed, error_of
from ._types import (AgentInfo, Approval, CellInfo, Checkpoint, ExitInfo, FileInfo, JournalCheck,
                     JournalPage, PoolInfo, ProcessInfo, Ran, Snapshot, UsageHistory, _from)

Event = Tuple[str, Any]

RUN_DOC = """Runs one command in a cell made for it and deleted once the command ends
        (`POST /v1/run`; an unnamed cell of a pool's policy is taken from the pool). `cell`: what
        `create` takes (name, preset, policy, workspace, env, labels, from_, secrets); the other
        arguments are an exec's."""


def _event(name: str, data: Any) -> Event:
    """An exec's event as the SDK gives it: text for output, an `ExitInfo` for the exit, a
    count for dropped bytes, the server's message for an error."""
    if name in ("stdout", "stderr"):
        return name, ops.chunk_text(data)
    if name == "exit":
        return name, _from(ExitInfo, data)
    if name == "dropped":
        return name, data.get("bytes", 0)
    if name == "error":
        return name, data.get("message", "")
    return name, data


class _Collect:
    """A command's events gathered into a `Ran`; a run's `error` (its cell not deleted) is
    raised once the exit is in."""

    def __init__(self, what: str):
        self.what = what
        self.out: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        self.dropped = 0
        self.error: Optional[str] = None

    def add(self, name: str, data: Any) -> Optional[Ran]:
        if name in self.out:
            self.out[name].append(data)
        elif name == "dropped":
            self.dropped += data
        elif name == "error":
            self.error = data
        elif name == "exit":
            if self.error is not None:
                raise ConnectionFailed(0, "unavailable", f"{self.what}: {self.error}")
            return Ran(data, "".join(self.out["stdout"]), "".join(self.out["stderr"]),
                       self.dropped)
        return None

    def missing(self) -> ConnectionFailed:
        return ConnectionFailed(0, "unavailable", f"{self.what}'s stream ended without its exit")


def _transport_args(socket: Optional[str], url: Optional[str], token: Optional[str]):
    headers = {}
    if url is None:
        socket = socket or ops.default_socket()
        _check_server(socket)
        return socket, "http://warden", headers
    if token:
        headers["Authorization"] = f"Bearer {token.strip()}"
    return None, url.rstrip("/"), headers


def _check_server(path: str) -> None:
    """Refuses a socket another user serves (the kernel's word, `SO_PEERCRED`), before anything
    is sent: what the client sends (a cell's environment and secrets, answers to approvals)
    goes to no other user's process that took the socket's path. The default runtime directory
    of a user without `XDG_RUNTIME_DIR`, `/tmp/warden-UID`, is anyone's to make first. A socket
    nobody serves is left to the first request, which says so."""
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
        creds = probe.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED,
                                 struct.calcsize("3i"))
    except OSError:
        return
    finally:
        probe.close()
    _pid, uid, _gid = struct.unpack("3i", creds)
    ours = os.geteuid()
    if uid not in (ours, 0):
        raise ConnectionFailed(
            0, "unavailable",
            f"{path} is served by uid {uid}, not by you (uid {ours}) or root: it is not your "
            "warden daemon, and nothing was sent to it. Another user may have made its runtime "
            "directory first (the default /tmp/warden-UID is anyone's to make where "
            "XDG_RUNTIME_DIR is unset): remove that directory, or set WARDEN_RUNTIME_DIR to a "
            "directory only you can write")


def _check(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_of(response.status_code, body)


def _parse(op: ops.Op, response: httpx.Response) -> Any:
    if op.raw:
        return response.content
    if not response.content:
        return None
    return op.parse(response.json())


class Warden:
    """A connection to the daemon: over its unix socket (default: where `warden` finds it), or
    `url` with the TCP listener's `token`."""

    def __init__(self, socket: Optional[str] = None, *, url: Optional[str] = None,
                 token: Optional[str] = None, timeout: Optional[float] = 60.0):
        self.socket, base, headers = _transport_args(socket, url, token)
        transport = httpx.HTTPTransport(uds=self.socket) if self.socket else None
        self._http = httpx.Client(base_url=base, headers=headers, transport=transport,
                                  timeout=httpx.Timeout(timeout, read=None))
        self.cells = Cells(self)
        self.approvals = Approvals(self)
        self.agents = Agents(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Warden":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, op: ops.Op) -> Any:
        try:
            response = self._http.request(op.method, op.path, json=op.json, params=op.params,
                                          content=op.content)
        except httpx.TransportError as e:
            raise ConnectionFailed(0, "unavailable", f"cannot reach the warden daemon: {e}",
                                   "is `warden serve` running?") from e
        _check(response)
        return _parse(op, response)

    def _stream(self, op: ops.Op) -> Iterator[Tuple[str, Any, Optional[str]]]:
        try:
            with self._http.stream(op.method, op.path, json=op.json, params=op.params) as r:
                if not r.is_success:
                    r.read()
                    _check(r)
                parser = ops.SseParser()
                for line in r.iter_lines():
                    event = parser.feed(line)
                    if event:
                        yield event
        except httpx.TransportError as e:
            raise ConnectionFailed(0, "unavailable", f"the warden daemon's stream broke: {e}",
                                   "is `warden serve` running?") from e

    def health(self) -> Dict[str, Any]:
        return self._run(ops.health())

    def journal(self, before: Optional[int] = None, limit: Optional[int] = None,
                cell: Optional[str] = None, kind: Optional[str] = None,
                since_ms: Optional[int] = None, until_ms: Optional[int] = None) -> JournalPage:
        """A page of whole journal entries (hash and link), newest first: `before` pages back
        (a page's `next_before`), `kind` is a prefix (`net.`, `exec.exit`)."""
        return self._run(ops.journal(before, limit, cell, kind, since_ms, until_ms))

    def verify_journal(self) -> JournalCheck:
        """Checks the whole chain and its signed checkpoints against the daemon's key."""
        return self._run(ops.verify_journal())

    def usage(self, cell: Optional[str] = None) -> List[UsageHistory]:
        """The live cells' recent CPU time, memory and tasks, from their cgroups."""
        return self._run(ops.usage(cell))

    def pools(self) -> List[PoolInfo]:
        """The cells the daemon keeps made ahead, per policy: how many are ready, their
        memory, how many were handed out. A `cells.create()` with no name, workspace, source
        or environment of its own, of a pool's policy, takes one."""
        return self._run(ops.pools())

    def events(self, cell: Optional[str] = None, after: Optional[int] = None
               ) -> Iterator[Dict[str, Any]]:
        """Journal entries as they are written (`after`: those after this sequence number
        first). Runs until the caller stops iterating."""
        for name, data, _ in self._stream(ops.events(cell, after)):
            if isinstance(data, dict):
                yield data

    def replay(self, cell: str, idle: float = 0.5) -> List[Dict[str, Any]]:
        """The journal's entries about a cell, from the first: read until none came for
        `idle` seconds."""
        out: List[Dict[str, Any]] = []
        with httpx.Client(base_url=self._http.base_url, headers=self._http.headers,
                          transport=httpx.HTTPTransport(uds=self.socket) if self.socket else None,
                          timeout=httpx.Timeout(30.0, read=idle)) as http:
            try:
                with http.stream("GET", "/v1/events", params={"cell": cell, "after": 0}) as r:
                    if not r.is_success:
                        r.read()
                        _check(r)
                    parser = ops.SseParser()
                    for line in r.iter_lines():
                        event = parser.feed(line)
                        if event and isinstance(event[1], dict):
                            out.append(event[1])
            except httpx.ReadTimeout:
                pass
        return out


class Cells:
    def __init__(self, w: Warden):
        self._w = w

    def create(self, name: Optional[str] = None, *, preset: Optional[str] = None,
               policy: Optional[str] = None, workspace: Optional[str] = None,
               env: Optional[Dict[str, str]] = None, labels: Optional[Dict[str, str]] = None,
               from_: Optional[str] = None, secrets: Optional[Dict[str, str]] = None) -> "Cell":
        """Makes a cell and starts it. `policy`: YAML text; `preset`: a built-in one;
        `from_`: a snapshot (`CELL@SNAP`) or a running cell to fork."""
        info = self._w._run(ops.create(name=name, preset=preset, policy=policy,
                                       workspace=workspace, env=env, labels=labels,
                                       from_=from_, secrets=secrets))
        return Cell(self._w, info)

    def run_stream(self, argv: ops.Argv, *, cell: Optional[Dict[str, Any]] = None,
                   **kwargs: Any) -> Iterator[Event]:
        for name, data, _ in self._w._stream(ops.run(ops.cell_body(**(cell or {})),
                                                     ops.exec_spec(argv, **kwargs))):
            yield _event(name, data)

    run_stream.__doc__ = RUN_DOC + """ Yields as `Cell.exec_stream` does (read it to its
        end: the exit is the last event); `started` names the cell too; an ("error", message)
        before the exit says the cell could not be deleted."""

    def run(self, argv: ops.Argv, *, cell: Optional[Dict[str, Any]] = None,
            **kwargs: Any) -> Ran:
        collect = _Collect("the run")
        ran = None
        for name, data in self.run_stream(argv, cell=cell, **kwargs):
            ran = collect.add(name, data) or ran
        if ran is None:
            raise collect.missing()
        return ran

    run.__doc__ = RUN_DOC + """ To its end: its exit, stdout and stderr (`Ran`)."""

    def restore(self, checkpoint: str, name: Optional[str] = None,
                labels: Optional[Dict[str, str]] = None) -> "Cell":
        """Brings back a checkpoint (`CELL@CKPT`, from `Cell.checkpoint`) as a new cell: its
        processes go on where they were, its workspace is as it was, its policy is the
        checkpointed cell's."""
        info = self._w._run(ops.create(name=name, restore=checkpoint, labels=labels))
        return Cell(self._w, info)

    def list(self) -> List["Cell"]:
        return [Cell(self._w, info) for info in self._w._run(ops.cells())]

    def get(self, name: str) -> "Cell":
        return Cell(self._w, self._w._run(ops.cell(name)))


class Cell:
    """One cell. `info` is as it was when this handle was made; `refresh()` reads it again."""

    def __init__(self, w: Warden, info: CellInfo):
        self._w = w
        self.info = info
        self.name = info.name
        self.files = Files(w, info.name)

    def __repr__(self) -> str:
        return f"Cell({self.name!r}, {self.info.state})"

    def refresh(self) -> CellInfo:
        self.info = self._w._run(ops.cell(self.name))
        return self.info

    def pause(self) -> CellInfo:
        return self._w._run(ops.control(self.name, "pause"))

    def resume(self) -> CellInfo:
        return self._w._run(ops.control(self.name, "resume"))

    def kill(self) -> CellInfo:
        return self._w._run(ops.control(self.name, "kill"))

    def delete(self) -> None:
        self._w._run(ops.delete(self.name))

    def exec_stream(self, argv: ops.Argv, **kwargs: Any) -> Iterator[Event]:
        """Runs a command in the foreground, yielding ("started", {process, pid}), ("stdout",
        text), ("stderr", text), ("dropped", bytes) as they come, and last ("exit",
        ExitInfo). Stopping the iteration early kills the command."""
        spec = ops.exec_spec(argv, **kwargs)
        spec.pop("background", None)
        for name, data, _ in self._w._stream(ops.exec_(self.name, spec)):
            yield _event(name, data)
            if name == "exit":
                return

    def exec(self, argv: ops.Argv, *, background: bool = False, **kwargs: Any
             ) -> Union[Ran, "Process"]:
        """Runs a command (a list, or a string for `sh -c`). To its end: its exit, stdout and
        stderr (`Ran`). With `background=True`: a `Process` at once."""
        if background:
            info = self._w._run(ops.exec_(self.name, ops.exec_spec(argv, background=True,
                                                                   **kwargs)))
            return Process(self._w, self.name, info)
        collect = _Collect("the exec")
        for name, data in self.exec_stream(argv, **kwargs):
            ran = collect.add(name, data)
            if ran is not None:
                return ran
        raise collect.missing()

    def processes(self) -> List["Process"]:
        return [Process(self._w, self.name, p) for p in self._w._run(ops.processes(self.name))]

    def process(self, pid: int) -> "Process":
        return Process(self._w, self.name, self._w._run(ops.process(self.name, pid)))

    def snapshot(self, name: Optional[str] = None) -> Snapshot:
        return self._w._run(ops.snapshot(self.name, name))

    def snapshots(self) -> List[Snapshot]:
        return self._w._run(ops.snapshots(self.name))

    def remove_snapshot(self, snapshot: str) -> None:
        """Removes a snapshot of this cell (`SNAP` or `CELL@SNAP`); journaled. `NotFound` when
        there is none of that name; refused while a cell forked from it runs."""
        self._w._run(ops.remove_snapshot(self.name, snapshot))

    def checkpoint(self, name: Optional[str] = None) -> Checkpoint:
        """Saves the cell's memory and workspace (tiers that have memory snapshots: gVisor);
        the cell ends there. `cells.restore(ckpt.id)` brings it back."""
        return self._w._run(ops.checkpoint(self.name, name))

    def reset(self, to: Optional[str] = None) -> None:
        self._w._run(ops.reset(self.name, to))

    def fork(self, name: Optional[str] = None, snapshot: Optional[str] = None) -> "Cell":
        """A new cell from this one's files: of `snapshot`, or as they are now."""
        source = f"{self.name}@{snapshot}" if snapshot else self.name
        made = self._w._run(ops.policy(self.name))
        return self._w.cells.create(name, from_=source, policy=made.get("policy"),
                                    preset=made.get("preset"))

    def diff(self) -> Dict[str, Any]:
        return self._w._run(ops.diff(self.name))

    def apply(self, paths: Optional[List[str]] = None, *, digest: Optional[str] = None,
              dry_run: bool = False, force: bool = False,
              include_sensitive: bool = False) -> Dict[str, Any]:
        return self._w._run(ops.apply(self.name, paths, digest, dry_run, force,
                                      include_sensitive))

    def policy(self) -> Dict[str, Any]:
        return self._w._run(ops.policy(self.name))

    def set_policy(self, yaml: str) -> Dict[str, Any]:
        return self._w._run(ops.set_policy(self.name, yaml))


class Process:
    """A process exec'd into a cell."""

    def __init__(self, w: Warden, cell: str, info: ProcessInfo):
        self._w = w
        self.cell = cell
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"Process({self.cell!r}, {self.id}, running={self.info.running})"

    def refresh(self) -> ProcessInfo:
        self.info = self._w._run(ops.process(self.cell, self.id))
        return self.info

    def wait(self) -> ExitInfo:
        return self._w._run(ops.wait(self.cell, self.id))

    def write(self, data: Union[str, bytes], close: bool = False) -> None:
        self._w._run(ops.stdin(self.cell, self.id, data, close))

    def close_stdin(self) -> None:
        self._w._run(ops.stdin(self.cell, self.id, "", True))

    def signal(self, sig: Union[int, str] = "TERM") -> None:
        self._w._run(ops.signal(self.cell, self.id, sig))

    def kill(self) -> None:
        self.signal("KILL")

    def resize(self, rows: int, cols: int) -> None:
        self._w._run(ops.resize(self.cell, self.id, rows, cols))

    def output(self, start: int = 0, follow: bool = True) -> Iterator[Event]:
        """Its output from the start (kept output first), then live with `follow`: like
        `Cell.exec_stream`, ending with ("exit", ExitInfo), or ("live", ...) without follow."""
        for name, data, _ in self._w._stream(ops.output(self.cell, self.id, start, follow)):
            if name in ("stdout", "stderr"):
                yield name, ops.chunk_text(data)
            elif name == "exit":
                yield name, _from(ExitInfo, data)
                return
            else:
                yield name, data
                if name == "live":
                    return


class Files:
    """Files of a running cell, read and written inside it (paths relative to its
    workspace)."""

    def __init__(self, w: Warden, cell: str):
        self._w = w
        self.cell = cell

    def read(self, path: str) -> bytes:
        return self._w._run(ops.read(self.cell, path))

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, data: Union[str, bytes]) -> None:
        self._w._run(ops.write(self.cell, path, data))

    def list(self, path: str = ".") -> List[FileInfo]:
        return self._w._run(ops.listdir(self.cell, path))

    def archive(self, path: str = ".") -> bytes:
        """A tar archive of a directory of the cell."""
        return self._w._run(ops.archive(self.cell, path))

    def extract(self, tar: bytes, path: str = ".") -> None:
        """Unpacks a tar archive into a directory of the cell."""
        self._w._run(ops.extract(self.cell, path, tar))

    def stat(self, path: str) -> FileInfo:
        return self._w._run(ops.stat(self.cell, path))

    def exists(self, path: str) -> bool:
        from ._errors import NotFound
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def mkdir(self, path: str, recursive: bool = True) -> None:
        self._w._run(ops.mkdir(self.cell, path, recursive))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._w._run(ops.remove(self.cell, path, recursive))

    def move(self, source: str, dest: str) -> None:
        self._w._run(ops.move(self.cell, source, dest))


class PendingApproval:
    """A question an `ask` rule holds for a person."""

    def __init__(self, w: Warden, approval: Approval):
        self._w = w
        self.approval = approval

    def __repr__(self) -> str:
        a = self.approval
        return f"PendingApproval({a.cell!r}, {a.id}, {a.request!r}, rule={a.rule!r})"

    def approve(self, scope: str = "once") -> None:
        self._w._run(ops.answer(self.approval.cell, self.approval.id, "approve", scope))

    def deny(self) -> None:
        self._w._run(ops.answer(self.approval.cell, self.approval.id, "deny", "once"))


class Approvals:
    def __init__(self, w: Warden):
        self._w = w

    def list(self) -> List[PendingApproval]:
        return [PendingApproval(self._w, a) for a in self._w._run(ops.approvals())]

    def answer(self, cell: str, qid: int, decision: str, scope: str = "once") -> None:
        self._w._run(ops.answer(cell, qid, decision, scope))

    def wait(self, cell: Optional[str] = None, timeout: float = 30.0,
             interval: float = 0.05) -> PendingApproval:
        """The first question (of `cell`, or of any cell) that waits, once one does."""
        deadline = time.monotonic() + timeout
        while True:
            for pending in self.list():
                if cell is None or pending.approval.cell == cell:
                    return pending
            if time.monotonic() > deadline:
                raise TimeoutError(f"no approval waited within {timeout} s")
            time.sleep(interval)


class Agents:
    """Sessions of the warden's own agent loop: the model's tool calls run in a cell under its
    policy; pause, step, say, rewind and fork them from here."""

    def __init__(self, w: Warden):
        self._w = w

    def start(self, task: str, model: str, **kwargs: Any) -> "Agent":
        """`model` is PROVIDER:MODEL; keyword arguments as `POST /v1/agents` takes them
        (`base_url`, `workspace`, `preset`, `policy`, `cell`, `budgets`, `tools`, `paused`,
        `instructions`, `api_key`: by default the provider's variable of this environment)."""
        return Agent(self._w, self._w._run(ops.start_agent(task, model, **kwargs)))

    def list(self) -> List["Agent"]:
        return [Agent(self._w, i) for i in self._w._run(ops.agents())]

    def get(self, aid: str) -> "Agent":
        return Agent(self._w, self._w._run(ops.agent(aid)))


class Agent:
    def __init__(self, w: Warden, info: AgentInfo):
        self._w = w
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"Agent({self.id!r}, {self.info.state}, turn {self.info.turn})"

    def _act(self, action: str, body: Any = None) -> AgentInfo:
        self.info = self._w._run(ops.agent_action(self.id, action, body))
        return self.info

    def refresh(self) -> AgentInfo:
        self.info = self._w._run(ops.agent(self.id))
        return self.info

    def wait(self) -> AgentInfo:
        """Until the session is paused or over."""
        self.info = self._w._run(ops.agent(self.id, "/wait"))
        return self.info

    def pause(self) -> AgentInfo:
        return self._act("pause")

    def resume(self) -> AgentInfo:
        return self._act("resume")

    def step(self) -> AgentInfo:
        return self._act("step")

    def stop(self) -> AgentInfo:
        return self._act("stop")

    def say(self, text: str) -> AgentInfo:
        return self._act("say", {"text": text})

    def rewind(self, turn: int) -> AgentInfo:
        return self._act("rewind", {"turn": turn})

    def fork(self, turn: int, say: Optional[str] = None, **kwargs: Any) -> "Agent":
        body = {k: v for k, v in dict(turn=turn, say=say, **kwargs).items() if v is not None}
        return Agent(self._w, self._w._run(ops.agent_action(self.id, "fork", body)))

    def transcript(self) -> Dict[str, Any]:
        return self._w._run(ops.agent_transcript(self.id))

    def cell(self) -> Cell:
        return self._w.cells.get(self.info.cell)


# The async client: the same operations, awaited.

class AsyncWarden:
    """`Warden`, for asyncio."""

    def __init__(self, socket: Optional[str] = None, *, url: Optional[str] = None,
                 token: Optional[str] = None, timeout: Optional[float] = 60.0):
        self.socket, base, headers = _transport_args(socket, url, token)
        transport = httpx.AsyncHTTPTransport(uds=self.socket) if self.socket else None
        self._http = httpx.AsyncClient(base_url=base, headers=headers, transport=transport,
                                       timeout=httpx.Timeout(timeout, read=None))
        self.cells = AsyncCells(self)
        self.agents = AsyncAgents(self)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncWarden":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _run(self, op: ops.Op) -> Any:
        try:
            response = await self._http.request(op.method, op.path, json=op.json,
                                                params=op.params, content=op.content)
        except httpx.TransportError as e:
            raise ConnectionFailed(0, "unavailable", f"cannot reach the warden daemon: {e}",
                                   "is `warden serve` running?") from e
        _check(response)
        return _parse(op, response)

    async def _stream(self, op: ops.Op) -> AsyncIterator[Tuple[str, Any, Optional[str]]]:
        try:
            async with self._http.stream(op.method, op.path, json=op.json,
                                         params=op.params) as r:
                if not r.is_success:
                    await r.aread()
                    _check(r)
                parser = ops.SseParser()
                async for line in r.aiter_lines():
                    event = parser.feed(line)
                    if event:
                        yield event
        except httpx.TransportError as e:
            raise ConnectionFailed(0, "unavailable", f"the warden daemon's stream broke: {e}",
                                   "is `warden serve` running?") from e

    async def health(self) -> Dict[str, Any]:
        return await self._run(ops.health())

    async def journal(self, before: Optional[int] = None, limit: Optional[int] = None,
                      cell: Optional[str] = None, kind: Optional[str] = None,
                      since_ms: Optional[int] = None, until_ms: Optional[int] = None
                      ) -> JournalPage:
        return await self._run(ops.journal(before, limit, cell, kind, since_ms, until_ms))

    async def verify_journal(self) -> JournalCheck:
        return await self._run(ops.verify_journal())

    async def usage(self, cell: Optional[str] = None) -> List[UsageHistory]:
        return await self._run(ops.usage(cell))

    async def pools(self) -> List[PoolInfo]:
        return await self._run(ops.pools())

    async def approvals(self) -> List[Approval]:
        return await self._run(ops.approvals())

    async def answer(self, cell: str, qid: int, decision: str, scope: str = "once") -> None:
        await self._run(ops.answer(cell, qid, decision, scope))


class AsyncCells:
    def __init__(self, w: AsyncWarden):
        self._w = w

    async def create(self, name: Optional[str] = None, **kwargs: Any) -> "AsyncCell":
        info = await self._w._run(ops.create(name=name, **kwargs))
        return AsyncCell(self._w, info)

    async def run_stream(self, argv: ops.Argv, *, cell: Optional[Dict[str, Any]] = None,
                         **kwargs: Any) -> AsyncIterator[Event]:
        async for name, data, _ in self._w._stream(ops.run(ops.cell_body(**(cell or {})),
                                                           ops.exec_spec(argv, **kwargs))):
            yield _event(name, data)

    run_stream.__doc__ = Cells.run_stream.__doc__

    async def run(self, argv: ops.Argv, *, cell: Optional[Dict[str, Any]] = None,
                  **kwargs: Any) -> Ran:
        collect = _Collect("the run")
        ran = None
        async for name, data in self.run_stream(argv, cell=cell, **kwargs):
            ran = collect.add(name, data) or ran
        if ran is None:
            raise collect.missing()
        return ran

    run.__doc__ = Cells.run.__doc__

    async def restore(self, checkpoint: str, name: Optional[str] = None,
                      labels: Optional[Dict[str, str]] = None) -> "AsyncCell":
        info = await self._w._run(ops.create(name=name, restore=checkpoint, labels=labels))
        return AsyncCell(self._w, info)

    async def list(self) -> List["AsyncCell"]:
        return [AsyncCell(self._w, i) for i in await self._w._run(ops.cells())]

    async def get(self, name: str) -> "AsyncCell":
        return AsyncCell(self._w, await self._w._run(ops.cell(name)))


class AsyncCell:
    def __init__(self, w: AsyncWarden, info: CellInfo):
        self._w = w
        self.info = info
        self.name = info.name

    async def kill(self) -> CellInfo:
        return await self._w._run(ops.control(self.name, "kill"))

    async def pause(self) -> CellInfo:
        return await self._w._run(ops.control(self.name, "pause"))

    async def resume(self) -> CellInfo:
        return await self._w._run(ops.control(self.name, "resume"))

    async def delete(self) -> None:
        await self._w._run(ops.delete(self.name))

    async def exec_stream(self, argv: ops.Argv, **kwargs: Any) -> AsyncIterator[Event]:
        spec = ops.exec_spec(argv, **kwargs)
        spec.pop("background", None)
        async for name, data, _ in self._w._stream(ops.exec_(self.name, spec)):
            yield _event(name, data)
            if name == "exit":
                return

    async def exec(self, argv: ops.Argv, *, background: bool = False, **kwargs: Any
                   ) -> Union[Ran, ProcessInfo]:
        if background:
            return await self._w._run(ops.exec_(self.name, ops.exec_spec(
                argv, background=True, **kwargs)))
        collect = _Collect("the exec")
        async for name, data in self.exec_stream(argv, **kwargs):
            ran = collect.add(name, data)
            if ran is not None:
                return ran
        raise collect.missing()

    async def wait(self, pid: int) -> ExitInfo:
        return await self._w._run(ops.wait(self.name, pid))

    async def read(self, path: str) -> bytes:
        return await self._w._run(ops.read(self.name, path))

    async def write(self, path: str, data: Union[str, bytes]) -> None:
        await self._w._run(ops.write(self.name, path, data))

    async def list_files(self, path: str = ".") -> List[FileInfo]:
        return await self._w._run(ops.listdir(self.name, path))

    async def diff(self) -> Dict[str, Any]:
        return await self._w._run(ops.diff(self.name))

    async def checkpoint(self, name: Optional[str] = None) -> Checkpoint:
        return await self._w._run(ops.checkpoint(self.name, name))

    async def snapshot(self, name: Optional[str] = None) -> Snapshot:
        return await self._w._run(ops.snapshot(self.name, name))

    async def snapshots(self) -> List[Snapshot]:
        return await self._w._run(ops.snapshots(self.name))

    async def remove_snapshot(self, snapshot: str) -> None:
        await self._w._run(ops.remove_snapshot(self.name, snapshot))

    async def reset(self, to: Optional[str] = None) -> None:
        await self._w._run(ops.reset(self.name, to))


class AsyncAgents:
    def __init__(self, w: AsyncWarden):
        self._w = w

    async def start(self, task: str, model: str, **kwargs: Any) -> "AsyncAgent":
        return AsyncAgent(self._w, await self._w._run(ops.start_agent(task, model, **kwargs)))

    async def list(self) -> List["AsyncAgent"]:
        return [AsyncAgent(self._w, i) for i in await self._w._run(ops.agents())]

    async def get(self, aid: str) -> "AsyncAgent":
        return AsyncAgent(self._w, await self._w._run(ops.agent(aid)))


class AsyncAgent:
    def __init__(self, w: AsyncWarden, info: AgentInfo):
        self._w = w
        self.info = info
        self.id = info.id

    async def _act(self, action: str, body: Any = None) -> AgentInfo:
        self.info = await self._w._run(ops.agent_action(self.id, action, body))
        return self.info

    async def refresh(self) -> AgentInfo:
        self.info = await self._w._run(ops.agent(self.id))
        return self.info

    async def wait(self) -> AgentInfo:
        self.info = await self._w._run(ops.agent(self.id, "/wait"))
        return self.info

    async def pause(self) -> AgentInfo:
        return await self._act("pause")

    async def resume(self) -> AgentInfo:
        return await self._act("resume")

    async def step(self) -> AgentInfo:
        return await self._act("step")

    async def stop(self) -> AgentInfo:
        return await self._act("stop")

    async def say(self, text: str) -> AgentInfo:
        return await self._act("say", {"text": text})

    async def rewind(self, turn: int) -> AgentInfo:
        return await self._act("rewind", {"turn": turn})

    async def fork(self, turn: int, say: Optional[str] = None, **kwargs: Any) -> "AsyncAgent":
        body = {k: v for k, v in dict(turn=turn, say=say, **kwargs).items() if v is not None}
        return AsyncAgent(self._w, await self._w._run(ops.agent_action(self.id, "fork", body)))

    async def transcript(self) -> Dict[str, Any]:
        return await self._w._run(ops.agent_transcript(self.id))
