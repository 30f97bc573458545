//! Who asks: the unix socket's peer credentials, and the TCP listener's bearer token.

use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Extension, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use super::dashboard::{Gate, Proof};
use crate::listen::UnixPeer;

pub use warden_harness::Caller;

/// The unix socket's gate: every peer is the daemon's owner (the socket is owner-only); what
/// a browser marks as sent from another site is refused even here.
pub(super) async fn identify_unix(
    State(gate): State<Arc<Gate>>,
    mut request: Request,
    next: Next,
) -> Response {
    if let Err(refused) = gate.check(&request) {
        return refused.into_response();
    }
    let caller = match request.extensions().get::<ConnectInfo<UnixPeer>>() {
        Some(ConnectInfo(UnixPeer {
            uid: Some(uid),
            pid,
        })) => match pid {
            Some(pid) => format!("uid {uid} (pid {pid}) on the unix socket"),
            None => format!("uid {uid} on the unix socket"),
        },
        _ => "a client on the unix socket".to_owned(),
    };
    request.extensions_mut().insert(Caller(caller));
    request.extensions_mut().insert(Proof::Unix);
    next.run(request).await
}

pub(super) fn caller(extension: Option<Extension<Caller>>) -> String {
    extension.map_or_else(|| "unknown".to_owned(), |Extension(Caller(c))| c)
}

/// The TCP listener's gate: the bearer token, or the dashboard's session cookie (with its
/// CSRF token for changes); the dashboard's page and login pass without.
pub(super) async fn require_token(
    State(gate): State<Arc<Gate>>,
    mut request: Request,
    next: Next,
) -> Response {
    match gate.check(&request) {
        Ok(Some(proof)) => {
            let peer = request
                .extensions()
                .get::<ConnectInfo<std::net::SocketAddr>>()
                .map(|ConnectInfo(addr)| addr.to_string())
                .unwrap_or_else(|| "?".to_owned());
            let how = match proof {
                Proof::Cookie => "the dashboard's session",
                _ => "the bearer token",
            };
            request
                .extensions_mut()
                .insert(Caller(format!("{how}, over TCP from {peer}")));
            request.extensions_mut().insert(proof);
            if proof == Proof::Cookie
                && let Some(uri) = super::dashboard::without_csrf_param(request.uri())
            {
                *request.uri_mut() = uri;
            }
            // The connection has proven its owner: it is not closed to make room for strangers.
            if let Some(conn) = request.extensions().get::<Arc<crate::listen::Admitted>>() {
                conn.trust();
            }
            next.run(request).await
        }
        // The page and its login, before anyone has logged in: only a small body.
        Ok(None) => match unproven_body(request).await {
            Ok(request) => next.run(request).await,
            Err(refused) => closing(refused),
        },
        Err(refused) => closing(refused),
    }
}

/// A refusal on TCP: a connection that failed to prove itself is not kept.
fn closing(refused: super::ApiError) -> Response {
    let unauthorized = refused.status == StatusCode::UNAUTHORIZED;
    let mut response = refused.into_response();
    if unauthorized {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// The body of a request that has proven nothing (the dashboard's login, or the page asked
/// with one), read here whole, and only a small one: the API's limit (1 MiB) was a stranger's
/// to fill on every connection it opened, and a thousand logins that never sent their last
/// byte held a gigabyte of the daemon's memory. A larger declared length is refused before a
/// byte of it is read.
async fn unproven_body(request: Request) -> Result<Request, super::ApiError> {
    use futures_util::StreamExt as _;
    let too_large = || super::ApiError {
        reason: None,
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!(
            "a request without the token (the dashboard's login) carries at most {} KiB; a login's body is {{\"token\": TOKEN}}",
            OPEN_BODY_LIMIT / 1024
        ),
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > OPEN_BODY_LIMIT as u64) {
        return Err(too_large());
    }
    let (parts, body) = request.into_parts();
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| super::ApiError {
            reason: None,
            status: StatusCode::BAD_REQUEST,
            message: format!("reading the request's body: {e}"),
        })?;
        if bytes.len() + chunk.len() > OPEN_BODY_LIMIT {
            return Err(too_large());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

/// The largest body of a request that has proven nothing (a login is a few dozen bytes).
pub(super) const OPEN_BODY_LIMIT: usize = 8 * 1024;
