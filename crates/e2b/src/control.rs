//! The control plane: sandboxes made, listed, timed, paused, resumed and killed (both SDK
//! generations' routes).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use warden_protocol::{CellState, ControlAction};

use crate::wire::{self, ALIAS, ENVD_VERSION, HOME};
use crate::{Sandbox, Shared, api_error, harness_error, label, random_hex};

/// How long a sandbox lives when the create does not say (the SDKs' default).
const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest timeout accepted (E2B's own limit for its paid tier).
const MAX_TIMEOUT_S: u64 = 24 * 3600;

const BY: &str = "the E2B API key";

pub(crate) fn routes() -> Router<Shared> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
}

/// A JSON body, read leniently (unknown fields are ignored; an empty body is the defaults).
fn body<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, Response> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes).map_err(|e| {
        api_error(
            StatusCode::BAD_REQUEST,
            format!("the request body is not what this call takes: {e}"),
        )
    })
}

impl Default for wire::NewSandbox {
    fn default() -> Self {
        Self {
            template: "base".to_owned(),
            timeout: None,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            auto_pause: false,
        }
    }
}

fn timeout_of(seconds: Option<u64>) -> Result<Duration, Response> {
    match seconds.unwrap_or(DEFAULT_TIMEOUT_S) {
        0 => Err(api_error(
            StatusCode::BAD_REQUEST,
            "a timeout of 0 seconds would end the sandbox at once; give at least 1",
        )),
        s if s > MAX_TIMEOUT_S => Err(api_error(
            StatusCode::BAD_REQUEST,
            format!("a timeout of {s} s is longer than the {MAX_TIMEOUT_S} s this server allows"),
        )),
        s => Ok(Duration::from_secs(s)),
    }
}

/// The policy of a template: a Warden preset (`base` is `default`), with the workspace, the
/// working directory and `HOME` at the E2B user's home.
fn policy_of(template: &str) -> Result<String, Response> {
    template_policy(template).map_err(|why| api_error(StatusCode::BAD_REQUEST, why))
}

/// The policy (YAML) the sandboxes of an E2B template get, or why there is none (what
/// `warden serve --pool e2b:TEMPLATE=N` keeps made ahead).
pub fn template_policy(template: &str) -> Result<String, String> {
    let preset = match template {
        "base" | "" => "default",
        other => other,
    };
    if warden_policy_known(preset).is_none() {
        let known: Vec<&str> = std::iter::once("base")
            .chain(warden_presets().into_iter().filter(|p| *p != "default"))
            .collect();
        // A name of any length is shown by its head only.
        let shown: String = template.chars().take(64).collect();
        let cut = if shown.len() < template.len() {
            format!("… ({} bytes)", template.len())
        } else {
            String::new()
        };
        return Err(format!(
            "template `{shown}`{cut} is not known here; templates are Warden's presets: {}",
            known.join(", ")
        ));
    }
    Ok(format!(
        "version: 1\nextends: {preset}\nfilesystem:\n  workspace:\n    mount: {HOME}\n  links:\n    {ALIAS}: {HOME}\nprocess:\n  cwd: {HOME}\n  env:\n    set:\n      HOME: {HOME}\n      USER: user\n"
    ))
}

fn warden_presets() -> Vec<&'static str> {
    warden_policy::PRESETS
        .iter()
        .map(|(name, _, _)| *name)
        .collect()
}

fn warden_policy_known(name: &str) -> Option<()> {
    warden_presets().contains(&name).then_some(())
}

async fn create(State(state): State<Shared>, bytes: Bytes) -> Response {
    let request: wire::NewSandbox = match body(&bytes) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let timeout = match timeout_of(request.timeout) {
        Ok(t) => t,
        Err(e) => return e,
    };
    let policy = match policy_of(&request.template) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let token = match random_hex(16) {
        Ok(token) => token,
        _ => {
            return api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no randomness for a token",
            );
        }
    };
    let token_digest = crate::digest(&token);
    // The cell's name is the sandbox's id: the warden names it, so that a cell made ahead for
    // the template's policy (`warden serve --pool e2b:TEMPLATE=N`) can be the sandbox.
    let create = warden_protocol::CreateCell {
        name: None,
        policy: Some(policy),
        env: request.env_vars,
        labels: [
            (label::MADE_BY, "e2b".to_owned()),
            (label::TEMPLATE, request.template.clone()),
            (
                label::METADATA,
                serde_json::to_string(&request.metadata).unwrap_or_default(),
            ),
            (label::TIMEOUT, timeout.as_secs().to_string()),
            (label::AUTO_PAUSE, request.auto_pause.to_string()),
            (label::TOKEN_DIGEST, token_digest.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
        ..Default::default()
    };
    let id = match state.harness.create(create).await {
        Ok(made) => made.name,
        Err(err) => return harness_error(err),
    };
    let now = SystemTime::now();
    let sandbox = Sandbox {
        template: request.template,
        token: Some(token),
        token_digests: vec![token_digest],
        metadata: request.metadata,
        started: now,
        end: Some(now + timeout),
        auto_pause: request.auto_pause,
        tags: HashMap::new(),
        ttys: Vec::new(),
        watchers: HashMap::new(),
    };
    let answer = sandbox_of(&id, &sandbox);
    if let Ok(mut sandboxes) = state.sandboxes.lock() {
        sandboxes.insert(id, sandbox);
    }
    (StatusCode::CREATED, axum::Json(answer)).into_response()
}

fn sandbox_of(id: &str, s: &Sandbox) -> wire::Sandbox {
    wire::Sandbox {
        template: s.template.clone(),
        id: id.to_owned(),
        client: "warden",
        envd_version: ENVD_VERSION,
        token: s.token.clone().unwrap_or_default(),
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The sandbox, if this face made it and its cell is still there.
fn known(state: &Shared, id: &str) -> Result<(Sandbox, CellState), Response> {
    match state.sandbox(id) {
        Some((sandbox, cell)) if cell.state != CellState::Ended => Ok((sandbox, cell.state)),
        _ => Err(api_error(
            StatusCode::NOT_FOUND,
            format!("sandbox `{id}` not found"),
        )),
    }
}

fn listed(id: &str, s: &Sandbox, state: CellState, with_token: bool) -> wire::Listed {
    wire::Listed {
        template: s.template.clone(),
        id: id.to_owned(),
        client: "warden",
        started_at: rfc3339(s.started),
        end_at: rfc3339(s.end.unwrap_or_else(SystemTime::now)),
        cpu_count: 1,
        memory_mb: 1024,
        disk_size_mb: 0,
        state: match state {
            CellState::Paused => "paused",
            _ => "running",
        },
        envd_version: ENVD_VERSION,
        metadata: s.metadata.clone(),
        token: if with_token { s.token.clone() } else { None },
    }
}

async fn info(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    match known(&state, &id) {
        Ok((sandbox, cell)) => axum::Json(listed(&id, &sandbox, cell, true)).into_response(),
        Err(e) => e,
    }
}

async fn list(State(state): State<Shared>, Query(query): Query<Vec<(String, String)>>) -> Response {
    let param = |name: &str| {
        query
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .collect::<Vec<_>>()
    };
    // `state=running,paused` (or repeated), `metadata=k%3Dv%26k2%3Dv2`.
    let states: Vec<String> = param("state")
        .iter()
        .flat_map(|v| v.split(',').map(str::to_owned).collect::<Vec<_>>())
        .collect();
    let wanted: Vec<(String, String)> = param("metadata")
        .iter()
        .flat_map(|v| {
            v.split('&')
                .filter_map(|pair| pair.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect();
    let sandboxes: Vec<(String, Sandbox)> = state
        .sandboxes
        .lock()
        .map(|s| s.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    for (id, _) in sandboxes {
        let Some((sandbox, cell)) = state.sandbox(&id) else {
            continue;
        };
        if cell.state == CellState::Ended {
            continue;
        }
        let item = listed(&id, &sandbox, cell.state, false);
        if !states.is_empty() && !states.iter().any(|s| s == item.state) {
            continue;
        }
        if !wanted
            .iter()
            .all(|(k, v)| sandbox.metadata.get(k) == Some(v))
        {
            continue;
        }
        out.push(item);
    }
    out.sort_by(|a, b| a.started_at.cmp(&b.started_at).then(a.id.cmp(&b.id)));
    axum::Json(out).into_response()
}

async fn kill(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    if let Err(e) = known(&state, &id) {
        return e;
    }
    let deleted = state.harness.delete(&id, BY).await;
    if let Ok(mut sandboxes) = state.sandboxes.lock() {
        sandboxes.remove(&id);
    }
    match deleted {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => harness_error(err),
    }
}

async fn set_timeout(
    State(state): State<Shared>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Response {
    let request: wire::Timeout = match body(&bytes) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let Some(seconds) = request.timeout else {
        return api_error(StatusCode::BAD_REQUEST, "`timeout` (seconds) is required");
    };
    let timeout = match timeout_of(Some(seconds)) {
        Ok(t) => t,
        Err(e) => return e,
    };
    if let Err(e) = known(&state, &id) {
        return e;
    }
    if let Ok(mut sandboxes) = state.sandboxes.lock()
        && let Some(s) = sandboxes.get_mut(&id)
    {
        s.end = Some(SystemTime::now() + timeout);
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn pause(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    match known(&state, &id) {
        Ok((_, CellState::Paused)) => api_error(
            StatusCode::CONFLICT,
            format!("sandbox `{id}` is already paused"),
        ),
        Ok(_) => match state.harness.control(&id, ControlAction::Pause, BY).await {
            Ok(_) => StatusCode::NO_CONTENT.into_response(),
            Err(err) => harness_error(err),
        },
        Err(e) => e,
    }
}

/// Connect (and resume): a paused sandbox is thawed; the timeout is set anew when given.
async fn connect(State(state): State<Shared>, Path(id): Path<String>, bytes: Bytes) -> Response {
    let request: wire::Timeout = match body(&bytes) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let (mut sandbox, cell) = match known(&state, &id) {
        Ok(k) => k,
        Err(e) => return e,
    };
    if sandbox.token.is_none() {
        // Taken back by a daemon that started again: it knows only the old token's digest, so
        // the connect gives the sandbox a new token (the old one goes on working too).
        let Ok(token) = random_hex(16) else {
            return api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no randomness for a token",
            );
        };
        sandbox.token = Some(token.clone());
        if let Ok(mut sandboxes) = state.sandboxes.lock()
            && let Some(s) = sandboxes.get_mut(&id)
        {
            s.token = Some(token.clone());
            s.token_digests.push(crate::digest(&token));
        }
    }
    let resumed = cell == CellState::Paused;
    if resumed && let Err(err) = state.harness.control(&id, ControlAction::Resume, BY).await {
        return harness_error(err);
    }
    if let Some(seconds) = request.timeout.or(resumed.then_some(DEFAULT_TIMEOUT_S)) {
        let timeout = match timeout_of(Some(seconds)) {
            Ok(t) => t,
            Err(e) => return e,
        };
        if let Ok(mut sandboxes) = state.sandboxes.lock()
            && let Some(s) = sandboxes.get_mut(&id)
        {
            s.end = Some(SystemTime::now() + timeout);
        }
    }
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, axum::Json(sandbox_of(&id, &sandbox))).into_response()
}
