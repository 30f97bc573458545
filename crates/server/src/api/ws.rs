//! A process attached over a WebSocket: output out; stdin, resize and signals in.

use axum::extract::State;
use axum::response::Response;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use warden_harness::{Harness, HarnessError, Item, Process, Stream};

use super::*;

/// A process over one WebSocket, both ways: the server sends `{"event": "stdout"|"stderr",
/// "text"|"base64": ...}`, `{"event": "dropped", "bytes": N}` and a last `{"event": "exit", ...}`
/// (output from the start, then live); the client sends `{"stdin": TEXT}` or `{"stdin_base64":
/// B64}` (with `"close": true` to end input), `{"resize": {"rows": R, "cols": C}}` and
/// `{"signal": N}`. Closing the socket leaves the process running.
pub(super) async fn attach(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    upgrade: Result<
        axum::extract::ws::WebSocketUpgrade,
        axum::extract::ws::rejection::WebSocketUpgradeRejection,
    >,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    // Not a WebSocket's opening: an API error like every other (axum's own is plain text).
    let upgrade = upgrade.map_err(|rejection| {
        ApiError::new(
            rejection.status(),
            format!(
                "this endpoint attaches to the process over a WebSocket (a GET with `Connection: upgrade`, `Upgrade: websocket` and its `Sec-WebSocket-*` headers; output and exit are also at .../output and .../wait): {}",
                rejection.body_text()
            ),
        )
    })?;
    Ok(upgrade.on_upgrade(move |socket| attached(harness, name, process, socket)))
}

pub(super) async fn attached(
    harness: Shared,
    name: String,
    process: Arc<Process>,
    mut socket: axum::extract::ws::WebSocket,
) {
    use axum::extract::ws::Message;
    let mut cursor = warden_harness::Cursor::start();
    let mut pending: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    // The client's messages are carried out in order by a task of their own: input waits for
    // the process to read it (a pipe holds 64 KiB), and meanwhile the output goes on (it was
    // this loop that waited, and the socket carried nothing more until the process read). A
    // few messages wait their turn; past those, the socket is not read until one is done.
    let (inputs, mut queue) = tokio::sync::mpsc::channel::<String>(INPUTS_QUEUED);
    let (refusals, mut refused) = tokio::sync::mpsc::channel::<String>(INPUTS_QUEUED);
    let carrier = {
        let (harness, name, id) = (Arc::clone(&harness), name.clone(), process.id);
        tokio::spawn(async move {
            while let Some(text) = queue.recv().await {
                if let Err(error) = attached_input(&harness, &name, id, &text).await
                    && refusals.send(error.message).await.is_err()
                {
                    return;
                }
            }
        })
    };
    // The socket gone, what is still queued or under way goes with it.
    let _carrier = AbortOnDrop(carrier);
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
            Some(error) = refused.recv() => {
                let answer = json!({ "event": "error", "error": error });
                if socket.send(Message::Text(answer.to_string().into())).await.is_err() {
                    return;
                }
            }
            // A full queue: wait for room before reading the socket again.
            room = inputs.reserve(), if inputs.capacity() == 0 => {
                if room.is_err() {
                    return;
                }
            }
            message = socket.recv(), if inputs.capacity() > 0 => {
                let text = match message {
                    Some(Ok(Message::Text(text))) => text,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                    Some(Ok(_)) => continue,
                };
                // Room was seen above, and this loop is the only sender.
                if inputs.try_send(text.as_str().to_owned()).is_err() {
                    return;
                }
            }
        }
    }
}

/// Messages of an attached client that wait for the one under way.
const INPUTS_QUEUED: usize = 16;

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One message from an attached client: input, a resize or a signal.
pub(super) async fn attached_input(
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
