//! The model client: one request to a model API in its wire format, streamed, with retries.
//!
//! It is `reqwest` (TLS by rustls with the ring provider, roots from the platform's store), and
//! the warden's own decoders of the three formats (`warden-model`), which the egress gateway
//! shares: no SDK covers the three, and the gateway must read the same streams anyway.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use warden_model::{Delta, Format, Reply, Request, WireError};

/// The most one reply's body may hold.
const REPLY_LIMIT: usize = 32 << 20;
/// The most of an error answer's body read, for its message.
const ERROR_BODY_LIMIT: usize = 64 << 10;

/// Reads `response`'s body up to `limit` bytes: what came, and whether that was all of it
/// (`Ok(false)`: there was more, left unread), or the error that cut it.
async fn read_up_to(
    mut response: reqwest::Response,
    limit: usize,
) -> (Vec<u8>, Result<bool, reqwest::Error>) {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    let room = limit - body.len();
                    body.extend_from_slice(&chunk[..room]);
                    return (body, Ok(false));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return (body, Ok(true)),
            Err(e) => return (body, Err(e)),
        }
    }
}
/// Tries per request, for failures worth another try.
const ATTEMPTS: u32 = 4;
/// The first wait before another try; it doubles each time.
const BACKOFF: Duration = Duration::from_millis(500);
/// The longest a `Retry-After` is waited.
const LONGEST_WAIT: Duration = Duration::from_secs(30);

/// A model at an endpoint, with the key the warden holds for it.
#[derive(Clone)]
pub struct Model {
    pub format: Format,
    pub name: String,
    pub base_url: String,
    key: Option<String>,
    http: reqwest::Client,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("format", &self.format)
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("key", &self.key.as_ref().map(|_| "(held)"))
            .finish()
    }
}

/// A request that got its reply.
#[derive(Debug)]
pub struct Called {
    pub reply: Reply,
    pub latency: Duration,
    pub attempts: u32,
    pub request_bytes: usize,
    pub reply_bytes: usize,
}

/// Text the model API wrote (an error's message), quoted in the session's reason for ending:
/// every character that could steer a terminal written as `\u{..}`, since `warden agent run`
/// prints the reason to an operator's terminal.
fn plain(text: &str) -> String {
    let steers = |c: char| {
        (c.is_control() && c != '\t')
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if steers(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// Why a request got no reply.
#[derive(Debug, Clone)]
pub struct ModelError {
    pub message: String,
    /// Whether another try could help (a 429, a 5xx, a cut stream, a connection refused).
    pub retryable: bool,
    /// The wait the API asked for.
    retry_after: Option<Duration>,
    pub attempts: u32,
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Model {
    /// `spec` is `PROVIDER:MODEL`; `base_url` the API root (the provider's when none).
    pub fn new(spec: &str, base_url: Option<&str>, key: Option<String>) -> Result<Self, String> {
        let (provider, name) = spec.split_once(':').ok_or_else(|| {
            format!(
                "model `{spec}`: give PROVIDER:MODEL, PROVIDER one of {}",
                Format::PROVIDERS
            )
        })?;
        let format = Format::from_provider(provider).ok_or_else(|| {
            format!(
                "model `{spec}`: no provider `{provider}`; the providers are {}",
                Format::PROVIDERS
            )
        })?;
        if name.is_empty() {
            return Err(format!(
                "model `{spec}`: the model's name after `{provider}:` is empty"
            ));
        }
        let base_url = base_url
            .unwrap_or(format.default_base_url())
            .trim_end_matches('/')
            .to_owned();
        let url = reqwest::Url::parse(&base_url)
            .map_err(|e| format!("base URL `{base_url}` is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "base URL `{base_url}`: only http and https are spoken"
            ));
        }
        // One process-wide TLS provider; another part of the warden may have set it already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(300))
            .no_proxy()
            // A redirect is not followed: reqwest drops only `Authorization` on the way to
            // another host, and the Anthropic key is `x-api-key`; a 307 or 308 would also send
            // the whole conversation on.
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("making the model API's client: {e}"))?;
        Ok(Self {
            format,
            name: name.to_owned(),
            base_url,
            key: key.filter(|k| !k.is_empty()),
            http,
        })
    }

    /// `PROVIDER:MODEL`.
    pub fn spec(&self) -> String {
        format!("{}:{}", self.format.provider(), self.name)
    }

    /// The key, for the journal's redactions (never for the journal itself).
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// `text` (what the API said, in an error) with the key put out of it: an API that echoes
    /// the key it was sent (`Incorrect API key provided: sk-...`) had it in the session's
    /// reason, which the daemon keeps on disk, answers and shows on its dashboard. A key
    /// shorter than 8 bytes is left alone, not to mangle the words around it.
    fn without_key(&self, text: &str) -> String {
        match self.key.as_deref() {
            Some(key) if key.len() >= 8 => text.replace(key, "[the key]"),
            _ => text.to_owned(),
        }
    }

    /// Sends a request (streamed) and reads its reply, trying again with backoff where that
    /// can help. `on_delta` sees the text as it comes.
    pub async fn call(
        &self,
        request: &Request<'_>,
        mut on_delta: impl FnMut(Delta),
    ) -> Result<Called, ModelError> {
        let body = self.format.write_body(request);
        let started = Instant::now();
        let mut wait = BACKOFF;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.once(&body, &mut on_delta).await {
                Ok((reply, reply_bytes)) => {
                    return Ok(Called {
                        reply,
                        latency: started.elapsed(),
                        attempts: attempt,
                        request_bytes: body.len(),
                        reply_bytes,
                    });
                }
                Err(mut err) if !err.retryable || attempt >= ATTEMPTS => {
                    err.attempts = attempt;
                    err.message = self.without_key(&err.message);
                    if attempt > 1 {
                        err.message = format!("{} (after {attempt} tries)", err.message);
                    }
                    return Err(err);
                }
                Err(err) => {
                    let pause = err.retry_after.unwrap_or(wait).min(LONGEST_WAIT);
                    tokio::time::sleep(pause).await;
                    wait *= 2;
                }
            }
        }
    }

    async fn once(
        &self,
        body: &[u8],
        on_delta: &mut impl FnMut(Delta),
    ) -> Result<(Reply, usize), ModelError> {
        let url = format!("{}{}", self.base_url, self.format.path());
        let mut request = self
            .http
            .post(&url)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .body(body.to_vec());
        if let Some(key) = &self.key {
            for (name, value) in self.format.headers(key) {
                request = request.header(name, value);
            }
        } else if self.format == Format::Anthropic {
            request = request.header("anthropic-version", warden_model::ANTHROPIC_VERSION);
        }
        let response = request.send().await.map_err(|e| ModelError {
            message: format!("reaching the model API at {url}: {}", error_chain(&e)),
            retryable: true,
            retry_after: None,
            attempts: 0,
        })?;
        let status = response.status();
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64);
            if status.is_redirection() {
                let location = response
                    .headers()
                    .get("location")
                    .map(|v| {
                        plain(
                            &String::from_utf8_lossy(v.as_bytes())
                                .chars()
                                .take(300)
                                .collect::<String>(),
                        )
                    })
                    .unwrap_or_else(|| "(no Location)".to_owned());
                return Err(ModelError {
                    message: format!(
                        "the model API at {url} answered {status}, a redirect to {location}, which the warden does not follow (the key and the conversation would go with it); if that is the API, give it as the base URL"
                    ),
                    retryable: false,
                    retry_after: None,
                    attempts: 0,
                });
            }
            // Only enough of an error's body to say what it was: a server that answers an
            // endless one is not read on.
            let (body, _) = read_up_to(response, ERROR_BODY_LIMIT).await;
            let text = String::from_utf8_lossy(&body).into_owned();
            let detail = serde_json::from_str(&text)
                .ok()
                .and_then(|v| warden_model::error_message(&v))
                .unwrap_or_else(|| text.chars().take(300).collect());
            let detail = plain(&detail);
            let hint = match status.as_u16() {
                401 | 403 => format!(
                    "; check the key ({} in the environment of the command that started the session)",
                    self.format.key_variable()
                ),
                404 => format!("; check the model name `{}` and the base URL", self.name),
                _ => String::new(),
            };
            return Err(ModelError {
                message: format!("the model API answered {status}: {detail}{hint}"),
                retryable: matches!(status.as_u16(), 408 | 409 | 429) || status.is_server_error(),
                retry_after,
                attempts: 0,
            });
        }
        let streamed = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let wire = |e: WireError| ModelError {
            retryable: matches!(e, WireError::Incomplete),
            message: plain(&e.to_string()),
            retry_after: None,
            attempts: 0,
        };
        let mut size = 0;
        if !streamed {
            // Bounded like a streamed reply: a reply past the limit is refused, never read
            // whole into memory (its length said up front, or counted as it comes).
            let too_long = || ModelError {
                message: format!("the model API's reply is longer than {REPLY_LIMIT} bytes"),
                retryable: false,
                retry_after: None,
                attempts: 0,
            };
            if response
                .content_length()
                .is_some_and(|length| length > REPLY_LIMIT as u64)
            {
                return Err(too_long());
            }
            let (bytes, whole) = read_up_to(response, REPLY_LIMIT).await;
            let bytes = match whole {
                Ok(true) => bytes,
                Ok(false) => return Err(too_long()),
                Err(e) => {
                    return Err(ModelError {
                        message: format!("reading the model API's reply: {}", error_chain(&e)),
                        retryable: true,
                        retry_after: None,
                        attempts: 0,
                    });
                }
            };
            let value: serde_json::Value = serde_json::from_slice(&bytes)
                .map_err(|e| wire(WireError::Malformed(format!("the reply is not JSON: {e}"))))?;
            let reply = self.format.reply(&value).map_err(wire)?;
            if !reply.text.is_empty() {
                on_delta(Delta::Text(reply.text.clone()));
            }
            return Ok((reply, bytes.len()));
        }
        let mut decoder = self.format.stream();
        let mut chunks = response.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                // A stream cut mid-way: what came is not a reply.
                Err(_) => return Err(wire(WireError::Incomplete)),
            };
            size += chunk.len();
            if size > REPLY_LIMIT {
                return Err(ModelError {
                    message: format!("the model API's reply is longer than {REPLY_LIMIT} bytes"),
                    retryable: false,
                    retry_after: None,
                    attempts: 0,
                });
            }
            for delta in decoder.feed(&chunk).map_err(wire)? {
                on_delta(delta);
            }
            if decoder.is_done() {
                break;
            }
        }
        decoder.finish().map(|reply| (reply, size)).map_err(wire)
    }
}

/// An error with its causes (reqwest's own message is only the outermost).
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::{Read as _, Write as _};

    /// A model server on loopback that answers every request with `head` and then `body_len`
    /// bytes of a JSON string (sent as it is asked for, so an endless one costs it nothing).
    fn server(head: String, body_len: usize) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let head = head.clone();
                std::thread::spawn(move || {
                    let mut conn = conn;
                    let mut request = [0u8; 65536];
                    let _ = conn.read(&mut request);
                    let _ = conn.write_all(head.as_bytes());
                    let chunk = vec![b'a'; 1 << 16];
                    let _ = conn.write_all(b"{\"x\":\"");
                    let mut sent = 0;
                    while sent < body_len {
                        let n = chunk.len().min(body_len - sent);
                        if conn.write_all(&chunk[..n]).is_err() {
                            return;
                        }
                        sent += n;
                    }
                    let _ = conn.write_all(b"\"}");
                });
            }
        });
        format!("http://{address}/v1")
    }

    /// A model API that redirects the warden elsewhere: the key and the conversation stay
    /// where they were sent. (reqwest followed a 307 with the body, and dropped only
    /// `Authorization` on the way to another host: the Anthropic key, `x-api-key`, went on.)
    #[tokio::test]
    async fn a_redirect_is_not_followed_with_the_key() {
        let thief = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let thief_at = thief.local_addr().unwrap();
        let (got, heard) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for conn in thief.incoming().flatten() {
                let mut conn = conn;
                let mut request = vec![0u8; 65536];
                let n = conn.read(&mut request).unwrap_or(0);
                let _ = got.send(String::from_utf8_lossy(&request[..n]).into_owned());
                let _ = conn.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        for spec in ["anthropic:fake", "openai:fake", "openai-responses:fake"] {
            for code in [
                "307 Temporary Redirect",
                "308 Permanent Redirect",
                "302 Found",
            ] {
                let url = server(
                    format!(
                        "HTTP/1.1 {code}\r\nLocation: http://{thief_at}/steal\r\nContent-Length: 0\r\n\r\n"
                    ),
                    0,
                );
                let model = Model::new(spec, Some(&url), Some("sk-secret-key".to_owned())).unwrap();
                let err =
                    tokio::time::timeout(Duration::from_secs(20), model.once(b"{}", &mut |_| {}))
                        .await
                        .expect("the call ended")
                        .unwrap_err();
                assert!(
                    err.message.contains("redirect") && err.message.contains("/steal"),
                    "{spec} {code}: {}",
                    err.message
                );
                assert!(!err.retryable);
                assert!(!err.message.contains("sk-secret-key"));
            }
        }
        let stolen: Vec<String> = heard.try_iter().collect();
        assert!(stolen.is_empty(), "the redirect was followed: {stolen:?}");
    }

    /// A model API that echoes the key in its error: the session's reason (kept on disk by
    /// the daemon, answered and shown) says it without the key.
    #[tokio::test]
    async fn an_error_that_echoes_the_key_is_told_without_it() {
        let key = "sk-echoed-0123456789abcdef";
        let body = format!(r#"{{"error":{{"message":"Incorrect API key provided: {key}"}}}}"#);
        for (code, streamed) in [("401 Unauthorized", false), ("200 OK", true)] {
            let head = if streamed {
                let event = format!(r#"data: {{"error":{{"message":"bad key {key}"}}}}"#);
                format!(
                    "HTTP/1.1 {code}\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n{event}\n\n"
                )
            } else {
                format!(
                    "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
            };
            let url = server(head, 0);
            let model = Model::new("openai:fake", Some(&url), Some(key.to_owned())).unwrap();
            let request = Request {
                model: "fake",
                instructions: "",
                items: &[],
                tools: &[],
                max_output_tokens: None,
                stream: true,
            };
            let err = tokio::time::timeout(Duration::from_secs(20), model.call(&request, |_| {}))
                .await
                .expect("the call ended")
                .unwrap_err();
            assert!(!err.message.contains(key), "{code}: {}", err.message);
            assert!(err.message.contains("[the key]"), "{code}: {}", err.message);
        }
    }

    #[tokio::test]
    async fn a_reply_longer_than_the_limit_is_refused_unread() {
        let long = REPLY_LIMIT + (4 << 20);
        // Its length said up front, and not said (read to the connection's end).
        for head in [
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                long + 8
            ),
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                .to_owned(),
            // An error answer that never ends: its message is taken from its first bytes.
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                .to_owned(),
        ] {
            let failing = head.contains(" 500 ");
            let url = server(head, if failing { usize::MAX } else { long });
            let model = Model::new("openai:fake", Some(&url), Some("k".to_owned())).unwrap();
            let err = tokio::time::timeout(
                Duration::from_secs(60),
                model.once(b"{}", &mut |_| {}),
            )
            .await
            .expect("the reply was read without end")
            .unwrap_err();
            if failing {
                assert!(err.message.contains("500"), "{}", err.message);
            } else {
                assert!(err.message.contains("longer than"), "{}", err.message);
                assert!(!err.retryable);
            }
        }
    }
}
