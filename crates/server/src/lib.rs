//! `warden serve`: the HTTP API over the harness, on an owner-only unix socket and, when asked,
//! on a loopback TCP port that requires a bearer token.

mod api;
mod listen;
pub mod openapi;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use warden_harness::{Config, Harness};

pub use api::{OPENAPI, router};
pub use listen::{HEAD_LIMIT, HEAD_TIMEOUT, MAX_CONNECTIONS};

/// The daemon's socket in the runtime directory.
pub const SOCKET: &str = warden_protocol::DAEMON_SOCKET;
/// Where the TCP listener's token is written (owner-only) unless one is given.
pub const TOKEN_FILE: &str = "daemon.token";
/// The TCP listener's address, once it listens.
pub const ADDR_FILE: &str = "daemon.addr";
/// Where the E2B-compatible API's key is written (owner-only).
pub const E2B_KEY_FILE: &str = "e2b.key";
/// The E2B-compatible API's address, once it listens.
pub const E2B_ADDR_FILE: &str = "e2b.addr";

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub harness: Config,
    /// Also listen on this loopback address (token required).
    pub listen: Option<SocketAddr>,
    /// A file holding the token; without it one is made and written next to the socket.
    pub token_file: Option<PathBuf>,
    /// Also serve the E2B-compatible API on this loopback address (its key is made at start
    /// and written to `e2b.key` in the runtime directory).
    pub e2b: Option<SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("a warden daemon already listens on {0}; stop it first (or use it)")]
    Running(PathBuf),
    #[error(
        "{socket} is served by uid {uid}, another user: its runtime directory is not yours (another user may have made it first; the default /tmp/warden-UID is anyone's to make where XDG_RUNTIME_DIR is unset). Remove that directory, or set WARDEN_RUNTIME_DIR to a directory only you can write"
    )]
    Stranger { socket: PathBuf, uid: u32 },
    #[error(
        "{0}: the daemon listens on loopback addresses only (127.0.0.1, ::1; for --listen and --e2b alike); put a TLS proxy in front for anything else"
    )]
    NotLoopback(SocketAddr),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the token in {0} is shorter than 16 characters")]
    WeakToken(PathBuf),
    #[error(
        "the token file {path} {why}: another local user could read the token and use the API as you. Make it yours and owner-only (`chmod 600 {path}`), or leave --token-file out and the daemon makes a token in its runtime directory"
    )]
    OpenToken { path: PathBuf, why: String },
    #[error(transparent)]
    Harness(#[from] warden_harness::HarnessError),
}

fn io_at<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ServeError + 'a {
    move |source| ServeError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Runs the daemon until SIGINT or SIGTERM. `ready` is called with the socket path once the API
/// accepts requests.
pub async fn serve(
    config: ServeConfig,
    ready: impl FnOnce(&Path, Option<SocketAddr>),
) -> Result<(), ServeError> {
    let socket = config.harness.runtime.join(SOCKET);
    for addr in [config.listen, config.e2b].into_iter().flatten() {
        if !addr.ip().is_loopback() {
            return Err(ServeError::NotLoopback(addr));
        }
    }
    std::fs::create_dir_all(&config.harness.runtime)
        .map_err(io_at("creating", &config.harness.runtime))?;
    if let Ok(stream) = tokio::net::UnixStream::connect(&socket).await {
        // Another user's process on this path is no daemon to use (the clients refuse it too).
        let uid = stream.peer_cred().map(|c| c.uid()).unwrap_or(0);
        if uid != 0 && uid != rustix::process::geteuid().as_raw() {
            return Err(ServeError::Stranger { socket, uid });
        }
        return Err(ServeError::Running(socket));
    }
    let harness = Harness::open(config.harness.clone()).await?;
    let agents = warden_agent::Agents::open(
        Arc::clone(&harness),
        Some(config.harness.state.join("daemon").join("agents")),
    );
    // An earlier daemon's addresses (one killed, or one started with other listeners) are not
    // this one's: `warden dashboard` would hand the token to whatever program holds that port
    // now, and an E2B client would be pointed at it with a key that no longer opens anything.
    for (listens, files) in [
        (config.listen.is_some(), &[ADDR_FILE][..]),
        (config.e2b.is_some(), &[E2B_ADDR_FILE, E2B_KEY_FILE][..]),
    ] {
        for file in files.iter().filter(|_| !listens) {
            let path = config.harness.runtime.join(file);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io_at("removing an earlier daemon's", &path)(e));
                }
                _ => {}
            }
        }
    }
    // TCP first (token, port, address file): once the unix socket answers, all is ready.
    let mut tcp_addr = None;
    if let Some(addr) = config.listen {
        let token = load_or_make_token(&config, &config.harness.runtime.join(TOKEN_FILE))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Io {
                what: "listening on",
                path: PathBuf::from(addr.to_string()),
                source,
            })?;
        tcp_addr = listener.local_addr().ok();
        if let Some(bound) = tcp_addr {
            // Where a client finds the port when `--listen` asked for port 0.
            let file = config.harness.runtime.join(ADDR_FILE);
            std::fs::write(&file, bound.to_string()).map_err(io_at("writing", &file))?;
        }
        let app = router(Arc::clone(&agents), Some(token));
        tokio::spawn(listen::serve(listener, app, false));
    }
    if let Some(addr) = config.e2b {
        let key = warden_e2b::new_key().map_err(|e| ServeError::Io {
            what: "making a key for",
            path: config.harness.runtime.join(E2B_KEY_FILE),
            source: std::io::Error::other(e),
        })?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Io {
                what: "listening on",
                path: PathBuf::from(addr.to_string()),
                source,
            })?;
        write_private(&config.harness.runtime.join(E2B_KEY_FILE), &key)?;
        if let Ok(bound) = listener.local_addr() {
            let file = config.harness.runtime.join(E2B_ADDR_FILE);
            std::fs::write(&file, bound.to_string()).map_err(io_at("writing", &file))?;
        }
        let app = warden_e2b::router(Arc::clone(&harness), key)
            .layer(axum::middleware::from_fn(listen::trust_if_authenticated));
        tokio::spawn(listen::serve(listener, app, false));
    }
    let _ = std::fs::remove_file(&socket);
    let unix = tokio::net::UnixListener::bind(&socket).map_err(io_at("listening on", &socket))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .map_err(io_at("restricting", &socket))?;
    let app = router(Arc::clone(&agents), None);
    let unix_server = tokio::spawn(listen::serve(unix, app, true));
    ready(&socket, tcp_addr);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io_at("handling signals for", &socket))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = unix_server => {}
    }
    harness.shutdown().await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

fn load_or_make_token(config: &ServeConfig, default: &Path) -> Result<String, ServeError> {
    if let Some(path) = &config.token_file {
        // The token is the daemon's owner's whole API on TCP: a file others can read (or
        // replace) hands it to every local user.
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).map_err(io_at("reading the token", path))?;
        let ours = rustix::process::geteuid().as_raw();
        let why = if meta.uid() != ours && meta.uid() != 0 {
            Some(format!(
                "belongs to uid {}, not to you (uid {ours})",
                meta.uid()
            ))
        } else if meta.mode() & 0o077 != 0 {
            Some(format!(
                "has mode {:o}, open to its group or others",
                meta.mode() & 0o777
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(ServeError::OpenToken {
                path: path.clone(),
                why,
            });
        }
        let token = std::fs::read_to_string(path)
            .map_err(io_at("reading the token", path))?
            .trim()
            .to_owned();
        if token.len() < 16 {
            return Err(ServeError::WeakToken(path.clone()));
        }
        return Ok(token);
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| ServeError::Io {
        what: "making a token for",
        path: default.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let token = hex::encode(bytes);
    write_private(default, &token)?;
    Ok(token)
}

/// Writes a secret to a new owner-only file (replacing what was there).
fn write_private(path: &Path, secret: &str) -> Result<(), ServeError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_at("writing a secret to", path))?;
    file.write_all(secret.as_bytes())
        .map_err(io_at("writing a secret to", path))
}
