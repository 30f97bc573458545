"""An OpenAI Agents SDK sandbox client on Warden cells: a `SandboxAgent`'s shell and file tools
run in a cell, under its policy (command rules, approvals, network) and journal, and what the
agent writes to a workspace stays in the cell's copy-on-write layer until it is reviewed
(`session.cell.diff()`) and taken (`session.cell.apply(digest=...)`). What an E2B backend
cannot give: review before anything reaches the host, approvals, snapshots.

    from agents import Runner, RunConfig
    from agents.run_config import SandboxRunConfig
    from warden_cells.openai_agents import WardenSandboxClient, WardenSandboxClientOptions

    client = WardenSandboxClient()
    options = WardenSandboxClientOptions(workspace="/path/to/project", preset="python")
    run_config = RunConfig(sandbox=SandboxRunConfig(client=client, options=options))

Needs `openai-agents` (not a dependency of this package). The cell's workspace is mounted at
the manifest's root (`/workspace`, the SDK's default).
"""

from __future__ import annotations

import asyncio
import io
import posixpath
from pathlib import Path
from typing import Literal, Optional

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
    WorkspaceStartError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.session.workspace_payloads import coerce_write_payload
from agents.sandbox.snapshot import resolve_snapshot
from agents.sandbox.types import ExecResult

from ._client import Cell, Warden
from ._errors import Forbidden, NotFound, WardenError

#: The exit code a command refused by the cell's policy reports to the agent.
REFUSED = 126


class WardenSandboxClientOptions(BaseSandboxClientOptions):
    """How a session's cell is made: a preset or a YAML policy, and a host workspace."""

    type: Literal["warden"] = "warden"
    preset: Optional[str] = None
    policy: Optional[str] = None
    workspace: Optional[str] = None
    name: Optional[str] = None


class WardenSandboxSessionState(SandboxSessionState):
    type: Literal["warden"] = "warden"
    cell: str


class WardenSandboxSession(BaseSandboxSession):
    """One cell, as the Agents SDK's session. `cell` is the Warden SDK's handle: diff, apply,
    snapshot, reset, its processes."""

    state: WardenSandboxSessionState

    def __init__(self, *, state: WardenSandboxSessionState, warden: Warden) -> None:
        self.state = state
        self._warden = warden
        self.cell: Cell = warden.cells.get(state.cell)

    def _relative(self, path: Path | str) -> str:
        root = str(self.state.manifest.root).rstrip("/") or "/"
        full = posixpath.normpath(str(path) if str(path).startswith("/") else f"{root}/{path}")
        if full == root:
            return "."
        if not full.startswith(root + "/"):
            raise WorkspaceArchiveReadError(path=Path(full),
                                            context={"reason": "outside the cell's workspace"})
        return full[len(root) + 1:]

    async def _prepare_backend_workspace(self) -> None:
        try:
            info = await asyncio.to_thread(self.cell.refresh)
        except WardenError as e:
            raise WorkspaceStartError(path=Path(self.state.manifest.root), cause=e) from e
        if info.state != "running":
            raise WorkspaceStartError(path=Path(self.state.manifest.root),
                                      context={"reason": f"cell `{info.name}` is {info.state}"})

    async def _exec_internal(self, *command: str | Path,
                             timeout: float | None = None) -> ExecResult:
        argv = [str(c) for c in command]
        try:
            ran = await asyncio.to_thread(self.cell.exec, argv, timeout=timeout,
                                          cwd=str(self.state.manifest.root))
        except Forbidden as e:
            # A refusal is the agent's to read, with the rule that made it.
            return ExecResult(stdout=b"", stderr=f"refused by the cell's policy: {e.message}\n"
                              .encode(), exit_code=REFUSED)
        except WardenError as e:
            raise ExecTransportError(command=argv, cause=e) from e
        exit = ran.exit
        if exit.reason == "timeout":
            raise ExecTimeoutError(command=argv, timeout_s=timeout)
        if exit.reason == "exited":
            code = exit.code or 0
        elif exit.reason == "signaled":
            code = 128 + (exit.signal or 0)
        else:
            code = exit.code if exit.code is not None else 1
        return ExecResult(stdout=ran.stdout.encode(), stderr=ran.stderr.encode(), exit_code=code)

    async def read(self, path: Path, *, user=None) -> io.IOBase:
        rel = self._relative(path)
        try:
            return io.BytesIO(await asyncio.to_thread(self.cell.files.read, rel))
        except NotFound as e:
            raise WorkspaceReadNotFoundError(path=path, cause=e) from e
        except WardenError as e:
            raise WorkspaceArchiveReadError(path=path, cause=e) from e

    async def write(self, path: Path, data: io.IOBase, *, user=None) -> None:
        payload = coerce_write_payload(path=path, data=data)
        rel = self._relative(path)
        content = payload.stream.read()
        try:
            parent = posixpath.dirname(rel)
            if parent and not await asyncio.to_thread(self.cell.files.exists, parent):
                await asyncio.to_thread(self.cell.files.mkdir, parent, True)
            await asyncio.to_thread(self.cell.files.write, rel, content)
        except WardenError as e:
            raise WorkspaceArchiveWriteError(path=path, cause=e) from e

    async def running(self) -> bool:
        try:
            return (await asyncio.to_thread(self.cell.refresh)).state == "running"
        except WardenError:
            return False

    async def persist_workspace(self) -> io.IOBase:
        try:
            return io.BytesIO(await asyncio.to_thread(self.cell.files.archive, "."))
        except WardenError as e:
            raise WorkspaceArchiveReadError(path=Path(self.state.manifest.root), cause=e) from e

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        try:
            await asyncio.to_thread(self.cell.files.extract, data.read(), ".")
        except WardenError as e:
            raise WorkspaceArchiveWriteError(path=Path(self.state.manifest.root), cause=e) from e


class WardenSandboxClient(BaseSandboxClient[WardenSandboxClientOptions]):
    """Sessions on cells of a Warden daemon (`warden`: a `Warden` connection; default, the
    daemon's unix socket)."""

    backend_id = "warden"

    def __init__(self, warden: Optional[Warden] = None) -> None:
        self.warden = warden or Warden()

    async def create(self, *, snapshot=None, manifest: Optional[Manifest] = None,
                     options: Optional[WardenSandboxClientOptions] = None):
        options = options or WardenSandboxClientOptions()
        manifest = manifest if manifest is not None else Manifest()
        self._validate_manifest_for_create(manifest)
        cell = await asyncio.to_thread(
            self.warden.cells.create, options.name, preset=options.preset,
            policy=options.policy, workspace=options.workspace,
            labels={"made-by": "openai-agents"})
        state = WardenSandboxSessionState(
            manifest=manifest, snapshot=resolve_snapshot(snapshot, cell.name), cell=cell.name)
        return self._wrap_session(WardenSandboxSession(state=state, warden=self.warden))

    async def delete(self, session):
        """Ends the session's cell; its workspace changes stay for review and apply."""
        inner = session._inner
        if isinstance(inner, WardenSandboxSession):
            try:
                await asyncio.to_thread(inner.cell.kill)
            except WardenError:
                pass
        return session

    async def resume(self, state: SandboxSessionState):
        if not isinstance(state, WardenSandboxSessionState):
            raise TypeError("WardenSandboxClient.resume expects a WardenSandboxSessionState")
        return self._wrap_session(WardenSandboxSession(state=state, warden=self.warden))

    def deserialize_session_state(self, payload: dict) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, WardenSandboxSessionState)
