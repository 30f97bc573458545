"""The API's types, field for field as `docs/openapi.json` describes them (a test of the SDK
checks every field against the document's schemas)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, TypeVar

T = TypeVar("T")


def _from(cls: Type[T], data: Dict[str, Any]) -> T:
    """An instance of a dataclass from the API's JSON (fields it does not know are ignored, so
    that a newer daemon's additions do not break an older client)."""
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            continue
        convert = _NESTED.get((cls.__name__, key))
        kwargs[key] = convert(value) if convert and value is not None else value
    return cls(**kwargs)


@dataclass
class Usage:
    """CPU time and peak memory of a process, as the cell's init saw them when it reaped it."""

    cpu_user_ms: int
    cpu_system_ms: int
    max_rss_kib: int


@dataclass
class ExitInfo:
    """How a process ended. `reason`: exited, signaled, failed, timeout, killed, cell-ended,
    memory-limit, output-limit, disk-limit."""

    reason: str
    code: Optional[int] = None
    signal: Optional[int] = None
    message: Optional[str] = None
    duration_ms: int = 0
    usage: Optional[Usage] = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    journal_seq: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.reason == "exited" and self.code == 0


@dataclass
class CellInfo:
    name: str
    state: str  # running, paused, ended
    pid: Optional[int] = None
    created_ms: int = 0
    workspace: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)
    ended: Optional[str] = None
    processes: int = 0
    tier: str = "process"
    preset: Optional[str] = None


@dataclass
class ProcessInfo:
    id: int
    cell: str
    argv: List[str]
    pid: int
    started_ms: int
    background: bool
    running: bool
    exit: Optional[ExitInfo] = None


@dataclass
class FileInfo:
    name: str
    kind: str  # file, dir, symlink, other
    size: int
    mode: str  # octal
    modified_s: int
    target: Optional[str] = None


@dataclass
class Approval:
    cell: str
    id: int
    request: str
    rule: str
    asked_at: int
    timeout_s: int


@dataclass
class Snapshot:
    id: str  # CELL@SNAP
    # Bytes of file data; None while they are being counted (a snapshot that took the cell's
    # layer instead of a copy is counted just after it is taken; listing counts it at once).
    size: Optional[int] = None


@dataclass
class Checkpoint:
    """A cell's memory and workspace saved at one moment (the cell ended there); bring it back
    with `cells.restore(id)`."""

    id: str  # CELL@CKPT
    memory_bytes: int
    workspace_bytes: int


@dataclass
class PoolInfo:
    """Cells of one policy the daemon keeps made ahead (`warden serve --pool POLICY=N`)."""

    policy: str
    tier: str
    size: int
    ready: int
    memory_bytes: int
    taken: int
    error: Optional[str] = None


@dataclass
class Ran:
    """A command run to its end: its exit and everything it printed."""

    exit: ExitInfo
    stdout: str
    stderr: str
    dropped_bytes: int = 0


@dataclass
class TokenUsage:
    input: int
    output: int


@dataclass
class TurnInfo:
    """A finished turn: the workspace's snapshot at its end (none for a cell without a layer)
    and how many conversation items it ended with."""

    turn: int
    items: int
    snapshot: Optional[str] = None


@dataclass
class AgentInfo:
    """An agent session. `state`: running, paused, done, stopped, failed."""

    id: str
    cell: str
    state: str
    model: str
    base_url: str
    turn: int
    usage: TokenUsage
    started_ms: int
    turns: List[TurnInfo] = field(default_factory=list)
    ended: Optional[str] = None
    summary: Optional[str] = None
    forked_from: Optional[str] = None

    @property
    def over(self) -> bool:
        return self.state in ("done", "stopped", "failed")


@dataclass
class CellUsage:
    """What a cell used at one moment, from its cgroup: CPU time so far, memory charged now,
    tasks now (any of them None where the host does not account for it)."""

    time_ms: int
    cpu_usec: Optional[int] = None
    memory_bytes: Optional[int] = None
    pids: Optional[int] = None


@dataclass
class UsageHistory:
    """A live cell's recent samples, oldest first (every 2 s, the last 120)."""

    cell: str
    samples: List[CellUsage] = field(default_factory=list)


@dataclass
class JournalEntry:
    """One journal entry as it is on disk: `hash` covers the rest, `prev` is the hash of the
    entry before it."""

    seq: int
    time_ms: int
    kind: str
    data: Any
    prev: str
    hash: str
    cell: Optional[str] = None


@dataclass
class JournalPage:
    """Entries newest first; pass `next_before` as `before` for the next, older page."""

    entries: List[JournalEntry]
    head_seq: int
    next_before: Optional[int] = None


@dataclass
class JournalCheck:
    """What a check of the whole chain and its signed checkpoints found."""

    ok: bool
    first_seq: int
    last_seq: int
    entries: int
    checkpoints: int
    unsigned_tail: int
    head: str
    key: str
    error: Optional[str] = None


_NESTED = {
    ("UsageHistory", "samples"): lambda v: [_from(CellUsage, s) for s in v],
    ("JournalPage", "entries"): lambda v: [_from(JournalEntry, e) for e in v],
    ("AgentInfo", "usage"): lambda v: _from(TokenUsage, v),
    ("AgentInfo", "turns"): lambda v: [_from(TurnInfo, t) for t in v],
    ("ExitInfo", "usage"): lambda v: _from(Usage, v),
    ("ProcessInfo", "exit"): lambda v: _from(ExitInfo, v),
}

#: The SDK's types and the OpenAPI schema each mirrors.
SCHEMAS = {
    Usage: "Usage",
    ExitInfo: "ExitInfo",
    CellInfo: "CellInfo",
    ProcessInfo: "ProcessInfo",
    FileInfo: "FileInfo",
    Approval: "Approval",
    Snapshot: "Snapshot",
    Checkpoint: "Checkpoint",
    PoolInfo: "PoolInfo",
    TokenUsage: "TokenUsage",
    TurnInfo: "TurnInfo",
    AgentInfo: "AgentInfo",
    CellUsage: "CellUsage",
    UsageHistory: "UsageHistory",
    JournalEntry: "JournalEntry",
    JournalPage: "JournalPage",
    JournalCheck: "JournalCheck",
}
