//! The OpenAI Responses API: `instructions` and `input` items in, `output` items out; streamed
//! as typed events (`response.output_item.added`, `response.function_call_arguments.delta`,
//! `response.output_text.delta`, ... `response.completed`).

use serde::Serialize;
use serde_json::Value;

use crate::{Calls, Delta, Item, Reply, Request, Stop, Usage, WireError, number, string};

/// The request body, written straight from the conversation (no copy of its texts).
pub(crate) fn write_body(request: &Request, out: &mut Vec<u8>) -> serde_json::Result<()> {
    serde_json::to_writer(
        out,
        &Body {
            model: request.model,
            input: Input(request.items),
            store: false,
            instructions: (!request.instructions.is_empty()).then_some(request.instructions),
            tools: (!request.tools.is_empty()).then_some(crate::FunctionTools {
                tools: request.tools,
                nested: false,
            }),
            max_output_tokens: request.max_output_tokens,
            stream: request.stream,
        },
    )
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    input: Input<'a>,
    store: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    instructions: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<crate::FunctionTools<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

/// The input items: messages, and an assistant's calls each as an item of its own.
struct Input<'a>(&'a [Item]);

#[derive(Serialize)]
#[serde(untagged)]
enum InputItem<'a> {
    Message {
        role: &'static str,
        content: &'a str,
    },
    Call {
        #[serde(rename = "type")]
        kind: &'static str,
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
    },
    Output {
        #[serde(rename = "type")]
        kind: &'static str,
        call_id: &'a str,
        output: &'a str,
    },
}

impl Serialize for Input<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().flat_map(|item| {
            let items: Box<dyn Iterator<Item = InputItem<'_>>> = match item {
                Item::User { text } => Box::new(std::iter::once(InputItem::Message {
                    role: "user",
                    content: text,
                })),
                Item::Assistant { text, calls } => Box::new(
                    (!text.is_empty())
                        .then_some(InputItem::Message {
                            role: "assistant",
                            content: text,
                        })
                        .into_iter()
                        .chain(calls.iter().map(|call| InputItem::Call {
                            kind: "function_call",
                            call_id: &call.id,
                            name: &call.name,
                            arguments: &call.arguments,
                        })),
                ),
                Item::Result {
                    call_id, output, ..
                } => Box::new(std::iter::once(InputItem::Output {
                    kind: "function_call_output",
                    call_id,
                    output,
                })),
            };
            items
        }))
    }
}

fn usage(response: &Value) -> Usage {
    let usage = response.get("usage").cloned().unwrap_or_default();
    Usage {
        input: number(&usage, "input_tokens"),
        output: number(&usage, "output_tokens"),
    }
}

/// Why a finished response stopped.
fn stop(response: &Value, calls: bool) -> Stop {
    match response.get("status").and_then(Value::as_str) {
        Some("incomplete") => {
            let reason = response
                .get("incomplete_details")
                .map(|d| string(d, "reason"))
                .unwrap_or_default();
            match reason.as_str() {
                "max_output_tokens" => Stop::MaxTokens,
                "content_filter" => Stop::Refusal,
                other => Stop::Other(other.to_owned()),
            }
        }
        _ if calls => Stop::ToolUse,
        _ => Stop::End,
    }
}

/// The text of a `message` output item.
fn message_text(item: &Value) -> String {
    item.get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|part| part.get("type").and_then(Value::as_str) == Some("output_text"))
        .map(|part| string(part, "text"))
        .collect()
}

/// Whether an output is a refusal (a `refusal` part of a message).
fn refused(output: &[Value]) -> bool {
    output.iter().any(|item| {
        item.get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| {
                parts
                    .iter()
                    .any(|p| p.get("type").and_then(Value::as_str) == Some("refusal"))
            })
    })
}

pub(crate) fn reply(response: &Value) -> Result<Reply, WireError> {
    if response.get("status").and_then(Value::as_str) == Some("failed") {
        return Err(WireError::Upstream(failure(response)));
    }
    let output = response
        .get("output")
        .and_then(Value::as_array)
        .ok_or_else(|| WireError::Malformed("no `output` in a response".into()))?;
    let mut text = String::new();
    let mut calls = Calls::default();
    for (n, item) in output.iter().enumerate() {
        match item.get("type").and_then(Value::as_str) {
            Some("message") => text.push_str(&message_text(item)),
            Some("function_call") => {
                calls
                    .start(n as u64, string(item, "call_id"), string(item, "name"))
                    .arguments = string(item, "arguments");
            }
            _ => {}
        }
    }
    let calls = calls.into_calls();
    Ok(Reply {
        text,
        stop: if refused(output) {
            Stop::Refusal
        } else {
            stop(response, !calls.is_empty())
        },
        calls,
        usage: usage(response),
        model: response
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

fn failure(response: &Value) -> String {
    response
        .get("error")
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .unwrap_or("the response failed")
        .to_owned()
}

#[derive(Debug, Default)]
pub(crate) struct Stream {
    text: String,
    calls: Calls,
    /// The finished response (`response.completed` or `.incomplete`).
    last: Option<Value>,
}

impl Stream {
    pub(crate) fn event(
        &mut self,
        event: &Value,
        deltas: &mut Vec<Delta>,
    ) -> Result<bool, WireError> {
        let index = number(event, "output_index");
        match event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
        {
            "response.output_item.added" | "response.output_item.done" => {
                let item = event.get("item").cloned().unwrap_or_default();
                if item.get("type").and_then(Value::as_str) == Some("function_call") {
                    let new = self.calls.get(index).is_none();
                    let name = string(&item, "name");
                    let call = self
                        .calls
                        .start(index, string(&item, "call_id"), name.clone());
                    let arguments = string(&item, "arguments");
                    // The item's arguments are whole when present (`done`; some servers send
                    // them with `added` too); the deltas build them otherwise.
                    if !arguments.is_empty() {
                        call.arguments = arguments;
                    }
                    if new {
                        deltas.push(Delta::Call(name));
                    }
                }
            }
            "response.function_call_arguments.delta" => {
                let delta = string(event, "delta");
                match self.calls.get(index) {
                    Some(call) => call.arguments.push_str(&delta),
                    None => {
                        self.calls
                            .start(index, String::new(), String::new())
                            .arguments = delta
                    }
                }
            }
            "response.function_call_arguments.done" => {
                let arguments = string(event, "arguments");
                let call = match self.calls.get(index) {
                    Some(call) => call,
                    None => self
                        .calls
                        .start(index, String::new(), string(event, "name")),
                };
                call.arguments = arguments;
            }
            "response.output_text.delta" => {
                let delta = string(event, "delta");
                self.text.push_str(&delta);
                deltas.push(Delta::Text(delta));
            }
            "response.completed" | "response.incomplete" => {
                self.last = Some(event.get("response").cloned().unwrap_or_default());
                return Ok(true);
            }
            "response.failed" => {
                return Err(WireError::Upstream(failure(
                    &event.get("response").cloned().unwrap_or_default(),
                )));
            }
            _ => {}
        }
        Ok(false)
    }

    pub(crate) fn finish(self, done: bool) -> Result<Reply, WireError> {
        let (true, Some(response)) = (done, self.last) else {
            return Err(WireError::Incomplete);
        };
        let calls = self.calls.into_calls();
        // A server that streamed no deltas still sends the whole output at the end.
        let output = response
            .get("output")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if calls.is_empty() && self.text.is_empty() && !output.is_empty() {
            return reply(&response);
        }
        Ok(Reply {
            text: self.text,
            stop: if refused(&output) {
                Stop::Refusal
            } else {
                stop(&response, !calls.is_empty())
            },
            calls,
            usage: usage(&response),
            model: response
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned),
        })
    }
}
