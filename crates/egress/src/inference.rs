//! A cell's model traffic. Requests to `network.inference`'s name are sent to its upstream;
//! every exchange with the upstream is read in its wire format (`warden-model`: Chat
//! Completions, Responses, Anthropic Messages, streamed or whole) and recorded with the
//! decision; the cell's tokens are counted against the route's budget. A model call that goes
//! elsewhere through the gateway, where it sees the request (plain HTTP, or HTTPS it opens:
//! a destination with a credential or with method and path rules), is read, recorded and
//! counted the same way: an agent in a cell that speaks to its provider itself is seen as well.

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

    /// Refuses and records a model call past the cell's token budget; the body to answer it
    /// with (429). `None`: within the budget, nothing done.
    pub(crate) fn refuse_over_budget(&self, decision: &mut crate::Decision) -> Option<Value> {
        let reason = self.inference_refusal()?;
        decision.allowed = false;
        decision.reason = reason;
        self.log_decision(decision);
        Some(budget_spent_body(&decision.reason))
    }

    /// Reads an exchange (the request's body, the response as the client got it: head and
    /// decoded body, each its first `KEPT` bytes; `relayed`: how many bytes went up and came
    /// down in all) and counts its tokens; the record's `inference` field. One off the route
    /// (`routed` false) is passed over only when its request, read whole, is JSON that names no
    /// `model` (a REST API's `/messages` is not counted as tokens); one longer than what is
    /// kept, or that is not JSON the gateway reads, is counted.
    pub(crate) fn read_exchange(
        &self,
        path: &str,
        request: &[u8],
        response: &[u8],
        latency: Duration,
        routed: bool,
        relayed: (u64, u64),
    ) -> Option<Value> {
        let request_cut = request.len() >= KEPT;
        // The request is kept as it went upstream: a credential bound `in_body` is the secret
        // there, and the record gets the placeholder the cell sent instead.
        let request = self.secrets.scrubbed(request);
        let request = request.as_slice();
        let format = warden_model::Format::of_path(path);
        let body: Option<Value> = serde_json::from_slice(request).ok();
        // Passed over only when read whole: a request padded past what is kept (blanks inside
        // its JSON cost no tokens), or one the provider reads and serde does not (a lone
        // surrogate), was passed over, and its tokens never counted.
        if !routed
            && !request_cut
            && body
                .as_ref()
                .is_some_and(|b| !b.get("model").is_some_and(Value::is_string))
        {
            return None;
        }
        let body = body.unwrap_or(Value::Null);
        // The final answer's head and body: interim answers (`100 Continue`, which a cell
        // gets by asking for it, `103 Early Hints`) came before it and are read past. (Read as
        // the exchange's, a 100 was no success, and the reply was counted as no tokens.)
        let mut rest = response;
        let (status, reply) = loop {
            let (head, reply) = match rest.windows(4).position(|w| w == b"\r\n\r\n") {
                Some(at) => (&rest[..at], &rest[at + 4..]),
                None => (rest, &[][..]),
            };
            let status: u16 = std::str::from_utf8(head)
                .ok()
                .and_then(|h| h.split(' ').nth(1))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            match status {
                100 | 102..=199 if !reply.is_empty() => rest = reply,
                _ => break (status, reply),
            }
        };
        let mut out = json!({
            "format": format.map(|f| f.provider()),
            "status": status,
            "latency_ms": latency.as_millis() as u64,
            "request_bytes": request.len(),
            "response_bytes": reply.len(),
        });
        let Some(format) = format else {
            out["error"] = "not a model API path the warden reads".into();
            return Some(out);
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
        // that cannot be read) a count by size, of all that was relayed, not of what was kept:
        // a reply's length never goes uncounted. The usage of a reply read whole holds however
        // long the request was (a request past what is kept was counted by size, a quarter
        // of a 4 MiB request's tokens).
        let by_size =
            ((request.len() as u64).max(relayed.0) + (response.len() as u64).max(relayed.1)) / 4;
        let by_size = by_size.max(1);
        let truncated = response.len() >= KEPT;
        let counted = match &parsed {
            Ok(reply) if !truncated && reply.usage.input.saturating_add(reply.usage.output) > 0 => {
                reply.usage.input.saturating_add(reply.usage.output)
            }
            _ if (200..300).contains(&status) => {
                out["tokens_estimated"] = true.into();
                by_size
            }
            _ => 0,
        };
        // Added saturating: the usage is the upstream's word, and an upstream the cell can
        // make answer (an allowed host of its own) could report one near 2^64 that wrapped the
        // total round to nothing, the cell's budget whole again.
        let used = self
            .inference_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                Some(used.saturating_add(counted))
            })
            .unwrap_or_else(|used| used);
        let total = used.saturating_add(counted);
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
        Some(out)
    }
}

/// Whether a request is a model call the gateway reads wherever it goes: a `POST` to one of the
/// three model API endpoints (whether its body names a model is seen once it has passed).
pub(crate) fn model_call(method: &str, path: &str) -> bool {
    method == "POST" && warden_model::Format::of_path(path).is_some()
}

/// The answer to a model request past the cell's token budget: 429 with the body the model
/// APIs use for errors, so that a client's own error reads it.
fn budget_spent_body(reason: &str) -> Value {
    json!({ "error": { "message": reason, "type": "warden_token_budget", "code": "token_budget" } })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn gateway() -> Gateway {
        gateway_with(crate::Secrets::default())
    }

    fn gateway_with(secrets: crate::Secrets) -> Gateway {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let log = std::env::temp_dir().join(format!(
            "warden-inference-test-{}-{}.jsonl",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let gateway = Gateway::new(
            crate::Rules::compile(&warden_policy::Network::default()).unwrap(),
            &log,
            "test",
            secrets,
            None,
            crate::Bounds::default(),
        )
        .unwrap();
        let _ = std::fs::remove_file(&log);
        gateway
    }

    const REPLY: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"id\":\"c\",\"object\":\"chat.completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}";

    #[test]
    fn a_call_off_the_route_is_read_only_when_it_names_a_model() {
        let gateway = gateway();
        let call = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                call,
                REPLY,
                Duration::ZERO,
                false,
                (0, 0),
            )
            .expect("a model call is read");
        assert_eq!(read["text"], "hi");
        assert_eq!(read["tokens_used"], 10);
        // A REST API's own `/messages` (no model named) is neither read nor counted.
        let other = br#"{"to":"someone","body":"hello"}"#;
        let none =
            gateway.read_exchange("/api/messages", other, REPLY, Duration::ZERO, false, (0, 0));
        assert!(none.is_none());
        assert_eq!(gateway.inference_tokens.load(Ordering::Relaxed), 10);
        // On the route, every exchange is read, whatever its body.
        let routed =
            gateway.read_exchange("/v1/messages", other, b"", Duration::ZERO, true, (0, 0));
        assert!(routed.is_some_and(|r| r.get("error").is_some()));
    }

    /// A model call off the route padded past what is kept (blanks inside its JSON cost no
    /// tokens) was passed over as if it named no model, and never counted; so was one whose
    /// JSON the gateway does not read (a lone surrogate, which a provider may take). Both are
    /// counted; a reply read whole by its usage however long the request, and one without
    /// usage by the size of all that was relayed, not of the first MiB kept.
    #[test]
    fn a_model_call_too_long_or_too_odd_to_read_is_counted_all_the_same() {
        let gateway = gateway();
        let mut padded = br#"{"model":"m","#.to_vec();
        padded.resize(KEPT, b' ');
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                &padded,
                REPLY,
                Duration::ZERO,
                false,
                (3 * KEPT as u64, REPLY.len() as u64),
            )
            .expect("a model call padded past what is kept is read");
        assert_eq!(read["tokens_used"], 10, "{read}");
        let odd = br#"{"model":"m","messages":[{"role":"user","content":"\ud800"}]}"#;
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                odd,
                REPLY,
                Duration::ZERO,
                false,
                (odd.len() as u64, REPLY.len() as u64),
            )
            .expect("a model call the gateway cannot parse is read");
        assert_eq!(read["tokens_used"], 20, "{read}");
        let no_usage = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"choices\":[]}";
        let relayed = 4 << 20;
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                &padded,
                no_usage,
                Duration::ZERO,
                true,
                (relayed, no_usage.len() as u64),
            )
            .unwrap();
        assert_eq!(read["tokens_estimated"], true, "{read}");
        assert_eq!(
            read["tokens_used"],
            20 + (relayed + no_usage.len() as u64) / 4,
            "{read}"
        );
    }

    /// A credential bound `in_body` is the secret in the body that went upstream; the record
    /// read from that body names the placeholder, never the secret.
    #[test]
    fn the_record_of_a_model_call_never_holds_a_secret_put_in_its_body() {
        let secret = crate::secrets::Secret {
            name: "api".into(),
            placeholder: "placeholder-0123456789".into(),
            value: "s3cr3t-VALUE-abcdefghi".into(),
            header: "Authorization".into(),
            format: "Bearer {}".into(),
            env: None,
            in_body: true,
        };
        let gateway = gateway_with(crate::Secrets { all: vec![secret] });
        let sent =
            br#"{"model":"s3cr3t-VALUE-abcdefghi","messages":[{"role":"user","content":"x"}]}"#;
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                sent,
                REPLY,
                Duration::ZERO,
                false,
                (0, 0),
            )
            .expect("a model call is read");
        let text = read.to_string();
        assert!(!text.contains("s3cr3t-VALUE"), "{text}");
        assert_eq!(read["model"], "placeholder-0123456789");
    }

    #[test]
    fn model_calls_are_posts_to_the_model_endpoints() {
        assert!(model_call("POST", "/v1/chat/completions"));
        assert!(model_call("POST", "/v1/messages?beta=true"));
        assert!(model_call("POST", "/openai/v1/responses"));
        assert!(!model_call("GET", "/v1/responses"));
        assert!(!model_call("POST", "/v1/embeddings"));
    }
}
