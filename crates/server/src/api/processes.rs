//! Processes in cells: exec, output streams, stdin, signals, terminal sizes.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::json;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use warden_harness::{
    Cursor, ExecSpec, HarnessError, Item, KillOnDrop, LineHold, Process, RunOnce, Stream,
};

use super::*;

/// Starts a process. Foreground: the answer is an event stream of its output and ending, and
/// the process is killed if the client goes away first. Background: the answer is the process,
/// whose output is read (from the start, any number of times) at `.../output`.
pub(super) async fn exec(
    State(harness): State<Shared>,
    Path(name): Path<String>,
    Body(spec): Body<ExecSpec>,
) -> Result<Response, ApiError> {
    let background = spec.background;
    let process = harness.exec(&name, spec).await?;
    if background {
        return Ok((StatusCode::CREATED, Json(process.info())).into_response());
    }
    Ok(stream_output(process, 0, true, true, None, None))
}

/// Runs one command in a cell made for it (`POST /v1/run`): the answer is the exec's event
/// stream, its `started` naming the cell too, and its `exit` sent once the cell is deleted
/// (an `error` event before it says why, where the cell could not be); the process is killed
/// if the client goes away first, and the cell deleted all the same.
pub(super) async fn run(
    State(harness): State<Shared>,
    by: Option<Extension<Caller>>,
    Body(request): Body<RunOnce>,
) -> Result<Response, ApiError> {
    let running = harness.run_once(request, &caller(by)).await?;
    Ok(stream_output(
        running.process,
        0,
        true,
        true,
        Some((running.cell, running.deleted)),
        Some(running.line),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OutputQuery {
    /// Chunk index to start from (0: the first kept).
    #[serde(default)]
    from: u64,
    /// `false`: end with a `live` event once caught up with a running process.
    follow: Option<bool>,
}

pub(super) async fn output(
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
        None,
        None,
    ))
}

pub(super) async fn processes(
    State(harness): State<Shared>,
    Path(name): Path<String>,
    Query(NoQuery {}): Query<NoQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.processes(&name)?).into_response())
}

pub(super) async fn process(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.process(&name, id)?.info()).into_response())
}

pub(super) async fn wait(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Query(NoQuery {}): Query<NoQuery>,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    let mut cursor = Cursor::end(); // skip output: only the ending matters here
    loop {
        if let Item::Exit(exit) = process.next(&mut cursor).await {
            return Ok(Json(exit).into_response());
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StdinBody {
    #[serde(default)]
    data: String,
    /// The same bytes in base64, for binary input.
    data_base64: Option<String>,
    #[serde(default)]
    close: bool,
}

pub(super) async fn stdin(
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

pub(super) async fn resize(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Body(size): Body<warden_harness::TtySize>,
) -> Result<Response, ApiError> {
    harness.resize(&name, id, size).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn signal(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    Body(body): Body<warden_protocol::SignalBody>,
) -> Result<Response, ApiError> {
    let signal = body.signal.number().map_err(|message| ApiError {
        reason: None,
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
/// The event stream of a process's output and exit, from chunk `from`; `run`: the cell made
/// for it (named in `started`) and its delete, awaited before the `exit`.
///
/// The stream reads the process's log itself as the connection asks for the next event (no
/// task and channel in between: each of them was one more wake-up of a task per event, the
/// process's end included), and a client that goes away drops it, and with it what kills the
/// process.
pub(super) fn stream_output(
    process: Arc<Process>,
    from: u64,
    kill_on_disconnect: bool,
    follow: bool,
    run: Option<(String, tokio::sync::oneshot::Receiver<Result<(), String>>)>,
    line: Option<LineHold>,
) -> Response {
    let mut feed = Feed {
        guard: kill_on_disconnect.then(|| KillOnDrop(Arc::clone(&process))),
        process,
        cursor: Cursor::at(from),
        pending: [Vec::new(), Vec::new()],
        follow,
        run,
        ready: std::collections::VecDeque::new(),
        done: false,
        _line: line,
    };
    // A process that could not start (not found, not executable) never ran: its stream is its
    // `exit` alone. The `started` event is ready before the answer goes out, so that its head
    // and this event leave in one write (one wake-up of the client, not two).
    if feed.process.pid != 0 {
        let mut started = json!({ "process": feed.process.id, "pid": feed.process.pid });
        if let Some((cell, _)) = &feed.run {
            started["cell"] = json!(cell);
        }
        feed.ready
            .push_back(Event::default().event("started").data(started.to_string()));
    }
    let events = futures_util::stream::unfold(feed, |mut feed| async move {
        loop {
            if let Some(event) = feed.ready.pop_front() {
                return Some((Ok::<_, Infallible>(event), feed));
            }
            if feed.done {
                return None;
            }
            feed.step().await;
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// What an output stream has read of its process's log, and the events ready to go.
struct Feed {
    process: Arc<Process>,
    /// Kills the process when the stream is dropped before its end (a foreground exec's
    /// client went away).
    guard: Option<KillOnDrop>,
    cursor: Cursor,
    /// Bytes of each stream not sent yet (a UTF-8 character's first bytes).
    pending: [Vec<u8>; 2],
    follow: bool,
    run: Option<(String, tokio::sync::oneshot::Receiver<Result<(), String>>)>,
    ready: std::collections::VecDeque<Event>,
    /// The last event is among `ready`.
    done: bool,
    /// A run's line to its cell, let go of (and the cell's teardown begun) once the stream is
    /// over: when its last event has been taken for the answer, or its client went away.
    _line: Option<LineHold>,
}

impl Feed {
    /// Reads the next item of the log (waiting for it when following), and makes the events
    /// it gives ready.
    async fn step(&mut self) {
        let item = if self.follow {
            self.process.next(&mut self.cursor).await
        } else if let Some(item) = self.process.try_next(&mut self.cursor) {
            item
        } else {
            self.flush();
            self.ready.push_back(
                Event::default()
                    .event("live")
                    .data(json!({ "running": true, "next": self.cursor.index() }).to_string()),
            );
            self.done = true;
            return;
        };
        match item {
            Item::Output(stream, data) => {
                let slot = stream as usize;
                self.pending[slot].extend_from_slice(&data);
                if let Some(event) = output_event(stream, &mut self.pending[slot], false) {
                    self.ready.push_back(event);
                }
            }
            Item::Dropped(bytes) => self.ready.push_back(
                Event::default()
                    .event("dropped")
                    .data(json!({ "bytes": bytes }).to_string()),
            ),
            Item::Exit(exit) => {
                self.flush();
                if let Some((cell, deleted)) = self.run.take() {
                    let failed = match deleted.await {
                        Ok(Ok(())) => None,
                        Ok(Err(message)) => Some(message),
                        Err(_) => Some(format!(
                            "the delete of cell `{cell}` stopped before it ended (the daemon stops?)"
                        )),
                    };
                    if let Some(message) = failed {
                        self.ready.push_back(
                            Event::default()
                                .event("error")
                                .data(json!({ "message": message }).to_string()),
                        );
                    }
                }
                self.ready.push_back(
                    Event::default()
                        .event("exit")
                        .data(serde_json::to_string(&exit).unwrap_or_default()),
                );
                // Ended: nothing is left to kill.
                self.guard = None;
                self.done = true;
            }
        }
    }

    /// What is left of both streams' bytes, as events.
    fn flush(&mut self) {
        for (stream, slot) in [(Stream::Stdout, 0), (Stream::Stderr, 1)] {
            if let Some(event) = output_event(stream, &mut self.pending[slot], true) {
                self.ready.push_back(event);
            }
        }
    }
}

/// The server-sent event of what can be sent from `pending` (see `output_chunk`).
pub(super) fn output_event(stream: Stream, pending: &mut Vec<u8>, last: bool) -> Option<Event> {
    let (name, data) = output_chunk(stream, pending, last)?;
    Some(Event::default().event(name).data(data.to_string()))
}

/// Takes what can be sent from `pending`: UTF-8 text up to an incomplete character at the end
/// (kept for the next chunk unless `last`), or base64 for bytes that are not UTF-8. Returns the
/// stream's name and `{"text": ...}` or `{"base64": ...}`.
pub(super) fn output_chunk(
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
