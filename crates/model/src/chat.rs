//! OpenAI-compatible Chat Completions: `messages` in, `choices[0]` out; streamed as chunks of
//! `delta`s, tool calls in fragments by `index`, ended by `data: [DONE]`.

use serde::Serialize;
use serde_json::Value;

use crate::{Calls, Delta, Item, Reply, Request, Stop, Usage, WireError, number, string};

/// The request body, written straight from the conversation (no copy of its texts).
pub(crate) fn write_body(request: &Request, out: &mut Vec<u8>) -> serde_json::Result<()> {
    serde_json::to_writer(
        out,
        &Body {
            model: request.model,
            messages: Messages(request),
            tools: (!request.tools.is_empty()).then_some(crate::FunctionTools {
                tools: request.tools,
                nested: true,
            }),
            max_completion_tokens: request.max_output_tokens,
            stream: request.stream,
            stream_options: request.stream.then_some(StreamOptions {
                include_usage: true,
            }),
        },
    )
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    messages: Messages<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<crate::FunctionTools<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The system message, then one message per item.
struct Messages<'a>(&'a Request<'a>);

impl Serialize for Messages<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let request = self.0;
        let system = (!request.instructions.is_empty()).then_some(Message::System {
            content: request.instructions,
        });
        serializer.collect_seq(system.into_iter().chain(request.items.iter().map(
            |item| match item {
                Item::User { text } => Message::User { content: text },
                Item::Assistant { text, calls } => Message::Assistant {
                    content: (!text.is_empty()).then_some(text.as_str()),
                    tool_calls: ToolCalls(calls),
                },
                Item::Result {
                    call_id, output, ..
                } => Message::Tool {
                    tool_call_id: call_id,
                    content: output,
                },
            },
        )))
    }
}

#[derive(Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum Message<'a> {
    System {
        content: &'a str,
    },
    User {
        content: &'a str,
    },
    Assistant {
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "ToolCalls::is_empty")]
        tool_calls: ToolCalls<'a>,
    },
    Tool {
        tool_call_id: &'a str,
        content: &'a str,
    },
}

/// An assistant message's tool calls.
struct ToolCalls<'a>(&'a [crate::ToolCall]);

impl ToolCalls<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for ToolCalls<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Call<'a> {
            id: &'a str,
            #[serde(rename = "type")]
            kind: &'static str,
            function: Function<'a>,
        }
        #[derive(Serialize)]
        struct Function<'a> {
            name: &'a str,
            arguments: &'a str,
        }
        serializer.collect_seq(self.0.iter().map(|c| Call {
            id: &c.id,
            kind: "function",
            function: Function {
                name: &c.name,
                arguments: &c.arguments,
            },
        }))
    }
}

fn stop(reason: &str) -> Stop {
    match reason {
        "stop" => Stop::End,
        "tool_calls" | "function_call" => Stop::ToolUse,
        "length" => Stop::MaxTokens,
        "content_filter" => Stop::Refusal,
        other => Stop::Other(other.to_owned()),
    }
}

fn usage(value: &Value) -> Option<Usage> {
    let usage = value.get("usage").filter(|u| u.is_object())?;
    Some(Usage {
        input: number(usage, "prompt_tokens"),
        output: number(usage, "completion_tokens"),
    })
}

pub(crate) fn reply(body: &Value) -> Result<Reply, WireError> {
    let choice = body
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| WireError::Malformed("no `choices[0]` in a chat completion".into()))?;
    let message = choice.get("message").cloned().unwrap_or_default();
    let mut calls = Calls::default();
    for (n, call) in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let function = call.get("function").cloned().unwrap_or_default();
        calls
            .start(n as u64, string(call, "id"), string(&function, "name"))
            .arguments = string(&function, "arguments");
    }
    let calls = calls.into_calls();
    let reason = string(choice, "finish_reason");
    Ok(Reply {
        text: string(&message, "content"),
        stop: match reason.as_str() {
            "" if !calls.is_empty() => Stop::ToolUse,
            "" => Stop::End,
            reason => stop(reason),
        },
        calls,
        usage: usage(body).unwrap_or_default(),
        model: body.get("model").and_then(Value::as_str).map(str::to_owned),
    })
}

#[derive(Debug, Default)]
pub(crate) struct Stream {
    text: String,
    calls: Calls,
    reason: Option<String>,
    usage: Usage,
    model: Option<String>,
}

impl Stream {
    /// One chunk. Chat Completions' end is `[DONE]` (handled by the caller), so no chunk ends it.
    pub(crate) fn event(
        &mut self,
        chunk: &Value,
        deltas: &mut Vec<Delta>,
    ) -> Result<bool, WireError> {
        if self.model.is_none() {
            self.model = chunk
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        if let Some(usage) = usage(chunk) {
            self.usage = usage;
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return Err(WireError::Malformed(
                "a chat completion chunk without `choices`".into(),
            ));
        };
        for choice in choices.iter().filter(|c| number(c, "index") == 0) {
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.reason = Some(reason.to_owned());
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            if let Some(text) = delta.get("content").and_then(Value::as_str)
                && !text.is_empty()
            {
                self.text.push_str(text);
                deltas.push(Delta::Text(text.to_owned()));
            }
            for fragment in delta
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let index = number(fragment, "index");
                let function = fragment.get("function").cloned().unwrap_or_default();
                let name = string(&function, "name");
                let new = self.calls.get(index).is_none();
                let call = self
                    .calls
                    .start(index, string(fragment, "id"), name.clone());
                call.arguments.push_str(&string(&function, "arguments"));
                if new {
                    deltas.push(Delta::Call(name));
                }
            }
        }
        Ok(false)
    }

    /// Some servers end with the finish reason and no `[DONE]` (so `_done` is not needed); a
    /// stream without a finish reason was cut.
    pub(crate) fn finish(self, _done: bool) -> Result<Reply, WireError> {
        let Some(reason) = self.reason else {
            return Err(WireError::Incomplete);
        };
        let calls = self.calls.into_calls();
        Ok(Reply {
            text: self.text,
            stop: stop(&reason),
            calls,
            usage: self.usage,
            model: self.model,
        })
    }
}
