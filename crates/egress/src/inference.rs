//! A cell's model traffic. Requests to `network.inference`'s name are sent to its upstream;
//! every exchange with the upstream is read in its wire format (`warden-model`: Chat
//! Completions, Responses, Anthropic Messages, streamed or whole) and recorded with the
//! decision; the cell's tokens are counted against the route's budget. A model call that goes
//! elsewhere through the gateway, where it sees the request (plain HTTP, or HTTPS it opens:
//! a destination with a credential or with method and path rules), is read, recorded and
//! counted the same way: an agent in a cell that speaks to its provider itself is seen as well.

use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};

use crate::host::Host;
use crate::http::Body;
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

    /// Tokens the cell's model calls used so far (those under way not yet in them).
    #[cfg(test)]
    pub(crate) fn tokens_used(&self) -> u64 {
        lock(&self.inference_budget).used
    }

    /// Lets a model call through the cell's token budget (`network.inference.max_tokens`), or
    /// refuses and records it; the body to answer a refusal with (429). A call let through
    /// holds a reservation of what it may cost until its tokens are counted: its input (a
    /// quarter token a byte of its body) and the output its request caps (`max_tokens` and its
    /// kin), or, where it caps none, all that is left of the budget (no other call starts
    /// while it is under way). A call is refused when what is used, what the calls under way
    /// hold and what it asks for would take the cell past its budget: checked only against
    /// what was used, calls sent at once all found the budget unspent and overran it as many
    /// times over. To see its cap, a body announced by its length and shorter than what is
    /// kept is read here, before anything goes upstream (into `early`, which is sent from);
    /// a client that asked to be told to go on is, first. `routed`: the call is the route's
    /// (off it, a body read whole that names no model is a REST API's, counted as nothing,
    /// and reserves nothing). `None`: no budget, or no reservation to hold.
    pub(crate) fn admit_call(
        &self,
        decision: &mut crate::Decision,
        client: &mut (impl Read + Write),
        headers: &[(String, Vec<u8>)],
        body: Body,
        early: &mut Vec<u8>,
        routed: bool,
    ) -> Result<Option<Reservation>, Value> {
        let Some(max) = self.rules().inference.as_ref().and_then(|r| r.max_tokens) else {
            return Ok(None);
        };
        // Spent, or held whole by the calls under way: refused unread, as before.
        if let Some(reason) = refusal(&lock(&self.inference_budget), max, None) {
            return Err(self.refuse_over_budget(decision, reason));
        }
        let length = match body {
            Body::Length(n) if n < KEPT as u64 => Some(n as usize),
            _ => None,
        };
        if let Some(length) = length
            && early.len() < length
        {
            crate::http::go_on(client, headers, body, early);
            // A body that does not come whole (a client gone, or silent past the idle limit)
            // does not read: the call caps nothing, and takes what is left.
            let _ = client
                .take((length - early.len()) as u64)
                .read_to_end(early);
        }
        let request: Option<Value> =
            length.and_then(|n| serde_json::from_slice(&early[..n.min(early.len())]).ok());
        if !routed
            && request
                .as_ref()
                .is_some_and(|b| b.is_object() && !b.get("model").is_some_and(Value::is_string))
        {
            return Ok(None);
        }
        let ask = length
            .zip(request.as_ref().and_then(declared_cap))
            .map(|(length, cap)| Ask {
                input: length as u64 / 4,
                cap,
            });
        let mut budget = lock(&self.inference_budget);
        if let Some(reason) = refusal(&budget, max, ask.as_ref()) {
            drop(budget);
            return Err(self.refuse_over_budget(decision, reason));
        }
        let tokens = match &ask {
            Some(ask) => ask.tokens(),
            None => max.saturating_sub(budget.used.saturating_add(budget.reserved)),
        };
        budget.reserved = budget.reserved.saturating_add(tokens);
        budget.under_way += 1;
        Ok(Some(Reservation {
            budget: self.inference_budget.clone(),
            tokens,
            held: true,
        }))
    }

    /// Refuses and records a model call past the cell's token budget for `reason`; the body
    /// to answer it with (429).
    fn refuse_over_budget(&self, decision: &mut crate::Decision, reason: String) -> Value {
        decision.allowed = false;
        decision.reason = reason;
        self.log_decision(decision);
        budget_spent_body(&decision.reason)
    }

    /// Reads an exchange (the request's body, the response as the client got it: head and
    /// decoded body, each its first `KEPT` bytes; `relayed`: how many bytes went up and came
    /// down in all) and counts its tokens; the record's `inference` field. One off the route
    /// (`routed` false) is passed over only when its request, read whole, is JSON that names no
    /// `model` (a REST API's `/messages` is not counted as tokens); one longer than what is
    /// kept, or that is not JSON the gateway reads, is counted. `held`: the call's reservation
    /// of the budget (`admit_call`), given back as its tokens are counted.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read_exchange(
        &self,
        path: &str,
        request: &[u8],
        response: &[u8],
        latency: Duration,
        routed: bool,
        relayed: (u64, u64),
        held: Option<Reservation>,
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
        // And only an object: what was kept of a chunked body the upstream cut off after its
        // first write is the chunk's size line (`38\r\n`), which reads as a JSON number.
        if !routed
            && !request_cut
            && body
                .as_ref()
                .is_some_and(|b| b.is_object() && !b.get("model").is_some_and(Value::is_string))
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
        // total round to nothing, the cell's budget whole again. The call's reservation is
        // given back in the same step: at no moment is it counted neither way.
        let total = {
            let mut budget = lock(&self.inference_budget);
            budget.used = budget.used.saturating_add(counted);
            if let Some(mut held) = held {
                held.release(&mut budget);
            }
            budget.used
        };
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

/// The cell's token budget as it stands (one per gateway).
#[derive(Debug, Default)]
pub(crate) struct Budget {
    /// Tokens counted, of the calls that ended.
    used: u64,
    /// Tokens reserved by the calls under way (what each may cost), and how many they are.
    reserved: u64,
    under_way: u64,
}

/// What a model call let through holds of the cell's budget while it is under way. Given back
/// when its tokens are counted (`read_exchange`), and on every other way out (an upstream that
/// cannot be reached, a refusal after the call was let through, an error, a client gone) when
/// it is dropped: a reservation kept would hold the cell's budget for good.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Mutex<Budget>>,
    tokens: u64,
    held: bool,
}

impl Reservation {
    /// Gives the reservation back to `budget` (its own, locked), once.
    fn release(&mut self, budget: &mut Budget) {
        if std::mem::take(&mut self.held) {
            budget.reserved = budget.reserved.saturating_sub(self.tokens);
            budget.under_way = budget.under_way.saturating_sub(1);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.held {
            let budget = self.budget.clone();
            self.release(&mut lock(&budget));
        }
    }
}

/// The budget, locked (a thread that panicked holding it left numbers that still hold).
fn lock(budget: &Mutex<Budget>) -> MutexGuard<'_, Budget> {
    budget.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a model call that caps its output asks of the budget.
#[derive(Debug)]
struct Ask {
    /// Its input: a quarter token a byte of its body.
    input: u64,
    cap: Cap,
}

/// The output a request caps, as it names it.
#[derive(Debug)]
struct Cap {
    /// The field (`max_tokens`, `max_completion_tokens`, ...).
    field: &'static str,
    tokens: u64,
    /// Answers asked for (`n`, `candidateCount`), each capped alike.
    answers: u64,
}

impl Ask {
    fn tokens(&self) -> u64 {
        self.input
            .saturating_add(self.cap.tokens.saturating_mul(self.cap.answers))
    }
}

/// The fields in which the model APIs take a cap on a reply's tokens: Chat Completions
/// (`max_tokens`, `max_completion_tokens`), Responses (`max_output_tokens`), Anthropic
/// Messages (`max_tokens`), Gemini (`generationConfig.maxOutputTokens`).
const CAPS: [(&str, &str); 5] = [
    ("", "max_tokens"),
    ("", "max_completion_tokens"),
    ("", "max_output_tokens"),
    ("generationConfig", "maxOutputTokens"),
    ("generation_config", "max_output_tokens"),
];

/// The output a request caps: the largest of its caps, times the answers it asks for. `None`
/// where it caps none, or names a cap that is not a whole number (a provider that takes it
/// some other way is not held to a number the gateway made up).
fn declared_cap(request: &Value) -> Option<Cap> {
    let mut found: Option<Cap> = None;
    for (within, field) in CAPS {
        let holder = if within.is_empty() {
            request
        } else {
            match request.get(within) {
                Some(holder) => holder,
                None => continue,
            }
        };
        match holder.get(field) {
            None | Some(Value::Null) => {}
            Some(value) => {
                let tokens = value.as_u64()?;
                if found.as_ref().is_none_or(|f| f.tokens < tokens) {
                    found = Some(Cap {
                        field,
                        tokens,
                        answers: 1,
                    });
                }
            }
        }
    }
    let mut cap = found?;
    let answers = [
        request.get("n"),
        request.get("candidateCount"),
        request
            .get("generationConfig")
            .and_then(|g| g.get("candidateCount")),
        request
            .get("generation_config")
            .and_then(|g| g.get("candidate_count")),
    ];
    for answers in answers.into_iter().flatten() {
        match answers {
            Value::Null => {}
            n => cap.answers = cap.answers.max(n.as_u64()?),
        }
    }
    Some(cap)
}

/// Why a model call asking `ask` (`None`: it caps no output, and would take what is left)
/// may not start, with the budget as it stands.
fn refusal(budget: &Budget, max: u64, ask: Option<&Ask>) -> Option<String> {
    let Budget {
        used,
        reserved,
        under_way,
    } = *budget;
    let what = format!("the cell's inference token budget ({max}, network.inference.max_tokens)");
    if used >= max {
        return Some(format!("{what} is spent: {used} used"));
    }
    let left = max - used.saturating_add(reserved).min(max);
    let held = match under_way {
        0 => "none reserved by calls under way".to_owned(),
        1 => format!("{reserved} reserved by the call under way"),
        n => format!("{reserved} reserved by the {n} calls under way"),
    };
    let wait = if under_way > 0 {
        ", or wait for the calls under way to end"
    } else {
        ""
    };
    match ask {
        None if left == 0 => Some(format!(
            "{what} is held whole: {used} used, {held}; wait for the calls under way to end"
        )),
        None => None,
        Some(ask) if ask.tokens() <= left => None,
        Some(ask) => {
            let Cap {
                field,
                tokens,
                answers,
            } = &ask.cap;
            let answers = if *answers > 1 {
                format!(" for each of {answers} answers")
            } else {
                String::new()
            };
            Some(format!(
                "{what} cannot take this call: {used} used, {held}, and this one may take {} ({} of input, a quarter token a byte of its body, and its {field} of {tokens}{answers}), past the {left} left; lower its {field}{wait}",
                ask.tokens(),
                ask.input,
            ))
        }
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
    use std::sync::atomic::Ordering;

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
                None,
            )
            .expect("a model call is read");
        assert_eq!(read["text"], "hi");
        assert_eq!(read["tokens_used"], 10);
        // A REST API's own `/messages` (no model named) is neither read nor counted.
        let other = br#"{"to":"someone","body":"hello"}"#;
        let none = gateway.read_exchange(
            "/api/messages",
            other,
            REPLY,
            Duration::ZERO,
            false,
            (0, 0),
            None,
        );
        assert!(none.is_none());
        assert_eq!(gateway.tokens_used(), 10);
        // What is kept of a body that is no JSON object (a chunked body cut off after its size
        // line, which reads as a number) is counted, by size.
        for kept in [&b"38\r\n"[..], b"\"text\"", b"[1]"] {
            let read = gateway.read_exchange(
                "/v1/chat/completions",
                kept,
                REPLY,
                Duration::ZERO,
                false,
                (0, 0),
                None,
            );
            assert!(read.is_some(), "{kept:?} was passed over");
        }
        assert!(gateway.tokens_used() > 10);
        // On the route, every exchange is read, whatever its body.
        let routed = gateway.read_exchange(
            "/v1/messages",
            other,
            b"",
            Duration::ZERO,
            true,
            (0, 0),
            None,
        );
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
                None,
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
                None,
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
                None,
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
                None,
            )
            .expect("a model call is read");
        let text = read.to_string();
        assert!(!text.contains("s3cr3t-VALUE"), "{text}");
        assert_eq!(read["model"], "placeholder-0123456789");
    }

    /// The caps of the wire formats are read, the largest where several are named, times the
    /// answers asked for; a request with none, or one the gateway cannot take as a number,
    /// caps nothing.
    #[test]
    fn a_request_caps_its_output_in_the_fields_of_its_format() {
        let cap = |v: Value| declared_cap(&v).map(|c| (c.field, c.tokens * c.answers));
        assert_eq!(cap(json!({"max_tokens": 50})), Some(("max_tokens", 50)));
        assert_eq!(
            cap(json!({"max_tokens": 50, "max_completion_tokens": 70, "n": 3})),
            Some(("max_completion_tokens", 210))
        );
        assert_eq!(
            cap(json!({"max_output_tokens": 9})),
            Some(("max_output_tokens", 9))
        );
        assert_eq!(
            cap(json!({"generationConfig": {"maxOutputTokens": 12, "candidateCount": 2}})),
            Some(("maxOutputTokens", 24))
        );
        assert_eq!(cap(json!({"model": "m", "max_tokens": null})), None);
        assert_eq!(cap(json!({"max_tokens": "50"})), None);
        assert_eq!(cap(json!({"max_tokens": -1})), None);
        assert_eq!(cap(json!({"max_tokens": 50, "n": 1.5})), None);
    }

    /// A reservation is given back when its call is counted, and when it is dropped on any
    /// other way out; the budget refuses what would take it past its end, saying why.
    #[test]
    fn a_reservation_is_given_back_when_counted_or_dropped() {
        let gateway = gateway();
        let budget = |g: &Gateway| {
            let b = lock(&g.inference_budget);
            (b.used, b.reserved, b.under_way)
        };
        let take = |tokens| {
            let mut b = lock(&gateway.inference_budget);
            b.reserved += tokens;
            b.under_way += 1;
            Reservation {
                budget: gateway.inference_budget.clone(),
                tokens,
                held: true,
            }
        };
        let first = take(100);
        let second = take(50);
        assert_eq!(budget(&gateway), (0, 150, 2));
        let ask = Ask {
            input: 30,
            cap: Cap {
                field: "max_tokens",
                tokens: 40,
                answers: 1,
            },
        };
        let why = refusal(&lock(&gateway.inference_budget), 200, Some(&ask)).unwrap();
        assert!(
            why.contains("0 used, 150 reserved by the 2 calls under way")
                && why.contains("may take 70")
                && why.contains("lower its max_tokens, or wait"),
            "{why}"
        );
        drop(second);
        assert_eq!(budget(&gateway), (0, 100, 1));
        assert!(refusal(&lock(&gateway.inference_budget), 200, Some(&ask)).is_none());
        let read = gateway
            .read_exchange(
                "/v1/chat/completions",
                br#"{"model":"m"}"#,
                REPLY,
                Duration::ZERO,
                true,
                (0, 0),
                Some(first),
            )
            .unwrap();
        assert_eq!(read["tokens_used"], 10);
        assert_eq!(budget(&gateway), (10, 0, 0));
        // A call passed over (a REST API's) gives its reservation back all the same.
        let third = take(60);
        let none = gateway.read_exchange(
            "/api/messages",
            br#"{"to":"x"}"#,
            REPLY,
            Duration::ZERO,
            false,
            (0, 0),
            Some(third),
        );
        assert!(none.is_none());
        assert_eq!(budget(&gateway), (10, 0, 0));
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
