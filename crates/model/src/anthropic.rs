//! Anthropic Messages: `system` and alternating `messages` of content blocks in, `content`
//! blocks out; streamed as `message_start`, `content_block_start/delta/stop` per block
//! (`input_json_delta` fragments of a tool's input), `message_delta` (stop reason, usage) and
//! `message_stop`.

use serde::Serialize;
use serde_json::{Value, json};

use crate::{Calls, Delta, Item, Reply, Request, Stop, Usage, WireError, number, string};

/// What a reply may hold when the request names no limit (Messages requires one).
const DEFAULT_MAX_TOKENS: u64 = 8192;

/// The request body, written straight from the conversation (no copy of its texts).
pub(crate) fn write_body<'a>(request: &Request<'a>, out: &mut Vec<u8>) -> serde_json::Result<()> {
    // Messages alternate user and assistant: tool results and the words after them are blocks
    // of one user message.
    let mut messages: Vec<Message<'a>> = Vec::new();
    let mut push = |role: &'static str, block: Block<'a>| match messages.last_mut() {
        Some(last) if last.role == role => last.content.push(block),
        _ => messages.push(Message {
            role,
            content: vec![block],
        }),
    };
    for item in request.items {
        match item {
            Item::User { text } => push("user", Block::Text { text }),
            Item::Assistant { text, calls } => {
                if !text.is_empty() {
                    push("assistant", Block::Text { text });
                }
                for call in calls {
                    // The input goes back as the object it was; input that never parsed goes
                    // back empty (its result says why it was not run).
                    let input = serde_json::from_str::<Value>(&call.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({}));
                    push(
                        "assistant",
                        Block::ToolUse {
                            id: &call.id,
                            name: &call.name,
                            input,
                        },
                    );
                }
            }
            Item::Result {
                call_id,
                output,
                error,
            } => push(
                "user",
                Block::ToolResult {
                    tool_use_id: call_id,
                    content: output,
                    is_error: *error,
                },
            ),
        }
    }
    serde_json::to_writer(
        out,
        &Body {
            model: request.model,
            max_tokens: request.max_output_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
            messages,
            system: (!request.instructions.is_empty()).then_some(request.instructions),
            tools: request
                .tools
                .iter()
                .map(|t| ToolSpec {
                    name: &t.name,
                    description: &t.description,
                    input_schema: &t.parameters,
                })
                .collect(),
            stream: request.stream,
        },
    )
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    max_tokens: u64,
    messages: Vec<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<ToolSpec<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Value,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
        is_error: bool,
    },
}

#[derive(Serialize)]
struct ToolSpec<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
}

fn stop(reason: &str) -> Stop {
    match reason {
        "end_turn" | "stop_sequence" => Stop::End,
        "tool_use" => Stop::ToolUse,
        "max_tokens" => Stop::MaxTokens,
        "refusal" => Stop::Refusal,
        other => Stop::Other(other.to_owned()),
    }
}

fn add_usage(usage: &mut Usage, value: Option<&Value>) {
    let Some(value) = value else { return };
    if let Some(input) = value.get("input_tokens").and_then(Value::as_u64) {
        usage.input = input
            + number(value, "cache_read_input_tokens")
            + number(value, "cache_creation_input_tokens");
    }
    if let Some(output) = value.get("output_tokens").and_then(Value::as_u64) {
        usage.output = output;
    }
}

pub(crate) fn reply(message: &Value) -> Result<Reply, WireError> {
    let content = message
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| WireError::Malformed("no `content` in a message".into()))?;
    let mut text = String::new();
    let mut calls = Calls::default();
    for (n, block) in content.iter().enumerate() {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(&string(block, "text")),
            Some("tool_use") => {
                calls
                    .start(n as u64, string(block, "id"), string(block, "name"))
                    .arguments = block
                    .get("input")
                    .map_or_else(|| "{}".to_owned(), Value::to_string);
            }
            _ => {}
        }
    }
    let mut usage = Usage::default();
    add_usage(&mut usage, message.get("usage"));
    Ok(Reply {
        text,
        calls: calls.into_calls(),
        stop: stop(&string(message, "stop_reason")),
        usage,
        model: message
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

#[derive(Debug, Default)]
pub(crate) struct Stream {
    text: String,
    calls: Calls,
    /// The input a `tool_use` block started with, by index (used when no fragment follows).
    started: std::collections::BTreeMap<u64, String>,
    reason: Option<String>,
    usage: Usage,
    model: Option<String>,
}

impl Stream {
    pub(crate) fn event(
        &mut self,
        event: &Value,
        deltas: &mut Vec<Delta>,
    ) -> Result<bool, WireError> {
        let index = number(event, "index");
        match event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
        {
            "message_start" => {
                let message = event.get("message").cloned().unwrap_or_default();
                self.model = message
                    .get("model")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                add_usage(&mut self.usage, message.get("usage"));
            }
            "content_block_start" => {
                let block = event.get("content_block").cloned().unwrap_or_default();
                match block.get("type").and_then(Value::as_str) {
                    Some("tool_use") => {
                        let name = string(&block, "name");
                        self.calls.start(index, string(&block, "id"), name.clone());
                        let input = block
                            .get("input")
                            .filter(|i| i.as_object().is_some_and(|o| !o.is_empty()));
                        if let Some(input) = input {
                            self.started.insert(index, input.to_string());
                        }
                        deltas.push(Delta::Call(name));
                    }
                    Some("text") => {
                        let text = string(&block, "text");
                        if !text.is_empty() {
                            self.text.push_str(&text);
                            deltas.push(Delta::Text(text));
                        }
                    }
                    _ => {}
                }
            }
            "content_block_delta" => {
                let delta = event.get("delta").cloned().unwrap_or_default();
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        let text = string(&delta, "text");
                        self.text.push_str(&text);
                        deltas.push(Delta::Text(text));
                    }
                    Some("input_json_delta") => {
                        let Some(call) = self.calls.get(index) else {
                            return Err(WireError::Malformed(format!(
                                "input for content block {index}, which is no tool_use"
                            )));
                        };
                        call.arguments.push_str(&string(&delta, "partial_json"));
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                if let Some(call) = self.calls.get(index)
                    && call.arguments.is_empty()
                {
                    call.arguments = self
                        .started
                        .remove(&index)
                        .unwrap_or_else(|| "{}".to_owned());
                }
            }
            "message_delta" => {
                if let Some(reason) = event
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.reason = Some(reason.to_owned());
                }
                add_usage(&mut self.usage, event.get("usage"));
            }
            "message_stop" => return Ok(true),
            _ => {} // ping, thinking and other blocks
        }
        Ok(false)
    }

    pub(crate) fn finish(self, done: bool) -> Result<Reply, WireError> {
        let (true, Some(reason)) = (done, self.reason) else {
            return Err(WireError::Incomplete);
        };
        Ok(Reply {
            text: self.text,
            calls: self.calls.into_calls(),
            stop: stop(&reason),
            usage: self.usage,
            model: self.model,
        })
    }
}
