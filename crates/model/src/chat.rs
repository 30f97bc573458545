//! OpenAI-compatible Chat Completions: `messages` in, `choices[0]` out; streamed as chunks of
//! `delta`s, tool calls in fragments by `index`, ended by `data: [DONE]`.

use serde_json::{Value, json};

use crate::{Calls, Delta, Item, Reply, Request, Stop, Usage, WireError, number, string};

pub(crate) fn body(request: &Request) -> Value {
    let mut messages = Vec::with_capacity(request.items.len() + 1);
    if !request.instructions.is_empty() {
        messages.push(json!({ "role": "system", "content": request.instructions }));
    }
    for item in request.items {
        messages.push(match item {
            Item::User { text } => json!({ "role": "user", "content": text }),
            Item::Assistant { text, calls } => {
                let mut message = json!({
                    "role": "assistant",
                    "content": if text.is_empty() { Value::Null } else { Value::from(text.as_str()) },
                });
                if !calls.is_empty() {
                    message["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": { "name": c.name, "arguments": c.arguments },
                            })
                        })
                        .collect();
                }
                message
            }
            Item::Result {
                call_id, output, ..
            } => json!({ "role": "tool", "tool_call_id": call_id, "content": output }),
        });
    }
    let mut body = json!({ "model": request.model, "messages": messages });
    if !request.tools.is_empty() {
        body["tools"] = crate::function_tools(request.tools, true);
    }
    if let Some(max) = request.max_output_tokens {
        body["max_completion_tokens"] = max.into();
    }
    if request.stream {
        body["stream"] = true.into();
        body["stream_options"] = json!({ "include_usage": true });
    }
    body
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
