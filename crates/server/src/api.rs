//! The routes of the HTTP API. Each handler turns a request into one harness call; the harness
//! validates, journals and carries it out.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::ConnectInfo;
use axum::extract::{DefaultBodyLimit, Extension, FromRequest, FromRequestParts, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;
use warden_harness::{
    CreateCell, ErrorKind, ExecSpec, Harness, HarnessError, Item, KillOnDrop, Process, Stream,
};

/// The API's OpenAPI document (also committed as docs/openapi.json).
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

/// Largest request body.
const BODY_LIMIT: usize = 1024 * 1024;
/// Largest file or archive upload.
const UPLOAD_LIMIT: usize = 64 * 1024 * 1024;

type Shared = Arc<Harness>;

/// An error as the API answers it: a status and `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl From<HarnessError> for ApiError {
    fn from(err: HarnessError) -> Self {
        // The one mapping of the core's error codes onto HTTP statuses.
        let status = match err.kind {
            ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self {
            status,
            message: err.message,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use warden_protocol::ErrorCode;
        let code = match self.status {
            StatusCode::FORBIDDEN => ErrorCode::Forbidden,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => ErrorCode::NotFound,
            StatusCode::CONFLICT => ErrorCode::Conflict,
            StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
            StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Unavailable,
            status if status.is_server_error() => ErrorCode::Internal,
            _ => ErrorCode::BadRequest,
        };
        let body = warden_protocol::ErrorBody {
            error: self.message,
            code,
            hint: None,
        };
        (self.status, Json(body)).into_response()
    }
}

/// A JSON body whose rejections (malformed, wrong type, too large) are API errors too. Any
/// content type is read as JSON, so `curl -d '{...}'` works without a header.
pub struct Body<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|rejection| ApiError {
                status: rejection.status(),
                message: format!("request body: {}", rejection.body_text()),
            })?;
        let mut json = serde_json::Deserializer::from_slice(&bytes);
        let value = serde_path_to_error::deserialize(&mut json).map_err(|err| {
            let status = match err.inner().classify() {
                serde_json::error::Category::Data => StatusCode::UNPROCESSABLE_ENTITY,
                _ => StatusCode::BAD_REQUEST,
            };
            let path = err.path().to_string();
            let message = if path == "." {
                format!("request body: {}", err.inner())
            } else {
                format!("request body: {path}: {}", err.inner())
            };
            ApiError { status, message }
        })?;
        // Nothing may follow the JSON value.
        json.end().map_err(|err| ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("request body: {err}"),
        })?;
        Ok(Self(value))
    }
}

/// Who sent a request, as the journal records it.
#[derive(Debug, Clone)]
pub struct Caller(pub String);

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

async fn identify_unix(mut request: Request, next: Next) -> Response {
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

fn caller(extension: Option<Extension<Caller>>) -> String {
    extension.map_or_else(|| "unknown".to_owned(), |Extension(Caller(c))| c)
}

/// Path parameters whose rejections are API errors.
pub struct Path<T>(T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError {
                status: rejection.status(),
                message: format!("path: {}", rejection.body_text()),
            }),
        }
    }
}

/// Query parameters whose rejections are API errors.
pub struct Query<T>(T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError {
                status: rejection.status(),
                message: format!("query: {}", rejection.body_text()),
            }),
        }
    }
}

/// The API. With a token, every request must carry `Authorization: Bearer TOKEN`.
pub fn router(harness: Shared, token: Option<String>) -> Router {
    let router = Router::new()
        .route("/openapi.json", get(openapi))
        .route("/v1/health", get(health))
        .route("/v1/cells", get(list_cells).post(create_cell))
        .route("/v1/cells/{name}", get(get_cell).delete(delete_cell))
        .route("/v1/cells/{name}/pause", post(pause))
        .route("/v1/cells/{name}/resume", post(resume))
        .route("/v1/cells/{name}/kill", post(kill))
        .route("/v1/cells/{name}/exec", post(exec))
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
        .route("/v1/cells/{name}/snapshots", get(snapshots))
        .route("/v1/cells/{name}/reset", post(reset))
        .route("/v1/cells/{name}/diff", get(diff))
        .route("/v1/cells/{name}/apply", post(apply))
        .route("/v1/cells/{name}/policy", get(get_policy).put(put_policy))
        .route("/v1/events", get(events))
        .route("/v1/approvals", get(approvals))
        .route("/v1/approvals/{name}/{id}", post(answer))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(harness);
    match token {
        Some(token) => router.layer(middleware::from_fn_with_state(
            Arc::new(token),
            require_token,
        )),
        None => router.layer(middleware::from_fn(identify_unix)),
    }
}

async fn require_token(
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
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
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

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn no_route() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint; GET /openapi.json lists them".to_owned(),
    }
}

async fn wrong_method() -> ApiError {
    ApiError {
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

async fn list_cells(State(harness): State<Shared>) -> Result<Response, ApiError> {
    Ok(Json(harness.list()?).into_response())
}

async fn create_cell(
    State(harness): State<Shared>,
    Body(request): Body<CreateCell>,
) -> Result<Response, ApiError> {
    let cell = harness.create(request).await?;
    Ok((StatusCode::CREATED, Json(cell)).into_response())
}

async fn get_cell(
    State(harness): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.get(&name)?).into_response())
}

async fn delete_cell(
    State(harness): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    harness.delete(&name, &caller(by)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Pause, &caller(by))
            .await?,
    )
    .into_response())
}

async fn resume(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Resume, &caller(by))
            .await?,
    )
    .into_response())
}

async fn kill(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Kill, &caller(by))
            .await?,
    )
    .into_response())
}

/// Starts a process. Foreground: the answer is an event stream of its output and ending, and
/// the process is killed if the client goes away first. Background: the answer is the process,
/// whose output is read (from the start, any number of times) at `.../output`.
async fn exec(
    State(harness): State<Shared>,
    Path(name): Path<String>,
    Body(spec): Body<ExecSpec>,
) -> Result<Response, ApiError> {
    let background = spec.background;
    let process = harness.exec(&name, spec).await?;
    if background {
        return Ok((StatusCode::CREATED, Json(process.info())).into_response());
    }
    Ok(stream_output(process, 0, true, true))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    /// Chunk index to start from (0: the first kept).
    #[serde(default)]
    from: u64,
    /// `false`: end with a `live` event once caught up with a running process.
    follow: Option<bool>,
}

async fn output(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Query(query): Query<OutputQuery>,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    Ok(stream_output(
        process,
        query.from,
        false,
        query.follow.unwrap_or(true),
    ))
}

async fn processes(
    State(harness): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.processes(&name)?).into_response())
}

async fn process(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.process(&name, id)?.info()).into_response())
}

async fn wait(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    let mut cursor = u64::MAX; // skip output: only the ending matters here
    loop {
        if let Item::Exit(exit) = process.next(&mut cursor).await {
            return Ok(Json(exit).into_response());
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinBody {
    #[serde(default)]
    data: String,
    /// The same bytes in base64, for binary input.
    data_base64: Option<String>,
    #[serde(default)]
    close: bool,
}

async fn stdin(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Body(body): Body<StdinBody>,
) -> Result<Response, ApiError> {
    let data = match body.data_base64 {
        Some(encoded) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|e| HarnessError::bad(format!("data_base64: {e}")))?,
        None => body.data.into_bytes(),
    };
    harness.stdin(&name, id, &data, body.close).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    /// Relative to the cell's files root (its workspace mount).
    #[serde(default)]
    path: String,
}

async fn read_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let data = h.read_file(&name, &q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

async fn write_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    h.write_file(&name, &q.path, body.to_vec()).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn download(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let data = h.download(&name, &q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], data).into_response())
}

async fn upload(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    h.upload(&name, &q.path, body.to_vec()).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list_files(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(h.list_files(&name, &q.path).await?).into_response())
}

async fn stat_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(h.stat_file(&name, &q.path).await?).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathBody {
    path: String,
    #[serde(default)]
    recursive: bool,
}

async fn mkdir(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PathBody>,
) -> Result<Response, ApiError> {
    h.mkdir(&name, &body.path).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn remove_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PathBody>,
) -> Result<Response, ApiError> {
    h.remove(&name, &body.path, body.recursive).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    from: String,
    to: String,
}

async fn move_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<MoveBody>,
) -> Result<Response, ApiError> {
    h.rename(&name, &body.from, &body.to).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(rename = "as")]
    as_name: Option<String>,
}

async fn snapshot(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<SnapshotBody>,
) -> Result<Response, ApiError> {
    let snap = h.snapshot(&name, body.as_name.as_deref()).await?;
    Ok((StatusCode::CREATED, Json(snap)).into_response())
}

async fn snapshots(
    State(h): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(h.snapshots(&name)?).into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    /// `SNAP` or `CELL@SNAP`; none: the start.
    to: Option<String>,
}

async fn reset(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<ResetBody>,
) -> Result<Response, ApiError> {
    h.reset(&name, body.to.as_deref()).await?;
    Ok(Json(h.get(&name)?).into_response())
}

async fn diff(State(h): State<Shared>, Path(name): Path<String>) -> Result<Response, ApiError> {
    Ok(Json(h.diff(&name).await?).into_response())
}

async fn apply(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
    Body(request): Body<warden_harness::ApplyRequest>,
) -> Result<Response, ApiError> {
    Ok(Json(h.apply(&name, &request, &caller(by)).await?).into_response())
}

async fn get_policy(
    State(h): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let (made, replaced) = h.policy(&name)?;
    let mut body = match made {
        warden_harness::PolicySource::Preset(p) => json!({ "preset": p }),
        warden_harness::PolicySource::Yaml(y) => json!({ "policy": y }),
    };
    if let Some(replaced) = replaced {
        body["replaced"] = json!(replaced);
    }
    Ok(Json(body).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyBody {
    /// A whole policy (YAML); its `network` and `commands` replace the running cell's.
    policy: String,
}

async fn put_policy(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PolicyBody>,
) -> Result<Response, ApiError> {
    let closed = h.replace_policy(&name, &body.policy).await?;
    Ok(Json(json!({ "closed_connections": closed })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    cell: Option<String>,
    /// Start after this entry (its `seq`, which is each event's id): the entries written
    /// since come first, then the live ones. `Last-Event-ID` does the same.
    after: Option<u64>,
}

/// Journal entries as they are written (`entry` events, each with the entry's `seq` as its
/// id), optionally of one cell; a client that reconnects with `after` (or `Last-Event-ID`)
/// gets what it missed first.
async fn events(
    State(h): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    let after = q.after.or_else(|| {
        headers
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
    });
    // Subscribed before the journal is read: nothing falls between the two.
    let mut entries = h.subscribe();
    let missed = match after {
        Some(after) => h.entries_after(after, q.cell.clone()).await?,
        None => Vec::new(),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let entry_event = |entry: &serde_json::Value| {
            let event = Event::default().event("entry").data(entry.to_string());
            match entry["seq"].as_u64() {
                Some(seq) => event.id(seq.to_string()),
                None => event,
            }
        };
        let mut last = after.unwrap_or(0);
        for entry in &missed {
            last = last.max(entry["seq"].as_u64().unwrap_or(0));
            if tx
                .send(Ok::<_, Infallible>(entry_event(entry)))
                .await
                .is_err()
            {
                return;
            }
        }
        loop {
            let entry = tokio::select! {
                entry = entries.recv() => entry,
                () = tx.closed() => return,
            };
            let event = match entry {
                Ok(entry) => {
                    if q.cell.as_deref().is_some_and(|c| entry["cell"] != c)
                        || entry["seq"].as_u64().is_some_and(|seq| seq <= last)
                    {
                        continue;
                    }
                    entry_event(&entry)
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => Event::default()
                    .event("lagged")
                    .data(json!({ "missed": missed }).to_string()),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            if tx.send(Ok::<_, Infallible>(event)).await.is_err() {
                return;
            }
        }
    });
    Ok(Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

async fn approvals(State(harness): State<Shared>) -> Json<Vec<warden_harness::Approval>> {
    Json(harness.approvals())
}

async fn answer(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    by: Option<Extension<Caller>>,
    Body(body): Body<warden_protocol::Answer>,
) -> Result<Response, ApiError> {
    let allow = body.decision == warden_protocol::Decision::Approve;
    harness
        .answer(&name, id, allow, body.scope, &caller(by))
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn resize(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Body(size): Body<warden_harness::TtySize>,
) -> Result<Response, ApiError> {
    harness.resize(&name, id, size).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn signal(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Body(body): Body<warden_protocol::SignalBody>,
) -> Result<Response, ApiError> {
    let signal = body.signal.number().map_err(|message| ApiError {
        status: StatusCode::BAD_REQUEST,
        message: format!("signal: {message}"),
    })?;
    harness.signal(&name, id, signal).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Server-sent events: `started`, then `stdout`/`stderr` chunks in order (`{"text": ...}` when
/// the bytes are UTF-8, else `{"base64": ...}`; a UTF-8 character is never split), `dropped`
/// when kept output was discarded before this reader got to it, and a last `exit` (or, when
/// not following, `live` once caught up with a process that still runs).
fn stream_output(
    process: Arc<Process>,
    from: u64,
    kill_on_disconnect: bool,
    follow: bool,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let _guard = kill_on_disconnect.then(|| KillOnDrop(Arc::clone(&process)));
        // A process that could not start (not found, not executable) never ran: its stream is
        // its `exit` alone.
        if process.pid != 0 {
            let started = json!({ "process": process.id, "pid": process.pid });
            if tx
                .send(Ok(Event::default()
                    .event("started")
                    .data(started.to_string())))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut cursor = from;
        let mut pending: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
        loop {
            let item = if follow {
                tokio::select! {
                    item = process.next(&mut cursor) => item,
                    () = tx.closed() => return,
                }
            } else if let Some(item) = process.try_next(&mut cursor) {
                item
            } else {
                for (stream, slot) in [(Stream::Stdout, 0), (Stream::Stderr, 1)] {
                    if let Some(event) = output_event(stream, &mut pending[slot], true) {
                        let _ = tx.send(Ok(event)).await;
                    }
                }
                let event = Event::default()
                    .event("live")
                    .data(json!({ "running": true, "next": cursor }).to_string());
                let _ = tx.send(Ok(event)).await;
                return;
            };
            let event = match item {
                Item::Output(stream, data) => {
                    let slot = stream as usize;
                    pending[slot].extend_from_slice(&data);
                    match output_event(stream, &mut pending[slot], false) {
                        Some(event) => event,
                        None => continue,
                    }
                }
                Item::Dropped(bytes) => Event::default()
                    .event("dropped")
                    .data(json!({ "bytes": bytes }).to_string()),
                Item::Exit(exit) => {
                    for (stream, slot) in [(Stream::Stdout, 0), (Stream::Stderr, 1)] {
                        if let Some(event) = output_event(stream, &mut pending[slot], true) {
                            let _ = tx.send(Ok(event)).await;
                        }
                    }
                    let event = Event::default()
                        .event("exit")
                        .data(serde_json::to_string(&exit).unwrap_or_default());
                    let _ = tx.send(Ok(event)).await;
                    return;
                }
            };
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::<Result<Event, Infallible>>::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// The server-sent event of what can be sent from `pending` (see `output_chunk`).
fn output_event(stream: Stream, pending: &mut Vec<u8>, last: bool) -> Option<Event> {
    let (name, data) = output_chunk(stream, pending, last)?;
    Some(Event::default().event(name).data(data.to_string()))
}

/// Takes what can be sent from `pending`: UTF-8 text up to an incomplete character at the end
/// (kept for the next chunk unless `last`), or base64 for bytes that are not UTF-8. Returns the
/// stream's name and `{"text": ...}` or `{"base64": ...}`.
fn output_chunk(
    stream: Stream,
    pending: &mut Vec<u8>,
    last: bool,
) -> Option<(&'static str, serde_json::Value)> {
    if pending.is_empty() {
        return None;
    }
    let name = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    let data = match std::str::from_utf8(pending) {
        Ok(text) => {
            let data = json!({ "text": text });
            pending.clear();
            data
        }
        Err(err) if err.error_len().is_none() && !last && err.valid_up_to() > 0 => {
            let rest = pending.split_off(err.valid_up_to());
            let text = String::from_utf8_lossy(pending).into_owned();
            *pending = rest;
            json!({ "text": text })
        }
        Err(err) if err.error_len().is_none() && !last => {
            // Only the start of a character so far: wait for the rest.
            let _ = err;
            return None;
        }
        Err(_) => {
            let data =
                json!({ "base64": base64::engine::general_purpose::STANDARD.encode(&pending) });
            pending.clear();
            data
        }
    };
    Some((name, data))
}

/// A process over one WebSocket, both ways: the server sends `{"event": "stdout"|"stderr",
/// "text"|"base64": ...}`, `{"event": "dropped", "bytes": N}` and a last `{"event": "exit", ...}`
/// (output from the start, then live); the client sends `{"stdin": TEXT}` or `{"stdin_base64":
/// B64}` (with `"close": true` to end input), `{"resize": {"rows": R, "cols": C}}` and
/// `{"signal": N}`. Closing the socket leaves the process running.
async fn attach(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    Ok(upgrade.on_upgrade(move |socket| attached(harness, name, process, socket)))
}

async fn attached(
    harness: Shared,
    name: String,
    process: Arc<Process>,
    mut socket: axum::extract::ws::WebSocket,
) {
    use axum::extract::ws::Message;
    let mut cursor = 0;
    let mut pending: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    loop {
        tokio::select! {
            item = process.next(&mut cursor) => {
                let mut out = Vec::new();
                let mut done = false;
                match item {
                    Item::Output(stream, data) => {
                        let slot = stream as usize;
                        pending[slot].extend_from_slice(&data);
                        out.extend(output_chunk(stream, &mut pending[slot], false));
                    }
                    Item::Dropped(bytes) => out.push(("dropped", json!({ "bytes": bytes }))),
                    Item::Exit(exit) => {
                        for (stream, slot) in [(Stream::Stdout, 0), (Stream::Stderr, 1)] {
                            out.extend(output_chunk(stream, &mut pending[slot], true));
                        }
                        out.push(("exit", serde_json::to_value(&exit).unwrap_or_default()));
                        done = true;
                    }
                }
                for (event, mut data) in out {
                    data["event"] = json!(event);
                    if socket.send(Message::Text(data.to_string().into())).await.is_err() {
                        return;
                    }
                }
                if done {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
            }
            message = socket.recv() => {
                let text = match message {
                    Some(Ok(Message::Text(text))) => text,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                    Some(Ok(_)) => continue,
                };
                if let Err(error) = attached_input(&harness, &name, process.id, &text).await {
                    let answer = json!({ "event": "error", "error": error.message });
                    if socket.send(Message::Text(answer.to_string().into())).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// One message from an attached client: input, a resize or a signal.
async fn attached_input(
    harness: &Harness,
    name: &str,
    id: u64,
    text: &str,
) -> Result<(), HarnessError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Input {
        stdin: Option<String>,
        stdin_base64: Option<String>,
        #[serde(default)]
        close: bool,
        resize: Option<warden_harness::TtySize>,
        signal: Option<i32>,
    }
    let input: Input =
        serde_json::from_str(text).map_err(|e| HarnessError::bad(format!("message: {e}")))?;
    if let Some(size) = input.resize {
        harness.resize(name, id, size).await?;
    }
    if let Some(signal) = input.signal {
        harness.signal(name, id, signal).await?;
    }
    let data = match (input.stdin, input.stdin_base64) {
        (Some(text), _) => Some(text.into_bytes()),
        (None, Some(encoded)) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|e| HarnessError::bad(format!("stdin_base64: {e}")))?,
        ),
        (None, None) => None,
    };
    if data.is_some() || input.close {
        harness
            .stdin(name, id, &data.unwrap_or_default(), input.close)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    /// Every route of the router is in the OpenAPI document, and nothing else is.
    #[test]
    fn the_openapi_document_names_exactly_the_routes() {
        let source = include_str!("api.rs");
        let mut routes: Vec<String> = source
            .split(".route(")
            .skip(1)
            .filter_map(|rest| rest.trim_start().strip_prefix('"'))
            .map(|rest| rest.split('"').next().unwrap().to_owned())
            .filter(|route| route.starts_with('/'))
            .collect();
        routes.sort();
        routes.dedup();
        let doc: serde_json::Value = serde_json::from_str(super::OPENAPI).unwrap();
        let mut documented: Vec<String> =
            doc["paths"].as_object().unwrap().keys().cloned().collect();
        documented.sort();
        assert_eq!(routes, documented);
    }
}
