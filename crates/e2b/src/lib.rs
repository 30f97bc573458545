//! An E2B-compatible face: what the `e2b` SDKs (both generations: 2.31's `/sandboxes` and
//! 2.5x-2.6x's `/v2/sandboxes`) speak to E2B's control plane and to the `envd` daemon inside a
//! sandbox, served by the warden (never inside a cell) and mapped onto cells, execs and files.
//! Point the SDK at it with its documented variables only: `E2B_API_URL` and
//! `E2B_SANDBOX_URL` (both this listener: the two planes' paths do not collide, and envd calls
//! carry the sandbox in `E2b-Sandbox-Id`) and `E2B_API_KEY` (the key `warden serve --e2b`
//! writes to `e2b.key`).
//!
//! A sandbox is a cell whose workspace is mounted at `/home/user`, the E2B user's home and
//! working directory, so that what `files.write("a.txt")` writes is what `commands.run("cat
//! a.txt")` reads. Its template names a Warden preset (`base` is `default`). Every effect goes
//! through the harness like any other face's: the cell's policy, command rules and journal.
//! What is not supported answers with an error that names it.

// A helper's error here is the request's whole answer, built once and returned as is.
#![allow(clippy::result_large_err)]

mod control;
mod envd;
mod wire;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use subtle::ConstantTimeEq as _;
use warden_harness::{ErrorKind, Harness, HarnessError};

pub use control::template_policy;
pub use wire::{ENVD_VERSION, HOME};

/// What the face keeps of a sandbox beside its cell. What must outlive the daemon is in the
/// cell's labels (`e2b.*`: template, metadata, timeout, and the BLAKE3 digest of the access
/// token, never the token), from which a daemon that starts again takes its sandboxes back.
#[derive(Debug, Clone)]
struct Sandbox {
    template: String,
    /// The access token, while this daemon knows it (a daemon that started again knows only
    /// its digest, until a connect gives the sandbox a new one).
    token: Option<String>,
    /// BLAKE3 of the access tokens it takes, in hex (the first, in its cell's labels, and any a
    /// connect gave it since this daemon started).
    token_digests: Vec<String>,
    metadata: BTreeMap<String, String>,
    started: SystemTime,
    /// When the sandbox's timeout ends it (none while it is paused by its timeout).
    end: Option<SystemTime>,
    /// At the end, pause instead of kill.
    auto_pause: bool,
    /// Processes started with a tag, by tag.
    tags: HashMap<String, u64>,
    /// Processes started on a terminal (their output is `pty` data).
    ttys: Vec<u64>,
    /// Directory watchers by id: what each saw last.
    watchers: HashMap<String, envd::Watcher>,
}

impl Sandbox {
    /// Whether `cell` is this sandbox's own cell: the one made for it carries the digest of its
    /// first token among its labels. A cell that took the name later (the sandbox's own was
    /// deleted through the daemon's API, and another made under its name) is not: the sandbox's
    /// token reached that cell's files and commands, and its timeout deleted it.
    fn owns(&self, cell: &warden_protocol::CellInfo) -> bool {
        cell.labels.get(label::MADE_BY).map(String::as_str) == Some("e2b")
            && cell.labels.get(label::TOKEN_DIGEST) == self.token_digests.first()
    }
}

/// The face's state: the harness, the API key, and the sandboxes it made.
#[derive(Debug)]
pub struct E2b {
    harness: Arc<Harness>,
    key: String,
    sandboxes: Mutex<HashMap<String, Sandbox>>,
}

type Shared = Arc<E2b>;

impl E2b {
    /// Sandbox `id` and its cell, while the cell is still the sandbox's own (running, paused or
    /// ended, but not deleted). A sandbox whose cell is gone, or whose name another cell has
    /// taken since, is forgotten here: none of its calls reach a cell again.
    fn sandbox(&self, id: &str) -> Option<(Sandbox, warden_protocol::CellInfo)> {
        let sandbox = self.sandboxes.lock().ok()?.get(id).cloned()?;
        match self.harness.get(id) {
            Ok(cell) if sandbox.owns(&cell) => Some((sandbox, cell)),
            Ok(_) => {
                self.forget(id, &sandbox);
                None
            }
            // Not there: forgotten. A failed look (the daemon's state unreadable now) forgets
            // nothing, and lets nothing through.
            Err(err) => {
                if err.kind == ErrorKind::NotFound {
                    self.forget(id, &sandbox);
                }
                None
            }
        }
    }

    /// Forgets sandbox `id` if the map still holds `sandbox` under it (not one made since).
    fn forget(&self, id: &str, sandbox: &Sandbox) {
        if let Ok(mut sandboxes) = self.sandboxes.lock()
            && sandboxes
                .get(id)
                .is_some_and(|s| s.token_digests.first() == sandbox.token_digests.first())
        {
            sandboxes.remove(id);
        }
    }
}

/// A random key of the form the SDKs accept (`e2b_` and 40 hex digits).
pub fn new_key() -> Result<String, String> {
    Ok(format!("e2b_{}", random_hex(20)?))
}

fn random_hex(bytes: usize) -> Result<String, String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| format!("no randomness for a key: {e}"))?;
    Ok(hex::encode(buf))
}

/// The face's router: the control plane and envd on one listener. `key`: the API key every
/// control-plane call must carry (`X-API-KEY`).
pub fn router(harness: Arc<Harness>, key: String) -> Router {
    let sandboxes = taken_back(&harness);
    let state = Arc::new(E2b {
        harness,
        key,
        sandboxes: Mutex::new(sandboxes),
    });
    tokio::spawn(reap(Arc::clone(&state)));
    control::routes()
        .merge(envd::routes())
        .fallback(unsupported)
        .layer(middleware::from_fn(refusals_in_shape))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .with_state(state)
}

/// Label keys of a sandbox's cell.
pub(crate) mod label {
    pub const MADE_BY: &str = "made-by";
    pub const TEMPLATE: &str = "e2b.template";
    pub const METADATA: &str = "e2b.metadata";
    pub const TIMEOUT: &str = "e2b.timeout-s";
    pub const AUTO_PAUSE: &str = "e2b.auto-pause";
    pub const TOKEN_DIGEST: &str = "e2b.token-blake3";
}

pub(crate) fn digest(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

/// The sandboxes an earlier daemon made, from their cells' labels; their timeouts start anew.
fn taken_back(harness: &Harness) -> HashMap<String, Sandbox> {
    let now = SystemTime::now();
    let mut out = HashMap::new();
    for cell in harness.list().unwrap_or_default() {
        let l = &cell.labels;
        if l.get(label::MADE_BY).map(String::as_str) != Some("e2b")
            || cell.state == warden_protocol::CellState::Ended
        {
            continue;
        }
        let Some(token_digest) = l.get(label::TOKEN_DIGEST).cloned() else {
            continue;
        };
        let timeout_s = l
            .get(label::TIMEOUT)
            .and_then(|t| t.parse().ok())
            .unwrap_or(300);
        let sandbox = Sandbox {
            template: l
                .get(label::TEMPLATE)
                .cloned()
                .unwrap_or_else(|| "base".to_owned()),
            token: None,
            token_digests: vec![token_digest],
            metadata: l
                .get(label::METADATA)
                .and_then(|m| serde_json::from_str(m).ok())
                .unwrap_or_default(),
            started: SystemTime::UNIX_EPOCH + Duration::from_millis(cell.created_ms),
            end: (cell.state == warden_protocol::CellState::Running)
                .then(|| now + Duration::from_secs(timeout_s)),
            auto_pause: l.get(label::AUTO_PAUSE).map(String::as_str) == Some("true"),
            tags: HashMap::new(),
            ttys: Vec::new(),
            watchers: HashMap::new(),
        };
        out.insert(cell.name, sandbox);
    }
    out
}

/// A control-plane error as the SDKs read it: `{"code": STATUS, "message": "..."}`.
fn api_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message.into() })),
    )
        .into_response()
}

fn status_of(kind: ErrorKind) -> StatusCode {
    StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn harness_error(err: HarnessError) -> Response {
    api_error(status_of(err.kind), err.message)
}

async fn unsupported(request: Request) -> Response {
    api_error(
        StatusCode::NOT_IMPLEMENTED,
        format!(
            "{} {} is not supported by Warden's E2B-compatible API (see the table of supported calls in Warden's README)",
            request.method(),
            request.uri().path()
        ),
    )
}

/// The most of a plain-text refusal that is read to answer it in the face's shape.
const REFUSAL_LIMIT: usize = 64 * 1024;

/// Answers what the web framework refuses before a handler runs (a body over its limit, a
/// query string that cannot be read) in the shape the SDKs read, as every handler's own
/// refusals are: `{"code": STATUS, "message"}` on the control plane and envd's `/files`, a
/// Connect error on envd's services. They were plain text ("Failed to buffer the request
/// body: length limit exceeded").
async fn refusals_in_shape(request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    let plain = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !plain || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), REFUSAL_LIMIT)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!("{text}: the request is larger than this call takes; send less")
    } else {
        text
    };
    if envd::is_envd_path(&path) && path != "/files" {
        let code = match status {
            StatusCode::PAYLOAD_TOO_LARGE => "resource_exhausted",
            s if s.is_client_error() => "invalid_argument",
            _ => "internal",
        };
        envd::connect_error(code, message)
    } else {
        api_error(status, message)
    }
}

/// Marks a response to a request that proved its caller (a valid `X-API-KEY`, or the access
/// token of the sandbox it names). The listener keeps the connection of such a caller when it
/// is full: any other answer (a 404 for a sandbox nobody made, a refusal) proves nothing, and a
/// connection that carried only those is made room with like a stranger's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Authenticated;

/// Who may call: the API key on the control plane; on envd's paths, the access token of the
/// sandbox the call names (`E2b-Sandbox-Id`), which create and connect gave its caller. What
/// passes is answered with [`Authenticated`] in its extensions.
async fn auth(
    State(state): State<Shared>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    let envd = envd::is_envd_path(path);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    if envd {
        let id = header("e2b-sandbox-id");
        let token = header("x-access-token");
        let expected = state.sandbox(&id).map(|(s, _)| s.token_digests);
        let given = digest(&token);
        match expected {
            Some(expected)
                if expected
                    .iter()
                    .any(|d| bool::from(given.as_bytes().ct_eq(d.as_bytes()))) => {}
            Some(_) => {
                return envd::connect_error(
                    "unauthenticated",
                    "wrong or missing X-Access-Token for this sandbox",
                );
            }
            None => {
                return envd::connect_error(
                    "not_found",
                    format!("no sandbox `{id}` (the E2b-Sandbox-Id header names it)"),
                );
            }
        }
    } else if !bool::from(header("x-api-key").as_bytes().ct_eq(state.key.as_bytes())) {
        return api_error(
            StatusCode::UNAUTHORIZED,
            "a valid X-API-KEY is required: the key `warden serve --e2b` wrote to e2b.key in its runtime directory (E2B_API_KEY)",
        );
    }
    let mut response = next.run(request).await;
    response.extensions_mut().insert(Authenticated);
    response
}

/// Ends sandboxes whose timeout passed: killed and deleted, or paused with `autoPause`.
async fn reap(state: Shared) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let now = SystemTime::now();
        let due: Vec<(String, bool)> = match state.sandboxes.lock() {
            Ok(mut sandboxes) => {
                let due: Vec<(String, bool)> = sandboxes
                    .iter()
                    .filter(|(_, s)| s.end.is_some_and(|end| end <= now))
                    .map(|(id, s)| (id.clone(), s.auto_pause))
                    .collect();
                // Ended once: a connect of a paused one resumes it and sets a new end; a
                // killed one is forgotten once its cell is gone.
                for (id, _) in &due {
                    if let Some(s) = sandboxes.get_mut(id) {
                        s.end = None;
                    }
                }
                due
            }
            Err(_) => return,
        };
        for (id, pause) in due {
            // Only the sandbox's own cell: one that took its name since is another's.
            if state.sandbox(&id).is_none() {
                continue;
            }
            let by = "the E2B sandbox timeout";
            if pause {
                let _ = state
                    .harness
                    .control(&id, warden_protocol::ControlAction::Pause, by)
                    .await;
            } else {
                let _ = state.harness.delete(&id, by).await;
                if let Ok(mut sandboxes) = state.sandboxes.lock() {
                    sandboxes.remove(&id);
                }
            }
        }
    }
}
