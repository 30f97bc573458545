#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};

use crate::*;

fn sse(events: &[(Option<&str>, Value)]) -> Vec<u8> {
    let mut out = String::new();
    for (name, data) in events {
        if let Some(name) = name {
            out.push_str(&format!("event: {name}\n"));
        }
        out.push_str(&format!("data: {data}\n\n"));
    }
    out.into_bytes()
}

/// Feeds a stream cut at every byte boundary into two pieces; each must give the same reply.
fn read_split(format: Format, bytes: &[u8]) -> Result<Reply, WireError> {
    let whole = {
        let mut stream = format.stream();
        stream.feed(bytes)?;
        stream.finish()
    };
    for cut in (0..bytes.len()).step_by(7) {
        let mut stream = format.stream();
        let split = stream
            .feed(&bytes[..cut])
            .and_then(|_| stream.feed(&bytes[cut..]))
            .and_then(|_| stream.finish());
        assert_eq!(split, whole, "cut at {cut}");
    }
    whole
}

fn two_calls() -> Vec<ToolCall> {
    vec![
        ToolCall {
            id: "call_a".into(),
            name: "exec".into(),
            arguments: r#"{"command":"ls -la"}"#.into(),
        },
        ToolCall {
            id: "call_b".into(),
            name: "read_file".into(),
            arguments: r#"{"path":"a.txt"}"#.into(),
        },
    ]
}

#[test]
fn chat_completions_parallel_calls_in_fragments() {
    let chunk = |delta: Value, finish: Value| json!({"id":"c1","model":"m-1","choices":[{"index":0,"delta":delta,"finish_reason":finish}]});
    let bytes = sse(&[
        (
            None,
            chunk(
                json!({"role":"assistant","content":"Let me look"}),
                Value::Null,
            ),
        ),
        (
            None,
            chunk(
                json!({"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"exec","arguments":""}}]}),
                Value::Null,
            ),
        ),
        (
            None,
            chunk(
                json!({"tool_calls":[{"index":0,"function":{"arguments":"{\"comm"}}]}),
                Value::Null,
            ),
        ),
        (
            None,
            chunk(
                json!({"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"read_file","arguments":"{\"path\""}}]}),
                Value::Null,
            ),
        ),
        (
            None,
            chunk(
                json!({"tool_calls":[{"index":0,"function":{"arguments":"and\":\"ls -la\"}"}}]}),
                Value::Null,
            ),
        ),
        (
            None,
            chunk(
                json!({"tool_calls":[{"index":1,"function":{"arguments":":\"a.txt\"}"}}]}),
                Value::Null,
            ),
        ),
        (None, chunk(json!({}), json!("tool_calls"))),
        (
            None,
            json!({"id":"c1","model":"m-1","choices":[],"usage":{"prompt_tokens":120,"completion_tokens":30,"total_tokens":150}}),
        ),
    ]);
    let mut bytes = bytes;
    bytes.extend_from_slice(b"data: [DONE]\n\n");
    let reply = read_split(Format::Chat, &bytes).unwrap();
    assert_eq!(reply.text, "Let me look");
    assert_eq!(reply.calls, two_calls());
    assert_eq!(reply.stop, Stop::ToolUse);
    assert_eq!(
        reply.usage,
        Usage {
            input: 120,
            output: 30
        }
    );
    assert_eq!(reply.model.as_deref(), Some("m-1"));
}

#[test]
fn responses_parallel_calls_in_fragments() {
    let bytes = sse(&[
        (
            Some("response.created"),
            json!({"type":"response.created","response":{"id":"r1","status":"in_progress","output":[]}}),
        ),
        (
            Some("response.output_item.added"),
            json!({"type":"response.output_item.added","output_index":0,"item":{"type":"message","id":"m1","role":"assistant","content":[]}}),
        ),
        (
            Some("response.output_text.delta"),
            json!({"type":"response.output_text.delta","output_index":0,"item_id":"m1","delta":"Let me "}),
        ),
        (
            Some("response.output_text.delta"),
            json!({"type":"response.output_text.delta","output_index":0,"item_id":"m1","delta":"look"}),
        ),
        (
            Some("response.output_item.added"),
            json!({"type":"response.output_item.added","output_index":1,"item":{"type":"function_call","id":"fc1","call_id":"call_a","name":"exec","arguments":""}}),
        ),
        (
            Some("response.output_item.added"),
            json!({"type":"response.output_item.added","output_index":2,"item":{"type":"function_call","id":"fc2","call_id":"call_b","name":"read_file","arguments":""}}),
        ),
        (
            Some("response.function_call_arguments.delta"),
            json!({"type":"response.function_call_arguments.delta","output_index":1,"item_id":"fc1","delta":"{\"command\":"}),
        ),
        (
            Some("response.function_call_arguments.delta"),
            json!({"type":"response.function_call_arguments.delta","output_index":2,"item_id":"fc2","delta":"{\"path\":\"a.txt\"}"}),
        ),
        (
            Some("response.function_call_arguments.delta"),
            json!({"type":"response.function_call_arguments.delta","output_index":1,"item_id":"fc1","delta":"\"ls -la\"}"}),
        ),
        (
            Some("response.completed"),
            json!({"type":"response.completed","response":{"id":"r1","model":"m-2","status":"completed","output":[],"usage":{"input_tokens":200,"output_tokens":40}}}),
        ),
    ]);
    let reply = read_split(Format::Responses, &bytes).unwrap();
    assert_eq!(reply.text, "Let me look");
    assert_eq!(reply.calls, two_calls());
    assert_eq!(reply.stop, Stop::ToolUse);
    assert_eq!(
        reply.usage,
        Usage {
            input: 200,
            output: 40
        }
    );
    assert_eq!(reply.model.as_deref(), Some("m-2"));
}

#[test]
fn anthropic_parallel_calls_in_fragments() {
    let bytes = sse(&[
        (
            Some("message_start"),
            json!({"type":"message_start","message":{"id":"msg1","model":"claude-x","usage":{"input_tokens":300,"output_tokens":1}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Let me look"}}),
        ),
        (Some("ping"), json!({"type":"ping"})),
        (
            Some("content_block_stop"),
            json!({"type":"content_block_stop","index":0}),
        ),
        (
            Some("content_block_start"),
            json!({"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"call_a","name":"exec","input":{}}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"command\":"}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"\"ls -la\"}"}}),
        ),
        (
            Some("content_block_stop"),
            json!({"type":"content_block_stop","index":1}),
        ),
        (
            Some("content_block_start"),
            json!({"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"call_b","name":"read_file","input":{}}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"path\":\"a.txt\"}"}}),
        ),
        (
            Some("content_block_stop"),
            json!({"type":"content_block_stop","index":2}),
        ),
        (
            Some("message_delta"),
            json!({"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":50}}),
        ),
        (Some("message_stop"), json!({"type":"message_stop"})),
    ]);
    let reply = read_split(Format::Anthropic, &bytes).unwrap();
    assert_eq!(reply.text, "Let me look");
    assert_eq!(reply.calls, two_calls());
    assert_eq!(reply.stop, Stop::ToolUse);
    assert_eq!(
        reply.usage,
        Usage {
            input: 300,
            output: 50
        }
    );
}

#[test]
fn a_cut_stream_is_incomplete_in_every_format() {
    let cases = [
        (
            Format::Chat,
            sse(&[(
                None,
                json!({"choices":[{"index":0,"delta":{"content":"half"}}]}),
            )]),
        ),
        (
            Format::Responses,
            sse(&[(
                None,
                json!({"type":"response.output_text.delta","output_index":0,"delta":"half"}),
            )]),
        ),
        (
            Format::Anthropic,
            sse(&[
                (
                    None,
                    json!({"type":"message_start","message":{"usage":{"input_tokens":1}}}),
                ),
                (
                    None,
                    json!({"type":"message_delta","delta":{"stop_reason":"end_turn"}}),
                ),
            ]),
        ),
    ];
    for (format, bytes) in cases {
        let mut stream = format.stream();
        stream.feed(&bytes).unwrap();
        assert_eq!(stream.finish(), Err(WireError::Incomplete), "{format:?}");
    }
}

#[test]
fn error_events_and_garbage_are_errors_not_replies() {
    let mut stream = Format::Anthropic.stream();
    let err = stream
        .feed(&sse(&[(
            Some("error"),
            json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}),
        )]))
        .unwrap_err();
    assert_eq!(err, WireError::Upstream("Overloaded".into()));
    let mut stream = Format::Responses.stream();
    let err = stream
        .feed(&sse(&[(None, json!({"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"boom"}}}))]))
        .unwrap_err();
    assert_eq!(err, WireError::Upstream("boom".into()));
    let mut stream = Format::Chat.stream();
    assert!(matches!(
        stream.feed(b"data: {not json\n\n"),
        Err(WireError::Malformed(_))
    ));
    assert_eq!(
        Format::Chat.reply(&json!({"error":{"message":"Rate limit reached","type":"requests"}})),
        Err(WireError::Upstream("Rate limit reached".into()))
    );
}

#[test]
fn whole_replies_in_every_format() {
    let chat = json!({"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[
        {"id":"call_a","type":"function","function":{"name":"exec","arguments":"{\"command\":\"ls -la\"}"}},
        {"id":"call_b","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.txt\"}"}}]},"finish_reason":"tool_calls"}],
        "usage":{"prompt_tokens":5,"completion_tokens":6}});
    let responses = json!({"model":"m","status":"completed","output":[
        {"type":"function_call","call_id":"call_a","name":"exec","arguments":"{\"command\":\"ls -la\"}"},
        {"type":"function_call","call_id":"call_b","name":"read_file","arguments":"{\"path\":\"a.txt\"}"}],
        "usage":{"input_tokens":5,"output_tokens":6}});
    let anthropic = json!({"model":"m","stop_reason":"tool_use","content":[
        {"type":"tool_use","id":"call_a","name":"exec","input":{"command":"ls -la"}},
        {"type":"tool_use","id":"call_b","name":"read_file","input":{"path":"a.txt"}}],
        "usage":{"input_tokens":5,"output_tokens":6}});
    for (format, body) in [
        (Format::Chat, chat),
        (Format::Responses, responses),
        (Format::Anthropic, anthropic),
    ] {
        let reply = format.reply(&body).unwrap();
        assert_eq!(reply.calls, two_calls(), "{format:?}");
        assert_eq!(reply.stop, Stop::ToolUse, "{format:?}");
        assert_eq!(
            reply.usage,
            Usage {
                input: 5,
                output: 6
            },
            "{format:?}"
        );
    }
    let text = json!({"model":"m","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[
        {"type":"message","role":"assistant","content":[{"type":"output_text","text":"partial"}]}]});
    let reply = Format::Responses.reply(&text).unwrap();
    assert_eq!(
        (reply.text.as_str(), reply.stop),
        ("partial", Stop::MaxTokens)
    );
}

/// A conversation with a tool round and an operator's words after it, in each format's shape.
#[test]
fn request_bodies_carry_the_conversation_in_each_shape() {
    let items = vec![
        Item::User {
            text: "fix the bug".into(),
        },
        Item::Assistant {
            text: "looking".into(),
            calls: two_calls(),
        },
        Item::Result {
            call_id: "call_a".into(),
            output: "a.txt".into(),
            error: false,
        },
        Item::Result {
            call_id: "call_b".into(),
            output: "no such file".into(),
            error: true,
        },
        Item::User {
            text: "[operator] use python".into(),
        },
    ];
    let tools = vec![Tool {
        name: "exec".into(),
        description: "run".into(),
        parameters: json!({"type":"object"}),
    }];
    let request = Request {
        model: "m",
        instructions: "be brief",
        items: &items,
        tools: &tools,
        max_output_tokens: None,
        stream: true,
    };

    let chat = Format::Chat.body(&request);
    assert_eq!(
        chat["messages"][0],
        json!({"role":"system","content":"be brief"})
    );
    assert_eq!(
        chat["messages"][2]["tool_calls"][1]["function"]["name"],
        "read_file"
    );
    assert_eq!(
        chat["messages"][4],
        json!({"role":"tool","tool_call_id":"call_b","content":"no such file"})
    );
    assert_eq!(chat["messages"][5]["role"], "user");
    assert_eq!(chat["tools"][0]["function"]["name"], "exec");
    assert_eq!(chat["stream_options"]["include_usage"], true);

    let responses = Format::Responses.body(&request);
    assert_eq!(responses["instructions"], "be brief");
    let input = responses["input"].as_array().unwrap();
    let kinds: Vec<&str> = input
        .iter()
        .map(|i| i["type"].as_str().unwrap_or("message"))
        .collect();
    assert_eq!(
        kinds,
        [
            "message",
            "message",
            "function_call",
            "function_call",
            "function_call_output",
            "function_call_output",
            "message"
        ]
    );
    assert_eq!(input[2]["call_id"], "call_a");
    assert_eq!(responses["tools"][0]["name"], "exec");

    let anthropic = Format::Anthropic.body(&request);
    assert_eq!(anthropic["system"], "be brief");
    let messages = anthropic["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"], "roles alternate");
    assert_eq!(
        messages[1]["content"][1]["input"],
        json!({"command":"ls -la"})
    );
    assert_eq!(messages[2]["content"][1]["is_error"], true);
    assert_eq!(messages[2]["content"][2]["text"], "[operator] use python");
    assert_eq!(
        anthropic["tools"][0]["input_schema"],
        json!({"type":"object"})
    );
    assert!(anthropic["max_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn formats_by_path_and_provider() {
    assert_eq!(Format::of_path("/v1/chat/completions"), Some(Format::Chat));
    assert_eq!(
        Format::of_path("/v1/responses?x=1"),
        Some(Format::Responses)
    );
    assert_eq!(Format::of_path("/v1/messages"), Some(Format::Anthropic));
    assert_eq!(Format::of_path("/v1/models"), None);
    for format in [Format::Chat, Format::Responses, Format::Anthropic] {
        assert_eq!(Format::from_provider(format.provider()), Some(format));
    }
}
