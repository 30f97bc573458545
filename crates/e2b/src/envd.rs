//! envd's services, as the SDKs call them (Connect protocol, JSON codec): `process.Process`
//! (start with streamed output, background processes, connect, stdin, signals, terminals),
//! `filesystem.Filesystem` (stat, list, make dir, move, remove), and `/files` (upload and
//! download), each mapped onto the harness's exec and files of the sandbox's cell. Paths are
//! the E2B user's: absolute under `/home/user` (the cell's workspace mount) or relative to it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest as _, Multipart, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio_stream::wrappers::ReceiverStream;
use warden_harness::{ErrorKind, ExecSpec, FileKind, HarnessError, Item, Process};
use warden_protocol::{ExitReason, Stream, TtySize};

use crate::wire::{self, ALIAS, END_STREAM, HOME, b64, envelope};
use crate::{Shared, status_of};

const PROCESS: &str = "/process.Process/";
/// The largest upload `/files` takes (the files API's limit).
const UPLOAD_LIMIT: usize = 64 << 20;
const FILESYSTEM: &str = "/filesystem.Filesystem/";

pub(crate) fn is_envd_path(path: &str) -> bool {
    path.starts_with(PROCESS)
        || path.starts_with(FILESYSTEM)
        || path == "/files"
        || path == "/health"
}

pub(crate) fn routes() -> Router<Shared> {
    Router::new()
        .route("/health", get(health))
        .route(
            "/files",
            get(download)
                .post(upload)
                .layer(axum::extract::DefaultBodyLimit::max(UPLOAD_LIMIT)),
        )
        .route("/process.Process/{method}", post(process))
        .route("/filesystem.Filesystem/{method}", post(filesystem))
}

/// A Connect error of a unary call: its status and `{"code", "message"}`.
pub(crate) fn connect_error(code: &str, message: impl Into<String>) -> Response {
    let status = match code {
        "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "permission_denied" => StatusCode::FORBIDDEN,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (
        status,
        axum::Json(json!({ "code": code, "message": message.into() })),
    )
        .into_response()
}

fn code_of(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::BadRequest => "invalid_argument",
        ErrorKind::Unauthorized => "unauthenticated",
        ErrorKind::Forbidden => "permission_denied",
        ErrorKind::NotFound => "not_found",
        ErrorKind::Conflict => "failed_precondition",
        ErrorKind::TooLarge => "resource_exhausted",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Internal => "internal",
    }
}

fn failed(err: HarnessError) -> Response {
    connect_error(code_of(err.kind), err.message)
}

fn sandbox_of(headers: &HeaderMap) -> String {
    headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The cell's path of an E2B path (`/home/user/x`, `/workspace/x` or `x`: `x`).
fn cell_path(path: &str) -> Result<String, Response> {
    let under = |root: &str| {
        if path == root || path == format!("{root}/") {
            Some(".")
        } else {
            path.strip_prefix(&format!("{root}/"))
        }
    };
    let rest = if let Some(rest) = under(HOME).or_else(|| under(ALIAS)) {
        rest
    } else if path.starts_with('/') {
        return Err(connect_error(
            "permission_denied",
            format!(
                "{path}: only the sandbox's workspace, {HOME}, is reachable through this API (run a command to reach the rest of the sandbox)"
            ),
        ));
    } else if path.is_empty() {
        "."
    } else {
        path
    };
    Ok(rest.trim_end_matches('/').to_owned())
}

/// The E2B path of a cell path.
fn e2b_path(rel: &str) -> String {
    match rel {
        "." | "" => HOME.to_owned(),
        rel => format!("{HOME}/{}", rel.trim_start_matches("./")),
    }
}

/// The value of a result, or, from the handler, its error's answer.
macro_rules! or_answer {
    ($result:expr) => {
        match $result {
            Ok(value) => value,
            Err(answer) => return answer,
        }
    };
}

/// How often a stream's client asked for keepalives (`Keepalive-Ping-Interval`, seconds).
fn keepalive_of(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

fn json_of<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Response> {
    serde_json::from_slice(bytes).map_err(|e| {
        connect_error(
            "invalid_argument",
            format!("the request is not what this method takes: {e}"),
        )
    })
}

async fn health() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

async fn process(
    State(state): State<Shared>,
    axum::extract::Path(method): axum::extract::Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Response {
    let cell = sandbox_of(&headers);
    let keepalive = keepalive_of(&headers);
    match method.as_str() {
        "Start" => {
            let request: wire::StartRequest = or_answer!(streamed(&bytes));
            start(state, cell, request, keepalive).await
        }
        "Connect" => {
            let request: wire::Selected = or_answer!(streamed(&bytes));
            match select(&state, &cell, &request.process) {
                Ok(process) => {
                    // From now on: what was printed before was for the first reader.
                    let mut cursor = warden_harness::Cursor::start();
                    while process.try_next(&mut cursor).is_some() {}
                    let tty = ttys_of(&state, &cell).contains(&process.info().id);
                    stream(process, cursor, keepalive, tty)
                }
                Err((code, message)) => stream_error(code, &message),
            }
        }
        "List" => match state.harness.processes(&cell) {
            Ok(list) => {
                let tags = tags_of(&state, &cell);
                let processes: Vec<Value> = list
                    .into_iter()
                    .filter(|p| p.running)
                    .map(|p| {
                        let tag = tags
                            .iter()
                            .find(|(_, id)| *id == p.id)
                            .map(|(tag, _)| tag.clone());
                        json!({
                            "config": {
                                "cmd": p.argv.first().cloned().unwrap_or_default(),
                                "args": p.argv.get(1..).unwrap_or_default(),
                                "envs": {},
                            },
                            "pid": p.id,
                            "tag": tag,
                        })
                    })
                    .collect();
                axum::Json(json!({ "processes": processes })).into_response()
            }
            Err(err) => failed(err),
        },
        "SendInput" => {
            let request: wire::SendInput = or_answer!(json_of(&bytes));
            let data = match (request.input.stdin, request.input.pty) {
                (Some(data), None) | (None, Some(data)) => data,
                _ => return connect_error("invalid_argument", "`input` needs `stdin` or `pty`"),
            };
            match select(&state, &cell, &request.process) {
                Ok(process) => unary(
                    state
                        .harness
                        .stdin(&cell, process.info().id, &data, false)
                        .await,
                ),
                Err(f) => unary_failure(f),
            }
        }
        "CloseStdin" => {
            let request: wire::Selected = or_answer!(json_of(&bytes));
            match select(&state, &cell, &request.process) {
                Ok(process) => unary(
                    state
                        .harness
                        .stdin(&cell, process.info().id, &[], true)
                        .await,
                ),
                Err(f) => unary_failure(f),
            }
        }
        "SendSignal" => {
            let request: wire::SendSignal = or_answer!(json_of(&bytes));
            let Some(signal) = request.number() else {
                return connect_error(
                    "invalid_argument",
                    format!(
                        "signal {} is not one this API sends (SIGNAL_SIGKILL, SIGNAL_SIGTERM)",
                        request.signal
                    ),
                );
            };
            match select(&state, &cell, &request.process) {
                Ok(process) => unary(state.harness.signal(&cell, process.info().id, signal).await),
                Err(f) => unary_failure(f),
            }
        }
        "Update" => {
            let request: wire::Update = or_answer!(json_of(&bytes));
            let Some(pty) = request.pty else {
                return axum::Json(json!({})).into_response();
            };
            let size = TtySize {
                rows: pty.size.rows.min(u16::MAX.into()) as u16,
                cols: pty.size.cols.min(u16::MAX.into()) as u16,
            };
            match select(&state, &cell, &request.process) {
                Ok(process) => unary(state.harness.resize(&cell, process.info().id, size).await),
                Err(f) => unary_failure(f),
            }
        }
        other => connect_error(
            "unimplemented",
            format!("process.Process/{other} is not supported by Warden's E2B-compatible API"),
        ),
    }
}

fn unary(result: Result<(), HarnessError>) -> Response {
    match result {
        Ok(()) => axum::Json(json!({})).into_response(),
        Err(err) => failed(err),
    }
}

/// The one message of a server-streaming call's body (a failure is the stream's end).
fn streamed<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Response> {
    let inner = wire::unwrap_envelope(bytes).map_err(|e| stream_error("invalid_argument", &e))?;
    serde_json::from_slice(inner).map_err(|e| {
        stream_error(
            "invalid_argument",
            &format!("the request is not what this method takes: {e}"),
        )
    })
}

fn ttys_of(state: &Shared, cell: &str) -> Vec<u64> {
    state
        .sandboxes
        .lock()
        .ok()
        .and_then(|s| s.get(cell).map(|s| s.ttys.clone()))
        .unwrap_or_default()
}

fn tags_of(state: &Shared, cell: &str) -> Vec<(String, u64)> {
    state
        .sandboxes
        .lock()
        .ok()
        .and_then(|s| {
            s.get(cell)
                .map(|s| s.tags.iter().map(|(k, v)| (k.clone(), *v)).collect())
        })
        .unwrap_or_default()
}

/// A Connect error before it is answered: its code and message.
type Failure = (&'static str, String);

/// The process a selector names.
fn select(state: &Shared, cell: &str, selector: &wire::Selector) -> Result<Arc<Process>, Failure> {
    let id = match (&selector.pid, &selector.tag) {
        (Some(pid), _) => u64::from(*pid),
        (None, Some(tag)) => match tags_of(state, cell).into_iter().find(|(t, _)| t == tag) {
            Some((_, id)) => id,
            None => return Err(("not_found", format!("no process tagged `{tag}`"))),
        },
        (None, None) => {
            return Err((
                "invalid_argument",
                "`process` needs a `pid` or a `tag`".to_owned(),
            ));
        }
    };
    state
        .harness
        .process(cell, id)
        .map_err(|e| (code_of(e.kind), e.message))
}

fn unary_failure((code, message): Failure) -> Response {
    connect_error(code, message)
}

fn streaming(envelopes: Vec<Vec<u8>>) -> Response {
    let body: Vec<u8> = envelopes.concat();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        body,
    )
        .into_response()
}

async fn start(
    state: Shared,
    cell: String,
    request: wire::StartRequest,
    keepalive: Option<Duration>,
) -> Response {
    let config = request.process;
    if config.cmd.is_empty() {
        return stream_error("invalid_argument", "`process.cmd` is empty");
    }
    let mut argv = vec![config.cmd];
    argv.extend(config.args);
    let tty = request.pty.map(|p| TtySize {
        rows: p.size.rows.min(u16::MAX.into()) as u16,
        cols: p.size.cols.min(u16::MAX.into()) as u16,
    });
    let cwd = match config.cwd.as_deref().map(absolute_cwd) {
        Some(Ok(cwd)) => Some(cwd),
        Some(Err(e)) => return e,
        None => None,
    };
    let spec = ExecSpec {
        argv,
        env: config.envs,
        cwd,
        // E2B's processes outlive the stream that started them; input stays open only when
        // asked for (or on a terminal).
        background: true,
        stdin: (!request.stdin.unwrap_or(false) && tty.is_none()).then(String::new),
        tty,
        ..Default::default()
    };
    let process = match state.harness.exec(&cell, spec).await {
        Ok(p) => p,
        Err(err) => return stream_error(code_of(err.kind), &err.message),
    };
    let on_tty = tty.is_some();
    if let Ok(mut sandboxes) = state.sandboxes.lock()
        && let Some(s) = sandboxes.get_mut(&cell)
    {
        if let Some(tag) = request.tag {
            s.tags.insert(tag, process.info().id);
        }
        if on_tty {
            s.ttys.push(process.info().id);
        }
    }
    stream(process, warden_harness::Cursor::start(), keepalive, on_tty)
}

/// A working directory of the E2B user's, as the cell sees it.
fn absolute_cwd(cwd: &str) -> Result<String, Response> {
    if cwd.starts_with('/') {
        Ok(cwd.to_owned())
    } else {
        Ok(format!("{HOME}/{cwd}"))
    }
}

/// The sending end of a streamed Connect answer: one envelope at a time.
#[derive(Debug, Clone)]
struct Envelopes(tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>);

impl Envelopes {
    /// Sends one envelope; `false` once the client has gone.
    async fn send(&self, flags: u8, message: Value) -> bool {
        let envelope = Bytes::from(envelope(flags, &message));
        self.0.send(Ok(envelope)).await.is_ok()
    }

    /// Returns once the client has gone.
    async fn closed(&self) {
        self.0.closed().await
    }
}

/// A streamed Connect answer, and what sends its envelopes.
fn connect_stream() -> (Envelopes, Response) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let mut response = Body::from_stream(ReceiverStream::new(rx)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/connect+json"),
    );
    (Envelopes(tx), response)
}

fn stream_error(code: &str, message: &str) -> Response {
    streaming(vec![envelope(
        END_STREAM,
        &json!({ "error": { "code": code, "message": message } }),
    )])
}

/// A process's events as a Connect stream: `start`, its output, `end`, then the stream's end;
/// keepalives at the interval the client asked for. The process outlives a reader that goes.
fn stream(
    process: Arc<Process>,
    mut cursor: warden_harness::Cursor,
    keepalive: Option<Duration>,
    tty: bool,
) -> Response {
    let (tx, response) = connect_stream();
    let pid = process.info().id;
    tokio::spawn(async move {
        let send = |message: Value, flags: u8| tx.send(flags, message);
        if !send(json!({ "event": { "start": { "pid": pid } } }), 0).await {
            return;
        }
        let mut ticks = keepalive.map(|every| {
            let mut t = tokio::time::interval(every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let tick = async {
                match ticks.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let item = tokio::select! {
                item = process.next(&mut cursor) => item,
                () = tick => {
                    if !send(json!({ "event": { "keepalive": {} } }), 0).await {
                        return;
                    }
                    continue;
                }
                () = tx.closed() => return,
            };
            let event = match item {
                Item::Output(stream, data) => {
                    let key = match (stream, tty) {
                        (_, true) => "pty",
                        (Stream::Stdout, _) => "stdout",
                        (Stream::Stderr, _) => "stderr",
                    };
                    json!({ "event": { "data": { key: b64(&data) } } })
                }
                Item::Dropped(_) => continue,
                Item::Exit(exit) => {
                    let (code, status) = match exit.reason {
                        ExitReason::Exited => {
                            let code = exit.code.unwrap_or(0);
                            (code, format!("exit status {code}"))
                        }
                        ExitReason::Signaled => (
                            -1,
                            format!("signal: {}", signal_name(exit.signal.unwrap_or(0))),
                        ),
                        ExitReason::Failed => (
                            exit.code.unwrap_or(127),
                            exit.message.clone().unwrap_or_else(|| "failed".to_owned()),
                        ),
                        _ => (
                            -1,
                            format!(
                                "signal: killed ({})",
                                exit.message.clone().unwrap_or_default()
                            ),
                        ),
                    };
                    let mut end = json!({
                        "exitCode": code,
                        "exited": exit.reason == ExitReason::Exited,
                        "status": status,
                    });
                    if exit.reason != ExitReason::Exited
                        && let Some(message) = &exit.message
                    {
                        end["error"] = json!(message);
                    }
                    let _ = send(json!({ "event": { "end": end } }), 0).await;
                    let _ = send(json!({}), END_STREAM).await;
                    return;
                }
            };
            if !send(event, 0).await {
                return;
            }
        }
    });
    response
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        1 => "hangup",
        6 => "aborted",
        11 => "segmentation fault",
        13 => "broken pipe",
        _ => "signaled",
    }
}

fn entry(rel: &str, info: &warden_protocol::FileInfo) -> wire::Entry {
    let mode = u32::from_str_radix(&info.mode, 8).unwrap_or(0);
    let kind = match info.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let letter = match info.kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    };
    let mut permissions = String::from(letter);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        permissions.push(if bits & 4 != 0 { 'r' } else { '-' });
        permissions.push(if bits & 2 != 0 { 'w' } else { '-' });
        permissions.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    wire::Entry {
        name: info.name.clone(),
        kind,
        path: e2b_path(rel),
        size: info.size.to_string(),
        mode,
        permissions,
        owner: "user".to_owned(),
        group: "user".to_owned(),
        modified_time: humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + Duration::from_secs(info.modified_s),
        )
        .to_string(),
        symlink_target: info.target.clone(),
    }
}

fn join(dir: &str, name: &str) -> String {
    match dir {
        "." | "" => name.to_owned(),
        dir => format!("{dir}/{name}"),
    }
}

async fn filesystem(
    State(state): State<Shared>,
    axum::extract::Path(method): axum::extract::Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Response {
    let cell = sandbox_of(&headers);
    let h = &state.harness;
    match method.as_str() {
        "Stat" => {
            let request: wire::PathRequest = or_answer!(json_of(&bytes));
            let rel = or_answer!(cell_path(&request.path));
            match h.stat_file(&cell, &rel).await {
                Ok(info) => axum::Json(json!({ "entry": entry(&rel, &info) })).into_response(),
                Err(err) => failed(err),
            }
        }
        "ListDir" => {
            let request: wire::ListDir = or_answer!(json_of(&bytes));
            let rel = or_answer!(cell_path(&request.path));
            let depth = request.depth.unwrap_or(1).clamp(1, 16);
            let mut entries = Vec::new();
            let mut level = vec![rel];
            for _ in 0..depth {
                let mut next = Vec::new();
                for dir in level {
                    let listed = match h.list_files(&cell, &dir).await {
                        Ok(listed) => listed,
                        Err(err) => return failed(err),
                    };
                    if entries.len() + listed.len() > LIST_LIMIT {
                        return connect_error(
                            "resource_exhausted",
                            format!(
                                "{} holds more than {LIST_LIMIT} entries to depth {depth}, more than one listing answers; list a subdirectory or a smaller depth, or count them with a command (`find {} -maxdepth {depth} | wc -l`)",
                                request.path, request.path
                            ),
                        );
                    }
                    for info in listed {
                        let path = join(&dir, &info.name);
                        if info.kind == FileKind::Dir {
                            next.push(path.clone());
                        }
                        entries.push(entry(&path, &info));
                    }
                }
                level = next;
            }
            axum::Json(json!({ "entries": entries })).into_response()
        }
        "MakeDir" => {
            let request: wire::PathRequest = or_answer!(json_of(&bytes));
            let rel = or_answer!(cell_path(&request.path));
            if h.stat_file(&cell, &rel).await.is_ok() {
                return connect_error("already_exists", format!("{} exists", request.path));
            }
            if let Err(err) = h.mkdir(&cell, &rel).await {
                return failed(err);
            }
            match h.stat_file(&cell, &rel).await {
                Ok(info) => axum::Json(json!({ "entry": entry(&rel, &info) })).into_response(),
                Err(err) => failed(err),
            }
        }
        "Move" => {
            let request: wire::Move = or_answer!(json_of(&bytes));
            let (from, to) = match (cell_path(&request.source), cell_path(&request.destination)) {
                (Ok(from), Ok(to)) => (from, to),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            if let Err(err) = h.rename(&cell, &from, &to).await {
                return failed(err);
            }
            match h.stat_file(&cell, &to).await {
                Ok(info) => axum::Json(json!({ "entry": entry(&to, &info) })).into_response(),
                Err(err) => failed(err),
            }
        }
        "Remove" => {
            let request: wire::PathRequest = or_answer!(json_of(&bytes));
            let rel = or_answer!(cell_path(&request.path));
            unary(h.remove(&cell, &rel, true).await)
        }
        "CreateWatcher" => {
            let request: wire::Watch = or_answer!(json_of(&bytes));
            let rel = or_answer!(cell_path(&request.path));
            let seen = match scan(&state, &cell, &rel, request.recursive).await {
                Ok(seen) => seen,
                Err(err) => return failed(err),
            };
            let Ok(id) = crate::random_hex(8) else {
                return connect_error("internal", "no randomness for a watcher id");
            };
            let watcher = Watcher {
                path: rel,
                recursive: request.recursive,
                seen,
            };
            if let Ok(mut sandboxes) = state.sandboxes.lock()
                && let Some(s) = sandboxes.get_mut(&cell)
            {
                if s.watchers.len() >= MAX_WATCHERS {
                    return connect_error(
                        "resource_exhausted",
                        format!("a sandbox has at most {MAX_WATCHERS} watchers; remove one first"),
                    );
                }
                s.watchers.insert(id.clone(), watcher);
            }
            axum::Json(json!({ "watcherId": id })).into_response()
        }
        "GetWatcherEvents" => {
            let request: wire::WatcherId = or_answer!(json_of(&bytes));
            let watcher = state.sandboxes.lock().ok().and_then(|s| {
                s.get(&cell)
                    .and_then(|s| s.watchers.get(&request.id).cloned())
            });
            let Some(mut watcher) = watcher else {
                return connect_error("not_found", format!("no watcher `{}`", request.id));
            };
            let events = match watcher.poll(&state, &cell).await {
                Ok(events) => events,
                Err(err) => return failed(err),
            };
            if let Ok(mut sandboxes) = state.sandboxes.lock()
                && let Some(s) = sandboxes.get_mut(&cell)
                && let Some(kept) = s.watchers.get_mut(&request.id)
            {
                *kept = watcher;
            }
            axum::Json(json!({ "events": events })).into_response()
        }
        "RemoveWatcher" => {
            let request: wire::WatcherId = or_answer!(json_of(&bytes));
            let removed = state.sandboxes.lock().ok().and_then(|mut s| {
                s.get_mut(&cell)
                    .and_then(|s| s.watchers.remove(&request.id))
            });
            match removed {
                Some(_) => axum::Json(json!({})).into_response(),
                None => connect_error("not_found", format!("no watcher `{}`", request.id)),
            }
        }
        "WatchDir" => {
            let request: wire::Watch = or_answer!(streamed(&bytes));
            let rel = match cell_path(&request.path) {
                Ok(p) => p,
                Err(_) => {
                    return stream_error(
                        "permission_denied",
                        &format!(
                            "{}: only {HOME} is reachable through this API",
                            request.path
                        ),
                    );
                }
            };
            let keepalive = keepalive_of(&headers);
            let seen = match scan(&state, &cell, &rel, request.recursive).await {
                Ok(seen) => seen,
                Err(err) => return stream_error(code_of(err.kind), &err.message),
            };
            let watcher = Watcher {
                path: rel,
                recursive: request.recursive,
                seen,
            };
            watch_stream(Arc::clone(&state), cell, watcher, keepalive)
        }
        other => connect_error(
            "unimplemented",
            format!(
                "filesystem.Filesystem/{other} is not supported by Warden's E2B-compatible API"
            ),
        ),
    }
}

/// The most entries one `ListDir` answers. What the cell made below a directory is the
/// daemon's to hold while it answers: a million entries (four directories of a quarter million,
/// listed to depth 2) took 1.9 GB of its memory for one call, and depth multiplied it.
const LIST_LIMIT: usize = 100_000;

/// The most directory watchers a sandbox may have at once.
const MAX_WATCHERS: usize = 64;
/// The most entries a watcher follows (a larger tree is watched to this many entries).
const WATCH_LIMIT: usize = 10_000;
/// The most directories one look lists (each listing is a file operation in the cell).
const WATCH_DIRS: usize = 256;

/// A directory watched by polling: what it held when last looked at, by path relative to the
/// watched directory (kind, size, modification time).
#[derive(Debug, Clone)]
pub(crate) struct Watcher {
    path: String,
    recursive: bool,
    seen: BTreeMap<String, (FileKind, u64, u64)>,
}

impl Watcher {
    /// What changed since the last look, as envd's `FilesystemEvent`s.
    async fn poll(&mut self, state: &Shared, cell: &str) -> Result<Vec<Value>, HarnessError> {
        let now = scan(state, cell, &self.path, self.recursive).await?;
        let mut events = Vec::new();
        for (name, entry) in &now {
            match self.seen.get(name) {
                None => events.push(json!({ "name": name, "type": "EVENT_TYPE_CREATE" })),
                Some(before) if before != entry => {
                    events.push(json!({ "name": name, "type": "EVENT_TYPE_WRITE" }));
                }
                Some(_) => {}
            }
        }
        for name in self.seen.keys().filter(|n| !now.contains_key(*n)) {
            events.push(json!({ "name": name, "type": "EVENT_TYPE_REMOVE" }));
        }
        self.seen = now;
        Ok(events)
    }
}

/// How often a streamed watch looks at its directory.
const WATCH_EVERY: Duration = Duration::from_millis(200);

/// A watch as a Connect stream: `start`, then each change as a `filesystem` event as the
/// polls find it, with keepalives; it ends when the client goes or the directory does. (A
/// `WatchDirResponse`'s oneof is the message itself: `{"start": {}}`, not under `event` as a
/// process's events are.)
fn watch_stream(
    state: Shared,
    cell: String,
    mut watcher: Watcher,
    keepalive: Option<Duration>,
) -> Response {
    let (tx, response) = connect_stream();
    tokio::spawn(async move {
        let send = |message: Value, flags: u8| tx.send(flags, message);
        if !send(json!({ "start": {} }), 0).await {
            return;
        }
        let mut last_sign = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(WATCH_EVERY) => {}
                () = tx.closed() => return,
            }
            match watcher.poll(&state, &cell).await {
                Ok(events) => {
                    for event in events {
                        if !send(json!({ "filesystem": event }), 0).await {
                            return;
                        }
                        last_sign = tokio::time::Instant::now();
                    }
                }
                Err(err) => {
                    let end =
                        json!({ "error": { "code": code_of(err.kind), "message": err.message } });
                    let _ = send(end, END_STREAM).await;
                    return;
                }
            }
            if let Some(every) = keepalive
                && last_sign.elapsed() >= every
            {
                if !send(json!({ "keepalive": {} }), 0).await {
                    return;
                }
                last_sign = tokio::time::Instant::now();
            }
        }
    });
    response
}

/// The entries below `rel` (recursively, up to 16 levels and `WATCH_LIMIT` entries).
async fn scan(
    state: &Shared,
    cell: &str,
    rel: &str,
    recursive: bool,
) -> Result<BTreeMap<String, (FileKind, u64, u64)>, HarnessError> {
    let mut out = BTreeMap::new();
    let mut level = vec![String::new()];
    let mut listed_dirs = 0;
    for _ in 0..if recursive { 16 } else { 1 } {
        let mut next = Vec::new();
        for dir in level {
            listed_dirs += 1;
            if listed_dirs > WATCH_DIRS {
                return Ok(out);
            }
            let path = if dir.is_empty() {
                rel.to_owned()
            } else {
                join(rel, &dir)
            };
            let listed = match state.harness.list_files(cell, &path).await {
                Ok(listed) => listed,
                // A directory that went between two listings is seen as removed.
                Err(err) if err.kind == ErrorKind::NotFound && !dir.is_empty() => continue,
                Err(err) => return Err(err),
            };
            for info in listed {
                let name = if dir.is_empty() {
                    info.name.clone()
                } else {
                    join(&dir, &info.name)
                };
                if info.kind == FileKind::Dir {
                    next.push(name.clone());
                }
                out.insert(name, (info.kind, info.size, info.modified_s));
                if out.len() >= WATCH_LIMIT {
                    return Ok(out);
                }
            }
        }
        level = next;
    }
    Ok(out)
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    path: Option<String>,
}

/// An error of envd's HTTP API (`/files`): `{"code": STATUS, "message"}`.
fn http_error(err: HarnessError) -> Response {
    let status = status_of(err.kind);
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": err.message })),
    )
        .into_response()
}

async fn download(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(query): Query<FileQuery>,
) -> Response {
    let cell = sandbox_of(&headers);
    let Some(path) = query.path else {
        return http_error(HarnessError::bad("`path` is required"));
    };
    let rel = match cell_path(&path) {
        Ok(p) => p,
        Err(_) => {
            return http_error(HarnessError::new(
                ErrorKind::Forbidden,
                format!("{path}: only {HOME} is reachable through this API"),
            ));
        }
    };
    match state.harness.read_file(&cell, &rel).await {
        Ok(data) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            data,
        )
            .into_response(),
        Err(err) => http_error(err),
    }
}

async fn upload(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(query): Query<FileQuery>,
    request: Request,
) -> Response {
    let cell = sandbox_of(&headers);
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let mut multipart = match Multipart::from_request(request, &()).await {
            Ok(m) => m,
            Err(e) => return http_error(HarnessError::bad(format!("the upload: {e}"))),
        };
        loop {
            match multipart.next_field().await {
                Ok(Some(field)) => {
                    let name = field.file_name().map(str::to_owned);
                    let data = match field.bytes().await {
                        Ok(d) => d.to_vec(),
                        Err(e) => return http_error(HarnessError::bad(format!("the upload: {e}"))),
                    };
                    // The target: the query's path for one file, else each part's file name.
                    match query.path.clone().filter(|_| files.is_empty()).or(name) {
                        Some(path) => files.push((path, data)),
                        None => {
                            return http_error(HarnessError::bad(
                                "an uploaded part has no file name and the request no `path`",
                            ));
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => return http_error(HarnessError::bad(format!("the upload: {e}"))),
            }
        }
    } else {
        let Some(path) = query.path.clone() else {
            return http_error(HarnessError::bad("`path` is required"));
        };
        let data = match axum::body::to_bytes(request.into_body(), UPLOAD_LIMIT).await {
            Ok(d) => d.to_vec(),
            Err(e) => return http_error(HarnessError::bad(format!("the upload: {e}"))),
        };
        files.push((path, data));
    }
    if files.is_empty() {
        return http_error(HarnessError::bad("the upload holds no file"));
    }
    // Every part's path is checked before any is written: an upload refused for one of its
    // paths writes nothing (it wrote the parts before that one).
    let mut targets = Vec::with_capacity(files.len());
    for (path, data) in files {
        let rel = match cell_path(&path) {
            Ok(p) => p,
            Err(_) => {
                return http_error(HarnessError::new(
                    ErrorKind::Forbidden,
                    format!(
                        "{path}: only {HOME} is reachable through this API; nothing of the upload was written"
                    ),
                ));
            }
        };
        if rel.contains('\0') || rel.split('/').any(|part| part == "..") {
            return http_error(HarnessError::bad(format!(
                "{path}: a path may not contain NUL bytes or `..`; nothing of the upload was written"
            )));
        }
        targets.push((rel, data));
    }
    let mut written = Vec::new();
    for (rel, data) in targets {
        // Parent directories are made, as envd does.
        let mut parent = String::new();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            parent = join(&parent, part);
            if state.harness.stat_file(&cell, &parent).await.is_err()
                && let Err(err) = state.harness.mkdir(&cell, &parent).await
            {
                return http_error(err);
            }
        }
        if let Err(err) = state.harness.write_file(&cell, &rel, data).await {
            return http_error(err);
        }
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_owned();
        written.push(json!({ "name": name, "type": "file", "path": e2b_path(&rel) }));
    }
    axum::Json(Value::Array(written)).into_response()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_are_the_users_home_or_refused() {
        assert_eq!(cell_path("/home/user/a/b.txt").unwrap(), "a/b.txt");
        assert_eq!(cell_path("/home/user").unwrap(), ".");
        assert_eq!(cell_path("/home/user/").unwrap(), ".");
        assert_eq!(cell_path("a.txt").unwrap(), "a.txt");
        assert!(cell_path("/etc/passwd").is_err());
        assert!(cell_path("/home/username/x").is_err());
        assert_eq!(cell_path("/workspace/a").unwrap(), "a");
        assert_eq!(cell_path("/workspace").unwrap(), ".");
        assert!(cell_path("/workspaces/a").is_err());
        assert_eq!(e2b_path("a/b.txt"), "/home/user/a/b.txt");
        assert_eq!(e2b_path("."), "/home/user");
    }
}
