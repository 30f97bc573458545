//! The agent's tools, each carried out in its cell through the harness: the cell's policy,
//! command rules, approvals and the journal apply to every call exactly as to a person's
//! `warden exec` (a command rule that refuses or asks does so here too).

use std::sync::Arc;

use serde_json::{Value, json};
pub(crate) use warden_harness::tools::word;
use warden_harness::tools::{listing, run_to_end, search_argv};
use warden_harness::{ExecSpec, Harness, HarnessError};
use warden_model::Tool;

/// The most a call's arguments may hold.
pub const ARGUMENTS_LIMIT: usize = 1 << 20;
/// The mark that begins the operator's words in the conversation (the standing instructions
/// tell the model to follow them).
pub const OPERATOR_MARK: &str = "[operator]";
/// How long a command runs when the model does not say.
const DEFAULT_TIMEOUT_S: u64 = 120;
/// The longest a command may be given.
const LONGEST_TIMEOUT_S: u64 = 3600;

/// The tools offered to the model, with their arguments' schemas.
pub fn specs() -> Vec<Tool> {
    let tool = |name: &str, description: &str, parameters: Value| Tool {
        name: name.to_owned(),
        description: description.to_owned(),
        parameters,
    };
    let path = json!({ "type": "string", "description": "A path relative to the workspace (the current directory of commands)." });
    vec![
        tool(
            "exec",
            "Run a shell command (sh -c) in the workspace and wait for it to end. Answers the exit status and the output (its head and tail when long). The cell's policy may refuse a command or hold it for a person's approval.",
            json!({ "type": "object", "properties": {
                "command": { "type": "string", "description": "The shell command line." },
                "timeout_s": { "type": "integer", "minimum": 1, "description": "Kill it after this many seconds (default 120)." }
            }, "required": ["command"] }),
        ),
        tool(
            "read_file",
            "Read a text file.",
            json!({ "type": "object", "properties": { "path": path }, "required": ["path"] }),
        ),
        tool(
            "write_file",
            "Write a file whole (created, or replaced), with the directories above it.",
            json!({ "type": "object", "properties": { "path": path, "content": { "type": "string" } }, "required": ["path", "content"] }),
        ),
        tool(
            "edit_file",
            "Replace `old_text` with `new_text` in a file. `old_text` must occur exactly once (copy it exactly, whitespace included), unless `replace_all`.",
            json!({ "type": "object", "properties": {
                "path": path,
                "old_text": { "type": "string" },
                "new_text": { "type": "string" },
                "replace_all": { "type": "boolean" }
            }, "required": ["path", "old_text", "new_text"] }),
        ),
        tool(
            "list_dir",
            "List a directory: kind, size and name of each entry.",
            json!({ "type": "object", "properties": { "path": { "type": "string", "description": "Default: the workspace." } } }),
        ),
        tool(
            "search",
            "Search text files for a regular expression (grep -E) below a path; answers file:line:text for each match.",
            json!({ "type": "object", "properties": {
                "pattern": { "type": "string" },
                "path": { "type": "string", "description": "Default: the workspace." },
                "ignore_case": { "type": "boolean" }
            }, "required": ["pattern"] }),
        ),
        tool(
            "diff",
            "Show what was changed in the workspace so far, against the host's copy: each path added, changed or removed, with text diffs.",
            json!({ "type": "object", "properties": {} }),
        ),
    ]
}

/// The names of the tools.
pub fn names() -> Vec<String> {
    specs().into_iter().map(|t| t.name).collect()
}

/// A call's result for the model: its text, and whether it is an error.
#[derive(Debug)]
pub struct Outcome {
    pub output: String,
    pub error: bool,
    /// Refused because the cell is paused (`cell-paused`): nothing of the call ran.
    pub paused: bool,
}

impl Outcome {
    fn ok(output: String) -> Self {
        Self {
            output,
            error: false,
            paused: false,
        }
    }
    pub fn error(output: impl Into<String>) -> Self {
        Self {
            output: output.into(),
            error: true,
            paused: false,
        }
    }
}

impl From<HarnessError> for Outcome {
    fn from(err: HarnessError) -> Self {
        let mut outcome = Self::error(format!("refused ({}): {}", word(err.kind), err.message));
        outcome.paused = err.reason == "cell-paused";
        outcome
    }
}

/// The parsed arguments of a call, or what is wrong with them (told to the model).
pub fn arguments(name: &str, raw: &str) -> Result<Value, Outcome> {
    if !names().iter().any(|n| n == name) {
        return Err(Outcome::error(format!(
            "there is no tool `{name}`; the tools are {}",
            names().join(", ")
        )));
    }
    if raw.len() > ARGUMENTS_LIMIT {
        return Err(Outcome::error(format!(
            "the arguments are {} bytes, more than the {ARGUMENTS_LIMIT} a call may have; write big files in pieces or with a command",
            raw.len()
        )));
    }
    let raw = if raw.trim().is_empty() { "{}" } else { raw };
    match serde_json::from_str::<Value>(raw) {
        Ok(value) if value.is_object() => Ok(value),
        Ok(_) => Err(Outcome::error("the arguments must be a JSON object")),
        Err(e) => Err(Outcome::error(format!(
            "the arguments are not valid JSON ({e}); send them again as one JSON object"
        ))),
    }
}

fn text<'a>(args: &'a Value, key: &str) -> Result<&'a str, Outcome> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| Outcome::error(format!("the argument `{key}` (a string) is missing")))
}

/// Carries out a call in `cell`, with its result cut to `limit` bytes. `cancelled` ends a
/// command under way (the session stopped, or rewound).
pub async fn run(
    harness: &Arc<Harness>,
    cell: &str,
    name: &str,
    args: &Value,
    limit: usize,
    cancelled: impl std::future::Future<Output = ()>,
) -> Outcome {
    let outcome = match name {
        "exec" => match text(args, "command") {
            Ok(command) => {
                let timeout = args
                    .get("timeout_s")
                    .and_then(Value::as_u64)
                    .unwrap_or(DEFAULT_TIMEOUT_S)
                    .clamp(1, LONGEST_TIMEOUT_S);
                let argv = vec!["sh".to_owned(), "-c".to_owned(), command.to_owned()];
                command_outcome(harness, cell, argv, timeout, limit, cancelled, false).await
            }
            Err(outcome) => outcome,
        },
        "search" => match text(args, "pattern") {
            Ok(pattern) => {
                let path = args.get("path").and_then(Value::as_str).unwrap_or(".");
                let ignore_case = args.get("ignore_case").and_then(Value::as_bool) == Some(true);
                let argv = search_argv(pattern, path, ignore_case);
                command_outcome(harness, cell, argv, 60, limit, cancelled, true).await
            }
            Err(outcome) => outcome,
        },
        "read_file" => match text(args, "path") {
            Ok(path) => match harness.read_file(cell, path).await {
                Ok(data) => Outcome::ok(String::from_utf8_lossy(&data).into_owned()),
                Err(err) => err.into(),
            },
            Err(outcome) => outcome,
        },
        "write_file" => match (text(args, "path"), text(args, "content")) {
            (Ok(path), Ok(content)) => {
                let size = content.len();
                match harness
                    .write_file(cell, path, content.as_bytes().to_vec())
                    .await
                {
                    Ok(()) => Outcome::ok(format!("wrote {path} ({size} bytes)")),
                    Err(err) => err.into(),
                }
            }
            (Err(outcome), _) | (_, Err(outcome)) => outcome,
        },
        "edit_file" => edit(harness, cell, args).await,
        "list_dir" => {
            let path = args.get("path").and_then(Value::as_str).unwrap_or(".");
            match harness.list_files(cell, path).await {
                Ok(entries) if entries.is_empty() => Outcome::ok(format!("{path} is empty")),
                Ok(entries) => Outcome::ok(listing(&entries)),
                Err(err) => err.into(),
            }
        }
        "diff" => match harness.diff(cell).await {
            Ok(diff) => Outcome::ok(render_diff(&diff)),
            Err(err) => err.into(),
        },
        other => Outcome::error(format!("there is no tool `{other}`")),
    };
    unmarked(clip(outcome, limit))
}

/// A result never begins with the operator's mark: a file the cell wrote that began `[operator]
/// ...`, read back, was a message that began with it, which the standing instructions tell the
/// model to follow.
fn unmarked(mut outcome: Outcome) -> Outcome {
    let start = outcome.output.trim_start();
    let mark = OPERATOR_MARK.trim_end_matches(']');
    if start
        .get(..mark.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(mark))
    {
        outcome
            .output
            .insert_str(0, "[a tool's output, not the operator's words] ");
    }
    outcome
}

async fn edit(harness: &Arc<Harness>, cell: &str, args: &Value) -> Outcome {
    let (path, old, new) = match (
        text(args, "path"),
        text(args, "old_text"),
        text(args, "new_text"),
    ) {
        (Ok(p), Ok(o), Ok(n)) => (p, o, n),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
    };
    let all = args.get("replace_all").and_then(Value::as_bool) == Some(true);
    match harness.edit_file(cell, path, old, new, all).await {
        Ok(count) => Outcome::ok(format!("replaced {count} occurrence(s) in {path}")),
        Err(err) => err.into(),
    }
}

async fn command_outcome(
    harness: &Arc<Harness>,
    cell: &str,
    argv: Vec<String>,
    timeout_s: u64,
    limit: usize,
    cancelled: impl std::future::Future<Output = ()>,
    search: bool,
) -> Outcome {
    let spec = ExecSpec {
        argv,
        timeout_ms: Some(timeout_s * 1000),
        ..Default::default()
    };
    let process = match harness.exec(cell, spec).await {
        Ok(process) => process,
        Err(err) => return err.into(),
    };
    match run_to_end(process, limit, cancelled, |_, _| async {}).await {
        Ok(ran) if search => match ran.exit.code {
            Some(0) => Outcome::ok(ran.stdout),
            Some(1) => Outcome::ok("no matches".to_owned()),
            _ => Outcome::error(format!("the search failed: {}", ran.text())),
        },
        Ok(ran) => Outcome {
            error: ran.status != 0,
            output: ran.text(),
            paused: false,
        },
        Err(err) => err.into(),
    }
}

/// The diff as a model reads it: a line per change, then the text diffs.
fn render_diff(diff: &Value) -> String {
    let changes = diff["changes"].as_array().cloned().unwrap_or_default();
    if changes.is_empty() {
        return "no changes".to_owned();
    }
    let mut out = String::new();
    for change in &changes {
        out.push_str(&format!(
            "{} {}\n",
            change["kind"].as_str().unwrap_or("?"),
            change["path"].as_str().unwrap_or("?")
        ));
    }
    for change in &changes {
        if let Some(text) = change["patch"].as_str().filter(|t| !t.is_empty()) {
            out.push('\n');
            out.push_str(text);
        }
    }
    out
}

/// A result cut to `limit` bytes (at a character boundary), with a note to the model.
fn clip(mut outcome: Outcome, limit: usize) -> Outcome {
    if outcome.output.len() > limit {
        let total = outcome.output.len();
        let mut cut = limit;
        while !outcome.output.is_char_boundary(cut) {
            cut -= 1;
        }
        outcome.output.truncate(cut);
        outcome.output.push_str(&format!(
            "\n[the result was cut: {total} bytes, only the first {cut} shown; ask for less (a narrower command, a part of the file)]"
        ));
    }
    outcome
}
