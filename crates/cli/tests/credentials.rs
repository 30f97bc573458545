//! TLS interception and credentials end to end: the cell talks HTTPS to a local upstream through
//! the gateway, which opens the TLS with the cell's own CA, applies method and path rules, puts
//! the caller's secret in the request, and keeps the secret out of everything the cell gets back.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use support::*;

const SECRET: &str = "super-secret-value-4711";

/// An HTTPS upstream on 127.0.0.2 whose certificate a test CA signed; it answers with the
/// Authorization header it received. Returns its port, the CA's PEM and what it saw.
fn https_upstream() -> (u16, String, Arc<Mutex<Vec<String>>>) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.2".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .unwrap();
    let config = Arc::new(config);
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
    (port, ca.pem(), seen)
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
