//! The routes of the HTTP API. Each handler turns a request into one harness call; the harness
//! validates, journals and carries it out. The router is here; the handlers are by subject
//! (`cells`, `processes`, `files`, `ws` for attached terminals), beside who asks (`auth`) and
//! what handlers take and give (`extract`).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::json;
use warden_harness::Harness;

mod agents;
mod auth;
mod cells;
mod dashboard;
mod extract;
mod files;
mod mcp;
mod processes;
mod routes;
mod ws;

use agents::*;
use auth::*;
use cells::*;
pub use extract::ApiError;
use extract::*;
use files::*;
use mcp::*;
use processes::*;
pub use routes::{ROUTES, Route};
use ws::*;

/// The API's OpenAPI document (also committed as docs/openapi.json).
pub const OPENAPI: &str = include_str!("../../../../docs/openapi.json");

/// Largest request body.
const BODY_LIMIT: usize = 1024 * 1024;

/// Largest file or archive upload.
const UPLOAD_LIMIT: usize = 64 * 1024 * 1024;

type Shared = Arc<Harness>;

/// The API. With a token, every request must carry `Authorization: Bearer TOKEN`.
pub fn router(agents: Arc<warden_agent::Agents>, token: Option<String>) -> Router {
    let harness = Arc::clone(agents.harness());
    let sessions = Router::new()
        .route("/v1/agents", get(list_agents).post(start_agent))
        .route("/v1/agents/{id}", get(get_agent))
        .route("/v1/agents/{id}/transcript", get(transcript))
        .route("/v1/agents/{id}/wait", get(wait_agent))
        .route("/v1/agents/{id}/pause", post(pause_agent))
        .route("/v1/agents/{id}/resume", post(resume_agent))
        .route("/v1/agents/{id}/step", post(step_agent))
        .route("/v1/agents/{id}/stop", post(stop_agent))
        .route("/v1/agents/{id}/say", post(say_agent))
        .route("/v1/agents/{id}/rewind", post(rewind_agent))
        .route("/v1/agents/{id}/fork", post(fork_agent))
        .route("/v1/agents/{id}/rerun", post(rerun_agent))
        .with_state(agents);
    let router = Router::new()
        .route("/openapi.json", get(openapi))
        .route("/v1/health", get(health))
        .route("/v1/cells", get(list_cells).post(create_cell))
        .route("/v1/cells/{name}", get(get_cell).delete(delete_cell))
        .route("/v1/cells/{name}/pause", post(pause))
        .route("/v1/cells/{name}/resume", post(resume))
        .route("/v1/cells/{name}/kill", post(kill))
        .route("/v1/cells/{name}/exec", post(exec))
        .route("/v1/run", post(run))
        .route("/v1/cells/{name}/processes", get(processes))
        .route("/v1/cells/{name}/processes/{id}", get(process))
        .route("/v1/cells/{name}/processes/{id}/output", get(output))
        .route("/v1/cells/{name}/processes/{id}/wait", get(wait))
        .route("/v1/cells/{name}/processes/{id}/stdin", post(stdin))
        .route("/v1/cells/{name}/processes/{id}/signal", post(signal))
        .route("/v1/cells/{name}/processes/{id}/resize", post(resize))
        .route("/v1/cells/{name}/processes/{id}/attach", get(attach))
        .route(
            "/v1/cells/{name}/files/content",
            get(read_file)
                .put(write_file)
                .layer(DefaultBodyLimit::max(UPLOAD_LIMIT)),
        )
        .route(
            "/v1/cells/{name}/files/archive",
            get(download)
                .put(upload)
                .layer(DefaultBodyLimit::max(UPLOAD_LIMIT)),
        )
        .route("/v1/cells/{name}/files/list", get(list_files))
        .route("/v1/cells/{name}/files/stat", get(stat_file))
        .route("/v1/cells/{name}/files/mkdir", post(mkdir))
        .route("/v1/cells/{name}/files/remove", post(remove_file))
        .route("/v1/cells/{name}/files/move", post(move_file))
        .route("/v1/cells/{name}/snapshot", post(snapshot))
        .route("/v1/cells/{name}/checkpoint", post(checkpoint))
        .route("/v1/cells/{name}/snapshots", get(snapshots))
        .route("/v1/snapshots/{id}", delete(remove_snapshot))
        .route("/v1/cells/{name}/reset", post(reset))
        .route("/v1/cells/{name}/diff", get(diff))
        .route("/v1/cells/{name}/apply", post(apply))
        .route("/v1/cells/{name}/policy", get(get_policy).put(put_policy))
        .route("/v1/events", get(events))
        .route("/v1/journal", get(journal))
        .route("/v1/journal/verify", get(verify_journal))
        .route("/v1/usage", get(usage))
        .route("/v1/pools", get(pools))
        .route("/v1/approvals", get(approvals))
        .route("/v1/approvals/{name}/{id}", post(answer))
        .route("/v1/mcp", get(mcp_stream))
        .route_service("/mcp", warden_mcp::http_service(Arc::clone(&harness)))
        .with_state(harness)
        .merge(sessions);
    let tcp = token.is_some();
    let gate = dashboard::Gate::new(token);
    let router = router
        .merge(dashboard::routes(Arc::clone(&gate)))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(read_small_body))
        .layer(middleware::from_fn(mcp_errors_as_jsonrpc))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    match tcp {
        true => router.layer(middleware::from_fn_with_state(gate, require_token)),
        false => router.layer(middleware::from_fn_with_state(gate, identify_unix)),
    }
}

/// Reads a small request body whole before the handler runs (after the caller has proven
/// who it is: the gate is the outer layer). A handler that takes no body (pause, step, kill...)
/// would otherwise leave one unread, and where its last bytes had not arrived when the answer
/// was written, hyper closes the connection: a client that had sent its next request on it
/// (a kept-alive connection) got a reset instead of an answer.
async fn read_small_body(request: axum::extract::Request, next: middleware::Next) -> Response {
    let small = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .is_some_and(|n| n > 0 && n <= BODY_LIMIT);
    if !small {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(bytes) => {
            next.run(axum::extract::Request::from_parts(
                parts,
                axum::body::Body::from(bytes),
            ))
            .await
        }
        Err(e) => ApiError {
            reason: None,
            status: StatusCode::BAD_REQUEST,
            message: format!("reading the request's body: {e}"),
        }
        .into_response(),
    }
}

async fn no_route() -> ApiError {
    ApiError {
        reason: Some("no-such-endpoint"),
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint; GET /openapi.json lists them".to_owned(),
    }
}

async fn wrong_method() -> ApiError {
    ApiError {
        reason: Some("method-not-allowed"),
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "this endpoint does not take that method; GET /openapi.json lists them".to_owned(),
    }
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn health(State(harness): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "journal_key": harness.journal().public_key(),
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    /// Every route of the router, with its methods, is in the route table the OpenAPI
    /// document is generated from, and nothing else is.
    #[test]
    fn the_route_table_names_exactly_the_routes_and_methods() {
        let source = include_str!("mod.rs");
        let mut routed: Vec<(String, String)> = Vec::new();
        for call in source.split(".route(").skip(1) {
            let Some(rest) = call.trim_start().strip_prefix('"') else {
                continue;
            };
            let path = rest.split('"').next().unwrap().to_owned();
            if !path.starts_with('/') {
                continue;
            }
            // The call's text, to its closing parenthesis.
            let mut depth = 1;
            let text: String = call
                .chars()
                .take_while(|c| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    depth > 0
                })
                .collect();
            for method in ["get", "post", "put", "delete", "patch"] {
                let needle = format!("{method}(");
                let found = text.match_indices(&needle).any(|(i, _)| {
                    i == 0
                        || !text.as_bytes()[i - 1].is_ascii_alphanumeric()
                            && text.as_bytes()[i - 1] != b'_'
                });
                if found {
                    routed.push((path.clone(), method.to_owned()));
                }
            }
        }
        routed.sort();
        routed.dedup();
        let mut tabled: Vec<(String, String)> = super::ROUTES
            .iter()
            .map(|r| (r.path.to_owned(), r.method.to_owned()))
            .collect();
        tabled.sort();
        assert_eq!(routed, tabled);
    }
}
