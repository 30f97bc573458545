//! The MCP face: the warden's tools for a model's client (Claude Code, Cursor, Codex, any MCP
//! client), over stdio (`warden mcp`) and streamable HTTP (`/mcp` of `warden serve`).
//!
//! Every tool turns its arguments into the harness's typed request and calls the same harness
//! function the HTTP API calls: the cell's policy, the command rules, approvals and the journal
//! apply to each call alike. A call the warden refuses (a rule, a person, a missing cell) is a
//! tool error whose text says why and what to do, as a model can act on it; arguments that do
//! not fit a tool's schema are a protocol error.

mod args;

use std::sync::Arc;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, ProgressNotificationParam, ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde::Serialize;
use serde_json::{Value, json};
use warden_harness::{Caller, ErrorKind, ExecSpec, Harness, HarnessError};

use args::*;
use warden_harness::tools::{Ran, listing, run_to_end, search_argv, word};

/// The most of each output stream (stdout, stderr) an exec's result holds: its head and its
/// tail, with what was left out between them counted.
pub const OUTPUT_LIMIT: usize = 64 * 1024;
/// The most of a file `read_file` answers with.
pub const READ_LIMIT: usize = 256 * 1024;
/// How long a command may run when the call does not say.
pub const DEFAULT_TIMEOUT_S: u64 = 120;

const INSTRUCTIONS: &str = "Warden runs commands in cells: isolated sandboxes whose every \
effect (network, files going back to the host, credentials) is decided by the cell's policy \
and recorded in a journal outside the cell. Make a cell with `create_cell` (optionally on a \
host directory: its workspace, seen through a copy-on-write layer), run commands with `exec`, \
read and change files with `read_file`, `write_file`, `edit_file`, `list_files` and \
`search_files` (paths relative to the workspace), review changes with `diff`, and write them \
to the host with `apply`. `snapshot`, `reset` and `fork_cell` go back or branch. A refused call \
says which rule refused it and what to change; some calls wait for a person's approval.";

/// The tools, bound to one harness.
#[derive(Debug, Clone)]
pub struct Tools {
    harness: Arc<Harness>,
    /// Who calls, for calls that do not come over HTTP with a `Caller` of their own.
    by: String,
}

impl Tools {
    /// `by`: who the calls come from, as the journal should name them.
    pub fn new(harness: Arc<Harness>, by: impl Into<String>) -> Self {
        Self {
            harness,
            by: by.into(),
        }
    }

    fn by(&self, context: &RequestContext<RoleServer>) -> String {
        context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Caller>())
            .map_or_else(|| self.by.clone(), |Caller(c)| format!("{c} over MCP"))
    }
}

/// A harness error as a tool error: the warden's message, its code, and what to do.
fn failed(err: HarnessError) -> CallToolResult {
    let hint = match err.kind {
        ErrorKind::Forbidden => {
            "the cell's policy or a person refused this; the message names the rule. Do \
             something else, or ask the operator to change the cell's policy"
        }
        ErrorKind::NotFound => "`list_cells` lists the cells; `list_files` a directory",
        ErrorKind::Conflict => {
            "the cell is not in a state for this (ended, paused, or the name is taken)"
        }
        ErrorKind::BadRequest => "change the arguments as the message says",
        ErrorKind::Unauthorized => "the MCP client's token for the warden is missing or wrong",
        ErrorKind::TooLarge => "ask for less",
        ErrorKind::Unavailable => "the warden cannot do this now; try again later",
        ErrorKind::Internal => "the warden failed; the operator can look in its journal",
    };
    let body = warden_protocol::ErrorBody {
        error: err.message,
        code: err.kind,
        hint: Some(hint.to_owned()),
        reason: Some(err.reason.to_owned()),
    };
    let text = format!(
        "refused ({}): {}\nwhat to do: {hint}",
        word(body.code),
        body.error
    );
    let mut result = CallToolResult::structured_error(json!(body));
    result.content = vec![ContentBlock::text(text)];
    result
}

/// A structured answer, with `text` as what a model reads.
fn answer(value: &impl Serialize, text: String) -> CallToolResult {
    let mut result = CallToolResult::structured(serde_json::to_value(value).unwrap_or(Value::Null));
    result.content = vec![ContentBlock::text(text)];
    result
}

fn json_text(value: &impl Serialize) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// What `exec` runs: the shell line, or the argv. Each refusal says what was wrong with what
/// was given, so that the caller's next try is the right one.
fn command_of(
    command: Option<String>,
    argv: Option<Vec<String>>,
) -> Result<Vec<String>, &'static str> {
    match (command, argv) {
        (Some(line), None) => Ok(vec!["sh".to_owned(), "-c".to_owned(), line]),
        (None, Some(argv)) if !argv.is_empty() => Ok(argv),
        (None, Some(_)) => Err(
            "`argv` is empty: give the program and its arguments (`[\"ls\", \"-l\"]`), or a shell line as `command`",
        ),
        (None, None) => Err(
            "give what to run: `command` (a shell line, run with sh -c) or `argv` (the program and its arguments)",
        ),
        (Some(_), Some(_)) => {
            Err("give `command` (a shell line) or `argv` (the program and its arguments), not both")
        }
    }
}

/// A tool's arguments that cannot be a request (a protocol error: the client sent them wrong).
fn invalid(message: impl Into<String>) -> ErrorData {
    ErrorData::invalid_params(message.into(), None)
}

type ToolResult = Result<CallToolResult, ErrorData>;

#[tool_router]
impl Tools {
    #[tool(
        description = "Make a new cell (an isolated sandbox) and start it. With `workspace`, a host \
directory appears inside it through a copy-on-write layer: the cell may change anything there, \
and nothing reaches the host until `apply`. The policy (`preset` or a YAML `policy`) decides \
its network, files, command rules and limits. Answers the cell's name and state."
    )]
    async fn create_cell(&self, Parameters(args): Parameters<CreateArgs>) -> ToolResult {
        let request = warden_protocol::CreateCell {
            name: args.name,
            policy: args.policy,
            preset: args.preset,
            workspace: args.workspace,
            env: args.env,
            labels: [("made-by".to_owned(), "mcp".to_owned())].into(),
            from: args.from,
            secrets: Default::default(),
            restore: None,
        };
        Ok(self.made(request).await)
    }

    #[tool(description = "List the cells: name, state (running, paused, ended), workspace.")]
    async fn list_cells(&self, Parameters(NoArgs {}): Parameters<NoArgs>) -> ToolResult {
        Ok(match self.harness.list() {
            Ok(cells) => {
                let text = if cells.is_empty() {
                    "no cells".to_owned()
                } else {
                    cells
                        .iter()
                        .map(|c| format!("{} {}", c.name, c.state.name()))
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                answer(&json!({ "cells": cells }), text)
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "End a cell: every process in it is killed. Its workspace changes stay for \
`diff` and `apply` unless `delete` is given, which also forgets the cell."
    )]
    async fn kill_cell(
        &self,
        Parameters(args): Parameters<KillArgs>,
        context: RequestContext<RoleServer>,
    ) -> ToolResult {
        let by = self.by(&context);
        let done = if args.delete {
            self.harness.delete(&args.cell, &by).await.map(|()| {
                answer(
                    &json!({ "cell": args.cell, "deleted": true }),
                    format!("cell `{}` killed and deleted", args.cell),
                )
            })
        } else {
            self.harness
                .control(&args.cell, warden_protocol::ControlAction::Kill, &by)
                .await
                .map(|cell| answer(&cell, format!("cell `{}` killed", cell.name)))
        };
        Ok(done.unwrap_or_else(failed))
    }

    #[tool(
        description = "Run a command in a cell and wait for it to end. Give `command` (a shell \
line, run with sh -c) or `argv`. Output is streamed as progress notifications while it runs; \
the result has the exit code, why it ended, and stdout and stderr (their first and last \
32 KiB each when longer). The cell's command rules may refuse the command, or hold it until \
a person answers. Killed after `timeout_s` (default 120)."
    )]
    async fn exec(
        &self,
        Parameters(args): Parameters<ExecArgs>,
        context: RequestContext<RoleServer>,
    ) -> ToolResult {
        let argv = command_of(args.command, args.argv).map_err(invalid)?;
        let timeout_s = args.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        let spec = ExecSpec {
            argv,
            env: args.env,
            cwd: args.cwd,
            stdin: args.stdin,
            timeout_ms: Some(timeout_s.saturating_mul(1000)),
            ..Default::default()
        };
        let ran = run(
            &self.harness,
            &args.cell,
            spec,
            Some(&context),
            OUTPUT_LIMIT,
        )
        .await;
        Ok(match ran {
            Ok(ran) => {
                let text = ran.text();
                answer(&ran, text)
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Read a text file of a cell (path relative to its workspace). Up to 256 KiB \
are answered; a longer file says how much was left out."
    )]
    async fn read_file(&self, Parameters(args): Parameters<PathArgs>) -> ToolResult {
        Ok(match self.harness.read_file(&args.cell, &args.path).await {
            Ok(data) => {
                let size = data.len();
                let shown = &data[..size.min(READ_LIMIT)];
                let text = match std::str::from_utf8(shown) {
                    Ok(text) => text.to_owned(),
                    Err(e) if e.valid_up_to() + 4 > shown.len() && size > READ_LIMIT => {
                        // A character cut by the limit.
                        String::from_utf8_lossy(&shown[..e.valid_up_to()]).into_owned()
                    }
                    Err(_) => {
                        return Ok(failed(HarnessError::bad(format!(
                            "{} is not text ({size} bytes); read it with a command (`base64 {}`)",
                            args.path, args.path
                        ))));
                    }
                };
                let mut shown_text = text.clone();
                if size > READ_LIMIT {
                    shown_text.push_str(&format!("\n[{} more bytes not shown]", size - text.len()));
                }
                answer(
                    &json!({ "path": args.path, "size": size, "content": text }),
                    shown_text,
                )
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Write a whole file of a cell (path relative to its workspace), replacing it \
if it exists. The write goes to the cell's copy-on-write layer, not to the host."
    )]
    async fn write_file(&self, Parameters(args): Parameters<WriteArgs>) -> ToolResult {
        let size = args.content.len();
        Ok(
            match self
                .harness
                .write_file(&args.cell, &args.path, args.content.into_bytes())
                .await
            {
                Ok(()) => answer(
                    &json!({ "path": args.path, "size": size }),
                    format!("wrote {} ({size} bytes)", args.path),
                ),
                Err(err) => failed(err),
            },
        )
    }

    #[tool(
        description = "Change a text file of a cell by replacing `old_text` with `new_text`. \
`old_text` must occur exactly once (copy it exactly, whitespace included), unless `replace_all`."
    )]
    async fn edit_file(&self, Parameters(args): Parameters<EditArgs>) -> ToolResult {
        if args.old_text.is_empty() {
            return Err(invalid("`old_text` may not be empty"));
        }
        Ok(
            match self
                .harness
                .edit_file(
                    &args.cell,
                    &args.path,
                    &args.old_text,
                    &args.new_text,
                    args.replace_all,
                )
                .await
            {
                Ok(found) => answer(
                    &json!({ "path": args.path, "replaced": found }),
                    format!("replaced {found} occurrence(s) in {}", args.path),
                ),
                Err(err) => failed(err),
            },
        )
    }

    #[tool(
        description = "List a directory of a cell (path relative to its workspace; default the \
workspace itself): name, kind, size and mode of each entry."
    )]
    async fn list_files(&self, Parameters(args): Parameters<ListArgs>) -> ToolResult {
        Ok(
            match self.harness.list_files(&args.cell, &args.path).await {
                Ok(entries) => {
                    let text = listing(&entries);
                    answer(&json!({ "path": args.path, "entries": entries }), text)
                }
                Err(err) => failed(err),
            },
        )
    }

    #[tool(
        description = "Search the text files of a cell for a regular expression (grep -E), below \
`path` (default: the whole workspace). Answers `file:line:text` for each match, up to 64 KiB. \
It runs as a command in the cell, so the cell's command rules apply to it."
    )]
    async fn search_files(
        &self,
        Parameters(args): Parameters<SearchArgs>,
        context: RequestContext<RoleServer>,
    ) -> ToolResult {
        let spec = ExecSpec {
            argv: search_argv(&args.pattern, &args.path, args.ignore_case),
            timeout_ms: Some(60_000),
            ..Default::default()
        };
        let ran = run(
            &self.harness,
            &args.cell,
            spec,
            Some(&context),
            OUTPUT_LIMIT,
        )
        .await;
        Ok(match ran {
            Ok(ran) => match ran.exit.code {
                Some(0) => answer(&json!({ "matches": ran.stdout }), ran.stdout.clone()),
                Some(1) => answer(&json!({ "matches": "" }), "no matches".to_owned()),
                _ => failed(HarnessError::bad(format!(
                    "the search failed: {}",
                    if ran.stderr.is_empty() {
                        ran.text()
                    } else {
                        ran.stderr
                    }
                ))),
            },
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Show what a cell changed in its workspace, against the host directory: \
each path added, changed or removed, with a text diff, which changes are sensitive (hooks, \
rc files, executables), and a `digest` to give to `apply`."
    )]
    async fn diff(&self, Parameters(args): Parameters<CellArg>) -> ToolResult {
        Ok(match self.harness.diff(&args.cell).await {
            Ok(diff) => {
                let text = json_text(&diff);
                answer(&diff, text)
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Write a cell's workspace changes to the host directory (all of them, or \
`paths`). With the `digest` a `diff` gave, exactly the reviewed changes or nothing. The policy \
may hold an apply until a person approves it; sensitive changes are left out and reported."
    )]
    async fn apply(
        &self,
        Parameters(args): Parameters<ApplyArgs>,
        context: RequestContext<RoleServer>,
    ) -> ToolResult {
        let request = warden_protocol::ApplyRequest {
            paths: args.paths,
            digest: args.digest,
            ..Default::default()
        };
        let by = self.by(&context);
        Ok(match self.harness.apply(&args.cell, &request, &by).await {
            Ok(report) => {
                let text = json_text(&report);
                answer(&report, text)
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Snapshot a cell's workspace as it is now (the cell keeps running). `reset` \
goes back to it; `fork_cell` starts a new cell from it."
    )]
    async fn snapshot(&self, Parameters(args): Parameters<SnapshotArgs>) -> ToolResult {
        Ok(
            match self
                .harness
                .snapshot(&args.cell, args.name.as_deref())
                .await
            {
                Ok(snap) => {
                    let text = match snap.size {
                        Some(size) => format!("snapshot {} ({size} bytes)", snap.id),
                        None => format!("snapshot {} (its size is being counted)", snap.id),
                    };
                    answer(&snap, text)
                }
                Err(err) => failed(err),
            },
        )
    }

    #[tool(
        description = "List a cell's snapshots (`CELL@NAME`), oldest first, with the bytes of \
file data each holds."
    )]
    async fn list_snapshots(&self, Parameters(args): Parameters<CellArg>) -> ToolResult {
        Ok(match self.harness.snapshots(&args.cell) {
            Ok(snapshots) => {
                let text = if snapshots.is_empty() {
                    format!("cell `{}` has no snapshots", args.cell)
                } else {
                    snapshots
                        .iter()
                        .map(|s| match s.size {
                            Some(size) => format!("{} ({size} bytes)", s.id),
                            None => format!("{} (size being counted)", s.id),
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                };
                answer(&json!({ "snapshots": snapshots }), text)
            }
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Remove a snapshot (`CELL@NAME`) and the disk it takes. Refused while a \
cell was forked from it and still keeps its files."
    )]
    async fn remove_snapshot(&self, Parameters(args): Parameters<SnapshotId>) -> ToolResult {
        Ok(match self.harness.remove_snapshot(&args.snapshot).await {
            Ok(()) => answer(
                &json!({ "removed": args.snapshot }),
                format!("removed {}", args.snapshot),
            ),
            Err(err) => failed(err),
        })
    }

    #[tool(
        description = "Put a cell's workspace back as it was at a snapshot (default: as it was at \
the cell's start). Its processes keep running; files they hold open may be stale."
    )]
    async fn reset(&self, Parameters(args): Parameters<ResetArgs>) -> ToolResult {
        Ok(
            match self
                .harness
                .reset(&args.cell, args.snapshot.as_deref())
                .await
            {
                Ok(()) => answer(
                    &json!({ "cell": args.cell, "snapshot": args.snapshot }),
                    format!(
                        "cell `{}` reset to {}",
                        args.cell,
                        args.snapshot.as_deref().unwrap_or("its start")
                    ),
                ),
                Err(err) => failed(err),
            },
        )
    }

    #[tool(
        description = "Start a new cell from another's files: from a running cell (`CELL`, \
snapshotted now) or from a snapshot (`CELL@SNAPSHOT`). The new cell has the same policy and \
workspace; both go on separately."
    )]
    async fn fork_cell(&self, Parameters(args): Parameters<ForkArgs>) -> ToolResult {
        let source = args.from.split('@').next().unwrap_or_default().to_owned();
        // The fork runs under its source's policy.
        let policy = match self.harness.policy(&source) {
            Ok((policy, _)) => policy,
            Err(err) => return Ok(failed(err)),
        };
        let (policy, preset) = match policy {
            warden_harness::PolicySource::Yaml(yaml) => (Some(yaml), None),
            warden_harness::PolicySource::Preset(preset) => (None, Some(preset)),
        };
        let request = warden_protocol::CreateCell {
            name: args.name,
            policy,
            preset,
            from: Some(args.from),
            labels: [("made-by".to_owned(), "mcp".to_owned())].into(),
            ..Default::default()
        };
        Ok(self.made(request).await)
    }

    #[tool(
        description = "List the questions waiting for a person: connections, commands and applies \
the policies hold for approval, with the rule that asked."
    )]
    async fn list_approvals(&self, Parameters(NoArgs {}): Parameters<NoArgs>) -> ToolResult {
        let approvals = self.harness.approvals();
        let text = if approvals.is_empty() {
            "nothing waits for approval".to_owned()
        } else {
            approvals
                .iter()
                .map(|a| format!("{} #{}: {} (rule {})", a.cell, a.id, a.request, a.rule))
                .collect::<Vec<_>>()
                .join("\n")
        };
        Ok(answer(&json!({ "approvals": approvals }), text))
    }

    #[tool(
        description = "Answer a waiting approval: allow (for `once`, this `cell` from now on, or \
`always`) or refuse it. Journaled with who answered."
    )]
    async fn answer_approval(
        &self,
        Parameters(args): Parameters<AnswerArgs>,
        context: RequestContext<RoleServer>,
    ) -> ToolResult {
        let by = self.by(&context);
        Ok(
            match self
                .harness
                .answer(&args.cell, args.id, args.allow, args.scope, &by)
                .await
            {
                Ok(()) => answer(
                    &json!({ "cell": args.cell, "id": args.id, "allow": args.allow }),
                    format!(
                        "{} #{} {}",
                        args.cell,
                        args.id,
                        if args.allow { "allowed" } else { "refused" }
                    ),
                ),
                Err(err) => failed(err),
            },
        )
    }
}

impl Tools {
    /// Makes a cell (a new one, or a fork) and answers with it.
    async fn made(&self, request: warden_protocol::CreateCell) -> CallToolResult {
        match self.harness.create(request).await {
            Ok(cell) => {
                let text = format!("cell `{}` is {}", cell.name, cell.state.name());
                answer(&cell, text)
            }
            Err(err) => failed(err),
        }
    }
}

#[tool_handler]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions(INSTRUCTIONS);
        info.server_info = rmcp::model::Implementation::new("warden", env!("CARGO_PKG_VERSION"));
        info
    }
}

/// Runs a command to its end, streaming its output to the caller as progress notifications
/// when the call asked for progress. A call cancelled, or a caller gone, kills the command.
async fn run(
    harness: &Arc<Harness>,
    cell: &str,
    spec: ExecSpec,
    context: Option<&RequestContext<RoleServer>>,
    limit: usize,
) -> Result<Ran, HarnessError> {
    let process = harness.exec(cell, spec).await?;
    let token = context.and_then(|c| c.meta.get_progress_token());
    let cancelled = context.map(|c| c.ct.clone()).unwrap_or_default();
    let mut step = 0.0;
    run_to_end(process, limit, cancelled.cancelled_owned(), |_, bytes| {
        step += 1.0;
        let progress = token.clone().zip(context).map(|(token, context)| {
            let text = String::from_utf8_lossy(bytes).into_owned();
            (
                context,
                ProgressNotificationParam::new(token, step).with_message(text),
            )
        });
        async move {
            if let Some((context, progress)) = progress {
                let _ = context.peer.notify_progress(progress).await;
            }
        }
    })
    .await
}

/// The longest request line a byte-stream session reads: room for a `write_file` of the most
/// the warden writes (64 MiB) with its JSON escapes. rmcp drops a longer line unanswered (its
/// own default, 16 MiB, left a `write_file` of 20 MiB waiting for an answer for good).
pub const LINE_LIMIT: usize = 2 * warden_harness::WRITE_LIMIT as usize + (1 << 20);

/// Serves the tools over a byte stream (stdio, or an upgraded connection of the daemon's)
/// until the client closes it.
pub async fn serve<T>(tools: Tools, transport: T) -> Result<(), String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    use rmcp::ServiceExt as _;
    let (read, write) = tokio::io::split(transport);
    let transport = rmcp::transport::async_rw::AsyncRwTransport::new_server(read, write)
        .with_max_line_length(LINE_LIMIT);
    let running = match tools.serve(transport).await {
        Ok(running) => running,
        // The client went before it asked anything: nothing was left undone.
        Err(rmcp::service::ServerInitializeError::ConnectionClosed(_)) => return Ok(()),
        Err(e) => return Err(format!("starting the MCP session: {e}")),
    };
    running
        .waiting()
        .await
        .map(drop)
        .map_err(|e| format!("the MCP session failed: {e}"))
}

/// Serves the tools over the process's stdin and stdout until the client closes them.
pub async fn serve_stdio(tools: Tools) -> Result<(), String> {
    serve(
        tools,
        tokio::io::join(tokio::io::stdin(), tokio::io::stdout()),
    )
    .await
}

/// The streamable HTTP endpoint (mount it at `/mcp`): stateless for clients of the current
/// protocol, with sessions for older ones. It answers only requests for a loopback host (or
/// `warden`, the name the daemon's unix-socket clients use): a guard against DNS rebinding,
/// as the daemon listens on loopback only.
pub fn http_service(
    harness: Arc<Harness>,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    Tools,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let config = StreamableHttpServerConfig::default().with_allowed_hosts([
        "localhost",
        "127.0.0.1",
        "::1",
        "warden",
    ]);
    StreamableHttpService::new(
        move || Ok(Tools::new(Arc::clone(&harness), "a client over MCP")),
        LocalSessionManager::default().into(),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_says_what_is_wrong_with_what_it_was_given() {
        let line = || Some("ls -l".to_owned());
        let argv = |a: &[&str]| Some(a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert_eq!(
            command_of(line(), None),
            Ok(vec!["sh".to_owned(), "-c".to_owned(), "ls -l".to_owned()])
        );
        assert_eq!(
            command_of(None, argv(&["ls", "-l"])),
            Ok(vec!["ls".to_owned(), "-l".to_owned()])
        );
        let empty = command_of(None, argv(&[])).unwrap_err();
        assert!(empty.contains("`argv` is empty"), "{empty}");
        assert!(!empty.contains("not both"), "{empty}");
        let neither = command_of(None, None).unwrap_err();
        assert!(neither.starts_with("give what to run"), "{neither}");
        assert!(!neither.contains("not both"), "{neither}");
        let both = command_of(line(), argv(&["ls"])).unwrap_err();
        assert!(both.ends_with("not both"), "{both}");
    }
}
