//! Agents inside a cell: the official `openai` package in a cell reaches the model server only
//! through the gateway at `inference.warden` (`network.inference`); the upstream gets the key,
//! the cell never holds it; each exchange is read in its wire format and journaled; the token
//! budget refuses the request past it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::model::{ModelServer, Step};

const KEY: &str = "sk-upstream-7d1e4f0a9b3c2851";

/// Runs `script` (a file of this folder) with python3 in a cell under `policy`, the openai
/// package on its path and the key in the caller's environment; returns its stdout and stderr,
/// having checked that it succeeded.
fn run_client(
    dir: &Path,
    policy: &Path,
    pydeps: &Path,
    port: u16,
    script: &str,
) -> (String, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.join("run"))
        .env("WARDEN_STATE_DIR", dir.join("state"))
        .env("OPENAI_API_KEY", KEY)
        .arg("run")
        .arg("--policy")
        .arg(policy)
        .args(["--env", &format!("PYTHONPATH={}", pydeps.display())])
        .args(["--env", &format!("UPSTREAM_PORT={port}")])
        .args([
            "--",
            "python3",
            "-c",
            &std::fs::read_to_string(script).unwrap(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

/// The journal of the run in `dir` (which must not hold the key), and the data of its
/// decisions that carry a model exchange, in order.
fn journal_and_exchanges(dir: &Path) -> (String, Vec<Value>) {
    let journal = std::fs::read_to_string(dir.join("state/journal/journal.jsonl")).unwrap();
    assert!(!journal.contains(KEY));
    let exchanges = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["kind"] == "net.decision" && !e["data"]["inference"].is_null())
        .map(|e| e["data"].clone())
        .collect();
    (journal, exchanges)
}

#[test]
fn an_openai_client_in_a_cell_reaches_the_model_only_through_the_gateway() {
    through_the_gateway(false);
}

/// The same with an `https://` upstream: the gateway speaks TLS to it itself (verified against
/// the policy's `extra_ca`), the cell still speaks plain HTTP to `inference.warden`.
#[test]
fn an_https_model_api_is_reached_through_the_gateway_the_same_way() {
    through_the_gateway(true);
}

fn through_the_gateway(tls: bool) {
    let pydeps = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/pydeps/openai-agents-0.24.0"
    ));
    assert!(
        pydeps.join("openai").is_dir(),
        "the openai package is not installed in {} (.ci/run installs it with openai-agents)",
        pydeps.display()
    );
    let pydeps = std::fs::canonicalize(pydeps).unwrap();
    let script = vec![
        Step::Text("hello from the model".into()),
        Step::Text("hello again".into()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let (server, scheme, extra_ca) = if tls {
        let (server, ca) = ModelServer::start_tls(script);
        let file = dir.path().join("model-ca.pem");
        std::fs::write(&file, ca).unwrap();
        (server, "https", format!("  extra_ca: {}\n", file.display()))
    } else {
        (ModelServer::start(script), "http", String::new())
    };
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nextends: default\nnetwork:\n{extra_ca}  inference:\n    upstream: {scheme}://127.0.0.1:{}/v1\n    credential: openai\n    max_tokens: 200\ncredentials:\n  openai: {{ from_env: OPENAI_API_KEY }}\nfilesystem:\n  read_only: [{}]\n",
            server.port,
            pydeps.display()
        ),
    )
    .unwrap();
    let (stdout, stderr) = run_client(
        dir.path(),
        &policy,
        &pydeps,
        server.port,
        "inference_client.py",
    );
    assert!(
        stdout.contains("streamed: hello from the model"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("responses: hello again"),
        "{stdout}\n{stderr}"
    );
    // 2 exchanges of 120 tokens: the third is past the budget of 200.
    assert!(
        stdout.contains("third: RateLimitError 429") && stdout.contains("token budget"),
        "{stdout}"
    );
    assert!(
        !stdout.contains(KEY) && !stderr.contains(KEY),
        "the key reached the cell"
    );
    assert!(
        stdout.contains("key in the cell: ") && !stdout.contains("key in the cell: None"),
        "{stdout}"
    );
    // The upstream got the key, from the gateway, on both requests; the third never came.
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    for r in &requests {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        assert_eq!(
            r.header("host"),
            Some(format!("127.0.0.1:{}", server.port).as_str())
        );
    }
    assert_eq!(requests[0].path, "/v1/chat/completions");
    assert_eq!(requests[1].path, "/v1/responses");
    // Each exchange is journaled with what the gateway read of it; the key is not.
    let (journal, decisions) = journal_and_exchanges(dir.path());
    let exchanges: Vec<Value> = decisions.iter().map(|d| d["inference"].clone()).collect();
    assert_eq!(exchanges.len(), 2, "{journal}");
    assert_eq!(exchanges[0]["format"], "openai");
    assert_eq!(exchanges[0]["model"], "scripted-1");
    assert_eq!(exchanges[0]["stream"], true);
    assert_eq!(exchanges[0]["text"], "hello from the model");
    assert_eq!(exchanges[0]["usage"]["input"], 100);
    assert_eq!(exchanges[1]["format"], "openai-responses");
    assert_eq!(exchanges[1]["text"], "hello again");
    assert_eq!(exchanges[1]["tokens_used"], 240);
    let refused = journal
        .lines()
        .any(|l| l.contains("\"net.decision\"") && l.contains("token budget"));
    assert!(refused, "the refusal past the budget is journaled");
}

/// An agent that speaks to its provider itself, over HTTPS, past the route: the destination
/// binds the key, so the gateway opens the TLS, and each call is read and journaled as on the
/// route, and counted against the same budget (the route's upstream is never called).
#[test]
fn a_model_api_the_cell_calls_itself_over_https_is_read_and_budgeted_the_same_way() {
    let pydeps = std::fs::canonicalize(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/pydeps/openai-agents-0.24.0"
    ))
    .expect("the openai package is installed (.ci/run installs it with openai-agents)");
    let (server, ca) = ModelServer::start_tls_on(
        "127.0.0.2",
        vec![
            Step::Text("hello from the model".into()),
            Step::Text("hello again".into()),
        ],
    );
    let route = ModelServer::start(vec![]);
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("model-ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nextends: default\nnetwork:\n  extra_ca: {}\n  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n      credential: openai\n  inference:\n    upstream: http://127.0.0.1:{}/v1\n    max_tokens: 200\ncredentials:\n  openai: {{ from_env: OPENAI_API_KEY }}\nfilesystem:\n  read_only: [{}]\n",
            ca_file.display(),
            server.port,
            route.port,
            pydeps.display()
        ),
    )
    .unwrap();
    let (stdout, stderr) = run_client(
        dir.path(),
        &policy,
        &pydeps,
        server.port,
        "inference_direct.py",
    );
    assert!(
        stdout.contains("streamed: hello from the model")
            && stdout.contains("responses: hello again"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("third: RateLimitError 429") && stdout.contains("token budget"),
        "{stdout}"
    );
    assert!(!stdout.contains(KEY) && !stderr.contains(KEY));
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    for r in &requests {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        // Asked unencoded, so that the reply can be read on its way.
        assert_eq!(r.header("accept-encoding"), Some("identity"));
    }
    assert!(route.requests().is_empty());
    let (journal, exchanges) = journal_and_exchanges(dir.path());
    assert_eq!(exchanges.len(), 2, "{journal}");
    assert_eq!(exchanges[0]["kind"], "https", "{}", exchanges[0]);
    let read = |i: usize| exchanges[i]["inference"].clone();
    assert_eq!(read(0)["format"], "openai");
    assert_eq!(read(0)["stream"], true);
    assert_eq!(read(0)["text"], "hello from the model");
    assert_eq!(read(0)["usage"]["output"], 20);
    assert_eq!(read(1)["format"], "openai-responses");
    assert_eq!(read(1)["text"], "hello again");
    assert_eq!(read(1)["tokens_used"], 240);
    let refused = journal
        .lines()
        .any(|l| l.contains("\"net.decision\"") && l.contains("token budget"));
    assert!(refused, "the refusal past the budget is journaled");
}

/// A model server that is asked to say `100 Continue` says it (Go's and Node's do) before its
/// answer. The gateway read the first status it kept as the exchange's: 100, not a success,
/// so the reply was counted as no tokens, and a cell that sent `Expect: 100-continue` on each
/// call was never held to its budget. An interim answer is passed on and read past.
#[test]
fn an_interim_answer_does_not_take_a_model_call_past_the_budget() {
    let server = ModelServer::start(vec![]);
    server.then(Step::Text("hello".into()));
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nnetwork:\n  inference:\n    upstream: http://127.0.0.1:{}/v1\n    max_tokens: 200\n",
            server.port
        ),
    )
    .unwrap();
    // Three calls of 120 tokens each, each expecting to be told to go on: the third is past
    // the budget of 200.
    let code = r#"
import socket
body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
for n in range(3):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    s.sendall(b'POST http://inference.warden/v1/chat/completions HTTP/1.1\r\nHost: inference.warden\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body))
    data = b''
    while True:
        more = s.recv(4096)
        if not more: break
        data += more
    lines = [l.decode() for l in data.split(b'\r\n') if l.startswith(b'HTTP/1.1 ')]
    print(' then '.join(lines), flush=True)
"#;
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--", "python3", "-c", code])
        .output()
        .unwrap();
    let ran = support::Ran::from(out);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{ran:?}");
    for line in &lines[..2] {
        assert_eq!(
            *line, "HTTP/1.1 100 Continue then HTTP/1.1 200 OK",
            "{ran:?}"
        );
    }
    let (journal, exchanges) = journal_and_exchanges(dir.path());
    assert!(lines[2].starts_with("HTTP/1.1 429 "), "{ran:?}\n{journal}");
    assert_eq!(server.requests().len(), 2);
    assert_eq!(exchanges.len(), 2, "{journal}");
    assert_eq!(exchanges[0]["inference"]["status"], 200, "{journal}");
    assert_eq!(exchanges[1]["inference"]["tokens_used"], 240, "{journal}");
}

/// A model server the cell may reach itself (an allowed host of its own) that reports a usage
/// near 2^64: the gateway added it to the cell's running total, which wrapped round to nothing,
/// and the cell had its whole budget back for the route. The total saturates instead.
#[test]
fn a_reported_usage_near_the_top_of_u64_does_not_wrap_the_budget() {
    let route = ModelServer::start(vec![]);
    route.then(Step::Text("hello".into()));
    // The cell's own "model API": 2^64 - 120 input tokens, so that 120 + that is 2^64.
    let own_port = own_model_server(u64::MAX - 119);
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{own_port}]\n  inference:\n    upstream: http://127.0.0.1:{}/v1\n    max_tokens: 200\n",
            route.port
        ),
    )
    .unwrap();
    // A route call (120 tokens), the call to its own server, then two more route calls: with
    // the total wrapped to 0 both passed (360 tokens on a budget of 200), and so on for ever.
    let code = r#"
import os, socket
body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
own = 'http://127.0.0.2:%s' % os.environ['OWN_PORT']
for target in ['http://inference.warden', own, 'http://inference.warden', 'http://inference.warden']:
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    host = target.split('//')[1].encode()
    s.sendall(b'POST %s/v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' % (target.encode(), host, len(body), body))
    data = b''
    while True:
        more = s.recv(4096)
        if not more: break
        data += more
    print(data.split(b'\r\n')[0].decode(), flush=True)
"#;
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--env", &format!("OWN_PORT={own_port}")])
        .args(["--", "python3", "-c", code])
        .output()
        .unwrap();
    let ran = support::Ran::from(out);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{ran:?}");
    let (journal, _) = journal_and_exchanges(dir.path());
    assert!(lines[0].starts_with("HTTP/1.1 200 "), "{ran:?}\n{journal}");
    assert!(lines[1].starts_with("HTTP/1.1 200 "), "{ran:?}\n{journal}");
    for line in &lines[2..] {
        assert!(
            line.starts_with("HTTP/1.1 429 "),
            "the budget came back: {ran:?}\n{journal}"
        );
    }
    assert_eq!(route.requests().len(), 1, "{journal}");
}

/// A model server on 127.0.0.2 (a cell reaches it through the gateway) that answers every
/// request with a Chat Completions reply of `prompt_tokens` input tokens; its port.
fn own_model_server(prompt_tokens: u64) -> u16 {
    use std::io::{Read as _, Write as _};
    let own = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = own.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in own.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                // The request, to its end (the gateway closes its side once it is sent).
                let mut request = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    match conn.read(&mut buf) {
                        Ok(n) if n > 0 => request.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                    let text = String::from_utf8_lossy(&request);
                    if let Some(at) = text.find("\r\n\r\n") {
                        let length = text[..at]
                            .lines()
                            .find_map(|l| {
                                let (name, value) = l.split_once(':')?;
                                name.eq_ignore_ascii_case("content-length")
                                    .then(|| value.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        if request.len() >= at + 4 + length {
                            break;
                        }
                    }
                }
                let body = format!(
                    r#"{{"id":"c","object":"chat.completion","model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"x"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{prompt_tokens},"completion_tokens":0}}}}"#
                );
                let _ = conn.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                );
            });
        }
    });
    port
}

/// A model call the cell makes itself, off the route, with blanks inside its JSON (they cost
/// no tokens) past the first MiB the gateway keeps, or with a chunked body: the request did not
/// read as JSON, was taken for a REST API's and passed over, and the cell's calls were never
/// counted nor refused.
#[test]
fn a_model_call_padded_past_what_the_gateway_keeps_is_counted() {
    let own_port = own_model_server(120);
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{own_port}]\n  inference:\n    upstream: http://127.0.0.1:9/v1\n    max_tokens: 200\n"
        ),
    )
    .unwrap();
    let code = r#"
import os, socket
body = b'{"model":"m",' + b' ' * (1 << 21) + b'"messages":[{"role":"user","content":"hi"}]}'
host = b'127.0.0.2:' + os.environ['OWN_PORT'].encode()
plain = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
for n in range(3):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    head = b'POST http://%s/v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n' % (host, host)
    if n == 1:
        # Chunked: the body the gateway kept was the chunks' framing, not JSON.
        s.sendall(head + b'Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n' % (len(plain), plain))
    else:
        s.sendall(head + b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
    data = b''
    while True:
        more = s.recv(4096)
        if not more: break
        data += more
    print(data.split(b'\r\n')[0].decode(), flush=True)
"#;
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--env", &format!("OWN_PORT={own_port}")])
        .args(["--", "python3", "-c", code])
        .output()
        .unwrap();
    let ran = support::Ran::from(out);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    let (journal, exchanges) = journal_and_exchanges(dir.path());
    assert_eq!(
        lines,
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 429 Too Many Requests"
        ],
        "{ran:?}\n{journal}"
    );
    // Counted by the reply's usage, which was read whole.
    assert_eq!(exchanges[1]["inference"]["tokens_used"], 240, "{journal}");
}

/// Runs `code` with python3 in a cell whose route goes to 127.0.0.1:`port` with a budget of
/// `budget` tokens; its output, the journal and the data of its decisions that carry a model
/// exchange.
fn run_budgeted(port: u16, budget: u64, code: &str) -> (support::Ran, String, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "version: 1\nnetwork:\n  inference:\n    upstream: http://127.0.0.1:{port}/v1\n    max_tokens: {budget}\n"
        ),
    )
    .unwrap();
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--", "python3", "-c", &format!("{CALL}{code}")])
        .output()
        .unwrap();
    let ran = support::Ran::from(out);
    let (journal, exchanges) = journal_and_exchanges(dir.path());
    (ran, journal, exchanges)
}

/// A model call through the route in Python: `call(cap)` sends a Chat Completions request
/// (its body over 600 bytes, so that the gateway's estimate of its input, a quarter token a
/// byte, is more than the 100 input tokens the model server reports) with `max_tokens: cap`
/// (none where `cap` is None), and returns the status line and the body of the answer.
const CALL: &str = r#"
import json, socket, threading, time
def send(cap, stream=False):
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 600}]}
    if cap is not None:
        body["max_tokens"] = cap
    if stream:
        body["stream"] = True
    body = json.dumps(body).encode()
    s = socket.create_connection(('127.0.0.1', 3128), timeout=60)
    s.sendall(b'POST http://inference.warden/v1/chat/completions HTTP/1.1\r\nHost: inference.warden\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body))
    return s
def call(cap, stream=False):
    s = send(cap, stream)
    data = b''
    while True:
        more = s.recv(65536)
        if not more: break
        data += more
    s.close()
    head, _, rest = data.partition(b'\r\n\r\n')
    return head.split(b'\r\n')[0].decode(), rest.decode(errors='replace')
"#;

/// The most tokens the journal says the cell used.
fn most_used(exchanges: &[Value]) -> u64 {
    exchanges
        .iter()
        .filter_map(|e| e["inference"]["tokens_used"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Many model calls at once: the budget was checked only before each (spent or not), and a
/// call counted when it ended, so every call sent while the others were under way found the
/// budget unspent, and 24 calls of 120 tokens went through on a budget of 1000. Each call
/// now reserves what it may cost (its input, a quarter token a byte, and its `max_tokens`)
/// while it is under way, and a call whose reservation would take the budget past its end
/// is refused: the calls let through stay within the budget.
#[test]
fn model_calls_made_in_parallel_do_not_overrun_the_token_budget() {
    let server = ModelServer::start(vec![]);
    // Slow enough that the calls overlap.
    server.then(Step::Delay(
        std::time::Duration::from_millis(1500),
        Box::new(Step::Text("hello".into())),
    ));
    let code = r#"
results = []
lock = threading.Lock()
def one():
    r = call(20)
    with lock:
        results.append(r)
threads = [threading.Thread(target=one) for _ in range(24)]
for t in threads: t.start()
for t in threads: t.join()
passed = [r for r in results if ' 200 ' in r[0]]
refused = [r for r in results if ' 429 ' in r[0]]
print('passed', len(passed), 'refused', len(refused), 'other', len(results) - len(passed) - len(refused), flush=True)
if refused:
    print('refusal', refused[0][1], flush=True)
"#;
    let budget = 1000;
    let (ran, journal, exchanges) = run_budgeted(server.port, budget, code);
    let passed = server.requests().len() as u64;
    let used = most_used(&exchanges);
    eprintln!(
        "{passed} calls let through, {used} tokens used of a budget of {budget}\n{}",
        ran.stdout
    );
    assert!(ran.stdout.contains("passed "), "{ran:?}");
    assert!(passed >= 1, "{ran:?}");
    assert!(
        used <= budget && passed * 120 <= budget,
        "{passed} calls let through, {used} tokens used on a budget of {budget}: {ran:?}"
    );
    // The refusal says what is used, what the calls under way hold, and what to do.
    assert!(
        ran.stdout.contains("reserved") && ran.stdout.contains("max_tokens"),
        "{ran:?}\n{journal}"
    );
}

/// One call after another: each within the budget goes through as before; the one whose
/// `max_tokens` (with its input) would take the cell past its budget is refused before it
/// leaves, saying why.
#[test]
fn model_calls_in_sequence_pass_within_the_budget_and_the_one_that_would_cross_it_is_refused() {
    let server = ModelServer::start(vec![]);
    server.then(Step::Text("hello".into()));
    // Each call asks for about 190 tokens (169 of input by its size, its max_tokens of 20)
    // and is counted as 120: with 0, 120, 240 and 360 used it fits in 650; with 480, it does
    // not (before, it went through, and so did a sixth, at 600 used).
    let code = r#"
for n in range(5):
    status, body = call(20)
    print(status, flush=True)
    if ' 429 ' in status:
        print('refusal', body, flush=True)
"#;
    let budget = 650;
    let (ran, journal, exchanges) = run_budgeted(server.port, budget, code);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert!(lines.len() >= 5, "{ran:?}");
    for line in &lines[..4] {
        assert_eq!(*line, "HTTP/1.1 200 OK", "{ran:?}\n{journal}");
    }
    // 480 used: the fifth (about 190) would cross 650.
    assert!(lines[4].starts_with("HTTP/1.1 429 "), "{ran:?}\n{journal}");
    assert!(
        lines[5].contains("480 used") && lines[5].contains("max_tokens"),
        "{ran:?}"
    );
    assert_eq!(server.requests().len(), 4, "{journal}");
    assert_eq!(most_used(&exchanges), 480, "{journal}");
}

/// A call reserves its cost while it is under way; a client that goes away before its reply
/// ends gives the reservation back (a reservation kept would lock the cell out of its budget
/// for good). A call with no `max_tokens` reserves what is left of the budget: while it is
/// under way no other call starts.
#[test]
fn a_client_that_goes_away_mid_reply_gives_its_reservation_back() {
    let server = ModelServer::start(vec![Step::Trickle(
        std::time::Duration::from_secs(60),
        Box::new(Step::Text("slow".into())),
    )]);
    server.then(Step::Text("hello".into()));
    let code = r#"
s = send(None, stream=True)
head = b''
while b'\r\n\r\n' not in head:
    head += s.recv(4096)
print('first', head.split(b'\r\n')[0].decode(), flush=True)
status, body = call(20)
print('while it runs', status, flush=True)
s.close()
deadline = time.time() + 20
while True:
    status, body = call(20)
    if ' 200 ' in status or time.time() > deadline:
        break
    time.sleep(0.2)
print('after', status, flush=True)
"#;
    let (ran, journal, _) = run_budgeted(server.port, 1000, code);
    assert!(
        ran.stdout.contains("first HTTP/1.1 200 OK"),
        "{ran:?}\n{journal}"
    );
    assert!(
        ran.stdout.contains("while it runs HTTP/1.1 429 "),
        "{ran:?}\n{journal}"
    );
    assert!(
        ran.stdout.contains("after HTTP/1.1 200 OK"),
        "the reservation of the call whose client went away was kept: {ran:?}\n{journal}"
    );
}

/// A call the upstream refuses (nothing listens at its port) is answered 403 and gives its
/// reservation back: a call with no `max_tokens`, which reserves all that is left, left the
/// next one nothing.
#[test]
fn a_call_the_upstream_refuses_gives_its_reservation_back() {
    let code = r#"
for cap in [None, None, 20]:
    print(call(cap)[0], flush=True)
"#;
    let (ran, journal, _) = run_budgeted(9, 1000, code);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{ran:?}");
    for line in lines {
        assert_eq!(line, "HTTP/1.1 403 Forbidden", "{ran:?}\n{journal}");
    }
}
