//! The MCP face on the daemon: streamable HTTP at `/mcp` (the tools of `warden-mcp`, behind the
//! same token or peer check as every route), and `GET /v1/mcp`, which upgrades a connection to
//! an MCP session over the bare byte stream, for `warden mcp` on the unix socket: a client
//! speaking stdio then talks to this daemon's harness, not to one of its own.

use axum::extract::{Extension, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::*;

use warden_protocol::MCP_UPGRADE;

pub(super) async fn mcp_stream(
    State(harness): State<Shared>,
    by: Option<Extension<Caller>>,
    mut request: Request,
) -> Result<Response, ApiError> {
    let asked = request
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(MCP_UPGRADE));
    if !asked {
        return Err(ApiError {
            reason: None,
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "this endpoint upgrades the connection to an MCP session (`Upgrade: {MCP_UPGRADE}`, as `warden mcp` sends); MCP over HTTP is at /mcp"
            ),
        });
    }
    let upgrade = hyper::upgrade::on(&mut request);
    let by = format!("{} through `warden mcp`", caller(by));
    tokio::spawn(async move {
        if let Ok(upgraded) = upgrade.await {
            let tools = warden_mcp::Tools::new(harness, by);
            let _ = warden_mcp::serve(tools, TokioIo::new(upgraded)).await;
        }
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static(MCP_UPGRADE));
    Ok(response)
}

/// The most of a refusal's text of the MCP layer that is read to answer it as JSON-RPC.
const REFUSAL_LIMIT: usize = 64 * 1024;

/// Answers what the MCP layer at `/mcp` refuses in plain text (a body that is no JSON-RPC
/// request: not JSON, a batch, an id of the wrong type; a body over its limit; a missing
/// session) as a JSON-RPC error object, as a client reads an error: it answered 415 with
/// `fail to deserialize request body` for a body that was not JSON. Other routes pass through.
pub(super) async fn mcp_errors_as_jsonrpc(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.uri().path() != "/mcp" {
        return next.run(request).await;
    }
    let response = next.run(request).await;
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json") || v.starts_with("text/event-stream"));
    if status.is_success() {
        return response;
    }
    if json {
        return if status == StatusCode::NOT_FOUND {
            method_not_found(response).await
        } else {
            response
        };
    }
    let text = match axum::body::to_bytes(response.into_body(), REFUSAL_LIMIT).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    };
    let (status, code, message) = jsonrpc_refusal(status, &text);
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": { "code": code, "message": message },
    });
    (status, axum::Json(body)).into_response()
}

/// The MCP layer's "method not found" says only the method's name, also for a method it has
/// whose `params` it could not read (`tools/call` with `arguments` that are no object): this
/// says which it may be, and what to send.
async fn method_not_found(response: Response) -> Response {
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, REFUSAL_LIMIT).await else {
        return (parts.status, "").into_response();
    };
    let mut answer: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(answer) => answer,
        Err(_) => return Response::from_parts(parts, axum::body::Body::from(bytes)),
    };
    if answer["error"]["code"] == -32601 {
        let method = answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        answer["error"]["message"] = serde_json::Value::from(format!(
            "`{method}` is no method of this server, or its `params` are not what it takes: \
             `tools/list` lists the tools, and `tools/call` takes `{{\"name\": TOOL, \
             \"arguments\": {{...}}}}` with an object of the tool's arguments"
        ));
    }
    (parts.status, axum::Json(answer)).into_response()
}

/// The status, JSON-RPC code and message of a plain-text refusal of the MCP layer.
fn jsonrpc_refusal(status: StatusCode, text: &str) -> (StatusCode, i64, String) {
    const PARSE_ERROR: i64 = -32700;
    const INVALID_REQUEST: i64 = -32600;
    if let Some(detail) = text.strip_prefix("fail to deserialize request body") {
        let detail = detail.trim();
        return if detail.contains("unrecognized JSON-RPC message") {
            (
                StatusCode::BAD_REQUEST,
                INVALID_REQUEST,
                "the body is JSON but no JSON-RPC 2.0 message: send one object with \
                 `\"jsonrpc\": \"2.0\"`, a `method`, its `params`, and an `id` that is a string \
                 or a whole number (none for a notification); batches (arrays) are not taken"
                    .to_owned(),
            )
        } else {
            (
                StatusCode::BAD_REQUEST,
                PARSE_ERROR,
                format!("the body is not JSON ({detail}); send one JSON-RPC 2.0 request as JSON"),
            )
        };
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return (
            status,
            INVALID_REQUEST,
            format!(
                "the request is larger than /mcp takes ({}); send less, and write a large file \
                 with the HTTP API's files route (PUT /v1/cells/NAME/files/content) or over \
                 `warden mcp`",
                text.trim()
            ),
        );
    }
    let text = text.trim();
    let message = if text.is_empty() {
        format!("the MCP endpoint refused the request ({status})")
    } else {
        text.to_owned()
    };
    (status, INVALID_REQUEST, message)
}
