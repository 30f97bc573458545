//! Who asks: the unix socket's peer credentials, and the TCP listener's bearer token.

use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Extension, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use subtle::ConstantTimeEq as _;

use super::*;

pub use warden_harness::Caller;

/// The peer of a unix-socket connection, from the kernel (SO_PEERCRED).
#[derive(Debug, Clone)]
pub struct UnixPeer {
    uid: Option<u32>,
    pid: Option<i32>,
}

impl UnixPeer {
    /// The peer of a unix-socket connection, as the kernel gives it.
    pub fn of(stream: &tokio::net::UnixStream) -> Self {
        let cred = stream.peer_cred().ok();
        Self {
            uid: cred.map(|c| c.uid()),
            pid: cred.and_then(|c| c.pid()),
        }
    }
}

pub(super) async fn identify_unix(mut request: Request, next: Next) -> Response {
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
    next.run(request).await
}

pub(super) fn caller(extension: Option<Extension<Caller>>) -> String {
    extension.map_or_else(|| "unknown".to_owned(), |Extension(Caller(c))| c)
}

pub(super) async fn require_token(
    State(token): State<Arc<String>>,
    headers: HeaderMap,
    mut request: Request,
    next: Next,
) -> Response {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        let peer = request
            .extensions()
            .get::<ConnectInfo<std::net::SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.to_string())
            .unwrap_or_else(|| "?".to_owned());
        request
            .extensions_mut()
            .insert(Caller(format!("the bearer token, over TCP from {peer}")));
        // The connection has proven its owner: it is not closed to make room for strangers.
        if let Some(conn) = request.extensions().get::<Arc<crate::listen::Admitted>>() {
            conn.trust();
        }
        next.run(request).await
    } else {
        let mut response = ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a bearer token is required on TCP (`Authorization: Bearer TOKEN`, the token is in the daemon's runtime directory, file daemon.token)".to_owned(),
        }
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        // A connection that failed to prove itself is not kept.
        response.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        response
    }
}
