//! The egress gateway end to end: a cell's only way out, decided by policy, with every upstream
//! a local server that the test starts on the host's loopback (127.0.0.2, which the cell's own
//! loopback cannot reach directly).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use support::*;

/// A minimal HTTP upstream: answers every request with its method and path, counting them; a
/// request for `/redirect/URL` is answered with a redirect to URL.
struct Upstream {
    port: u16,
    hits: Arc<AtomicUsize>,
}

fn http_upstream() -> Upstream {
    http_upstream_on("127.0.0.2")
}

fn http_upstream_on(ip: &str) -> Upstream {
    let listener = TcpListener::bind((ip, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            counter.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap_or(0);
                let mut length = 0usize;
                let mut chunked = false;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                    let header = header.to_ascii_lowercase();
                    if let Some(v) = header.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    chunked |=
                        header.starts_with("transfer-encoding:") && header.contains("chunked");
                }
                let mut body = vec![0u8; length];
                reader.read_exact(&mut body).unwrap_or(());
                // Read a chunked body to its end: closing with bytes unread would reset the
                // connection and could drop the answer on its way.
                while chunked {
                    let mut size = String::new();
                    reader.read_line(&mut size).unwrap_or(0);
                    let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
                    let mut chunk = vec![0u8; size + 2];
                    if reader.read_exact(&mut chunk).is_err() {
                        break;
                    }
                    body.extend_from_slice(&chunk[..size]);
                    chunked = size > 0;
                }
                let answer = format!(
                    "upstream saw {} body={}",
                    line.trim(),
                    String::from_utf8_lossy(&body)
                );
                let mut conn = conn;
                if let Some(target) = line
                    .split(' ')
                    .nth(1)
                    .and_then(|p| p.split_once("/redirect/"))
                {
                    let _ = write!(
                        conn,
                        "HTTP/1.1 302 Found\r\nLocation: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        target.1
                    );
                    return;
                }
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            });
        }
    });
    Upstream { port, hits }
}

/// A TCP echo upstream for tunnels; counts the bytes it received.
fn echo_upstream() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = Arc::new(AtomicUsize::new(0));
    let counter = received.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let counter = counter.clone();
            std::thread::spawn(move || {
                let mut reader = conn.try_clone().unwrap();
                let mut writer = conn;
                let mut buf = [0u8; 4096];
                while let Ok(n) = reader.read(&mut buf) {
                    if n == 0 || writer.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    counter.fetch_add(n, Ordering::SeqCst);
                }
            });
        }
    });
    (port, received)
}

/// The egress record of cell `name`, as `warden net --json` prints it, and its decisions.
fn net_decisions(name: &str) -> (Ran, Vec<serde_json::Value>) {
    let net = Ran::from(warden().args(["net", name, "--json"]).output().unwrap());
    let decisions = serde_json::from_str(&net.stdout).unwrap_or_else(|e| panic!("{e}: {net:?}"));
    (net, decisions)
}

fn net_policy(dir: &std::path::Path, body: &str) -> String {
    policy(dir, &format!("version: 1\nnetwork:\n{body}"))
        .display()
        .to_string()
}

/// Python that sends raw bytes to the gateway and prints the first line (and body) it answers.
fn raw_exchange(request: &str, then_send: &str) -> String {
    format!(
        "import socket\n\
         s = socket.create_connection(('127.0.0.1', 3128))\n\
         s.sendall({request:?}.encode())\n\
         data = b''\n\
         while b'\\r\\n\\r\\n' not in data:\n    chunk = s.recv(4096)\n    if not chunk: break\n    data += chunk\n\
         head, _, rest = data.partition(b'\\r\\n\\r\\n')\n\
         print(head.split(b'\\r\\n')[0].decode())\n\
         if b' 200 ' in head.split(b'\\r\\n')[0] and {then_send:?}:\n    s.sendall({then_send:?}.encode()); print(s.recv(100).decode())\n\
         else:\n    s.settimeout(5)\n    try:\n        while True:\n            more = s.recv(4096)\n            if not more: break\n            rest += more\n    except OSError: pass\n    print(rest.decode())"
    )
}

#[test]
fn allowed_requests_pass_and_refused_ones_get_a_403_that_says_why() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n      methods: [GET]\n",
            up.port
        ),
    );
    let name = unique("net");
    let code = format!(
        "import urllib.request, urllib.error, json\n\
         print(urllib.request.urlopen('http://127.0.0.2:{port}/ok').read().decode())\n\
         for req in [urllib.request.Request('http://127.0.0.2:{port}/x', method='POST', data=b'leak'),\n\
                     urllib.request.Request('http://127.0.0.3:{port}/'),\n\
                     urllib.request.Request('http://example.com/')]:\n\
         \x20   try:\n        urllib.request.urlopen(req); print('LEAKED')\n\
         \x20   except urllib.error.HTTPError as e:\n        body = json.loads(e.read()); print(e.code, body['destination'], body['rule'], '|', body['reason'])",
        port = up.port
    );
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    assert_eq!(ran.code, 0, "{ran:?}");
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], "upstream saw GET /ok HTTP/1.1 body=");
    assert!(
        lines[1].starts_with(&format!(
            "403 127.0.0.2:{} default | no rule allows",
            up.port
        )),
        "{ran:?}"
    );
    assert!(
        lines[2].starts_with(&format!("403 127.0.0.3:{} default", up.port)),
        "{ran:?}"
    );
    assert!(
        lines[3].starts_with("403 example.com:80 default"),
        "{ran:?}"
    );
    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        1,
        "a refused request reached the upstream"
    );

    let (net, decisions) = net_decisions(&name);
    let verdicts: Vec<(bool, String)> = decisions
        .iter()
        .map(|d| {
            (
                d["allowed"].as_bool().unwrap(),
                d["host"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    // Each decision is recorded when its connection ends, so the allowed request (whose
    // connection may close after the next one was refused) need not come first.
    assert_eq!(verdicts.len(), 4, "{net:?}");
    assert_eq!(
        verdicts
            .iter()
            .filter(|(allowed, _)| *allowed)
            .collect::<Vec<_>>(),
        [&(true, "127.0.0.2".to_owned())],
        "{net:?}"
    );
    let allowed = decisions.iter().find(|d| d["allowed"] == true).unwrap();
    assert!(
        allowed["bytes_down"].as_u64().unwrap() > 20
            && allowed["rule"].as_str().unwrap().starts_with("allow[0]")
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn tunnels_follow_the_host_rules() {
    let dir = tempdir();
    let (echo, received) = echo_upstream();
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{echo}]\n"),
    );
    // (A line of a protocol the gateway does not read: a lone word with nothing after it could
    // still become an HTTP request, and would be waited on.)
    let allowed = raw_exchange(
        &format!("CONNECT 127.0.0.2:{echo} HTTP/1.1\r\nHost: 127.0.0.2:{echo}\r\n\r\n"),
        "ping\n",
    );
    let ran = run_py(&["--rm", "--policy", &policy], &allowed);
    assert_eq!(
        ran.stdout, "HTTP/1.1 200 Connection established\nping\n\n",
        "{ran:?}"
    );
    let other_port = raw_exchange(
        "CONNECT 127.0.0.2:9 HTTP/1.1\r\nHost: 127.0.0.2:9\r\n\r\n",
        "",
    );
    let ran = run_py(&["--rm", "--policy", &policy], &other_port);
    assert!(
        ran.stdout.starts_with("HTTP/1.1 403 Forbidden\n{"),
        "{ran:?}"
    );

    // A tunnel opened for one host cannot carry TLS for another: the ClientHello's server name
    // is checked before a byte of it is relayed.
    let name = unique("sni");
    let before = received.load(Ordering::SeqCst);
    let code = format!(
        "import socket, ssl\n\
         s = socket.create_connection(('127.0.0.1', 3128))\n\
         s.sendall(b'CONNECT 127.0.0.2:{echo} HTTP/1.1\\r\\n\\r\\n')\n\
         print(s.recv(100).split(b'\\r\\n')[0].decode())\n\
         try:\n    ssl.create_default_context().wrap_socket(s, server_hostname='evil.test'); print('HANDSHAKE')\n\
         except (ssl.SSLError, OSError) as e: print('closed')"
    );
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    assert_eq!(
        ran.stdout, "HTTP/1.1 200 Connection established\nclosed\n",
        "{ran:?}"
    );
    assert_eq!(
        received.load(Ordering::SeqCst),
        before,
        "the ClientHello reached the upstream"
    );
    let net = Ran::from(warden().args(["net", &name]).output().unwrap());
    assert!(
        net.stdout
            .contains("the TLS server name `evil.test` is not the CONNECT host"),
        "{net:?}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn bypass_attempts_are_refused() {
    let dir = tempdir();
    let up = http_upstream();
    let (echo, _) = echo_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}, {echo}]\n",
            up.port
        ),
    );
    let attempts = [
        // userinfo that names the allowed host before the real one
        (
            format!("CONNECT 127.0.0.2@evil.test:{echo} HTTP/1.1\r\n\r\n"),
            "user information",
        ),
        // 127.0.0.2 as a decimal number
        (
            format!("CONNECT 2130706434:{echo} HTTP/1.1\r\n\r\n"),
            "non-canonical",
        ),
        // conflicting framing: request smuggling
        (
            format!(
                "POST http://127.0.0.2:{}/ HTTP/1.1\r\nHost: 127.0.0.2:{}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                up.port, up.port
            ),
            "smuggling",
        ),
        // a Host header naming another host than the URL
        (
            format!(
                "GET http://127.0.0.2:{}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n",
                up.port
            ),
            "Host header",
        ),
        // not a proxy request at all
        (
            "GET / HTTP/1.1\r\nHost: 127.0.0.2\r\n\r\n".to_owned(),
            "not an absolute",
        ),
    ];
    for (request, reason) in attempts {
        let ran = run_py(&["--rm", "--policy", &policy], &raw_exchange(&request, ""));
        assert!(
            ran.stdout.starts_with("HTTP/1.1 403 Forbidden\n"),
            "{request:?}: {ran:?}"
        );
        assert!(ran.stdout.contains(reason), "{request:?}: {ran:?}");
    }
    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        0,
        "a refused request reached the upstream"
    );

    // Around the proxy variables: direct TCP, over IPv4 and IPv6 alike, is redirected to the
    // gateway and decided there (a destination no rule allows is closed); other UDP gets nowhere,
    // and DNS is answered by the gateway, which resolves no name that no rule allows.
    let code = format!(
        "import socket, errno\n\
         s = socket.create_connection(('127.0.0.3', {port}), timeout=5); s.sendall(b'\\0')\n\
         print('REACHED' if s.recv(10) else 'closed by the gateway')\n\
         for family, kind, addr in [(socket.AF_INET, socket.SOCK_DGRAM, ('8.8.8.8', 123)),\n\
                                    (socket.AF_INET6, socket.SOCK_STREAM, ('2001:db8::1', 80))]:\n\
         \x20   s = socket.socket(family, kind)\n\
         \x20   try:\n        s.connect(addr); s.send(b'\\0'); s.settimeout(2); print('REACHED' if s.recv(1) else 'closed by the gateway')\n\
         \x20   except OSError as e: print(errno.errorcode.get(e.errno, 'timeout'))\n\
         # A name that would carry data to an attacker's DNS server resolves nowhere.\n\
         try:\n    socket.getaddrinfo('c2VjcmV0.attacker.test', 80); print('RESOLVED')\n\
         except socket.gaierror: print('no resolution')",
        port = up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    assert_eq!(
        ran.stdout, "closed by the gateway\nEPERM\nclosed by the gateway\nno resolution\n",
        "{ran:?}"
    );
}

#[test]
fn a_second_request_or_a_redirect_cannot_reach_another_host() {
    let dir = tempdir();
    let up = http_upstream();
    let other = http_upstream_on("127.0.0.3");
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
            up.port
        ),
    );
    // Two requests on one kept-alive connection, the second for a host no rule allows: the
    // gateway answers the first and closes, so the second goes nowhere.
    let pipelined = format!(
        "import socket\n\
         s = socket.create_connection(('127.0.0.1', 3128), timeout=10)\n\
         s.sendall(b'GET http://127.0.0.2:{up}/one HTTP/1.1\\r\\nHost: 127.0.0.2:{up}\\r\\nConnection: keep-alive\\r\\n\\r\\n'\n\
         \x20         b'GET http://127.0.0.3:{other}/two HTTP/1.1\\r\\nHost: 127.0.0.3:{other}\\r\\n\\r\\n')\n\
         data = b''\n\
         while True:\n    chunk = s.recv(4096)\n    if not chunk: break\n    data += chunk\n\
         print(data.count(b'HTTP/1.1 200 '), b'saw GET /one' in data, b'/two' in data)",
        up = up.port,
        other = other.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &pipelined);
    assert_eq!(ran.stdout, "1 True False\n", "{ran:?}");
    // An allowed upstream redirects to a host no rule allows: the client follows it through the
    // gateway, which refuses it.
    let redirect = format!(
        "import urllib.request, urllib.error, json\n\
         try:\n    urllib.request.urlopen('http://127.0.0.2:{}/redirect/http://127.0.0.3:{}/x'); print('LEAKED')\n\
         except urllib.error.HTTPError as e: print(e.code, json.loads(e.read())['reason'])",
        up.port, other.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &redirect);
    assert!(ran.stdout.starts_with("403 no rule allows"), "{ran:?}");
    assert_eq!(up.hits.load(Ordering::SeqCst), 2);
    assert_eq!(
        other.hits.load(Ordering::SeqCst),
        0,
        "a request reached a host no rule allows"
    );
}

/// Waits for the next question of cell `name` and returns its id and request.
fn next_question(name: &str, after: u64) -> (u64, String) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let listed = warden()
            .args(["approvals", name, "--json"])
            .output()
            .unwrap();
        if let Ok(serde_json::Value::Array(questions)) = serde_json::from_slice(&listed.stdout)
            && let Some(q) = questions.iter().find(|q| q["id"].as_u64() > Some(after))
        {
            return (
                q["id"].as_u64().unwrap(),
                q["request"].as_str().unwrap().to_owned(),
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("cell {name} asked nothing within 30 s");
}

#[test]
fn ask_rules_hold_a_connection_until_a_person_answers() {
    let dir = tempdir();
    let up = http_upstream();
    let rule = format!(
        "  ask:\n    - host: 127.0.0.2\n      ports: [{}]\n",
        up.port
    );
    // A test that fails half-way leaves no connection held for long.
    let asking = net_policy(dir.path(), &format!("{rule}approvals:\n  timeout: 30s\n"));
    let name = unique("ask");
    let code = format!(
        "import urllib.request, urllib.error, json\n\
         for path in ['first', 'second']:\n\
         \x20   try:\n        print(urllib.request.urlopen('http://127.0.0.2:{}/' + path).read().decode().split(' body=')[0])\n\
         \x20   except urllib.error.HTTPError as e: print(e.code, json.loads(e.read())['reason'])",
        up.port
    );
    let cell = warden()
        .args([
            "run", "--name", &name, "--policy", &asking, "--", "python3", "-c",
        ])
        .arg(&code)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (first, request) = next_question(&name, 0);
    assert_eq!(request, format!("GET 127.0.0.2:{}/first", up.port));
    // Held: nothing reached the upstream before the answer.
    assert_eq!(up.hits.load(Ordering::SeqCst), 0);
    let approve = Ran::from(
        warden()
            .args(["approve", &name, &first.to_string()])
            .output()
            .unwrap(),
    );
    assert_eq!(approve.code, 0, "{approve:?}");
    let (second, request) = next_question(&name, first);
    assert!(request.ends_with("/second"), "{request}");
    // A question that is not open is a clear error.
    let wrong = Ran::from(warden().args(["deny", &name, "999"]).output().unwrap());
    assert_eq!(wrong.code, 125, "{wrong:?}");
    assert!(wrong.stderr.contains("no open question 999"), "{wrong:?}");
    let deny = Ran::from(
        warden()
            .args(["deny", &name, &second.to_string()])
            .output()
            .unwrap(),
    );
    assert_eq!(deny.code, 0, "{deny:?}");
    let ran = Ran::from(cell.wait_with_output().unwrap());
    assert_eq!(
        ran.stdout,
        format!("upstream saw GET /first HTTP/1.1\n403 denied by a person (question {second})\n"),
        "{ran:?}"
    );
    // The terminal of `warden run` was told how to answer.
    assert!(
        ran.stderr.contains(&format!(
            "`warden approve {name} {first}` or `warden deny {name} {first}`"
        )),
        "{ran:?}"
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 1);
    assert!(warden().args(["rm", &name]).status().unwrap().success());

    // Nobody answers: the policy's timeout and on_timeout decide.
    let quick = policy(
        dir.path(),
        &format!("version: 1\nnetwork:\n{rule}approvals:\n  timeout: 1s\n"),
    );
    let code = format!(
        "import urllib.request, urllib.error, json\n\
         try:\n    urllib.request.urlopen('http://127.0.0.2:{}/'); print('LEAKED')\n\
         except urllib.error.HTTPError as e: print(e.code, json.loads(e.read())['reason'])",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &quick.display().to_string()], &code);
    assert_eq!(
        ran.stdout, "403 no answer to question 1 within 1 s (approvals.on_timeout: deny)\n",
        "{ran:?}"
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 1);
}

#[test]
fn private_addresses_need_a_rule_that_names_them() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(dir.path(), "  default: allow\n");
    let code = format!(
        "import urllib.request, urllib.error, json\n\
         try:\n    urllib.request.urlopen('http://127.0.0.2:{}/'); print('LEAKED')\n\
         except urllib.error.HTTPError as e: print(e.code, json.loads(e.read())['reason'])",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    assert!(
        ran.stdout
            .starts_with("403 127.0.0.2 resolves to a private, loopback"),
        "{ran:?}"
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 0);
}

#[test]
fn a_stalled_client_does_not_block_the_gateway_for_others() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
            up.port
        ),
    );
    let code = format!(
        "import socket, urllib.request\n\
         stalled = socket.create_connection(('127.0.0.1', 3128)); stalled.sendall(b'GET http://127.0.0.2/ HT')\n\
         huge = socket.create_connection(('127.0.0.1', 3128)); huge.sendall(b'GET http://127.0.0.2/ HTTP/1.1\\r\\nX: ' + b'a' * 70000)\n\
         print(huge.recv(100).split(b'\\r\\n')[0].decode())\n\
         print(urllib.request.urlopen('http://127.0.0.2:{}/fine', timeout=10).read().decode())",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    assert_eq!(
        ran.stdout,
        "HTTP/1.1 431 Request Header Fields Too Large\nupstream saw GET /fine HTTP/1.1 body=\n",
        "{ran:?}"
    );
}

#[test]
fn without_network_rules_there_is_no_gateway() {
    let ran = run_sh(
        &["--rm"],
        "env | grep -i proxy; echo end; (echo > /dev/tcp/127.0.0.1/3128) 2>&1 | head -c 0; python3 -c \"import socket; socket.create_connection(('127.0.0.1', 3128))\" 2>&1 | tail -1",
    );
    assert!(ran.stdout.starts_with("end\n"), "{ran:?}");
    assert!(ran.stdout.contains("Connection refused"), "{ran:?}");
}

#[test]
fn network_rules_change_while_the_cell_runs() {
    let dir = tempdir();
    let up = http_upstream();
    let (echo, _) = echo_upstream();
    let open = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}, {echo}]\n",
            up.port
        ),
    );
    let closed = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.9\n      ports: [{}]\n",
            up.port
        ),
    );
    let name = unique("live-net");
    // The cell keeps a tunnel open and polls an HTTP URL, printing each change it sees. A poll
    // under way when the rules change is cut with the other open connections (`cut`): the
    // loop goes on to the next.
    let code = format!(
        "import socket, time, urllib.request, urllib.error, sys\n\
         t = socket.create_connection(('127.0.0.1', 3128))\n\
         t.sendall(b'CONNECT 127.0.0.2:{echo} HTTP/1.1\\r\\n\\r\\n'); t.recv(100); t.settimeout(2)\n\
         last = None\n\
         while True:\n\
         \x20   try:\n        status = urllib.request.urlopen('http://127.0.0.2:{port}/').status\n\
         \x20   except urllib.error.HTTPError as e: status = e.code\n\
         \x20   except OSError: status = 'cut'\n\
         \x20   try:\n        t.sendall(b'\\0'); tunnel = 'tunnel open' if t.recv(1) == b'\\0' else 'tunnel closed'\n\
         \x20   except OSError: tunnel = 'tunnel closed'\n\
         \x20   now = f'{{status}} {{tunnel}}'\n\
         \x20   if now != last: print(now, flush=True); last = now\n\
         \x20   time.sleep(0.05)",
        port = up.port
    );
    let mut cell = warden()
        .args([
            "run", "--rm", "--name", &name, "--policy", &open, "--", "python3", "-c", &code,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = cell.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let wait = |wanted: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) if line == wanted => return,
                Ok(line) => seen.push(line),
                Err(_) => panic!("the cell never printed {wanted:?}; it printed {seen:?}"),
            }
        }
    };
    wait("200 tunnel open");
    let set = Ran::from(
        warden()
            .args(["policy", "set", &name, &closed])
            .output()
            .unwrap(),
    );
    assert_eq!(set.code, 0, "{set:?}");
    assert!(
        set.stdout.contains("open connection(s) closed") && !set.stdout.contains(" 0 open"),
        "{set:?}"
    );
    wait("403 tunnel closed");
    // A cell without a gateway has nothing to change.
    let bad = Ran::from(
        warden()
            .args(["policy", "set", "no-such-cell", &closed])
            .output()
            .unwrap(),
    );
    assert_eq!(bad.code, 125);
    assert!(warden().args(["kill", &name]).status().unwrap().success());
    let _ = cell.wait();
}

#[test]
fn chunked_uploads_pass_with_their_framing_checked() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
            up.port
        ),
    );
    let code = format!(
        "import http.client\n\
         c = http.client.HTTPConnection('127.0.0.1', 3128)\n\
         c.request('POST', 'http://127.0.0.2:{}/upload', body=iter([b'ab', b'cd']), encode_chunked=True)\n\
         r = c.getresponse(); print(r.status, r.read().decode())",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    assert_eq!(
        ran.stdout, "200 upstream saw POST /upload HTTP/1.1 body=abcd\n",
        "{ran:?}"
    );
}

#[test]
fn clients_that_ignore_the_proxy_variables_are_still_decided_by_the_gateway() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n    - host: localhost\n",
            up.port
        ),
    );
    let name = unique("transparent");
    let code = format!(
        "import socket, json\n\
         def raw(host_header, ip='127.0.0.2'):\n\
         \x20   s = socket.create_connection((ip, {port}), timeout=5)\n\
         \x20   s.sendall(f'GET /direct HTTP/1.1\\r\\nHost: {{host_header}}\\r\\nConnection: close\\r\\n\\r\\n'.encode())\n\
         \x20   data = b''\n\
         \x20   while True:\n        chunk = s.recv(4096)\n        if not chunk: break\n        data += chunk\n\
         \x20   head, _, body = data.partition(b'\\r\\n\\r\\n')\n\
         \x20   first = head.split(b'\\r\\n')[0].decode()\n\
         \x20   return first + (' ' + json.loads(body)['reason'] if ' 403 ' in first else '')\n\
         print(raw('127.0.0.2:{port}'))\n\
         print(raw('localhost:{port}'))\n\
         print(raw('127.0.0.3:{port}', ip='127.0.0.3'))",
        port = up.port
    );
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{ran:?}");
    assert_eq!(lines[0], "HTTP/1.1 200 OK", "{ran:?}");
    // Allowed by name, but the name does not lead where the client connected.
    assert!(
        lines[1].starts_with("HTTP/1.1 403 Forbidden localhost does not resolve to 127.0.0.2"),
        "{ran:?}"
    );
    // (Checked before its request is: the address itself, which no rule names.)
    assert!(
        lines[2].starts_with(
            "HTTP/1.1 403 Forbidden 127.0.0.3 is a private, loopback, link-local or metadata address that no rule names"
        ),
        "{ran:?}"
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 1);
    let (net, decisions) = net_decisions(&name);
    let kinds: Vec<&str> = decisions
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["transparent"; 3], "{net:?}");
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

/// The redirection of a cell's other traffic to its gateway, which (as root) the warden makes
/// from outside the cell, beside its setup, is in place when its command starts: the
/// command's first act reads the cell's routes, and the default one through loopback is there
/// every time. (Without the warden's redirection, none is.)
#[test]
fn the_redirection_is_in_place_when_the_command_starts() {
    let dir = tempdir();
    let policy = net_policy(
        dir.path(),
        "  allow:\n    - host: 127.0.0.2\n      ports: [80]\n",
    );
    for _ in 0..5 {
        let ran = Ran::from(
            warden()
                .args(["run", "--policy", &policy, "--", "cat", "/proc/net/route"])
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 0, "{ran:?}");
        assert!(
            ran.stdout
                .lines()
                .any(|line| line.starts_with("lo\t00000000\t")),
            "no default route when the command started: {ran:?}"
        );
    }
}

#[test]
fn redirected_plain_http_is_decided_on_method_and_path() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n      methods: [GET]\n      paths: [\"/ok/**\"]\n",
            up.port
        ),
    );
    // Raw sockets, no proxy: each connection is redirected to the gateway, which reads the
    // request as it would a proxied one.
    let code = format!(
        "import socket, json\n\
         def raw(method, target):\n\
         \x20   s = socket.create_connection(('127.0.0.2', {port}), timeout=5)\n\
         \x20   s.sendall(f'{{method}} {{target}} HTTP/1.1\\r\\nHost: 127.0.0.2:{port}\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n'.encode())\n\
         \x20   data = b''\n\
         \x20   while True:\n        chunk = s.recv(4096)\n        if not chunk: break\n        data += chunk\n\
         \x20   head, _, body = data.partition(b'\\r\\n\\r\\n')\n\
         \x20   first = head.split(b'\\r\\n')[0].decode()\n\
         \x20   return first + ' ' + (json.loads(body)['reason'] if ' 403 ' in first else body.decode())\n\
         print(raw('GET', '/ok/item'))\n\
         print(raw('GET', '/secret'))\n\
         print(raw('POST', '/ok/item'))\n\
         print(raw('GET', 'http://127.0.0.3:{port}/ok/item'))",
        port = up.port
    );
    let name = unique("redirected-http");
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{ran:?}");
    assert_eq!(
        lines[0], "HTTP/1.1 200 OK upstream saw GET /ok/item HTTP/1.1 body=",
        "{ran:?}"
    );
    assert!(lines[1].starts_with("HTTP/1.1 403 Forbidden"), "{ran:?}");
    assert!(lines[2].starts_with("HTTP/1.1 403 Forbidden"), "{ran:?}");
    assert_eq!(
        lines[3], "HTTP/1.1 403 Forbidden a redirected request must name a path, not a URL",
        "{ran:?}"
    );
    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        1,
        "only the allowed request got through"
    );
    let (net, decisions) = net_decisions(&name);
    // In any order: an allowed request's record is written when its relay ends, which can be
    // after the next connection's refusal was written.
    let mut decided: Vec<(&str, &str, bool)> = decisions
        .iter()
        .filter(|d| d["method"].is_string())
        .map(|d| {
            (
                d["method"].as_str().unwrap(),
                d["path"].as_str().unwrap(),
                d["allowed"].as_bool().unwrap(),
            )
        })
        .collect();
    decided.sort_unstable();
    assert_eq!(
        decided,
        [
            ("GET", "/ok/item", true),
            ("GET", "/secret", false),
            ("POST", "/ok/item", false)
        ],
        "{net:?}"
    );
    assert!(
        decisions.iter().all(|d| d["kind"] == "transparent"),
        "{net:?}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn names_are_answered_by_the_gateway_and_only_allowed_ones_resolve() {
    let dir = tempdir();
    let policy = net_policy(dir.path(), "  allow:\n    - host: localhost\n");
    let name = unique("dns");
    // Raw queries to a public resolver's address: the gateway answers them, whatever the
    // address, and a name no rule allows gets NXDOMAIN without leaving the host.
    let code = "import socket, struct\n\
         def ask(name):\n\
         \x20   q = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)\n\
         \x20   q += b''.join(bytes([len(p)]) + p.encode() for p in name.split('.')) + b'\\0' + struct.pack('>HH', 1, 1)\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)\n\
         \x20   s.sendto(q, ('8.8.8.8', 53)); r = s.recv(512)\n\
         \x20   answers = struct.unpack('>H', r[6:8])[0]\n\
         \x20   return r[3] & 15, socket.inet_ntoa(r[-4:]) if answers else None\n\
         print(*ask('localhost'))\n\
         print(*ask('c2VjcmV0.attacker.test'))\n\
         print('nameserver 127.0.0.1' in open('/etc/resolv.conf').read())";
    let ran = run_py(&["--name", &name, "--policy", &policy], code);
    assert_eq!(ran.stdout, "0 127.0.0.1\n3 None\nTrue\n", "{ran:?}");
    let (net, decisions) = net_decisions(&name);
    let seen: Vec<(&str, &str, bool)> = decisions
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap(),
                d["host"].as_str().unwrap(),
                d["allowed"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("dns", "localhost", true),
            ("dns", "c2vjcmv0.attacker.test", false)
        ],
        "{net:?}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

/// A package index with one wheel, built in `dir`, served over plain HTTP on 127.0.0.2.
fn package_index(dir: &std::path::Path) -> u16 {
    let wheel = "demo_pkg-1.0-py3-none-any.whl";
    let build = format!(
        "import zipfile, hashlib, base64\n\
         files = {{'demo_pkg/__init__.py': b'VALUE = 42\\n',\n\
                   'demo_pkg-1.0.dist-info/METADATA': b'Metadata-Version: 2.1\\nName: demo-pkg\\nVersion: 1.0\\n',\n\
                   'demo_pkg-1.0.dist-info/WHEEL': b'Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n'}}\n\
         record = ''\n\
         with zipfile.ZipFile('{dir}/{wheel}', 'w') as z:\n\
         \x20   for name, data in files.items():\n\
         \x20       z.writestr(name, data)\n\
         \x20       digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()\n\
         \x20       record += f'{{name}},sha256={{digest}},{{len(data)}}\\n'\n\
         \x20   z.writestr('demo_pkg-1.0.dist-info/RECORD', record + 'demo_pkg-1.0.dist-info/RECORD,,\\n')",
        dir = dir.display()
    );
    let status = std::process::Command::new("python3")
        .args(["-c", &build])
        .status()
        .unwrap();
    assert!(status.success());
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let wheel_bytes = std::fs::read(dir.join(wheel)).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let wheel_bytes = wheel_bytes.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap_or(0);
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (kind, body): (&str, Vec<u8>) = if path.ends_with(".whl") {
                    ("application/octet-stream", wheel_bytes)
                } else if path.starts_with("/simple/demo-pkg") {
                    (
                        "text/html",
                        format!("<html><body><a href=\"/files/{wheel}\">{wheel}</a></body></html>")
                            .into_bytes(),
                    )
                } else {
                    (
                        "text/html",
                        b"<html><body><a href=\"/simple/demo-pkg/\">demo-pkg</a></body></html>"
                            .to_vec(),
                    )
                };
                let mut conn = conn;
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(&body);
            });
        }
    });
    port
}

#[test]
fn pip_downloads_from_an_allowed_index_and_nothing_else() {
    let dir = tempdir();
    let port = package_index(dir.path());
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n"),
    );
    let name = unique("pip");
    let script = format!(
        "python3 -m pip download --no-deps --disable-pip-version-check --no-cache-dir -q \
           --index-url http://127.0.0.2:{port}/simple/ --trusted-host 127.0.0.2 -d /tmp/dl demo-pkg==1.0 \
         && ls /tmp/dl && python3 -m pip download --no-deps --disable-pip-version-check --no-cache-dir -q \
           --retries 0 --timeout 5 --index-url http://pypi.example/simple/ --trusted-host pypi.example \
           -d /tmp/dl2 demo-pkg 2>&1 | tail -1"
    );
    let ran = run_sh(&["--name", &name, "--policy", &policy], &script);
    assert!(
        ran.stdout.starts_with("demo_pkg-1.0-py3-none-any.whl\n"),
        "{ran:?}"
    );
    let (net, decisions) = net_decisions(&name);
    let denied: Vec<&str> = decisions
        .iter()
        .filter(|d| d["allowed"] == false)
        .map(|d| d["host"].as_str().unwrap())
        .collect();
    assert!(
        !denied.is_empty() && denied.iter().all(|h| *h == "pypi.example"),
        "{net:?}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn ask_rules_on_methods_hold_only_the_requests_they_name() {
    let dir = tempdir();
    let up = http_upstream();
    let rules = format!(
        "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [POST]\n      paths: [\"/write/**\"]\napprovals:\n  timeout: 30s\n",
        port = up.port
    );
    let asking = net_policy(dir.path(), &rules);
    let name = unique("askl7");
    let code = format!(
        "import urllib.request\n\
         print(urllib.request.urlopen('http://127.0.0.2:{port}/read').read().decode().split(' body=')[0])\n\
         req = urllib.request.Request('http://127.0.0.2:{port}/write/x', data=b'payload', method='POST')\n\
         print(urllib.request.urlopen(req).read().decode().split(' body=')[0])",
        port = up.port
    );
    let cell = warden()
        .args([
            "run", "--rm", "--name", &name, "--policy", &asking, "--", "python3", "-c",
        ])
        .arg(&code)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The GET went through on its allow rule; the POST waits for a person.
    let (id, request) = next_question(&name, 0);
    assert_eq!(request, format!("POST 127.0.0.2:{}/write/x", up.port));
    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        1,
        "only the GET reached the upstream"
    );
    let approve = Ran::from(
        warden()
            .args(["approve", &name, &id.to_string()])
            .output()
            .unwrap(),
    );
    assert_eq!(approve.code, 0, "{approve:?}");
    let ran = Ran::from(cell.wait_with_output().unwrap());
    assert_eq!(
        ran.stdout, "upstream saw GET /read HTTP/1.1\nupstream saw POST /write/x HTTP/1.1\n",
        "{ran:?}"
    );
}

#[test]
fn the_proxy_port_answers_on_ipv6_loopback_too() {
    if !std::path::Path::new("/proc/net/if_inet6").exists() {
        eprintln!("skipped the_proxy_port_answers_on_ipv6_loopback_too: this kernel has no IPv6");
        return;
    }
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
            up.port
        ),
    );
    let code = format!(
        "import urllib.request\n\
         opener = urllib.request.build_opener(urllib.request.ProxyHandler({{'http': 'http://[::1]:3128'}}))\n\
         print(opener.open('http://127.0.0.2:{}/six').read().decode().split(' body=')[0])",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    assert_eq!(ran.stdout, "upstream saw GET /six HTTP/1.1\n", "{ran:?}");
}

#[test]
fn a_cell_cannot_make_its_gateway_hold_more_connections_than_its_limit() {
    let dir = tempdir();
    let (echo, _) = echo_upstream();
    let limit = 16;
    let policy = policy(
        dir.path(),
        &format!(
            "version: 1\nlimits:\n  pids: 32\n  connections: {limit}\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{echo}]\n"
        ),
    );
    // 400 connections, far beyond the cell's 32 processes: half of them tunnels (two relay
    // threads each), half of them heads that never end; all held while the test counts the
    // warden's threads.
    let code = format!(
        "import socket, sys, time\n\
         print('ready'); sys.stdout.flush(); time.sleep(1)\n\
         socks = []\n\
         for i in range(400):\n\
         \x20   try: s = socket.create_connection(('127.0.0.1', 3128), timeout=5)\n\
         \x20   except OSError: continue\n\
         \x20   try: s.sendall(b'CONNECT 127.0.0.2:{echo} HTTP/1.1\\r\\n\\r\\n' if i % 2 else b'GET http://127.0.0.2:{echo}/ HTTP/1.1\\r\\nHo')\n\
         \x20   except OSError: pass\n\
         \x20   socks.append(s)\n\
         time.sleep(3)\n\
         busy = 0\n\
         for s in socks:\n\
         \x20   s.settimeout(0.2)\n\
         \x20   try: data = s.recv(300)\n\
         \x20   except OSError: data = b''\n\
         \x20   busy += b' 503 ' in data and b'limits.connections' in data\n\
         print(busy)"
    );
    let name = unique("flood");
    let mut child = warden()
        .args(["run", "--name", &name, "--policy", policy.to_str().unwrap()])
        .args(["--", "python3", "-c", &code])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let pid = child.id();
    let baseline = support::daemon::threads_of(pid);
    let mut most = baseline;
    while child.try_wait().unwrap().is_none() {
        most = most.max(support::daemon::threads_of(pid));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let busy: usize = rest.trim().parse().unwrap_or_else(|_| panic!("{rest:?}"));
    eprintln!(
        "warden threads: {baseline} before the flood, {most} at most during it; {busy} of 400 connections refused with 503"
    );
    // One thread per connection, two per tunnel, and nothing else grows.
    assert!(
        most <= baseline + 2 * limit + 4,
        "the warden grew from {baseline} to {most} threads for a cell limited to {limit} connections"
    );
    assert!(
        busy >= 400 - 2 * limit,
        "only {busy} connections were refused"
    );
    let (_, decisions) = net_decisions(&name);
    let refused: u64 = decisions
        .iter()
        .filter(|d| d["rule"] == "limits.connections")
        .map(|d| d["repeats"].as_u64().unwrap_or(1).max(1))
        .sum();
    assert!(
        refused >= busy as u64,
        "{refused} refusals recorded for {busy}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn a_head_trickled_byte_by_byte_is_cut_at_one_deadline() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
            up.port
        ),
    );
    // A byte every two seconds: each read is quick, the head never ends.
    let code = format!(
        "import socket, time\n\
         s = socket.create_connection(('127.0.0.1', 3128))\n\
         s.sendall(b'GET http://127.0.0.2:{}/ HTTP/1.1\\r\\n')\n\
         begun = time.time(); s.settimeout(2)\n\
         answer = b''\n\
         while time.time() - begun < 90:\n\
         \x20   try:\n        s.sendall(b'X')\n\
         \x20   except OSError: break\n\
         \x20   try:\n        got = s.recv(200)\n        answer = got\n        if not got or b'HTTP/1.1' in got: break\n\
         \x20   except socket.timeout: pass\n\
         \x20   except OSError: break\n\
         print(int(time.time() - begun), answer.split(b'\\r\\n')[0].decode())",
        up.port
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    let (seconds, status) = ran.stdout.trim().split_once(' ').unwrap_or(("", ""));
    let seconds: u64 = seconds.parse().unwrap_or_else(|_| panic!("{ran:?}"));
    assert!(
        (28..=40).contains(&seconds),
        "the head was cut after {seconds} s: {ran:?}"
    );
    assert_eq!(status, "HTTP/1.1 408 Request Timeout", "{ran:?}");
    assert_eq!(up.hits.load(Ordering::SeqCst), 0);
}

#[test]
fn a_flood_of_decisions_is_collapsed_rate_limited_and_stops_at_its_quota() {
    let dir = tempdir();
    let state = tempdir();
    let up = http_upstream();
    // DNS is served because something is allowed; every other name is refused, and recorded.
    let flood = "import socket, struct, time, random\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)\n\
         def query(name):\n\
         \x20   q = struct.pack('>HHHHHH', random.randrange(65536), 0x100, 1, 0, 0, 0)\n\
         \x20   for label in name.split('.'): q += bytes([len(label)]) + label.encode()\n\
         \x20   return q + b'\\x00\\x00\\x01\\x00\\x01'\n\
         sent = answered = 0\n\
         begun = time.time()\n\
         while time.time() - begun < 5:\n\
         \x20   for name in ['same.denied.test', 'x%d.denied.test' % sent]:\n\
         \x20       try: s.sendto(query(name), ('127.0.0.1', 53)); sent += 1\n\
         \x20       except BlockingIOError: pass\n\
         \x20   try:\n        while s.recv(512): answered += 1\n\
         \x20   except BlockingIOError: pass\n\
         time.sleep(2)\n\
         try:\n    while s.recv(512): answered += 1\n\
         except BlockingIOError: pass\n\
         print(sent, answered)";
    for (quota, name) in [
        (None, unique("dnsflood")),
        (Some(64 * 1024), unique("quota")),
    ] {
        let limits = quota.map_or(String::new(), |q| format!("limits:\n  records: {q}\n"));
        let policy = policy(
            dir.path(),
            &format!(
                "version: 1\n{limits}network:\n  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n",
                up.port
            ),
        );
        let ran = Ran::from(
            warden()
                .args(["run", "--name", &name, "--policy", policy.to_str().unwrap()])
                .args(["--", "python3", "-c", flood])
                .env("WARDEN_STATE_DIR", state.path())
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 0, "{ran:?}");
        let (sent, answered) = ran.stdout.trim().split_once(' ').unwrap();
        let (sent, answered): (u64, u64) = (sent.parse().unwrap(), answered.parse().unwrap());
        let record = state.path().join("net").join(format!("{name}.jsonl"));
        let bytes = std::fs::metadata(&record).unwrap().len();
        let decisions: Vec<serde_json::Value> = std::fs::read_to_string(&record)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        eprintln!(
            "{sent} queries sent, {answered} answered; the record has {} lines, {bytes} bytes (quota {quota:?})",
            decisions.len()
        );
        assert!(
            answered > 2_000,
            "the flood was too small to prove anything: {answered}"
        );
        match quota {
            None => {
                // 5 s of flood: each second at most LINES_PER_SECOND lines one by one, their
                // repeats and one summary.
                assert!(
                    decisions.len() <= 8 * (2 * 100 + 1),
                    "{} lines for {answered} decisions",
                    decisions.len()
                );
                let counted: u64 = decisions
                    .iter()
                    .map(|d| {
                        let repeats = d["repeats"].as_u64().unwrap_or(0);
                        if d["kind"] == "summary" || repeats > 0 {
                            repeats
                        } else {
                            1
                        }
                    })
                    .sum();
                assert!(
                    counted >= answered && counted <= sent,
                    "{counted} decisions counted, {answered} answered, {sent} sent"
                );
                let same: u64 = decisions
                    .iter()
                    .filter(|d| d["host"] == "same.denied.test")
                    .map(|d| d["repeats"].as_u64().unwrap_or(0).max(1))
                    .sum();
                assert!(
                    same > answered / 4,
                    "repeats of one name were not counted: {same}"
                );
            }
            Some(quota) => {
                assert!(bytes <= quota + 1024, "the record grew to {bytes} bytes");
                assert!(
                    decisions
                        .iter()
                        .any(|d| d["reason"].as_str().unwrap().contains("reached its quota")),
                    "no line says the quota was reached"
                );
                let last = decisions.last().unwrap();
                assert!(
                    last["reason"].as_str().unwrap().contains("after the quota"),
                    "{last}"
                );
            }
        }
        let rm = warden()
            .args(["rm", &name])
            .env("WARDEN_STATE_DIR", state.path())
            .status()
            .unwrap();
        assert!(rm.success());
    }
}

#[test]
fn paths_and_methods_are_decided_as_the_upstream_reads_them() {
    let dir = tempdir();
    let up = http_upstream();
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{}]\n      methods: [GET]\n      paths: [\"/public/**\"]\n",
            up.port
        ),
    );
    let url = format!("http://127.0.0.2:{}", up.port);
    let host = format!("Host: 127.0.0.2:{}\r\n", up.port);
    let refused = [
        (
            format!("GET {url}/public/../private/x HTTP/1.1\r\n{host}\r\n"),
            "no rule allows",
        ),
        (
            format!("GET {url}/public/%2e%2e/private/x HTTP/1.1\r\n{host}\r\n"),
            "no rule allows",
        ),
        (
            format!("GET {url}/public/%2E%2E/%2e%2e/x HTTP/1.1\r\n{host}\r\n"),
            "climbs above",
        ),
        (
            format!("GET {url}/public/..%2fprivate/x HTTP/1.1\r\n{host}\r\n"),
            "%2f",
        ),
        (
            format!("GET {url}/public/..;/private/x HTTP/1.1\r\n{host}\r\n"),
            "parameter",
        ),
        (
            format!("GET {url}/public/%252e%252e/private HTTP/1.1\r\n{host}\r\n"),
            "%25",
        ),
        (
            format!("GET {url}/public/x HTTP/1.1\r\n{host}X-HTTP-Method-Override: DELETE\r\n\r\n"),
            "`DELETE`",
        ),
        (
            format!("GET {url}/public/x?_method=delete HTTP/1.1\r\n{host}\r\n"),
            "`DELETE`",
        ),
        (
            format!("GET {url}/public/x HTTP/1.1\r\n{host}{host}\r\n"),
            "several Host",
        ),
    ];
    for (request, reason) in &refused {
        let ran = run_py(&["--rm", "--policy", &policy], &raw_exchange(request, ""));
        assert!(
            ran.stdout.starts_with("HTTP/1.1 403 Forbidden\n"),
            "{request:?}: {ran:?}"
        );
        assert!(ran.stdout.contains(reason), "{request:?}: {ran:?}");
    }
    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        0,
        "a refused request reached the upstream"
    );
    // What passes goes upstream exactly as it was decided.
    let ran = run_py(
        &["--rm", "--policy", &policy],
        &raw_exchange(
            &format!("GET {url}/public/./a/%7e/../b?q=/../x HTTP/1.1\r\n{host}\r\n"),
            "",
        ),
    );
    assert!(
        ran.stdout
            .contains("upstream saw GET /public/a/b?q=/../x HTTP/1.1"),
        "{ran:?}"
    );
}

/// Python that builds a real ClientHello for `server_name` (none for `None`), carried in
/// records of `record_size` bytes, sends it into a tunnel opened with CONNECT to `target`, and
/// prints the CONNECT answer and whether the tunnel stayed open.
fn split_hello(target: &str, server_name: Option<&str>, record_size: usize) -> String {
    let name = server_name.map_or("None".to_owned(), |n| format!("'{n}'"));
    format!(
        "import socket, ssl\n\
         ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n\
         incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()\n\
         tls = ctx.wrap_bio(incoming, outgoing, server_hostname={name})\n\
         try: tls.do_handshake()\n\
         except ssl.SSLWantReadError: pass\n\
         record = outgoing.read()\n\
         handshake = record[5:5 + int.from_bytes(record[3:5], 'big')]\n\
         split = b''.join(b'\\x16\\x03\\x01' + len(p).to_bytes(2, 'big') + p for p in (handshake[i:i + {record_size}] for i in range(0, len(handshake), {record_size})))\n\
         s = socket.create_connection(('127.0.0.1', 3128))\n\
         s.sendall(b'CONNECT {target} HTTP/1.1\\r\\n\\r\\n')\n\
         print(s.recv(100).split(b'\\r\\n')[0].decode())\n\
         s.sendall(split[:len(split) // 2]); s.sendall(split[len(split) // 2:])\n\
         s.settimeout(5)\n\
         try: print('relayed' if s.recv(100) else 'closed')\n\
         except OSError: print('closed')"
    )
}

#[test]
fn tunnels_refuse_hellos_split_across_records_or_without_the_name_asked_for() {
    let dir = tempdir();
    let (echo, received) = echo_upstream();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let local_echo = listener.local_addr().unwrap().port();
    drop(listener);
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{echo}]\n    - host: localhost\n      ports: [{local_echo}]\n"
        ),
    );
    let name = unique("hello");
    // A hello naming another host, in records of 40 bytes, to a tunnel opened for an address.
    let ran = run_py(
        &["--name", &name, "--policy", &policy],
        &split_hello(&format!("127.0.0.2:{echo}"), Some("evil.test"), 40),
    );
    assert_eq!(
        ran.stdout, "HTTP/1.1 200 Connection established\nclosed\n",
        "{ran:?}"
    );
    assert_eq!(
        received.load(Ordering::SeqCst),
        0,
        "the ClientHello reached the upstream"
    );
    let net = Ran::from(warden().args(["net", &name]).output().unwrap());
    assert!(
        net.stdout
            .contains("the TLS server name `evil.test` is not the CONNECT host"),
        "{net:?}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
    // A hello naming no server, to a tunnel opened for a name.
    let (local, local_received) = {
        let listener = TcpListener::bind(("127.0.0.1", local_echo)).unwrap();
        let received = Arc::new(AtomicUsize::new(0));
        let counter = received.clone();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    counter.fetch_add(n, Ordering::SeqCst);
                }
            }
        });
        (local_echo, received)
    };
    let name = unique("hello");
    let ran = run_py(
        &["--name", &name, "--policy", &policy],
        &split_hello(&format!("localhost:{local}"), None, 1 << 14),
    );
    assert_eq!(
        ran.stdout, "HTTP/1.1 200 Connection established\nclosed\n",
        "{ran:?}"
    );
    assert_eq!(local_received.load(Ordering::SeqCst), 0);
    let net = Ran::from(warden().args(["net", &name]).output().unwrap());
    assert!(net.stdout.contains("names no server"), "{net:?}");
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn ipv6_addresses_that_carry_a_private_ipv4_are_refused() {
    let dir = tempdir();
    let policy = net_policy(dir.path(), "  default: allow\n");
    // 127.0.0.2 and the metadata address, in NAT64, SIIT, 6to4 and Teredo forms.
    for address in [
        "[64:ff9b::7f00:2]:80",
        "[64:ff9b::a9fe:a9fe]:80",
        "[::ffff:0:7f00:2]:80",
        "[2002:7f00:2::1]:80",
        "[2001:0:4136:e378:8000:63bf:80ff:fffd]:80",
    ] {
        let ran = run_py(
            &["--rm", "--policy", &policy],
            &raw_exchange(&format!("CONNECT {address} HTTP/1.1\r\n\r\n"), ""),
        );
        assert!(
            ran.stdout.starts_with("HTTP/1.1 403 Forbidden\n"),
            "{address}: {ran:?}"
        );
        assert!(
            ran.stdout
                .contains("private, loopback, link-local or metadata"),
            "{address}: {ran:?}"
        );
    }
}

#[test]
fn under_dns_connected_a_query_alone_never_makes_a_lookup() {
    let dir = tempdir();
    let up = http_upstream_on("127.0.0.1");
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: localhost\n      ports: [{}]\n      dns: connected\n",
            up.port
        ),
    );
    let name = unique("dns-connected");
    // Asked before any connection, the name is not looked up; once the gateway connected to
    // it for an allowed request, the query is answered from that lookup.
    let code = format!(
        "import os, socket, struct, urllib.request\n\
         for var in ['no_proxy', 'NO_PROXY']: os.environ.pop(var, None)\n\
         def ask(name):\n\
         \x20   q = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)\n\
         \x20   q += b''.join(bytes([len(p)]) + p.encode() for p in name.split('.')) + b'\\0' + struct.pack('>HH', 1, 1)\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)\n\
         \x20   s.sendto(q, ('127.0.0.1', 53)); r = s.recv(512)\n\
         \x20   answers = struct.unpack('>H', r[6:8])[0]\n\
         \x20   return r[3] & 15, socket.inet_ntoa(r[-4:]) if answers else None\n\
         print(*ask('localhost'))\n\
         print(urllib.request.urlopen('http://localhost:{}/x').read().decode())\n\
         print(*ask('localhost'))",
        up.port
    );
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    assert_eq!(
        ran.stdout, "3 None\nupstream saw GET /x HTTP/1.1 body=\n0 127.0.0.1\n",
        "{ran:?}"
    );
    let (net, _) = net_decisions(&name);
    assert!(net.stdout.contains("dns: connected"), "{net:?}");
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn a_server_name_the_cell_chose_cannot_steer_the_terminal_of_warden_net() {
    let dir = tempdir();
    let (echo, received) = echo_upstream();
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{echo}]\n"),
    );
    let name = unique("sni-ansi");
    // A hand-made ClientHello whose server name erases the line and writes an "allow" one.
    let code = format!(
        "import socket, struct\n\
         name = b'x\\x1b[2K\\rallow  connect  127.0.0.2'\n\
         sni = struct.pack('>HHHBH', 0, len(name) + 5, len(name) + 3, 0, len(name)) + name\n\
         body = b'\\x03\\x03' + b'\\0' * 32 + b'\\0' + b'\\0\\x02\\x13\\x01' + b'\\x01\\0' + struct.pack('>H', len(sni)) + sni\n\
         hello = b'\\x01' + len(body).to_bytes(3, 'big') + body\n\
         s = socket.create_connection(('127.0.0.1', 3128))\n\
         s.sendall(b'CONNECT 127.0.0.2:{echo} HTTP/1.1\\r\\n\\r\\n')\n\
         s.recv(100)\n\
         s.sendall(b'\\x16\\x03\\x01' + struct.pack('>H', len(hello)) + hello)\n\
         s.settimeout(5)\n\
         try: print('relayed' if s.recv(100) else 'closed')\n\
         except OSError: print('closed')"
    );
    let ran = run_py(&["--name", &name, "--policy", &policy], &code);
    assert_eq!(ran.stdout, "closed\n", "{ran:?}");
    assert_eq!(received.load(Ordering::SeqCst), 0);
    let net = warden().args(["net", &name]).output().unwrap();
    let text = String::from_utf8_lossy(&net.stdout).into_owned();
    assert!(!text.contains('\x1b') && !text.contains('\r'), "{text:?}");
    assert!(text.contains("DENY"), "{text}");
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

/// Python that sends `request` on a connection of its own (through the proxy, through a
/// CONNECT tunnel opened first, or straight to the address, redirected), and prints what
/// came back, one line: the status line and the body.
fn exchanges(requests: &[(&str, &str)]) -> String {
    let mut code = String::from(
        "import socket\n\
         def ask(way, request):\n\
         \x20   kind, _, where = way.partition(' ')\n\
         \x20   if kind == 'direct':\n\
         \x20       host, _, port = where.rpartition(':')\n\
         \x20       s = socket.create_connection((host.strip('[]'), int(port)), timeout=10)\n\
         \x20   else:\n\
         \x20       s = socket.create_connection(('127.0.0.1', 3128), timeout=10)\n\
         \x20   if kind == 'connect':\n\
         \x20       s.sendall(f'CONNECT {where} HTTP/1.1\\r\\n\\r\\n'.encode())\n\
         \x20       head = b''\n\
         \x20       while b'\\r\\n\\r\\n' not in head:\n\
         \x20           more = s.recv(1)\n\
         \x20           if not more: break\n\
         \x20           head += more\n\
         \x20   data = b''\n\
         \x20   if kind != 'connect' or b' 200 ' in head.split(b'\\r\\n')[0]:\n\
         \x20       s.sendall(request.encode())\n\
         \x20   else:\n\
         \x20       data = head\n\
         \x20   try:\n\
         \x20       while True:\n\
         \x20           more = s.recv(4096)\n\
         \x20           if not more: break\n\
         \x20           data += more\n\
         \x20   except OSError as e:\n\
         \x20       data += f'[{e}]'.encode()\n\
         \x20   head, _, body = data.partition(b'\\r\\n\\r\\n')\n\
         \x20   return head.split(b'\\r\\n')[0].decode() + ' | ' + body.decode(errors='replace').replace('\\n', ' ')\n",
    );
    for (way, request) in requests {
        code.push_str(&format!("print(ask({way:?}, {request:?}), flush=True)\n"));
    }
    code
}

#[test]
fn a_rule_on_paths_holds_in_tunnels_redirected_connections_and_against_doubled_slashes() {
    let dir = tempdir();
    let up = http_upstream();
    let port = up.port;
    let policy = net_policy(
        dir.path(),
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n  deny:\n    - host: 127.0.0.2\n      paths: [\"/admin/**\"]\n"
        ),
    );
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\n\r\n");
    let absolute = |path: &str| {
        format!("GET http://127.0.0.2:{port}{path} HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\n\r\n")
    };
    let tunnel = format!("connect 127.0.0.2:{port}");
    let direct = format!("direct 127.0.0.2:{port}");
    // A kept-alive redirected connection that carries a second request for another host.
    let two = format!(
        "{}GET /second HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n",
        get("/public/1")
    );
    let requests = [
        ("proxy", absolute("/admin/x")),
        ("proxy", absolute("//admin/x")),
        ("proxy", absolute("/public/a")),
        (tunnel.as_str(), get("/admin/x")),
        (tunnel.as_str(), get("//admin/x")),
        (tunnel.as_str(), get("/public/b")),
        (direct.as_str(), get("/admin/x")),
        (direct.as_str(), get("//admin//x")),
        (direct.as_str(), two.clone()),
    ];
    let asked: Vec<(&str, &str)> = requests.iter().map(|(w, r)| (*w, r.as_str())).collect();
    let ran = run_py(&["--rm", "--policy", &policy], &exchanges(&asked));
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), requests.len(), "{ran:?}");
    for (i, line) in lines.iter().enumerate() {
        let refused = requests[i].1.contains("admin");
        if refused {
            assert!(
                line.starts_with("HTTP/1.1 403 ") && line.contains("deny[0]"),
                "request {i} ({:?}) was not refused by the rule: {line}",
                requests[i]
            );
        } else {
            assert!(
                line.starts_with("HTTP/1.1 200 ") && line.contains("upstream saw GET /public/"),
                "request {i} ({:?}): {line}",
                requests[i]
            );
        }
    }
    // The second request of the kept-alive connection never went out: one request a connection.
    assert!(!lines[8].contains("second"), "{}", lines[8]);
    assert_eq!(up.hits.load(Ordering::SeqCst), 3, "{ran:?}");
}

#[test]
fn a_name_or_an_address_form_that_leads_to_a_denied_address_is_refused() {
    let dir = tempdir();
    let denied = http_upstream_on("127.0.0.3");
    let fine = http_upstream();
    // The gateway's names come from an /etc/hosts of the run's own (a private mount
    // namespace): no lookup leaves the machine.
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        "127.0.0.1 localhost\n127.0.0.3 secret.corp.test\n127.0.0.2 fine.corp.test\n",
    )
    .unwrap();
    let policy = net_policy(
        dir.path(),
        "  default: allow\n  allow:\n    - host: 127.0.0.0/8\n    - host: \"*.corp.test\"\n  deny:\n    - host: 127.0.0.3\n",
    );
    let (dp, fp) = (denied.port, fine.port);
    let get = |host: &str, port: u16| format!("GET / HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n");
    let absolute = |host: &str, port: u16| {
        format!("GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n")
    };
    let requests = [
        ("proxy".to_owned(), absolute("secret.corp.test", dp)),
        ("proxy".to_owned(), absolute("[::ffff:127.0.0.3]", dp)),
        (format!("connect secret.corp.test:{dp}"), "ping".to_owned()),
        (
            format!("direct 127.0.0.3:{dp}"),
            get("secret.corp.test", dp),
        ),
        ("proxy".to_owned(), absolute("fine.corp.test", fp)),
    ];
    let asked: Vec<(&str, &str)> = requests
        .iter()
        .map(|(w, r)| (w.as_str(), r.as_str()))
        .collect();
    let script = format!(
        "mount --bind {} /etc/hosts && exec \"$0\" \"$@\"",
        hosts.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .arg(bin())
        .args(["run", "--rm", "--policy", &policy, "--", "python3", "-c"])
        .arg(exchanges(&asked))
        .output()
        .unwrap();
    let ran = Ran::from(out);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), requests.len(), "{ran:?}");
    for line in &lines[..4] {
        assert!(
            line.starts_with("HTTP/1.1 403 ") && line.contains("deny[0]"),
            "not refused by the rule that names the address: {line}\n{ran:?}"
        );
    }
    assert!(lines[4].contains("upstream saw GET /"), "{}", lines[4]);
    assert_eq!(denied.hits.load(Ordering::SeqCst), 0, "{ran:?}");
    assert_eq!(fine.hits.load(Ordering::SeqCst), 1, "{ran:?}");
}

#[test]
fn a_redirected_connection_to_another_network_is_answered() {
    // Nothing these clients ask for is allowed: the gateway's refusal must come back to them,
    // which needs a source address the answer can be sent to (the loopback's, not 0.0.0.0).
    let dir = tempdir();
    let policy = net_policy(
        dir.path(),
        "  default: deny\n  allow:\n    - host: 127.0.0.2\n      ports: [9]\n",
    );
    let requests = [
        (
            "direct 192.0.2.1:80",
            "GET / HTTP/1.1\r\nHost: 192.0.2.1\r\n\r\n",
        ),
        (
            "direct [2001:db8::1]:80",
            "GET / HTTP/1.1\r\nHost: [2001:db8::1]\r\n\r\n",
        ),
    ];
    let ran = run_py(&["--rm", "--policy", &policy], &exchanges(&requests));
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{ran:?}");
    for line in lines {
        assert!(line.starts_with("HTTP/1.1 403 "), "{line}\n{ran:?}");
    }
}

#[test]
fn plain_http_in_a_tunnel_is_decided_as_a_request_for_the_tunnels_host() {
    // No rule on paths: the tunnel is not opened up, and its relay hands a plain HTTP request
    // to the request path instead of relaying it raw.
    // (The upstream's count of connections is not looked at: each tunnel also made the
    // connection it was opened with, which goes unused.)
    let dir = tempdir();
    let port = http_upstream().port;
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n"),
    );
    let tunnel = format!("connect 127.0.0.2:{port}");
    let own = format!("GET /mine HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\n\r\n");
    // Another name at the same address (a virtual host the rules never allowed).
    let other = format!("GET /theirs HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n");
    let kept_alive = format!("{own}{other}");
    // Forms servers read as requests too: an empty line first, a method of their own.
    let blank_first = format!("\r\n{other}");
    let odd_method = format!("M-SEARCH /theirs HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n");
    let wide = format!("GET  /theirs  HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n");
    let tabbed = format!("GET\t/theirs HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n");
    // An upgrade whose target is a URL: a server may serve the URL's host.
    let upgrade_url = format!(
        "GET http://evil.test:{port}/theirs HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nUpgrade: websocket\r\n\r\n"
    );
    let direct = format!("direct 127.0.0.2:{port}");
    let requests = [
        (tunnel.as_str(), own.as_str()),
        (tunnel.as_str(), other.as_str()),
        (tunnel.as_str(), kept_alive.as_str()),
        (tunnel.as_str(), blank_first.as_str()),
        (tunnel.as_str(), odd_method.as_str()),
        (direct.as_str(), blank_first.as_str()),
        (direct.as_str(), odd_method.as_str()),
        (tunnel.as_str(), wide.as_str()),
        (tunnel.as_str(), tabbed.as_str()),
        (direct.as_str(), wide.as_str()),
        (tunnel.as_str(), upgrade_url.as_str()),
    ];
    let ran = run_py(&["--rm", "--policy", &policy], &exchanges(&requests));
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 11, "{ran:?}");
    assert!(!ran.stdout.contains("upstream saw GET /theirs"), "{ran:?}");
    // Refused, for its Host (in a tunnel), or as a redirected connection whose name does not
    // lead where it went.
    for line in &lines[3..] {
        assert!(
            (line.starts_with("HTTP/1.1 403 ")
                && (line.contains("Host header")
                    || line.contains("evil.test does not resolve")
                    || line.contains("not a URL")))
                || line.starts_with("HTTP/1.1 400 Bad Request | {\"error\":\"malformed"),
            "{line}\n{ran:?}"
        );
    }
    assert!(lines[0].contains("upstream saw GET /mine"), "{ran:?}");
    assert!(
        lines[1].starts_with("HTTP/1.1 403 ") && lines[1].contains("Host header"),
        "{ran:?}"
    );
    assert!(
        lines[2].contains("upstream saw GET /mine") && !lines[2].contains("theirs"),
        "{ran:?}"
    );
}

#[test]
fn http2_without_tls_is_not_relayed() {
    // Its requests name their host inside frames the gateway does not read.
    let dir = tempdir();
    let (echo, received) = echo_upstream();
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{echo}]\n"),
    );
    let preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let requests = [
        (format!("connect 127.0.0.2:{echo}"), preface),
        (format!("direct 127.0.0.2:{echo}"), preface),
    ];
    let asked: Vec<(&str, &str)> = requests.iter().map(|(w, r)| (w.as_str(), *r)).collect();
    let ran = run_py(&["--rm", "--policy", &policy], &exchanges(&asked));
    assert_eq!(ran.stdout.lines().count(), 2, "{ran:?}");
    assert!(!ran.stdout.contains("SM"), "the preface came back: {ran:?}");
    assert_eq!(received.load(Ordering::SeqCst), 0, "{ran:?}");
}

/// An upstream that switches protocols for any request asking it to (whatever it names in
/// `Upgrade`) and then keeps what the client sends after the switch; other requests get a 200.
/// Returns its port and everything it was sent after a switch.
fn switching_upstream() -> (u16, Arc<std::sync::Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let after = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = after.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut upgrade = None;
                let mut first = String::new();
                reader.read_line(&mut first).unwrap_or(0);
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                    if let Some(v) = header.to_ascii_lowercase().strip_prefix("upgrade:") {
                        upgrade = Some(v.trim().to_owned());
                    }
                }
                let mut conn = conn;
                let Some(protocol) = upgrade else {
                    let answer = format!("upstream saw {} without an upgrade", first.trim());
                    let _ = write!(
                        conn,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                        answer.len()
                    );
                    return;
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: {protocol}\r\nConnection: Upgrade\r\n\r\n"
                );
                // What the client says in the new protocol: kept until it pauses.
                let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                let mut seen = reader.buffer().to_vec();
                let mut chunk = [0u8; 4096];
                while let Ok(n) = reader.get_mut().read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&chunk[..n]);
                    if seen.ends_with(b"\r\n\r\n") {
                        break;
                    }
                }
                let _ = write!(
                    conn,
                    "switched to {protocol}, then saw {} bytes",
                    seen.len()
                );
                kept.lock().unwrap().extend_from_slice(&seen);
            });
        }
    });
    (port, after)
}

#[test]
fn only_a_websocket_upgrade_is_relayed_raw_in_a_tunnel() {
    // After `101` a tunnel's bytes go up raw. HTTP/2 (`h2c`) names its hosts inside its frames
    // and TLS (`TLS/1.2`) its server in a ClientHello the gateway would never read: either
    // would let the cell reach another host at the allowed address (a virtual host the rules
    // never allowed), as the HTTP/2 preface spoken first would. Such a request is the request
    // path's, which sends it without `Upgrade`; a WebSocket's is still relayed.
    let dir = tempdir();
    let (port, after) = switching_upstream();
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n"),
    );
    let tunnel = format!("connect 127.0.0.2:{port}");
    let next = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let h2c = format!(
        "GET / HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n{next}"
    );
    let tls = format!(
        "GET / HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nConnection: Upgrade\r\nUpgrade: TLS/1.2\r\n\r\n{next}"
    );
    let both = format!(
        "GET / HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nConnection: Upgrade\r\nUpgrade: websocket, h2c\r\n\r\n{next}"
    );
    let websocket = format!(
        "GET /ws HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nframes\r\n\r\n"
    );
    let requests = [
        (tunnel.as_str(), h2c.as_str()),
        (tunnel.as_str(), tls.as_str()),
        (tunnel.as_str(), both.as_str()),
        (tunnel.as_str(), websocket.as_str()),
    ];
    let ran = run_py(&["--rm", "--policy", &policy], &exchanges(&requests));
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{ran:?}");
    for line in &lines[..3] {
        assert!(
            line.starts_with("HTTP/1.1 200 ") && line.contains("without an upgrade"),
            "{line}\n{ran:?}"
        );
    }
    assert!(
        lines[3].starts_with("HTTP/1.1 101 ") && lines[3].contains("switched to websocket"),
        "{ran:?}"
    );
    let after = String::from_utf8_lossy(&after.lock().unwrap()).into_owned();
    assert_eq!(after, "frames\r\n\r\n", "{ran:?}");
}

#[test]
fn a_client_that_waits_to_be_told_to_send_its_body_is_told() {
    // `Expect: 100-continue`, the body held back until the answer says go on (curl's uploads,
    // .NET's, Node's `continue` event). The gateway reads the body before it reads the
    // upstream's answer, so nothing told the client: it waited for its own deadline, or, without
    // one, for the gateway's idle limit.
    let dir = tempdir();
    let upstream = http_upstream();
    let port = upstream.port;
    let policy = net_policy(
        dir.path(),
        &format!("  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n"),
    );
    let code = format!(
        r#"
import socket
s = socket.create_connection(('127.0.0.1', 3128))
s.sendall(b'POST http://127.0.0.2:{port}/up HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n')
s.settimeout(10)
head = b''
try:
    while b'\r\n\r\n' not in head:
        more = s.recv(1)
        if not more: break
        head += more
except OSError as e:
    print('not told to go on:', e, flush=True)
    raise SystemExit
print(head.split(b'\r\n')[0].decode(), flush=True)
s.sendall(b'hello')
data = b''
while True:
    more = s.recv(4096)
    if not more: break
    data += more
head, _, body = data.partition(b'\r\n\r\n')
print(head.split(b'\r\n')[0].decode(), '|', body.decode(), flush=True)
"#
    );
    let ran = run_py(&["--rm", "--policy", &policy], &code);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "HTTP/1.1 100 Continue",
            "HTTP/1.1 200 OK | upstream saw POST /up HTTP/1.1 body=hello"
        ],
        "{ran:?}"
    );
}
