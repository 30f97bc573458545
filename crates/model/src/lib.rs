//! The wire formats agents speak to their models, in one neutral shape: OpenAI-compatible Chat
//! Completions (also vLLM, llama.cpp's server, Ollama, OpenRouter), the OpenAI Responses API,
//! and Anthropic Messages. For each: the request body written from a conversation, and the
//! reply read back, whole or as its stream of server-sent events (tool calls reassembled from
//! their fragments, parallel calls kept apart, stop reason and token counts).
//!
//! No I/O lives here: the warden's own agent loop sends the requests, and the egress gateway
//! reads the same streams when it observes an agent inside a cell; both use these decoders.

use serde::{Deserialize, Serialize};
use serde_json::Value;

mod anthropic;
mod chat;
mod responses;
pub mod sse;

/// A model API's wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// `POST {base}/chat/completions`.
    Chat,
    /// `POST {base}/responses`.
    Responses,
    /// `POST {base}/v1/messages`.
    Anthropic,
}

impl Format {
    /// The provider names `--model PROVIDER:MODEL` takes.
    pub const PROVIDERS: &str =
        "openai (Chat Completions), openai-responses (Responses API), anthropic (Messages)";

    pub fn from_provider(name: &str) -> Option<Self> {
        match name {
            "openai" | "chat" => Some(Self::Chat),
            "openai-responses" | "responses" => Some(Self::Responses),
            "anthropic" => Some(Self::Anthropic),
            _ => None,
        }
    }

    pub fn provider(self) -> &'static str {
        match self {
            Self::Chat => "openai",
            Self::Responses => "openai-responses",
            Self::Anthropic => "anthropic",
        }
    }

    /// The API root its official SDKs use when given none.
    pub fn default_base_url(self) -> &'static str {
        match self {
            Self::Chat | Self::Responses => "https://api.openai.com/v1",
            Self::Anthropic => "https://api.anthropic.com",
        }
    }

    /// Where requests go, below the API root as the provider's SDKs take it.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/chat/completions",
            Self::Responses => "/responses",
            Self::Anthropic => "/v1/messages",
        }
    }

    /// The environment variable the provider's SDKs read their key from.
    pub fn key_variable(self) -> &'static str {
        match self {
            Self::Chat | Self::Responses => "OPENAI_API_KEY",
            Self::Anthropic => "ANTHROPIC_API_KEY",
        }
    }

    /// The headers that carry the key (and, for Anthropic, the API version).
    pub fn headers(self, key: &str) -> Vec<(&'static str, String)> {
        match self {
            Self::Chat | Self::Responses => vec![("authorization", format!("Bearer {key}"))],
            Self::Anthropic => vec![
                ("x-api-key", key.to_owned()),
                ("anthropic-version", ANTHROPIC_VERSION.to_owned()),
            ],
        }
    }

    /// Which format a request path is in (the gateway's view of a cell's model traffic).
    pub fn of_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(Self::Chat)
        } else if path.ends_with("/responses") {
            Some(Self::Responses)
        } else if path.ends_with("/messages") {
            Some(Self::Anthropic)
        } else {
            None
        }
    }

    /// The request body for a conversation, as bytes: serialized straight from the
    /// conversation, whose texts (each turn sends it whole) are not copied on the way.
    pub fn write_body(self, request: &Request) -> Vec<u8> {
        let mut out = Vec::with_capacity(4096);
        let written = match self {
            Self::Chat => chat::write_body(request, &mut out),
            Self::Responses => responses::write_body(request, &mut out),
            Self::Anthropic => anthropic::write_body(request, &mut out),
        };
        // Strings, numbers and JSON values only: writing them to memory cannot fail.
        debug_assert!(written.is_ok());
        out
    }

    /// The request body for a conversation, as a JSON value (what `write_body` writes).
    pub fn body(self, request: &Request) -> Value {
        serde_json::from_slice(&self.write_body(request)).unwrap_or(Value::Null)
    }

    /// Reads a whole (not streamed) reply.
    pub fn reply(self, body: &Value) -> Result<Reply, WireError> {
        if let Some(message) = error_message(body) {
            return Err(WireError::Upstream(message));
        }
        match self {
            Self::Chat => chat::reply(body),
            Self::Responses => responses::reply(body),
            Self::Anthropic => anthropic::reply(body),
        }
    }

    /// A decoder of this format's event stream.
    pub fn stream(self) -> Stream {
        Stream {
            sse: sse::Decoder::new(),
            state: match self {
                Self::Chat => Decoding::Chat(chat::Stream::default()),
                Self::Responses => Decoding::Responses(responses::Stream::default()),
                Self::Anthropic => Decoding::Anthropic(anthropic::Stream::default()),
            },
            done: false,
        }
    }

    /// What a request asks for, as far as the gateway journals it.
    pub fn summarize(self, body: &Value) -> RequestSummary {
        let items = match self {
            Self::Chat | Self::Anthropic => body.get("messages"),
            Self::Responses => body.get("input"),
        };
        RequestSummary {
            model: body.get("model").and_then(Value::as_str).map(str::to_owned),
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            items: items.map_or(0, |i| i.as_array().map_or(1, Vec::len)),
            tools: body
                .get("tools")
                .and_then(Value::as_array)
                .map_or(0, Vec::len),
        }
    }
}

/// The `anthropic-version` header sent with every Messages request.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

pub use warden_protocol::agents::{Item, ToolCall};

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// Its arguments' JSON Schema.
    pub parameters: Value,
}

/// One request: the model, its standing instructions, the conversation so far, the tools.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub model: &'a str,
    pub instructions: &'a str,
    pub items: &'a [Item],
    pub tools: &'a [Tool],
    /// Most tokens the reply may have (Anthropic needs a number; the others take none).
    pub max_output_tokens: Option<u64>,
    pub stream: bool,
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// It finished its turn.
    End,
    /// It wants its tool calls' results.
    ToolUse,
    /// It ran out of output tokens.
    MaxTokens,
    /// It refused (a safety stop).
    Refusal,
    /// Another reason, by the provider's name.
    Other(String),
}

/// Tokens a request used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
}

/// The model's reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub text: String,
    pub calls: Vec<ToolCall>,
    pub stop: Stop,
    pub usage: Usage,
    /// The model that answered, as the provider named it.
    pub model: Option<String>,
}

/// What a request asked for (for the record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestSummary {
    pub model: Option<String>,
    pub stream: bool,
    /// Messages (or input items) it carried.
    pub items: usize,
    pub tools: usize,
}

/// A reply that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The provider said something failed (an `error` event or body).
    #[error("the model API reported an error: {0}")]
    Upstream(String),
    /// Something that is not this format.
    #[error("the model API's reply is malformed: {0}")]
    Malformed(String),
    /// The stream ended before its last event.
    #[error("the model API's stream ended before the reply was complete")]
    Incomplete,
}

/// The message of an error body (`{"error": {"message": ...}}` in every format).
pub fn error_message(body: &Value) -> Option<String> {
    let error = body.get("error")?;
    if error.is_null() {
        return None;
    }
    Some(
        error
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| error.to_string()),
    )
}

/// A reply's event stream, read as its bytes arrive.
#[derive(Debug)]
pub struct Stream {
    sse: sse::Decoder,
    state: Decoding,
    done: bool,
}

#[derive(Debug)]
enum Decoding {
    Chat(chat::Stream),
    Responses(responses::Stream),
    Anthropic(anthropic::Stream),
}

/// What an event said, for whoever watches the stream (text as it comes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Text(String),
    /// A tool call began (its name).
    Call(String),
}

impl Stream {
    /// Feeds bytes of the body; returns the deltas they carried. An error is final.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Delta>, WireError> {
        let events = self
            .sse
            .feed(bytes)
            .map_err(|e| WireError::Malformed(e.to_string()))?;
        let mut deltas = Vec::new();
        for event in events {
            self.event(&event, &mut deltas)?;
        }
        Ok(deltas)
    }

    fn event(&mut self, event: &sse::Event, deltas: &mut Vec<Delta>) -> Result<(), WireError> {
        if self.done {
            return Ok(());
        }
        let data = event.data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        if data.is_empty() {
            return Ok(());
        }
        let value: Value = serde_json::from_str(data).map_err(|e| {
            WireError::Malformed(format!(
                "an event's data is not JSON ({e}): {}",
                clip(data, 200)
            ))
        })?;
        if let Some(message) = error_message(&value)
            && value.get("type").and_then(Value::as_str) != Some("response.failed")
        {
            return Err(WireError::Upstream(message));
        }
        self.done = match &mut self.state {
            Decoding::Chat(s) => s.event(&value, deltas)?,
            Decoding::Responses(s) => s.event(&value, deltas)?,
            Decoding::Anthropic(s) => s.event(&value, deltas)?,
        };
        Ok(())
    }

    /// Whether the stream's last event came.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The reply, once the body ended.
    pub fn finish(mut self) -> Result<Reply, WireError> {
        if let Some(event) = self.sse.finish() {
            let mut deltas = Vec::new();
            self.event(&event, &mut deltas)?;
        }
        let done = self.done;
        let reply = match self.state {
            Decoding::Chat(s) => s.finish(done),
            Decoding::Responses(s) => s.finish(done),
            Decoding::Anthropic(s) => s.finish(done),
        }?;
        Ok(reply)
    }
}

/// `text` cut to at most `limit` bytes at a character boundary, with `…` where it was cut:
/// for records and messages that keep a text's head (its size is kept beside it).
pub fn clip(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_owned();
    }
    let mut cut = limit;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

/// The string at `key`, or "".
fn string(value: &Value, key: &str) -> String {
    value
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// The number at `key`, or 0.
fn number(value: &Value, key: &str) -> u64 {
    value.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Tool calls, by the position the provider gave them, in that order.
#[derive(Debug, Default)]
struct Calls(std::collections::BTreeMap<u64, ToolCall>);

impl Calls {
    fn start(&mut self, index: u64, id: String, name: String) -> &mut ToolCall {
        let call = self.0.entry(index).or_insert_with(|| ToolCall {
            id: String::new(),
            name: String::new(),
            arguments: String::new(),
        });
        if !id.is_empty() {
            call.id = id;
        }
        if !name.is_empty() {
            call.name = name;
        }
        call
    }

    fn get(&mut self, index: u64) -> Option<&mut ToolCall> {
        self.0.get_mut(&index)
    }

    fn into_calls(self) -> Vec<ToolCall> {
        self.0
            .into_values()
            .enumerate()
            .map(|(n, mut call)| {
                if call.id.is_empty() {
                    call.id = format!("call_{n}");
                }
                call
            })
            .collect()
    }
}

/// The tools in the OpenAI function shape (`{"type":"function", ...}`), nested or flat.
/// Function tools as OpenAI's APIs take them: `{type, function: {name, ...}}` (Chat
/// Completions, `nested`) or `{type, name, ...}` (Responses).
struct FunctionTools<'a> {
    tools: &'a [Tool],
    nested: bool,
}

impl Serialize for FunctionTools<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Function<'a> {
            name: &'a str,
            description: &'a str,
            parameters: &'a Value,
        }
        #[derive(Serialize)]
        #[serde(untagged)]
        enum Spec<'a> {
            Nested {
                #[serde(rename = "type")]
                kind: &'static str,
                function: Function<'a>,
            },
            Flat {
                #[serde(rename = "type")]
                kind: &'static str,
                #[serde(flatten)]
                function: Function<'a>,
            },
        }
        serializer.collect_seq(self.tools.iter().map(|t| {
            let function = Function {
                name: &t.name,
                description: &t.description,
                parameters: &t.parameters,
            };
            if self.nested {
                Spec::Nested {
                    kind: "function",
                    function,
                }
            } else {
                Spec::Flat {
                    kind: "function",
                    function,
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests;
