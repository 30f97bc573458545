"""Python client of Warden's daemon API: cells for AI agents and the code they write, whose
every effect the warden decides, journals and can stop, from outside the cell.

    from warden_cells import Warden
    with Warden() as w:
        cell = w.cells.create(preset="python")
        print(cell.exec("python3 -c 'print(6 * 7)'").stdout)
        cell.kill()
"""

from ._client import (
    Agent,
    Agents,
    Approvals,
    AsyncAgent,
    AsyncAgents,
    AsyncCell,
    AsyncWarden,
    Cell,
    Cells,
    Files,
    PendingApproval,
    Process,
    Warden,
)
from ._errors import (
    BadRequest,
    Conflict,
    ConnectionFailed,
    Forbidden,
    NotFound,
    TooLarge,
    Unauthorized,
    Unavailable,
    WardenError,
)
from ._types import (
    SCHEMAS,
    AgentInfo,
    Approval,
    CellInfo,
    CellUsage,
    Checkpoint,
    ExitInfo,
    FileInfo,
    JournalCheck,
    JournalEntry,
    JournalPage,
    PoolInfo,
    ProcessInfo,
    Ran,
    Snapshot,
    Usage,
    UsageHistory,
)

__all__ = [
    "Agent", "AgentInfo", "Agents", "AsyncAgent", "AsyncAgents", "Approval", "Approvals", "AsyncCell", "AsyncWarden", "BadRequest", "Cell", "CellInfo",
    "Cells", "Conflict", "ConnectionFailed", "ExitInfo", "FileInfo", "Files", "Forbidden",
    "NotFound", "PendingApproval", "Process", "ProcessInfo", "Ran", "SCHEMAS", "Snapshot",
    "TooLarge", "Unauthorized", "Unavailable", "Usage", "Warden", "WardenError", "CellUsage", "UsageHistory",
    "JournalEntry", "JournalPage", "JournalCheck", "Checkpoint", "PoolInfo",
]
