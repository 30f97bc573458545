//! TLS interception and credentials end to end: the cell talks HTTPS to a local upstream through
//! the gateway, which opens the TLS with the cell's own CA, applies method and path rules, puts
//! the caller's secret in the request, and keeps the secret out of everything the cell gets back.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use support::*;

const SECRET: &str = "super-secret-value-4711";

/// An HTTPS upstream on 127.0.0.2 whose certificate a test CA signed; it answers with the
/// Authorization header it received. Returns its port, the CA's PEM and what it saw.
fn https_upstream() -> (u16, String, Arc<Mutex<Vec<String>>>) {
    let (config, ca_pem) = tls_server_config("127.0.0.2");
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let config = config.clone();
            let log = log.clone();
            std::thread::spawn(move || {
                let Ok(conn) = rustls::ServerConnection::new(config) else {
                    return;
                };
                let mut tls = rustls::StreamOwned::new(conn, tcp);
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match tls.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let auth = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .starts_with("authorization:")
                            .then(|| l[14..].trim().to_owned())
                    })
                    .unwrap_or_default();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap_or(0))
                    })
                    .unwrap_or(0);
                let mut body = vec![0u8; length];
                if tls.read_exact(&mut body).is_err() {
                    return;
                }
                let body = if body.is_empty() {
                    String::new()
                } else {
                    format!(" body={}", String::from_utf8_lossy(&body))
                };
                log.lock().unwrap().push(format!(
                    "{} {auth}{body}",
                    head.lines().next().unwrap_or_default()
                ));
                let body = format!("upstream got auth={auth}");
                let _ = write!(
                    tls,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                tls.conn.send_close_notify();
                let _ = tls.flush();
            });
        }
    });
    (port, ca_pem, seen)
}

/// Runs `command` in a cell under `policy`, with the test's secret in the caller's environment
/// (and `env` besides); `name` keeps the cell for `warden net`, else it is removed.
fn run_with_secret(
    policy: &std::path::Path,
    name: Option<&str>,
    env: &[(&str, &str)],
    command: &[&str],
) -> Ran {
    let mut args = vec!["run"];
    match name {
        Some(name) => args.extend(["--name", name]),
        None => args.push("--rm"),
    }
    args.extend(["--policy", policy.to_str().unwrap(), "--"]);
    args.extend(command);
    let mut cmd = warden();
    cmd.args(&args).env("WARDEN_TEST_API_TOKEN", SECRET);
    for (key, value) in env {
        cmd.env(key, value);
    }
    Ran::from(cmd.output().unwrap())
}

/// A policy file in `dir` whose `network` trusts the test upstream's CA (`ca_pem`) and goes on
/// with `rest` (the network rules, then any other sections).
fn trusting_policy(dir: &std::path::Path, ca_pem: String, rest: &str) -> std::path::PathBuf {
    let ca = dir.join("upstream-ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    policy(
        dir,
        &format!("version: 1\nnetwork:\n  extra_ca: {}\n{rest}", ca.display()),
    )
}

#[test]
fn the_secret_reaches_the_upstream_and_never_the_cell() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let plain = TcpListener::bind("127.0.0.2:0").unwrap();
    let plain_port = plain.local_addr().unwrap().port();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n      paths: [\"/api/**\"]\n      credential: api\n    - host: 127.0.0.2\n      ports: [{plain_port}]\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN }}\n"
        ),
    );
    let name = unique("cred");
    let code = format!(
        "import os, urllib.request, urllib.error\n\
         token = os.environ['WARDEN_TEST_API_TOKEN']\n\
         print('placeholder' if len(token) == {secret_len} and token != '{SECRET}' else 'LEAK ' + token)\n\
         def get(url, method='GET'):\n\
         \x20   req = urllib.request.Request(url, method=method, headers={{'Authorization': 'Bearer ' + token}})\n\
         \x20   try:\n        return urllib.request.urlopen(req, timeout=10).read().decode().replace(token, '<placeholder>')\n\
         \x20   except urllib.error.HTTPError as e: return str(e.code)\n\
         print(get('https://127.0.0.2:{port}/api/items'))\n\
         print(get('https://127.0.0.2:{port}/admin'))\n\
         print(get('https://127.0.0.2:{port}/api/items', 'POST'))\n\
         print(get('http://127.0.0.2:{plain_port}/'))\n\
         print(open('/proc/self/environ', 'rb').read().count(b'{SECRET}'))",
        secret_len = SECRET.len()
    );
    let ran = run_with_secret(&policy, Some(&name), &[], &["python3", "-c", &code]);
    assert_eq!(
        ran.stdout, "placeholder\nupstream got auth=Bearer <placeholder>\n403\n403\n403\n0\n",
        "{ran:?}"
    );
    assert!(!ran.stdout.contains(SECRET) && !ran.stderr.contains(SECRET));
    let upstream_saw = seen.lock().unwrap().clone();
    assert_eq!(
        upstream_saw,
        vec![format!("GET /api/items HTTP/1.1 Bearer {SECRET}")]
    );

    let net = Ran::from(warden().args(["net", &name, "--json"]).output().unwrap());
    assert!(
        !net.stdout.contains(SECRET),
        "the secret is in the egress record"
    );
    assert!(net.stdout.contains("not bound to"), "{net:?}");
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn curl_works_through_the_gateway_with_interception() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      paths: [\"/ok\"]\n      credential: api\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN, header: Authorization, format: \"token {{}}\" }}\n"
        ),
    );
    // curl reads the proxy from https_proxy and the CA bundle from CURL_CA_BUNDLE.
    let script = format!(
        "curl -sS https://127.0.0.2:{port}/ok; echo; curl -s -o /dev/null -w '%{{http_code}}\\n' https://127.0.0.2:{port}/other"
    );
    let ran = run_with_secret(&policy, None, &[], &["sh", "-c", &script]);
    assert!(
        ran.stdout.starts_with("upstream got auth=token "),
        "{ran:?}"
    );
    assert!(!ran.stdout.contains(SECRET), "{ran:?}");
    assert!(ran.stdout.ends_with("\n403\n"), "{ran:?}");
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![format!("GET /ok HTTP/1.1 token {SECRET}")]
    );
}

#[test]
fn a_missing_secret_stops_the_cell_before_it_starts() {
    let dir = tempdir();
    let policy = policy(
        dir.path(),
        "version: 1\nnetwork:\n  allow:\n    - host: api.example.com\n      credential: api\ncredentials:\n  api: { from_env: WARDEN_TEST_UNSET_TOKEN }\n",
    );
    let out = warden()
        .args([
            "run",
            "--rm",
            "--policy",
            policy.to_str().unwrap(),
            "--",
            "true",
        ])
        .env_remove("WARDEN_TEST_UNSET_TOKEN")
        .output()
        .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr
            .contains("credential `api`: the caller's environment has no WARDEN_TEST_UNSET_TOKEN"),
        "{ran:?}"
    );
}

#[test]
fn a_credential_bound_in_body_reaches_the_upstream_in_the_request_body() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      paths: [\"/login\"]\n      credential: api\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN, in_body: true }}\n"
        ),
    );
    // The cell puts its placeholder in a JSON body, as a login form would.
    let code = format!(
        "import os, json, urllib.request\n\
         token = os.environ['WARDEN_TEST_API_TOKEN']\n\
         body = json.dumps({{'user': 'agent', 'password': token}}).encode()\n\
         req = urllib.request.Request('https://127.0.0.2:{port}/login', data=body, method='POST', headers={{'Content-Type': 'application/json'}})\n\
         print(urllib.request.urlopen(req, timeout=10).status)\n\
         print(token != '{SECRET}')"
    );
    let ran = run_with_secret(&policy, None, &[], &["python3", "-c", &code]);
    assert_eq!(ran.stdout, "200\nTrue\n", "{ran:?}");
    let upstream_saw = seen.lock().unwrap().clone();
    assert_eq!(upstream_saw.len(), 1, "{upstream_saw:?}");
    assert!(
        upstream_saw[0].ends_with(&format!(
            "body={{\"user\": \"agent\", \"password\": \"{SECRET}\"}}"
        )),
        "the upstream got the secret in the body: {upstream_saw:?}"
    );
}

#[test]
fn clients_that_ignore_the_proxy_variables_are_intercepted_alike() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n      paths: [\"/ok\"]\n      credential: api\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN, header: Authorization, format: \"token {{}}\" }}\n"
        ),
    );
    // `--noproxy '*'`: curl connects to the address itself; nftables in the cell's namespace
    // sends the connection to the gateway, which must open the TLS, decide each request on
    // method and path and add the credential exactly as for a proxied one.
    let script = format!(
        "curl --noproxy '*' -sS -H \"Authorization: token $WARDEN_TEST_API_TOKEN\" https://127.0.0.2:{port}/ok; echo; \
         curl --noproxy '*' -s -o /dev/null -w '%{{http_code}}\\n' https://127.0.0.2:{port}/other; \
         curl --noproxy '*' -s -o /dev/null -w '%{{http_code}}\\n' -X DELETE https://127.0.0.2:{port}/ok"
    );
    let name = unique("redirected-tls");
    let ran = run_with_secret(&policy, Some(&name), &[], &["sh", "-c", &script]);
    assert!(
        ran.stdout.starts_with("upstream got auth=token "),
        "{ran:?}"
    );
    assert!(!ran.stdout.contains(SECRET), "{ran:?}");
    assert!(ran.stdout.ends_with("\n403\n403\n"), "{ran:?}");
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![format!("GET /ok HTTP/1.1 token {SECRET}")],
        "only the allowed request reached the upstream, with the secret"
    );
    let net = Ran::from(warden().args(["net", &name, "--json"]).output().unwrap());
    let decisions: Vec<serde_json::Value> = serde_json::from_str(&net.stdout).unwrap();
    let seen_by_gateway: Vec<(String, String, String, bool)> = decisions
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap().to_owned(),
                d["method"].as_str().unwrap_or_default().to_owned(),
                d["path"].as_str().unwrap_or_default().to_owned(),
                d["allowed"].as_bool().unwrap(),
            )
        })
        .collect();
    let expected = [
        ("GET", "/ok", true),
        ("GET", "/other", false),
        ("DELETE", "/ok", false),
    ];
    assert_eq!(
        seen_by_gateway,
        expected
            .iter()
            .map(|(m, p, a)| (
                "transparent".to_owned(),
                (*m).to_owned(),
                (*p).to_owned(),
                *a
            ))
            .collect::<Vec<_>>(),
        "{net:?}"
    );
    assert!(
        !net.stdout.contains(SECRET),
        "the secret is in the egress record"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

/// A plain HTTP upstream on 127.0.0.2 that records each whole request body it receives and
/// answers 200.
fn plain_upstream() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let log = bodies.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut got = Vec::new();
            let mut byte = [0u8; 1];
            while !got.ends_with(b"\r\n\r\n") {
                match conn.read(&mut byte) {
                    Ok(1) => got.push(byte[0]),
                    _ => break,
                }
            }
            let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap_or(0));
            let mut body = vec![0u8; length];
            // Only a whole body counts as received.
            if conn.read_exact(&mut body).is_ok() {
                log.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&body).into_owned());
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            }
        }
    });
    (port, bodies)
}

#[test]
fn a_placeholder_in_a_body_bound_for_another_destination_stops_the_request() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let (plain_port, plain_saw) = plain_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      paths: [\"/login\"]\n      credential: api\n    - host: 127.0.0.2\n      ports: [{plain_port}]\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN }}\n  other: {{ from_env: WARDEN_TEST_OTHER_TOKEN }}\n"
        ),
    );
    // Bodies large enough to go out in several writes, with the placeholder past the first.
    let code = format!(
        "import os, json, urllib.request, urllib.error\n\
         api, other = os.environ['WARDEN_TEST_API_TOKEN'], os.environ['WARDEN_TEST_OTHER_TOKEN']\n\
         def post(url, body):\n\
         \x20   req = urllib.request.Request(url, data=body.encode(), method='POST')\n\
         \x20   try:\n        return str(urllib.request.urlopen(req, timeout=10).status)\n\
         \x20   except urllib.error.HTTPError as e: return f'{{e.code}} ' + json.loads(e.read())['reason']\n\
         pad = 'x' * 100000\n\
         print(post('https://127.0.0.2:{port}/login', pad + other))\n\
         print(post('https://127.0.0.2:{port}/login', 'user=agent'))\n\
         print(post('http://127.0.0.2:{plain_port}/', pad + 'token=' + api))\n\
         print(post('http://127.0.0.2:{plain_port}/', 'hello'))"
    );
    let ran = run_with_secret(
        &policy,
        None,
        &[("WARDEN_TEST_OTHER_TOKEN", "another-secret-0815")],
        &["python3", "-c", &code],
    );
    assert_eq!(
        ran.stdout,
        "403 the request body carries the placeholder of credential `other` to a destination that credential is not bound to\n\
         200\n\
         403 the request body carries the placeholder of credential `api` to a destination that credential is not bound to\n\
         200\n",
        "{ran:?}"
    );
    // Neither upstream got a whole request with a placeholder in it.
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());
    assert_eq!(plain_saw.lock().unwrap().clone(), vec!["hello".to_owned()]);
}

/// Answers a request with the head it received, as echo services do: gzip-compressed when the
/// request accepts gzip (always, on `/always-gzip`), in chunks of 3 bytes on `/chunks`, else as
/// it is. Returns the head.
fn reflect(stream: &mut (impl Read + Write)) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return String::new(),
        }
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let path = text.split(' ').nth(1).unwrap_or("/").to_owned();
    let accepts_gzip = text.to_ascii_lowercase().contains("accept-encoding: gzip");
    let answer = if path == "/chunks" {
        let mut out =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
        for piece in head.chunks(3) {
            out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            out.extend_from_slice(piece);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n\r\n");
        out
    } else if accepts_gzip || path == "/always-gzip" {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&head).unwrap();
        let body = gz.finish().unwrap();
        let mut out = format!(
            "HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(&body);
        out
    } else {
        let mut out = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            head.len()
        )
        .into_bytes();
        out.extend_from_slice(&head);
        out
    };
    let _ = stream.write_all(&answer);
    let _ = stream.flush();
    text
}

/// A reflecting upstream on 127.0.0.2 (see `reflect`), over HTTPS with `tls`, else plain; its
/// port and the heads it received.
fn reflecting_upstream(tls: Option<Arc<rustls::ServerConfig>>) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (tls, log) = (tls.clone(), log.clone());
            std::thread::spawn(move || {
                let head = match tls {
                    Some(config) => {
                        let Ok(conn) = rustls::ServerConnection::new(config) else {
                            return;
                        };
                        let mut stream = rustls::StreamOwned::new(conn, tcp);
                        let head = reflect(&mut stream);
                        stream.conn.send_close_notify();
                        let _ = stream.flush();
                        head
                    }
                    None => reflect(&mut { tcp }),
                };
                if !head.is_empty() {
                    log.lock().unwrap().push(head);
                }
            });
        }
    });
    (port, seen)
}

#[test]
fn a_reflecting_upstream_cannot_hand_the_cell_its_secret() {
    let dir = tempdir();
    let (config, ca_pem) = tls_server_config("127.0.0.2");
    let (tls_port, tls_saw) = reflecting_upstream(Some(config));
    let (plain_port, plain_saw) = reflecting_upstream(None);
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{tls_port}, {plain_port}]\n      credential: api\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN }}\n"
        ),
    );
    // The cell asks for gzip and decodes what it gets: the secret must not be in it, whatever
    // encoding or chunking the upstream chose.
    let code = format!(
        "import os, gzip, urllib.request, urllib.error\n\
         token = os.environ['WARDEN_TEST_API_TOKEN']\n\
         for base in ['http://127.0.0.2:{plain_port}', 'https://127.0.0.2:{tls_port}']:\n\
         \x20   for path in ['/gzip', '/chunks', '/always-gzip']:\n\
         \x20       req = urllib.request.Request(base + path, headers={{'Authorization': 'Bearer ' + token, 'Accept-Encoding': 'gzip'}})\n\
         \x20       try:\n\
         \x20           r = urllib.request.urlopen(req, timeout=10); body = r.read()\n\
         \x20           if r.headers.get('Content-Encoding') == 'gzip': body = gzip.decompress(body)\n\
         \x20           print(path, r.status, body.decode().replace(token, '<placeholder>').lower().replace('\\r\\n', '|'))\n\
         \x20       except urllib.error.HTTPError as e: print(path, e.code, e.read().decode())"
    );
    let ran = run_with_secret(&policy, None, &[], &["python3", "-c", &code]);
    assert!(
        !ran.stdout.contains(SECRET),
        "the secret reached the cell: {ran:?}"
    );
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{ran:?}");
    for line in [lines[0], lines[1], lines[3], lines[4]] {
        assert!(line.contains(" 200 "), "{line}");
        assert!(
            line.contains("authorization: bearer <placeholder>"),
            "{line}"
        );
        assert!(line.contains("accept-encoding: identity"), "{line}");
    }
    for line in [lines[2], lines[5]] {
        assert!(line.starts_with("/always-gzip 502 "), "{line}");
        assert!(
            line.contains("cannot be inspected for a credential"),
            "{line}"
        );
    }
    // The upstreams did get the secret: it is the reflection that is the limit.
    for saw in [plain_saw, tls_saw] {
        let saw = saw.lock().unwrap();
        assert_eq!(saw.len(), 3);
        assert!(saw.iter().all(|head| head.contains(SECRET)), "{saw:?}");
    }
}

#[test]
fn inside_intercepted_tls_the_host_must_be_the_one_decided() {
    let dir = tempdir();
    let (port, ca_pem, seen) = https_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      credential: api\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN }}\n"
        ),
    );
    // Another virtual host on the same address, and a second Host header.
    let script = format!(
        "curl -s -o /dev/null -w '%{{http_code}}\\n' -H 'Host: other.example' https://127.0.0.2:{port}/x; \
         curl -s -o /dev/null -w '%{{http_code}}\\n' -H 'Host: 127.0.0.2' -H 'Host: other.example' https://127.0.0.2:{port}/x; \
         curl -s -o /dev/null -w '%{{http_code}}\\n' https://127.0.0.2:{port}/x"
    );
    let ran = run_with_secret(&policy, None, &[], &["sh", "-c", &script]);
    assert_eq!(ran.stdout, "403\n403\n200\n", "{ran:?}");
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![format!("GET /x HTTP/1.1 Bearer {SECRET}")],
        "only the request for the decided host reached the upstream"
    );
}

/// A TCP upstream on 127.0.0.2 that keeps every byte each connection brought (until it
/// closes or is silent for a second), and answers nothing.
fn recording_upstream() -> (u16, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let log = log.clone();
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(std::time::Duration::from_secs(1)))
                    .unwrap();
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                log.lock().unwrap().push(got);
            });
        }
    });
    (port, seen)
}

#[test]
fn placeholders_cannot_leave_in_a_target_a_header_name_or_split_chunks() {
    let dir = tempdir();
    let (port, ca_pem, _) = https_upstream();
    let (plain_port, plain_saw) = recording_upstream();
    let policy = trusting_policy(
        dir.path(),
        ca_pem,
        &format!(
            "  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      credential: api\n    - host: 127.0.0.2\n      ports: [{plain_port}]\ncredentials:\n  api: {{ from_env: WARDEN_TEST_API_TOKEN }}\n"
        ),
    );
    let code = format!(
        "import os, json, socket, urllib.parse\n\
         t = os.environ['WARDEN_TEST_API_TOKEN']\n\
         print(t)\n\
         half = len(t) // 2\n\
         target = 'http://127.0.0.2:{plain_port}'\n\
         chunked = 'POST %s/ HTTP/1.1\\r\\nHost: 127.0.0.2:{plain_port}\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n%x\\r\\n%s\\r\\n%x\\r\\n%s\\r\\n0\\r\\n\\r\\n' % (target, half, t[:half], len(t) - half, t[half:])\n\
         for request in ['GET %s/?key=%s HTTP/1.1\\r\\n\\r\\n' % (target, t),\n\
         \x20               'GET %s/%s HTTP/1.1\\r\\n\\r\\n' % (target, urllib.parse.quote(t, safe='').replace('a', '%61')),\n\
         \x20               'GET %s/ HTTP/1.1\\r\\n%s: 1\\r\\n\\r\\n' % (target, t),\n\
         \x20               chunked]:\n\
         \x20   s = socket.create_connection(('127.0.0.1', 3128)); s.sendall(request.encode())\n\
         \x20   data = b''\n\
         \x20   while True:\n\
         \x20       more = s.recv(4096)\n\
         \x20       if not more: break\n\
         \x20       data += more\n\
         \x20   head, _, body = data.partition(b'\\r\\n\\r\\n')\n\
         \x20   print(head.split(b' ')[1].decode() if head else 'nothing', json.loads(body)['reason'] if body.startswith(b'{{') else body.decode())"
    );
    let ran = run_with_secret(&policy, None, &[], &["python3", "-c", &code]);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{ran:?}");
    let placeholder = lines[0];
    for line in &lines[1..] {
        assert!(
            line.starts_with("403 ") && line.contains("placeholder of credential `api`"),
            "{line}: {ran:?}"
        );
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let saw = plain_saw.lock().unwrap();
    // Only the chunked request's head and its first chunk went up, never the whole placeholder.
    assert!(saw.len() <= 1, "{saw:?}");
    for bytes in saw.iter() {
        let text = String::from_utf8_lossy(bytes).replace("\r\n", "");
        assert!(
            !text.contains(placeholder),
            "the placeholder reached the unbound upstream: {text}"
        );
    }
}
