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
            // The connection has proven its owner: it is not closed to make room for strangers.
            if let Some(conn) = request.extensions().get::<Arc<crate::listen::Admitted>>() {
                conn.trust();
            }
            next.run(request).await
        }
        // The page and its login, before anyone has logged in.
        Ok(None) => next.run(request).await,
        Err(refused) => {
            let unauthorized = refused.status == StatusCode::UNAUTHORIZED;
            let mut response = refused.into_response();
            if unauthorized {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer"),
                );
            }
            // A connection that failed to prove itself is not kept.
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            response
        }
    }
}
