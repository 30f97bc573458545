//! The daemon's listeners: what a client can make the daemon hold before it has proven who it
//! is. Each listener admits a bounded number of connections; a connection must send each
//! request head within [`HEAD_TIMEOUT`] (an idle kept-alive connection too); when the listener
//! is full, the oldest connection that has not yet carried an authenticated request makes room
//! for the new one, so that idle or slow strangers cannot keep the API from its owner; a head
//! must fit in [`HEAD_LIMIT`], so that what each connection makes the daemon hold is small. Errors
//! from `accept` (out of descriptors, say) are waited out; they never reach the harness, which
//! learns of a cell's end only from the cell's keeper.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};

/// Time for each request head (and for an idle kept-alive connection to send its next one).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(20);
/// The most a connection's read buffer holds: a request head must fit (hyper answers 431
/// otherwise). Hyper's own default (about 400 KiB) let each stranger's connection hold that
/// much with a head it never ended (a thousand connections held 370 MB of the daemon's memory).
pub const HEAD_LIMIT: usize = 64 * 1024;
/// Connections each listener holds at once, at most; fewer where the daemon's limit of open
/// files is low (a quarter of it each), so that connections can never take the descriptors
/// its cells need.
pub const MAX_CONNECTIONS: usize = 1024;

/// The connections each listener admits under the current limit of open files.
pub fn connection_limit() -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    (soft / 4).clamp(16, MAX_CONNECTIONS as u64) as usize
}

/// One admitted connection.
#[derive(Debug)]
pub struct Admitted {
    id: u64,
    /// Has carried a request that proved its caller (a good token; the unix socket proves it
    /// by the kernel's file permissions).
    trusted: AtomicBool,
    evict: tokio::sync::Notify,
}

impl Admitted {
    /// Marks the connection as its owner's: it is no longer made room with.
    pub fn trust(&self) {
        self.trusted.store(true, Ordering::Relaxed);
    }
}

/// For the E2B-compatible API's listener, whose router checks its callers itself (its key and
/// sandboxes' tokens): a connection that carried a request the router answered as
/// [`warden_e2b::Authenticated`] has proven its caller, and is no longer made room with. Only
/// that mark counts, never the status: a stranger's request can be answered without a 401 (a
/// 404 for a sandbox nobody made) and must not earn its connection a place for good.
pub async fn trust_if_authenticated(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let connection = request.extensions().get::<Arc<Admitted>>().cloned();
    let response = next.run(request).await;
    if response
        .extensions()
        .get::<warden_e2b::Authenticated>()
        .is_some()
        && let Some(connection) = connection
    {
        connection.trust();
    }
    response
}

/// The connections of one listener.
#[derive(Debug)]
struct Admission {
    max: usize,
    open: Mutex<VecDeque<Arc<Admitted>>>,
    next: AtomicU64,
}

impl Admission {
    /// Admits a new connection, making room by closing the oldest untrusted one when full;
    /// `None` when every admitted connection is trusted.
    fn admit(&self, trusted: bool) -> Option<Arc<Admitted>> {
        let mut open = self.open.lock().ok()?;
        if open.len() >= self.max {
            let oldest = open
                .iter()
                .position(|c| !c.trusted.load(Ordering::Relaxed))?;
            if let Some(evicted) = open.remove(oldest) {
                evicted.evict.notify_one();
            }
        }
        let conn = Arc::new(Admitted {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            trusted: AtomicBool::new(trusted),
            evict: tokio::sync::Notify::new(),
        });
        open.push_back(Arc::clone(&conn));
        Some(conn)
    }

    fn leave(&self, conn: &Admitted) {
        if let Ok(mut open) = self.open.lock() {
            open.retain(|c| c.id != conn.id);
        }
    }
}

/// Something the daemon listens on: TCP, or its unix socket.
pub trait Listener: Send + 'static {
    type Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// What the handlers see of the peer (`ConnectInfo`).
    type Peer: Clone + Send + Sync + 'static;
    fn accept(
        &self,
    ) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, Self::Peer)>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    type Peer = std::net::SocketAddr;
    async fn accept(&self) -> std::io::Result<(Self::Stream, Self::Peer)> {
        let (stream, peer) = tokio::net::TcpListener::accept(self).await?;
        // Streamed answers go out as many small writes (events, envelopes): with Nagle's
        // algorithm each waited for the peer's delayed ACK, 40 ms a stream. A socket that
        // refuses the option is served all the same: the listener must not fail for one.
        let _ = stream.set_nodelay(true);
        Ok((stream, peer))
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    type Peer = UnixPeer;
    async fn accept(&self) -> std::io::Result<(Self::Stream, Self::Peer)> {
        let (stream, _) = tokio::net::UnixListener::accept(self).await?;
        let peer = UnixPeer::of(&stream);
        Ok((stream, peer))
    }
}

/// Serves `router` on `listener` until the listener fails for good. `trusted`: connections are
/// their owner's from the start (the owner-only unix socket).
pub async fn serve<L: Listener>(listener: L, router: Router, trusted: bool) {
    let admission = Arc::new(Admission {
        max: connection_limit(),
        open: Mutex::new(VecDeque::new()),
        next: AtomicU64::new(0),
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) if is_transient(&e) => {
                // Out of descriptors or memory for now: the connections already open go on.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(_) => return,
        };
        let Some(conn) = admission.admit(trusted) else {
            drop(stream); // full of the owner's own connections
            continue;
        };
        let router = router.clone();
        let admission = Arc::clone(&admission);
        tokio::spawn(async move {
            let admitted = Arc::clone(&conn);
            let service = hyper::service::service_fn(
                move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(ConnectInfo(peer.clone()));
                    request.extensions_mut().insert(Arc::clone(&admitted));
                    let mut router = router.clone();
                    async move { tower_service::Service::call(&mut router, request).await }
                },
            );
            let serving = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(HEAD_LIMIT)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::select! {
                _ = serving => {}
                () = conn.evict.notified() => {}
            }
            admission.leave(&conn);
        });
    }
}

/// Accept errors that pass (descriptors, memory, a connection reset before it was taken).
fn is_transient(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::OutOfMemory
    ) || matches!(
        err.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The peer of a unix-socket connection, from the kernel (SO_PEERCRED).
#[derive(Debug, Clone)]
pub struct UnixPeer {
    pub(crate) uid: Option<u32>,
    pub(crate) pid: Option<i32>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_listener_makes_room_with_the_oldest_stranger_only() {
        let admission = Admission {
            max: 3,
            open: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
        };
        let owner = admission.admit(false).unwrap();
        owner.trust();
        let stranger = admission.admit(false).unwrap();
        let newer = admission.admit(false).unwrap();
        let newest = admission.admit(false).unwrap();
        let open: Vec<u64> = admission
            .open
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(open, vec![owner.id, newer.id, newest.id]);
        assert!(!open.contains(&stranger.id));
        newer.trust();
        newest.trust();
        assert!(
            admission.admit(false).is_none(),
            "only owners' connections are left"
        );
    }
}
