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
