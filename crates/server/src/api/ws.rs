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
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let process = harness.process(&name, id)?;
    Ok(upgrade.on_upgrade(move |socket| attached(harness, name, process, socket)))
}

pub(super) async fn attached(
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
