//! A scripted stand-in for a model API (the one thing a test cannot have for real): a local
//! HTTP server that speaks the three wire formats the warden's agent loop does (OpenAI Chat
//! Completions, the Responses API, Anthropic Messages), streamed as the real APIs stream them:
//! tool-call arguments cut into fragments, parallel calls interleaved, usage at the end. Each
//! request gets the next step of a script; every request is kept for the test to look at.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// One answer of the script.
#[derive(Debug, Clone)]
pub enum Step {
    /// Tool calls (name, arguments as the model writes them: any text), in parallel.
    Calls(Vec<(String, String)>),
    /// Words and no call: the model is done.
    Text(String),
    /// An error status (with `Retry-After: 0`).
    Status(u16),
    /// A stream that stops half-way (the connection closed).
    Cut,
    /// Wait this long before answering with the next step.
    Delay(Duration, Box<Step>),
    /// A streamed answer that trickles: its headers at once, then an SSE comment (a keep-alive)
    /// a second for this long, then the step's events (a server that never ends its reply,
    /// or ends it after minutes; a read timeout that each byte resets never fires).
    Trickle(Duration, Box<Step>),
}

/// A tool call with JSON arguments.
pub fn call(name: &str, args: Value) -> Step {
    Step::Calls(vec![(name.to_owned(), args.to_string())])
}

/// A request the server got.
#[derive(Debug, Clone)]
pub struct Got {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Value,
    pub at: Instant,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every text in the request (messages, input items, tool results), for searching.
    pub fn text(&self) -> String {
        self.body.to_string()
    }
}

#[derive(Default, Debug)]
struct State {
    script: VecDeque<Step>,
    /// What is answered once the script is spent.
    then: Option<Step>,
    got: Vec<Got>,
}

#[derive(Debug, Clone)]
pub struct ModelServer {
    state: Arc<(Mutex<State>, Condvar)>,
    pub port: u16,
}

impl ModelServer {
    pub fn start(script: Vec<Step>) -> Self {
        let (server, listener) = Self::listening(script);
        let accepting = server.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let server = accepting.clone();
                std::thread::spawn(move || server.serve(stream));
            }
        });
        server
    }

    /// The API root for `--base-url` (the Anthropic SDKs' root has no `/v1`).
    pub fn base_url(&self, provider: &str) -> String {
        match provider {
            "anthropic" => format!("http://127.0.0.1:{}", self.port),
            _ => format!("http://127.0.0.1:{}/v1", self.port),
        }
    }

    /// What to answer once the script is spent (by default a final text).
    pub fn then(&self, step: Step) {
        self.state.0.lock().unwrap().then = Some(step);
    }

    pub fn push(&self, step: Step) {
        self.state.0.lock().unwrap().script.push_back(step);
    }

    pub fn requests(&self) -> Vec<Got> {
        self.state.0.lock().unwrap().got.clone()
    }

    pub fn count(&self) -> usize {
        self.state.0.lock().unwrap().got.len()
    }

    /// Waits until `n` requests came; panics after `timeout`.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Got> {
        let (lock, cvar) = &*self.state;
        let deadline = Instant::now() + timeout;
        let mut state = lock.lock().unwrap();
        while state.got.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "the model server got {} requests, not {n}",
                state.got.len()
            );
            state = cvar.wait_timeout(state, left).unwrap().0;
        }
        state.got.clone()
    }

    /// The same server behind TLS, with a certificate for 127.0.0.1 from a CA of its own
    /// (returned as PEM, for the client to trust).
    pub fn start_tls(script: Vec<Step>) -> (Self, String) {
        Self::start_tls_on("127.0.0.1", script)
    }

    /// The same behind TLS on another loopback address (`ip`, its certificate's name): one a
    /// cell's clients send through the gateway, where 127.0.0.1 is theirs (`NO_PROXY`).
    pub fn start_tls_on(ip: &str, script: Vec<Step>) -> (Self, String) {
        let (config, ca) = super::tls_server_config(ip);
        let (server, listener) = Self::listening_on(ip, script);
        let accepting = server.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let server = accepting.clone();
                let config = config.clone();
                std::thread::spawn(move || {
                    let session = rustls::ServerConnection::new(config).unwrap();
                    server.serve_on(BufReader::new(rustls::StreamOwned::new(session, stream)));
                });
            }
        });
        (server, ca)
    }

    /// A server with this script, and its listener on a free loopback port.
    fn listening(script: Vec<Step>) -> (Self, TcpListener) {
        Self::listening_on("127.0.0.1", script)
    }

    fn listening_on(ip: &str, script: Vec<Step>) -> (Self, TcpListener) {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new((
            Mutex::new(State {
                script: script.into(),
                ..Default::default()
            }),
            Condvar::new(),
        ));
        (Self { state, port }, listener)
    }

    fn serve(&self, stream: TcpStream) {
        self.serve_on(BufReader::new(stream));
    }

    fn serve_on<S: Read + Write>(&self, mut reader: BufReader<S>) {
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
            let mut headers = Vec::new();
            let mut length = 0;
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).unwrap();
                let header = header.trim_end();
                if header.is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':') {
                    if name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                    headers.push((name.trim().to_owned(), value.trim().to_owned()));
                }
            }
            // As the servers of the model APIs do (Go's, Node's): a client that expects to be
            // told to go on is, before its body is read.
            let expects = headers.iter().any(|(name, value)| {
                name.eq_ignore_ascii_case("expect") && value.eq_ignore_ascii_case("100-continue")
            });
            if expects && length > 0 {
                let _ = reader.get_mut().write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let step = {
                let (lock, cvar) = &*self.state;
                let mut state = lock.lock().unwrap();
                state.got.push(Got {
                    path: path.clone(),
                    headers,
                    body: body.clone(),
                    at: Instant::now(),
                });
                cvar.notify_all();
                let then = state
                    .then
                    .clone()
                    .unwrap_or(Step::Text("(the script ended)".into()));
                state.script.pop_front().unwrap_or(then)
            };
            if !answer(reader.get_mut(), &path, &body, step) {
                return;
            }
        }
    }
}

static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn id() -> u64 {
    IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Pieces of a text of about `n` bytes, at character boundaries.
fn pieces(text: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        current.push(c);
        if current.len() >= n {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() || out.is_empty() {
        out.push(current);
    }
    out
}

/// Answers one request; `false` when the connection is to be closed.
fn answer(out: &mut impl Write, path: &str, body: &Value, step: Step) -> bool {
    let (step, trickle) = match step {
        Step::Delay(wait, step) => {
            std::thread::sleep(wait);
            (*step, None)
        }
        Step::Trickle(long, step) => (*step, Some(long)),
        step => (step, None),
    };
    if let Step::Status(code) = step {
        let text = json!({ "error": { "message": format!("scripted status {code}"), "type": "scripted" } }).to_string();
        let _ = write!(
            out,
            "HTTP/1.1 {code} Scripted\r\ncontent-type: application/json\r\nretry-after: 0\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        return true;
    }
    let events = if path.ends_with("/chat/completions") {
        chat(&step)
    } else if path.ends_with("/responses") {
        responses(&step)
    } else if path.ends_with("/messages") {
        anthropic(&step)
    } else {
        let _ = write!(out, "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
        return true;
    };
    if body["stream"] != true {
        let text = whole(path, &step).to_string();
        let _ = write!(
            out,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        return true;
    }
    let _ = write!(
        out,
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    if let Some(long) = trickle {
        let until = Instant::now() + long;
        while Instant::now() < until {
            let comment = ": keep-alive\n\n";
            if write!(out, "{:x}\r\n{comment}\r\n", comment.len()).is_err() || out.flush().is_err()
            {
                // The client went away.
                return false;
            }
            std::thread::sleep(
                until
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_secs(1)),
            );
        }
    }
    let cut = matches!(step, Step::Cut);
    let total = events.len();
    for (n, (name, data)) in events.into_iter().enumerate() {
        if cut && n == total / 2 {
            // The connection is dropped, unfinished, by the caller.
            let _ = out.flush();
            return false;
        }
        let mut event = String::new();
        if let Some(name) = name {
            event.push_str(&format!("event: {name}\n"));
        }
        event.push_str(&format!("data: {data}\n\n"));
        if write!(out, "{:x}\r\n{event}\r\n", event.len()).is_err() {
            return false;
        }
        let _ = out.flush();
    }
    let _ = write!(out, "0\r\n\r\n");
    let _ = out.flush();
    true
}

/// A reply not streamed, in the format of `path`.
fn whole(path: &str, step: &Step) -> Value {
    let calls = calls_of(step);
    let text = text_of(step);
    let usage = (100, 20);
    if path.ends_with("/chat/completions") {
        let tool_calls: Vec<Value> = calls.iter().map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})).collect();
        let mut message = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { text.clone().into() }});
        if !tool_calls.is_empty() {
            message["tool_calls"] = tool_calls.into();
        }
        json!({"id": format!("chatcmpl-{}", id()), "object": "chat.completion", "created": 0, "model": "scripted", "choices": [{"index": 0, "message": message, "finish_reason": if calls.is_empty() { "stop" } else { "tool_calls" }}], "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}})
    } else if path.ends_with("/responses") {
        let mut output: Vec<Value> = Vec::new();
        if !text.is_empty() {
            output.push(json!({"type": "message", "id": format!("msg_{}", id()), "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}));
        }
        for (call_id, name, args) in &calls {
            output.push(json!({"type": "function_call", "id": format!("fc_{call_id}"), "call_id": call_id, "name": name, "arguments": args, "status": "completed"}));
        }
        json!({"id": format!("resp_{}", id()), "object": "response", "created_at": 0, "model": "scripted", "status": "completed", "output": output, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "usage": {"input_tokens": usage.0, "output_tokens": usage.1, "total_tokens": usage.0 + usage.1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}})
    } else {
        let mut content: Vec<Value> = Vec::new();
        if !text.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        for (call_id, name, args) in &calls {
            content.push(json!({"type": "tool_use", "id": call_id, "name": name, "input": serde_json::from_str::<Value>(args).unwrap_or(json!({}))}));
        }
        json!({"id": format!("msg_{}", id()), "type": "message", "role": "assistant", "model": "scripted", "content": content, "stop_reason": if calls.is_empty() { "end_turn" } else { "tool_use" }, "usage": {"input_tokens": usage.0, "output_tokens": usage.1}})
    }
}

/// The calls of a step (a cut stream: a call cut half-way).
fn calls_of(step: &Step) -> Vec<(String, String, String)> {
    match step {
        Step::Calls(calls) => calls
            .iter()
            .map(|(n, a)| (format!("call_{}", id()), n.clone(), a.clone()))
            .collect(),
        Step::Cut => vec![(
            format!("call_{}", id()),
            "exec".into(),
            json!({"command": "echo never"}).to_string(),
        )],
        _ => Vec::new(),
    }
}

fn text_of(step: &Step) -> String {
    match step {
        Step::Text(t) => t.clone(),
        _ => String::new(),
    }
}

fn chat(step: &Step) -> Vec<(Option<String>, String)> {
    let n = id();
    let chunk = |delta: Value, finish: Value| {
        (None, json!({"id": format!("chatcmpl-{n}"), "object": "chat.completion.chunk", "model": "scripted", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).to_string())
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    let calls = calls_of(step);
    for (i, (id, name, _)) in calls.iter().enumerate() {
        events.push(chunk(json!({"tool_calls": [{"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}), Value::Null));
    }
    // The calls' arguments in fragments, interleaved across the calls.
    let split: Vec<Vec<String>> = calls.iter().map(|(_, _, a)| pieces(a, 5)).collect();
    let longest = split.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..longest {
        for (i, parts) in split.iter().enumerate() {
            if let Some(part) = parts.get(k) {
                events.push(chunk(
                    json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}),
                    Value::Null,
                ));
            }
        }
    }
    for piece in pieces(&text_of(step), 7) {
        events.push(chunk(json!({"content": piece}), Value::Null));
    }
    let finish = if calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    events.push(chunk(json!({}), json!(finish)));
    events.push((None, json!({"id": format!("chatcmpl-{n}"), "object": "chat.completion.chunk", "model": "scripted", "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}).to_string()));
    events.push((None, "[DONE]".to_owned()));
    events
}

fn responses(step: &Step) -> Vec<(Option<String>, String)> {
    let mut seq = 0;
    let mut event = |kind: &str, mut fields: Value| {
        fields["type"] = kind.into();
        fields["sequence_number"] = seq.into();
        seq += 1;
        (Some(kind.to_owned()), fields.to_string())
    };
    let n = id();
    let mut events = vec![event(
        "response.created",
        json!({"response": {"id": format!("resp_{n}"), "status": "in_progress", "output": []}}),
    )];
    let calls = calls_of(step);
    let text = text_of(step);
    let mut output = Vec::new();
    if !text.is_empty() {
        let item = json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]});
        events.push(event("response.output_item.added", json!({"output_index": 0, "item": {"type": "message", "id": format!("msg_{n}"), "role": "assistant", "content": []}})));
        for piece in pieces(&text, 7) {
            events.push(event("response.output_text.delta", json!({"output_index": 0, "item_id": format!("msg_{n}"), "content_index": 0, "delta": piece})));
        }
        events.push(event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        ));
        output.push(item);
    }
    let base = output.len();
    for (i, (call_id, name, _)) in calls.iter().enumerate() {
        events.push(event("response.output_item.added", json!({"output_index": base + i, "item": {"type": "function_call", "id": format!("fc_{call_id}"), "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}})));
    }
    let split: Vec<Vec<String>> = calls.iter().map(|(_, _, a)| pieces(a, 5)).collect();
    let longest = split.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..longest {
        for (i, parts) in split.iter().enumerate() {
            if let Some(part) = parts.get(k) {
                events.push(event("response.function_call_arguments.delta", json!({"output_index": base + i, "item_id": format!("fc_{}", calls[i].0), "delta": part})));
            }
        }
    }
    for (i, (call_id, name, arguments)) in calls.iter().enumerate() {
        let item = json!({"type": "function_call", "id": format!("fc_{call_id}"), "call_id": call_id, "name": name, "arguments": arguments, "status": "completed"});
        events.push(event("response.function_call_arguments.done", json!({"output_index": base + i, "item_id": format!("fc_{call_id}"), "arguments": arguments})));
        events.push(event(
            "response.output_item.done",
            json!({"output_index": base + i, "item": item}),
        ));
        output.push(item);
    }
    events.push(event("response.completed", json!({"response": {"id": format!("resp_{n}"), "model": "scripted", "status": "completed", "output": output, "usage": {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120}}})));
    events
}

fn anthropic(step: &Step) -> Vec<(Option<String>, String)> {
    let event = |kind: &str, mut fields: Value| {
        fields["type"] = kind.into();
        (Some(kind.to_owned()), fields.to_string())
    };
    let n = id();
    let mut events = vec![event(
        "message_start",
        json!({"message": {"id": format!("msg_{n}"), "type": "message", "role": "assistant", "model": "scripted", "content": [], "stop_reason": null, "usage": {"input_tokens": 100, "output_tokens": 1}}}),
    )];
    let mut index = 0;
    let text = text_of(step);
    if !text.is_empty() {
        events.push(event(
            "content_block_start",
            json!({"index": index, "content_block": {"type": "text", "text": ""}}),
        ));
        for piece in pieces(&text, 7) {
            events.push(event(
                "content_block_delta",
                json!({"index": index, "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        events.push(event("content_block_stop", json!({"index": index})));
        index += 1;
    }
    events.push(event("ping", json!({})));
    let calls = calls_of(step);
    for (call_id, name, arguments) in &calls {
        events.push(event("content_block_start", json!({"index": index, "content_block": {"type": "tool_use", "id": call_id, "name": name, "input": {}}})));
        for piece in pieces(arguments, 5) {
            events.push(event("content_block_delta", json!({"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})));
        }
        events.push(event("content_block_stop", json!({"index": index})));
        index += 1;
    }
    let stop = if calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    };
    events.push(event("message_delta", json!({"delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 20}})));
    events.push(event("message_stop", json!({})));
    events
}
