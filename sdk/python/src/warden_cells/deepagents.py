"""A deepagents backend on a Warden cell: the agent's `execute` and file tools run in the cell,
under its policy (command rules, approvals, network) and journal, and what it writes to a
workspace stays in the cell's copy-on-write layer until you review it (`cell.diff()`) and
take it (`cell.apply(digest=...)`). What an E2B backend cannot give: review before anything
reaches the host, approvals, snapshots to go back to.

    from deepagents import create_deep_agent
    from warden_cells import Warden
    from warden_cells.deepagents import WardenSandbox

    cell = Warden().cells.create(workspace="/path/to/project", preset="python")
    agent = create_deep_agent(model=..., backend=WardenSandbox(cell))

Needs `deepagents` (not a dependency of this package).
"""

from __future__ import annotations

import posixpath
from typing import List, Optional, Tuple

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox

from ._client import Cell
from ._errors import BadRequest, Forbidden, NotFound, WardenError

#: The exit code a command refused by the cell's policy reports to the agent.
REFUSED = 126
#: The exit code of a command killed at its timeout (as `timeout(1)` has it).
TIMED_OUT = 124


class WardenSandbox(BaseSandbox):
    """deepagents' sandbox protocol on a running Warden cell. `workdir`: where the cell's
    workspace is mounted (its policy's `filesystem.workspace.mount`)."""

    def __init__(self, cell: Cell, *, workdir: str = "/workspace", timeout: float = 30 * 60):
        self.cell = cell
        self.workdir = workdir.rstrip("/") or "/"
        self.timeout = timeout

    @property
    def id(self) -> str:
        return self.cell.name

    def execute(self, command: str, *, timeout: Optional[int] = None) -> ExecuteResponse:
        try:
            ran = self.cell.exec(command, timeout=timeout or self.timeout)
        except Forbidden as e:
            # A refusal is the agent's to read, with the rule that made it.
            return ExecuteResponse(output=f"refused by the cell's policy: {e.message}",
                                   exit_code=REFUSED)
        output = ran.stdout
        if ran.stderr:
            output = f"{output}\n{ran.stderr}" if output else ran.stderr
        exit = ran.exit
        if exit.reason == "exited":
            code = exit.code
        elif exit.reason == "signaled":
            code = 128 + (exit.signal or 0)
        elif exit.reason == "timeout":
            code = TIMED_OUT
        else:
            code = exit.code if exit.code is not None else 1
            output += f"\n[{exit.reason}: {exit.message or ''}]"
        return ExecuteResponse(output=output, exit_code=code, truncated=ran.dropped_bytes > 0)

    def _relative(self, path: str) -> Optional[str]:
        """The path inside the workspace, relative to it (None: outside it)."""
        path = posixpath.normpath(path if path.startswith("/") else f"{self.workdir}/{path}")
        if path == self.workdir:
            return "."
        prefix = self.workdir + "/"
        return path[len(prefix):] if path.startswith(prefix) else None

    def upload_files(self, files: List[Tuple[str, bytes]]) -> List[FileUploadResponse]:
        out = []
        for path, content in files:
            rel = self._relative(path)
            if rel is None:
                out.append(FileUploadResponse(path=path, error="invalid_path"))
                continue
            try:
                parent = posixpath.dirname(rel)
                if parent and not self.cell.files.exists(parent):
                    self.cell.files.mkdir(parent, recursive=True)
                self.cell.files.write(rel, content)
                out.append(FileUploadResponse(path=path))
            except WardenError as e:
                out.append(FileUploadResponse(path=path, error=_file_error(e)))
        return out

    def download_files(self, paths: List[str]) -> List[FileDownloadResponse]:
        out = []
        for path in paths:
            rel = self._relative(path)
            if rel is None:
                out.append(FileDownloadResponse(path=path, error="invalid_path"))
                continue
            try:
                out.append(FileDownloadResponse(path=path, content=self.cell.files.read(rel)))
            except WardenError as e:
                out.append(FileDownloadResponse(path=path, error=_file_error(e)))
        return out


def _file_error(e: WardenError) -> str:
    if isinstance(e, NotFound):
        return "file_not_found"
    if isinstance(e, Forbidden):
        return "permission_denied"
    if isinstance(e, BadRequest):
        return "is_directory" if "directory" in e.message else "invalid_path"
    return e.message
