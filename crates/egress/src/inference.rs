//! A cell's model traffic (`network.inference`): requests to the route's name are sent to its
//! upstream; every exchange with the upstream is read in its wire format (`warden-model`: Chat
//! Completions, Responses, Anthropic Messages, streamed or whole) and recorded with the
//! decision; the cell's tokens are counted against the route's budget.

use std::io::{self, Write};
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};

use crate::host::Host;
use crate::proxy::Gateway;
use crate::rules::{INFERENCE_RULE, InferenceRoute};

/// The most of a request or a reply kept for reading (a longer one is counted by its size).
const KEPT: usize = 1 << 20;
/// The most tool calls of one reply the record lists.
const CALLS_LISTED: usize = 32;
/// The most of a text the record keeps (its size is kept whole).
const TEXT_LIMIT: usize = 8 * 1024;

/// Writes through to `inner`, keeping a copy of the first `KEPT` bytes.
pub(crate) struct Tap<'a, W> {
    pub(crate) inner: W,
    pub(crate) kept: &'a mut Vec<u8>,
}

impl<W: Write> Write for Tap<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        let room = KEPT.saturating_sub(self.kept.len());
        self.kept.extend_from_slice(&buf[..n.min(room)]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Gateway {
    /// The route of `network.inference` when `host` is its name.
    pub(crate) fn inference_route(&self, host: &Host) -> Option<InferenceRoute> {
        let rules = self.rules();
        let route = rules.inference.as_ref()?;
        matches!(host, Host::Name(name) if *name == route.name).then(|| route.clone())
    }

    /// Why the cell may not send another model request (its token budget is spent).
    pub(crate) fn inference_refusal(&self) -> Option<String> {
        let rules = self.rules();
        let max = rules.inference.as_ref()?.max_tokens?;
        let used = self.inference_tokens.load(Ordering::Relaxed);
        (used >= max).then(|| {
            format!("the cell's inference token budget ({max}, network.inference.max_tokens) is spent: {used} used")
        })
    }

    /// Reads an exchange (the request's body, the response as the client got it: head and
    /// decoded body) and counts its tokens; the record's `inference` field.
    pub(crate) fn read_exchange(
        &self,
        path: &str,
        request: &[u8],
        response: &[u8],
        latency: Duration,
    ) -> Value {
        let format = warden_model::Format::of_path(path);
        let body: Value = serde_json::from_slice(request).unwrap_or(Value::Null);
        let (head, reply) = match response.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(at) => (&response[..at], &response[at + 4..]),
            None => (response, &[][..]),
        };
        let status: u16 = std::str::from_utf8(head)
            .ok()
            .and_then(|h| h.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut out = json!({
            "format": format.map(|f| f.provider()),
            "status": status,
            "latency_ms": latency.as_millis() as u64,
            "request_bytes": request.len(),
            "response_bytes": reply.len(),
        });
        let Some(format) = format else {
            out["error"] = "not a model API path the warden reads".into();
            return out;
        };
        let summary = format.summarize(&body);
        out["model"] = json!(summary.model);
        out["stream"] = json!(summary.stream);
        out["items"] = json!(summary.items);
        out["tools"] = json!(summary.tools);
        let streamed = reply
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .is_some_and(|b| matches!(b, b'd' | b'e' | b':' | b'i'));
        let parsed = if streamed {
            let mut stream = format.stream();
            stream.feed(reply).and_then(|_| stream.finish())
        } else {
            serde_json::from_slice::<Value>(reply)
                .map_err(|e| warden_model::WireError::Malformed(e.to_string()))
                .and_then(|v| format.reply(&v))
        };
        // Tokens as the reply says, or (no usage in it, a reply longer than what is kept, one
        // that cannot be read) a count by size: a reply's length never goes uncounted.
        let by_size = ((request.len() + response.len()) / 4).max(1) as u64;
        let truncated = request.len() >= KEPT || response.len() >= KEPT;
        let counted = match &parsed {
            Ok(reply) if !truncated && reply.usage.input + reply.usage.output > 0 => {
                reply.usage.input + reply.usage.output
            }
            _ if (200..300).contains(&status) => {
                out["tokens_estimated"] = true.into();
                by_size
            }
            _ => 0,
        };
        let total = self.inference_tokens.fetch_add(counted, Ordering::Relaxed) + counted;
        out["tokens_used"] = total.into();
        match parsed {
            Ok(reply) => {
                out["answered_by"] = json!(reply.model);
                out["usage"] = json!({ "input": reply.usage.input, "output": reply.usage.output });
                out["stop"] = json!(reply.stop);
                out["text"] = clip(&reply.text).into();
                out["text_bytes"] = reply.text.len().into();
                out["calls_count"] = reply.calls.len().into();
                out["calls"] = reply
                    .calls
                    .iter()
                    .take(CALLS_LISTED)
                    .map(|c| json!({ "name": c.name, "arguments": clip(&c.arguments) }))
                    .collect();
            }
            Err(err) => out["error"] = err.to_string().into(),
        }
        out
    }
}

/// Why a request may not take the route: only what the model APIs take (a `POST` of a
/// conversation to one of the three endpoints, or a look at the models).
pub(crate) fn refused_request(method: &str, path: &str) -> Option<String> {
    let models = path.trim_end_matches('/').ends_with("/models") || path.contains("/models/");
    match (method, warden_model::Format::of_path(path)) {
        ("POST", Some(_)) => None,
        ("GET", None) if models => None,
        _ => Some(format!(
            "the inference route takes POST .../chat/completions, .../responses and .../messages (and GET .../models), not {method} {path}"
        )),
    }
}

/// Whether a verdict is the inference route's.
pub(crate) fn is_inference(rule: &str) -> bool {
    rule.strip_prefix(INFERENCE_RULE)
        .is_some_and(|rest| rest.starts_with(' '))
}

fn clip(text: &str) -> String {
    warden_model::clip(text, TEXT_LIMIT)
}
