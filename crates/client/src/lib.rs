//! A typed client of the daemon's API, over its unix socket: what the CLI speaks to a daemon,
//! and what tests and the faces to come can speak too. Requests and answers are the protocol's
//! wire types (`call`); errors are typed (`ClientError`), an answer that is not a success
//! carrying the API's status, message and code (`ApiError`).

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// What went wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to the warden daemon at {socket} (is `warden serve` running?): {source}")]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    /// The socket is served by another user: not this user's daemon (another user may have
    /// made the runtime directory before it), so nothing is sent to it.
    #[error(
        "{socket} is served by uid {uid}, not by you (uid {ours}) or root: it is not your warden daemon, and nothing was sent to it. Another user may have made its runtime directory first (the default /tmp/warden-UID is anyone's to make where XDG_RUNTIME_DIR is unset): remove that directory, or set WARDEN_RUNTIME_DIR to a directory only you can write"
    )]
    Stranger {
        socket: PathBuf,
        uid: u32,
        ours: u32,
    },
    /// The connection broke, or the request could not be sent.
    #[error("{what}: {reason}")]
    Transport { what: &'static str, reason: String },
    /// The daemon answered, with an error of the API's.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The daemon's answer is not what this client understands.
    #[error("{0}")]
    Answer(String),
}

impl ClientError {
    /// The API's error, when the daemon answered with one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            Self::Api(api) => Some(api),
            _ => None,
        }
    }
}

type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A connection to the daemon that broke: most often the daemon stopped (or was restarted)
/// under the call, which the message says with what to do.
fn transport(what: &'static str) -> impl FnOnce(hyper::Error) -> ClientError {
    move |err| ClientError::Transport {
        what,
        reason: format!(
            "{err}; the daemon may have stopped or restarted (a command it was running for \
             this call may have ended with it): `warden ps` says whether a daemon answers, \
             `warden serve` starts one"
        ),
    }
}

#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

/// An answer that is not a success: its status and the API's message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The API's error code (absent from an answer that was not the API's own).
    pub code: Option<warden_protocol::ErrorCode>,
    /// Which failure it is, within its code (`cell-paused`, `name-taken`, ...), where the API
    /// named one: what a program acts on.
    pub reason: Option<String>,
}

impl Client {
    pub fn new(socket: PathBuf) -> Self {
        Self { socket }
    }

    /// The daemon of this runtime directory, if one answers.
    pub fn detect(runtime: &Path) -> Option<Self> {
        let socket = runtime.join(warden_protocol::DAEMON_SOCKET);
        std::os::unix::net::UnixStream::connect(&socket)
            .ok()
            .map(|_| Self::new(socket))
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response<Incoming>> {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        self.send_bytes(method, path, bytes.into_bytes()).await
    }

    /// A connection to the daemon's socket, once the kernel says who serves it: this user or
    /// root. What a client sends (a cell's environment and secrets, a policy, answers to
    /// approvals) goes to no other user's process that took the socket's path.
    async fn connect(&self) -> Result<tokio::net::UnixStream> {
        let connect_error = |source| ClientError::Connect {
            socket: self.socket.clone(),
            source,
        };
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(connect_error)?;
        let uid = stream.peer_cred().map_err(connect_error)?.uid();
        let ours = rustix::process::geteuid().as_raw();
        if uid != ours && uid != 0 {
            return Err(ClientError::Stranger {
                socket: self.socket.clone(),
                uid,
                ours,
            });
        }
        Ok(stream)
    }

    async fn send_bytes(
        &self,
        method: Method,
        path: &str,
        bytes: Vec<u8>,
    ) -> Result<Response<Incoming>> {
        let stream = self.connect().await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(transport("talking to the warden daemon"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "warden")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| ClientError::Transport {
                what: "building a request",
                reason: e.to_string(),
            })?;
        sender
            .send_request(request)
            .await
            .map_err(transport("the warden daemon did not answer"))
    }

    /// A typed request and answer: `body` goes as JSON, the answer is read as `T` (errors
    /// carry the API's message and code).
    pub async fn call<B: serde::Serialize, T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T> {
        let body = body
            .map(serde_json::to_value)
            .transpose()
            .map_err(|e| ClientError::Answer(format!("writing the request: {e}")))?;
        // Read straight into the answer's type: a tree of `Value`s first took several times
        // the answer's size (a diff of 500,000 files, 700 MB in the client).
        let response = self.send(method, path, body.as_ref()).await?;
        let bytes = read_success(response).await?;
        let read = match bytes.is_empty() {
            true => serde_json::from_value(Value::Null),
            false => serde_json::from_slice(&bytes),
        };
        read.map_err(|e| match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                ClientError::Answer(format!("the daemon's answer is not JSON: {e}"))
            }
            _ => ClientError::Answer(format!(
                "the daemon's answer to {path} is not what this warden understands: {e}"
            )),
        })
    }

    /// Turns a connection into the byte stream of `protocol` (`GET path` with `Upgrade`), as
    /// the daemon's `/v1/mcp` does for an MCP session.
    pub async fn upgrade(
        &self,
        path: &str,
        protocol: &str,
    ) -> Result<TokioIo<hyper::upgrade::Upgraded>> {
        let stream = self.connect().await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(transport("talking to the warden daemon"))?;
        tokio::spawn(async move {
            let _ = connection.with_upgrades().await;
        });
        let request = Request::builder()
            .method(Method::GET)
            .uri(path)
            .header("host", "warden")
            .header("connection", "upgrade")
            .header("upgrade", protocol)
            .body(Full::new(Bytes::new()))
            .map_err(|e| ClientError::Transport {
                what: "building a request",
                reason: e.to_string(),
            })?;
        let response = sender
            .send_request(request)
            .await
            .map_err(transport("the warden daemon did not answer"))?;
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            read_success(response).await?;
            return Err(ClientError::Answer(format!(
                "the daemon did not switch {path} to {protocol}"
            )));
        }
        let upgraded = hyper::upgrade::on(response)
            .await
            .map_err(transport("switching the connection"))?;
        Ok(TokioIo::new(upgraded))
    }

    /// A request with raw bytes each way (files and archives).
    pub async fn bytes(&self, method: Method, path: &str, body: Vec<u8>) -> Result<Vec<u8>> {
        let response = self.send_bytes(method, path, body).await?;
        Ok(read_success(response).await?.to_vec())
    }

    /// A JSON request; errors carry the API's message.
    pub async fn json(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let response = self.send(method, path, body).await?;
        let bytes = read_success(response).await?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| ClientError::Answer(format!("the daemon's answer is not JSON: {e}")))
    }

    /// A request answered with server-sent events; `on_event(name, data)` for each.
    pub async fn events(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        on_event: impl FnMut(&str, &str),
    ) -> Result<()> {
        if self
            .open_events(method, path, body)
            .await?
            .each(on_event)
            .await?
        {
            return Ok(());
        }
        Err(ClientError::Answer(
            "the daemon's stream ended before the process did (did the daemon stop?)".to_owned(),
        ))
    }

    /// Opens a stream of server-sent events: once this returns, the daemon has subscribed, and
    /// nothing that happens after is missed.
    pub async fn open_events(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<EventStream> {
        let response = self.send(method, path, body).await?;
        if !response.status().is_success() {
            // Not a stream: the API's error.
            read_success(response).await?;
            return Err(ClientError::Answer(
                "the daemon refused the stream".to_owned(),
            ));
        }
        Ok(EventStream {
            body: response.into_body(),
        })
    }
}

/// An open stream of server-sent events.
#[derive(Debug)]
pub struct EventStream {
    body: Incoming,
}

impl EventStream {
    /// Calls `on_event(name, data)` for each event; returns `true` after an `exit` or `live`
    /// event, `false` when the stream ends without one.
    pub async fn each(mut self, mut on_event: impl FnMut(&str, &str)) -> Result<bool> {
        let mut decoder = warden_model::sse::Decoder::new();
        while let Some(frame) = self.body.frame().await {
            let frame = frame.map_err(transport("the daemon's stream broke off"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let events = decoder
                .feed(&data)
                .map_err(|e| ClientError::Answer(format!("the daemon's stream: {e}")))?;
            for event in events {
                let name = event.event.as_deref().unwrap_or("message");
                if !event.data.is_empty() {
                    on_event(name, &event.data);
                    if name == "exit" || name == "live" {
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    }
}

/// The body of a successful answer; an answer that is not one becomes an `ApiError` carrying
/// the API's message.
async fn read_success(response: Response<Incoming>) -> Result<Bytes> {
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(transport("reading the daemon's answer"))?
        .to_bytes();
    if status.is_success() {
        return Ok(bytes);
    }
    let (message, code, reason) = match serde_json::from_slice::<warden_protocol::ErrorBody>(&bytes)
    {
        Ok(body) => {
            let message = match body.hint {
                Some(hint) => format!("{} ({hint})", body.error),
                None => body.error,
            };
            (message, Some(body.code), body.reason)
        }
        Err(_) => (String::from_utf8_lossy(&bytes).into_owned(), None, None),
    };
    Err(ApiError {
        status,
        message,
        code,
        reason,
    }
    .into())
}
