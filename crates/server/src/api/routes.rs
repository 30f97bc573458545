//! Every route of the API as its OpenAPI document describes it: each one's summary,
//! parameters, body and answers written beside its path and method, and the failures it may
//! answer with taken from the core's error enums (the document's error answers are generated
//! from those: `openapi::paths`). A test holds the table to the router, and the committed
//! document to what the table generates.

use warden_harness::{
    ApprovalError, CellFailure, ControlError, CreateError, ExecError, Failure, FilesError,
    HistoryError, WorkspaceError,
};

/// One route: its path and method, its operation without the error answers (JSON), and the
/// failures of the operations it carries out.
#[derive(Debug)]
pub struct Route {
    pub path: &'static str,
    pub method: &'static str,
    pub operation: &'static str,
    pub failures: &'static [&'static [Failure]],
}

/// What an agent session's routes meet besides the operations its tools carry out.
const AGENT_FAILURES: &[Failure] = warden_agent::AgentError::FAILURES;

pub const ROUTES: &[Route] = &[
    Route {
        path: "/openapi.json",
        method: "get",
        operation: r#"{"operationId":"openapi","responses":{"200":{"content":{"application/json":{}},"description":"OpenAPI 3.1 document"}},"summary":"This document"}"#,
        failures: &[],
    },
    Route {
        path: "/v1/agents",
        method: "get",
        operation: r##"{"operationId":"listAgents","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/AgentInfo"},"type":"array"}}},"description":"The sessions"}},"summary":"The agent sessions of this daemon"}"##,
        failures: &[],
    },
    Route {
        path: "/v1/agents",
        method: "post",
        operation: r##"{"operationId":"startAgent","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/StartAgent"}}},"required":true},"responses":{"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session, started"}},"summary":"Start an agent session: the warden runs the model's loop, its tools in a cell"}"##,
        failures: &[
            AGENT_FAILURES,
            CreateError::FAILURES,
            ExecError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}",
        method: "get",
        operation: r##"{"operationId":"getAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"A session: state, turns and their snapshots, usage","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[AGENT_FAILURES],
    },
    Route {
        path: "/v1/agents/{id}/fork",
        method: "post",
        operation: r##"{"operationId":"forkAgent","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ForkAgent"}}},"required":true},"responses":{"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The new session"}},"summary":"A new session in a new cell from the end of a turn (the original is kept)","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            CreateError::FAILURES,
            ExecError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/pause",
        method: "post",
        operation: r##"{"operationId":"pauseAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"Hold the loop before its next model or tool call and freeze the cell","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            ControlError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/rerun",
        method: "post",
        operation: r##"{"operationId":"rerunAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Rerun"}}},"description":"Each call, then and now"}},"summary":"Carry out the session's recorded tool calls again in a new cell from its first snapshot; where the results diverge","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            CreateError::FAILURES,
            ExecError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/resume",
        method: "post",
        operation: r##"{"operationId":"resumeAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"Let the loop run on (a failed or stopped session tries again)","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            ControlError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/rewind",
        method: "post",
        operation: r##"{"operationId":"rewindAgent","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Rewind"}}},"required":true},"responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"Reset the workspace and the conversation to the end of a turn; the session is left paused","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            CreateError::FAILURES,
            ExecError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/say",
        method: "post",
        operation: r##"{"operationId":"sayAgent","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Say"}}},"required":true},"responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"An operator's instruction, delivered at the next turn marked as the operator's","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            CreateError::FAILURES,
            ExecError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/step",
        method: "post",
        operation: r##"{"operationId":"stepAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"Run one model turn and its tool calls, then pause","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            ControlError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/stop",
        method: "post",
        operation: r##"{"operationId":"stopAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"End the session; a model call or command under way is cut","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            AGENT_FAILURES,
            ControlError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/agents/{id}/transcript",
        method: "get",
        operation: r##"{"operationId":"agentTranscript","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Transcript"}}},"description":"The conversation"}},"summary":"The conversation as the model will next see it","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[AGENT_FAILURES],
    },
    Route {
        path: "/v1/agents/{id}/wait",
        method: "get",
        operation: r##"{"operationId":"waitAgent","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/AgentInfo"}}},"description":"The session"}},"summary":"Answers once the session is paused or has ended","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[AGENT_FAILURES],
    },
    Route {
        path: "/v1/approvals",
        method: "get",
        operation: r##"{"operationId":"listApprovals","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/Approval"},"type":"array"}}},"description":"Pending approvals, oldest first"}},"summary":"Questions of `ask` rules waiting for a person, over every cell"}"##,
        failures: &[],
    },
    Route {
        path: "/v1/approvals/{name}/{id}",
        method: "post",
        operation: r##"{"operationId":"answerApproval","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Answer"}}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Answer a question; journaled with who answered. Scope `cell` approves the same request from this cell from now on, `always` from every cell (kept across restarts).","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"in":"path","name":"id","required":true,"schema":{"type":"integer"}}]}"##,
        failures: &[ApprovalError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells",
        method: "get",
        operation: r##"{"operationId":"listCells","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/CellInfo"},"type":"array"}}},"description":"Cells"}},"summary":"List the daemon's cells"}"##,
        failures: &[CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells",
        method: "post",
        operation: r##"{"operationId":"createCell","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CreateCell"}}},"required":true},"responses":{"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"Create a cell and wait until it takes execs"}"##,
        failures: &[
            CreateError::FAILURES,
            WorkspaceError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/cells/{name}",
        method: "delete",
        operation: r#"{"operationId":"deleteCell","responses":{"204":{"description":"Removed"}},"summary":"Kill the cell if it runs and remove it with its workspace layer and egress record","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"#,
        failures: &[ControlError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}",
        method: "get",
        operation: r##"{"operationId":"getCell","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"One cell","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/apply",
        method: "post",
        operation: r##"{"operationId":"apply","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ApplyRequest"}}},"required":true},"responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ApplyReport"}}},"description":"The report: applied paths, skipped paths with reasons"}},"summary":"Write chosen changes into the host directory (all when `paths` is empty); with the policy's `approvals.apply: ask` it waits for a person's answer","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[
            WorkspaceError::FAILURES,
            ApprovalError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/cells/{name}/checkpoint",
        method: "post",
        operation: r##"{"operationId":"checkpoint","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CheckpointRequest"}}},"required":true},"responses":{"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Checkpoint"}}},"description":"The checkpoint"}},"summary":"Save the memory of a gVisor cell's processes, and its workspace, at one moment (`CELL@NAME`); the cell ends there and `POST /v1/cells` with `restore` brings it back","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/diff",
        method: "get",
        operation: r##"{"operationId":"diff","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Diff"}}},"description":"The diff"}},"summary":"What the cell changed in its copy-on-write workspace (the `warden diff --json` document: changes with kind, mode, size, hash, unified patch of text files)","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/exec",
        method: "post",
        operation: r##"{"operationId":"exec","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ExecSpec"}}},"required":true},"responses":{"200":{"content":{"text/event-stream":{"schema":{"type":"string"}}},"description":"Server-sent events: `started` {process, pid}; `stdout`/`stderr` {text} or {base64}, in order, never splitting a UTF-8 character; `dropped` {bytes}; last `exit` (an ExitInfo). A dead process or cell always ends the stream with `exit`."},"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ProcessInfo"}}},"description":"A background process"}},"summary":"Start a process in the cell. Foreground: the answer streams its output and exit, and the process is killed if the client disconnects. Background: 201 with the process; read it at .../processes/{id}/output.","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[
            ExecError::FAILURES,
            ApprovalError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/cells/{name}/files/archive",
        method: "get",
        operation: r#"{"operationId":"downloadArchive","responses":{"200":{"content":{"application/x-tar":{}},"description":"tar"}},"summary":"Download a directory as a tar archive (up to 64 MiB)","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/archive",
        method: "put",
        operation: r#"{"operationId":"uploadArchive","requestBody":{"content":{"application/x-tar":{}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Unpack a tar archive into a directory (made if missing); members with `..` are refused, owners not kept","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/content",
        method: "get",
        operation: r#"{"operationId":"readFile","responses":{"200":{"content":{"application/octet-stream":{}},"description":"The bytes"}},"summary":"Read a file (up to 64 MiB), inside the cell as its user","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/content",
        method: "put",
        operation: r#"{"operationId":"writeFile","requestBody":{"content":{"application/octet-stream":{}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Write a file with the request body (up to 64 MiB)","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/list",
        method: "get",
        operation: r##"{"operationId":"listFiles","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/FileInfo"},"type":"array"}}},"description":"Entries, by name"}},"summary":"List a directory","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"##,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/mkdir",
        method: "post",
        operation: r#"{"operationId":"mkdir","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"path":{"type":"string"},"recursive":{"type":"boolean"}},"required":["path"],"type":"object"}}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Make a directory and its parents","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/move",
        method: "post",
        operation: r#"{"operationId":"moveFile","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"from":{"type":"string"},"to":{"type":"string"}},"required":["from","to"],"type":"object"}}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Move or rename","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/remove",
        method: "post",
        operation: r#"{"operationId":"removeFile","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"path":{"type":"string"},"recursive":{"type":"boolean"}},"required":["path"],"type":"object"}}},"required":true},"responses":{"204":{"description":"Done"}},"summary":"Remove a file, an empty directory, or (recursive) a tree","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"#,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/files/stat",
        method: "get",
        operation: r##"{"operationId":"statFile","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/FileInfo"}}},"description":"The entry"}},"summary":"One entry","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"description":"Relative to the cell's files root: its workspace mount (its project, or the scratch directory commands start in). No `..`, not absolute; a write makes missing directories on the way.","in":"query","name":"path","required":false,"schema":{"type":"string"}}]}"##,
        failures: &[FilesError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/kill",
        method: "post",
        operation: r##"{"operationId":"killCell","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"End every process of the cell","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[ControlError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/pause",
        method: "post",
        operation: r##"{"operationId":"pauseCell","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"Freeze every process of the cell (cgroup freezer)","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[ControlError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/policy",
        method: "get",
        operation: r#"{"operationId":"getPolicy","responses":{"200":{"content":{"application/json":{}},"description":"The policy"}},"summary":"The policy of record: `{\"preset\": NAME}` or `{\"policy\": YAML}` as the cell was made, with `replaced`: the latest document whose `network` and `commands` replaced those of the running cell, if any","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"#,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/policy",
        method: "put",
        operation: r#"{"operationId":"replacePolicy","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"policy":{"type":"string"}},"required":["policy"],"type":"object"}}},"required":true},"responses":{"200":{"content":{"application/json":{"schema":{"properties":{"closed_connections":{"type":"integer"}},"type":"object"}}},"description":"How many connections were closed"}},"summary":"Replace the running cell's `network` and `commands` with those of a whole policy document (a section it leaves out means its default); open connections the new network rules forbid are closed, and the next exec is decided by the new command rules. Other sections are fixed when a cell is made: a document may leave them out or repeat them unchanged; one that changes them is refused (409, naming them) with nothing changed","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"#,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes",
        method: "get",
        operation: r##"{"operationId":"listProcesses","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/ProcessInfo"},"type":"array"}}},"description":"Processes"}},"summary":"Processes exec'd by this daemon","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}",
        method: "get",
        operation: r##"{"operationId":"getProcess","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ProcessInfo"}}},"description":"The process"}},"summary":"One process","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}},{"in":"path","name":"id","required":true,"schema":{"minimum":1,"type":"integer"}}]}"##,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/attach",
        method: "get",
        operation: r#"{"operationId":"attachProcess","responses":{"101":{"description":"Switching to the WebSocket protocol"}},"summary":"Attach to a process over a WebSocket, both ways. The server sends text messages {\"event\": \"stdout\"|\"stderr\", \"text\"|\"base64\": ...}, {\"event\": \"dropped\", \"bytes\": N}, {\"event\": \"error\", \"error\": ...} for a refused input, and a last {\"event\": \"exit\", ...ExitInfo}; output comes from the start, then live. The client sends {\"stdin\": TEXT} or {\"stdin_base64\": B64} (with \"close\": true to end input), {\"resize\": {\"rows\": R, \"cols\": C}} and {\"signal\": N}, each journaled. Closing the socket leaves the process running.","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"in":"path","name":"id","required":true,"schema":{"type":"integer"}}]}"#,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/output",
        method: "get",
        operation: r#"{"operationId":"processOutput","responses":{"200":{"content":{"text/event-stream":{"schema":{"type":"string"}}},"description":"Server-sent events: `started` {process, pid}; `stdout`/`stderr` {text} or {base64}, in order, never splitting a UTF-8 character; `dropped` {bytes}; last `exit` (an ExitInfo). A dead process or cell always ends the stream with `exit`."}},"summary":"Reconnect: the process's output from the start (or `from`), then live, then its exit. Disconnecting does not kill it.","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}},{"in":"path","name":"id","required":true,"schema":{"minimum":1,"type":"integer"}},{"description":"Chunk index to start from","in":"query","name":"from","required":false,"schema":{"minimum":0,"type":"integer"}},{"description":"false: end with a `live` event {running, next} once caught up with a running process","in":"query","name":"follow","required":false,"schema":{"default":true,"type":"boolean"}}]}"#,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/resize",
        method: "post",
        operation: r##"{"operationId":"resizeTerminal","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/TtySize"}}},"required":true},"responses":{"204":{"description":"Resized"}},"summary":"Resize the process's terminal (done from outside the cell, on the terminal's master)","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}},{"in":"path","name":"id","required":true,"schema":{"type":"integer"}}]}"##,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/signal",
        method: "post",
        operation: r##"{"operationId":"signalProcess","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/SignalBody"}}},"required":true},"responses":{"204":{"description":"Sent"}},"summary":"Send a signal to the process's group","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}},{"in":"path","name":"id","required":true,"schema":{"minimum":1,"type":"integer"}}]}"##,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/stdin",
        method: "post",
        operation: r#"{"operationId":"writeStdin","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"close":{"type":"boolean"},"data":{"type":"string"},"data_base64":{"type":"string"}},"type":"object"}}},"required":true},"responses":{"204":{"description":"Written"}},"summary":"Write to the process's stdin","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}},{"in":"path","name":"id","required":true,"schema":{"minimum":1,"type":"integer"}}]}"#,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/processes/{id}/wait",
        method: "get",
        operation: r##"{"operationId":"waitProcess","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/ExitInfo"}}},"description":"How it ended"}},"summary":"Wait for the process to end","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}},{"in":"path","name":"id","required":true,"schema":{"minimum":1,"type":"integer"}}]}"##,
        failures: &[ExecError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/reset",
        method: "post",
        operation: r##"{"operationId":"reset","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"to":{"type":"string"}},"type":"object"}}},"required":true},"responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"Return the workspace to a snapshot (`to`: SNAP or CELL@SNAP) or to its start (`{}`), also while the cell runs","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/resume",
        method: "post",
        operation: r##"{"operationId":"resumeCell","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/CellInfo"}}},"description":"The cell"}},"summary":"Thaw a paused cell","parameters":[{"in":"path","name":"name","required":true,"schema":{"pattern":"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$","type":"string"}}]}"##,
        failures: &[ControlError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/snapshot",
        method: "post",
        operation: r##"{"operationId":"snapshot","requestBody":{"content":{"application/json":{"schema":{"additionalProperties":false,"properties":{"as":{"description":"Snapshot name (default s1, s2, ...)","type":"string"}},"type":"object"}}},"required":true},"responses":{"201":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/Snapshot"}}},"description":"The snapshot"}},"summary":"Save the cell's workspace as an immutable snapshot (the cell is frozen while it is copied)","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/cells/{name}/snapshots",
        method: "get",
        operation: r##"{"operationId":"listSnapshots","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/Snapshot"},"type":"array"}}},"description":"Snapshots"}},"summary":"The cell's snapshots","parameters":[{"in":"path","name":"name","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES, CellFailure::FAILURES],
    },
    Route {
        path: "/v1/snapshots/{id}",
        method: "delete",
        operation: r##"{"operationId":"removeSnapshot","responses":{"204":{"description":"Removed"}},"summary":"Remove a snapshot (CELL@SNAPSHOT) of a running or removed cell, and a checkpoint's memory image of that name: the name goes at once, its layer once nothing stacks it; refused while a cell forked from it runs","parameters":[{"in":"path","name":"id","required":true,"schema":{"type":"string"}}]}"##,
        failures: &[WorkspaceError::FAILURES],
    },
    Route {
        path: "/v1/events",
        method: "get",
        operation: r#"{"operationId":"events","parameters":[{"description":"Only this cell's entries","in":"query","name":"cell","required":false,"schema":{"type":"string"}},{"description":"Start after this entry's seq: the ones written since come first (`Last-Event-ID` does the same)","in":"query","name":"after","required":false,"schema":{"minimum":0,"type":"integer"}},{"description":"Also `usage` events: each round of the live cells' use (an array of `{cell, usage}` with `usage` a `CellUsage`), every 2 s","in":"query","name":"usage","required":false,"schema":{"type":"boolean"}}],"responses":{"200":{"content":{"text/event-stream":{}},"description":"Event stream"}},"summary":"Journal entries as they are written: server-sent `entry` events `{seq, cell, kind, data}` with the seq as event id (`lagged` when a slow reader missed some)"}"#,
        failures: &[HistoryError::FAILURES],
    },
    Route {
        path: "/v1/health",
        method: "get",
        operation: r#"{"operationId":"health","responses":{"200":{"content":{"application/json":{"schema":{"properties":{"journal_key":{"type":"string"},"status":{"type":"string"},"version":{"type":"string"}},"type":"object"}}},"description":"OK"}},"summary":"Liveness, version and the journal's public key"}"#,
        failures: &[],
    },
    Route {
        path: "/v1/journal",
        method: "get",
        operation: r##"{"operationId":"readJournal","parameters":[{"description":"Only entries with a smaller sequence number (page back with `next_before`)","in":"query","name":"before","required":false,"schema":{"type":"integer"}},{"description":"At most this many (default 200, at most 1000)","in":"query","name":"limit","required":false,"schema":{"type":"integer"}},{"description":"Only this cell's entries","in":"query","name":"cell","required":false,"schema":{"type":"string"}},{"description":"Only kinds that start with this (`net.`, `exec.exit`)","in":"query","name":"kind","required":false,"schema":{"type":"string"}},{"description":"Only entries at or after this time (ms since the epoch)","in":"query","name":"since_ms","required":false,"schema":{"type":"integer"}},{"description":"Only entries before this time","in":"query","name":"until_ms","required":false,"schema":{"type":"integer"}}],"responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/JournalPage"}}},"description":"Entries, newest first"}},"summary":"A page of whole journal entries (hash and link included), newest first"}"##,
        failures: &[HistoryError::FAILURES],
    },
    Route {
        path: "/v1/journal/verify",
        method: "get",
        operation: r##"{"operationId":"verifyJournal","responses":{"200":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/JournalCheck"}}},"description":"What the check found; `ok` false with `error` when the chain does not hold"}},"summary":"Checks the whole chain and every signed checkpoint against the daemon's key (as `warden audit verify`)"}"##,
        failures: &[HistoryError::FAILURES],
    },
    Route {
        path: "/v1/mcp",
        method: "get",
        operation: r#"{"operationId":"mcpSession","parameters":[{"in":"header","name":"Upgrade","required":true,"schema":{"const":"warden-mcp","type":"string"}}],"responses":{"101":{"description":"Switched: the connection now carries the MCP session until either side closes it"}},"summary":"Turn this connection into one MCP session over its bare bytes (newline-delimited JSON-RPC, as over stdio): what `warden mcp` does on the unix socket when a daemon runs, so that a stdio MCP client talks to this daemon's core. Send `Connection: upgrade` and `Upgrade: warden-mcp`. MCP over HTTP (streamable HTTP, protocol 2026-07-28 stateless and 2025-11-25 with sessions) is served at `/mcp`, behind the same token."}"#,
        failures: &[],
    },
    Route {
        path: "/v1/pools",
        method: "get",
        operation: r##"{"operationId":"listPools","responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/PoolInfo"},"type":"array"}}},"description":"One entry per pool"}},"summary":"The cells made ahead per policy (`warden serve --pool`): size, how many are ready, their memory, how many were handed out"}"##,
        failures: &[],
    },
    Route {
        path: "/v1/run",
        method: "post",
        operation: r##"{"operationId":"run","requestBody":{"content":{"application/json":{"schema":{"$ref":"#/components/schemas/RunOnce"}}},"required":true},"responses":{"200":{"content":{"text/event-stream":{"schema":{"type":"string"}}},"description":"Server-sent events as for a foreground exec: `started` {process, pid, cell}; `stdout`/`stderr`; `dropped`; last `exit` (an ExitInfo), sent once the cell is deleted; an `error` {message} before it where the cell could not be deleted."}},"summary":"Run one command in a cell made for it (a create and a foreground exec in one call; an unnamed cell of a pool's policy is taken from the pool) and delete the cell when the command ends. The command is killed if the client disconnects, and the cell deleted all the same. A command that cannot start deletes the cell before the error is answered."}"##,
        failures: &[
            CreateError::FAILURES,
            WorkspaceError::FAILURES,
            ExecError::FAILURES,
            ApprovalError::FAILURES,
            CellFailure::FAILURES,
        ],
    },
    Route {
        path: "/v1/usage",
        method: "get",
        operation: r##"{"operationId":"cellUsage","parameters":[{"description":"Only this cell","in":"query","name":"cell","required":false,"schema":{"type":"string"}}],"responses":{"200":{"content":{"application/json":{"schema":{"items":{"$ref":"#/components/schemas/UsageHistory"},"type":"array"}}},"description":"One history per live cell that accounts for its use"}},"summary":"Recent CPU time, memory and task counts of the live cells, from their cgroups (sampled every 2 s, last 120 samples)"}"##,
        failures: &[],
    },
];
