//! Plain HTTP requests: absolute-form ones through the proxy port, and origin-form ones
//! redirected from clients that ignore the proxy variables. One request per connection (a
//! kept-alive connection cannot smuggle a second request to another host); each is decided on
//! its normalised path, its method and any method it asks the server to take instead, with
//! credential placeholders allowed only where their credential is bound.

use std::io::{self, Read as _};
use std::net::{Shutdown, TcpStream};

use serde_json::json;

use crate::host::{Host, split_authority};
use crate::http::{self, Body, ParsedRequest, ResponseError};
use crate::inference::Tap;
use crate::path::Target;
use crate::proxy::{Gateway, Via};
use crate::pump::pump;
use crate::record::Decision;
use crate::rules::{Request, Verdict};
use crate::secrets::{PlaceholderInBody, Replacer};

/// Headers through which a client asks a server to take a request for another method.
const METHOD_OVERRIDES: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// A request after its checks: the verdict (with the credential it binds), the decision to
/// record (refused, with the reason, when a check failed), the target to forward and the body's
/// framing.
pub(crate) struct Checked {
    pub(crate) verdict: Verdict,
    pub(crate) decision: Decision,
    pub(crate) target: Target,
    pub(crate) body: Body,
}

impl Gateway {
    /// Checks an origin-form request to `host:port` and decides it. Refused (in the decision)
    /// are: an ambiguous target, ambiguous framing, a `Host` that is missing where `host_required`,
    /// repeated, or names another host than the one decided, a method override the rules do not
    /// allow, and a credential's placeholder (in the target, a header's name or value) sent where
    /// that credential is not bound.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_request(
        &self,
        kind: &str,
        host: &Host,
        port: u16,
        default_port: u16,
        method: &str,
        raw_target: &str,
        headers: &[(String, Vec<u8>)],
        host_required: bool,
    ) -> Checked {
        let refused = |path: &str, reason: String| {
            let verdict = Verdict::new(false, "syntax", &reason);
            let decision = self.record(kind, &host.as_text(), port, Some((method, path)), &verdict);
            Checked {
                verdict,
                decision,
                target: Target {
                    path: path.to_owned(),
                    forwarded: path.to_owned(),
                },
                body: Body::Length(0),
            }
        };
        let shown_path = raw_target.split(['?', '#']).next().unwrap_or(raw_target);
        let target = match crate::path::normalize(raw_target) {
            Ok(target) => target,
            Err(e) => return refused(shown_path, e.to_string()),
        };
        let body = match http::request_body(headers) {
            Ok(body) => body,
            Err(reason) => return refused(&target.path, reason.to_owned()),
        };
        match http::values(headers, "host").as_slice() {
            [] if host_required => {
                return refused(&target.path, "the request has no Host header".to_owned());
            }
            [] => {}
            [one] => {
                let named = std::str::from_utf8(one)
                    .ok()
                    .and_then(|h| split_authority(h, default_port).ok());
                if named.as_ref() != Some(&(host.clone(), port)) {
                    return refused(
                        &target.path,
                        format!(
                            "the Host header names another host than the {} decided on",
                            host.as_text()
                        ),
                    );
                }
            }
            _ => {
                return refused(
                    &target.path,
                    "the request has several Host headers".to_owned(),
                );
            }
        }
        let rules = self.rules();
        let query = target.forwarded.split_once('?').map(|(_, query)| query);
        let verdict = self.decide_showing(
            &rules,
            &Request {
                host,
                port,
                http: Some((method, &target.path)),
            },
            query,
        );
        let mut decision = self.record(
            kind,
            &host.as_text(),
            port,
            Some((method, &target.path)),
            &verdict,
        );
        let mut checked = Checked {
            verdict,
            decision: decision.clone(),
            target,
            body,
        };
        if !decision.allowed {
            return checked;
        }
        if let Some(reason) = overridden_method(headers, &checked.target.forwarded)
            .into_iter()
            .filter(|other| !other.eq_ignore_ascii_case(method))
            .find_map(|other| {
                let verdict = rules.decide(&Request {
                    host,
                    port,
                    http: Some((&other, &checked.target.path)),
                });
                (!verdict.allowed).then(|| {
                    format!(
                        "the request asks the server to take it as `{other}` (a method override), which the rules do not allow: {}",
                        verdict.reason
                    )
                })
            })
        {
            decision.allowed = false;
            decision.reason = reason;
        } else if let Err(reason) = self.check_placeholders(raw_target, headers, &checked.verdict) {
            decision.allowed = false;
            decision.reason = reason;
        }
        checked.decision = decision;
        checked
    }

    /// A request may carry a credential's placeholder only where a rule binds that credential:
    /// not in its target (as sent, or percent-decoded), nor in a header's name or value.
    fn check_placeholders(
        &self,
        target: &str,
        headers: &[(String, Vec<u8>)],
        verdict: &Verdict,
    ) -> Result<(), String> {
        let decoded = percent_decoded(target);
        let places = [target.as_bytes(), decoded.as_slice()].into_iter().chain(
            headers
                .iter()
                .flat_map(|(n, v)| [n.as_bytes(), v.as_slice()]),
        );
        for bytes in places {
            if let Some(secret) = self.secrets.placeholder_in(bytes)
                && verdict.credential.as_deref() != Some(secret.name.as_str())
            {
                return Err(format!(
                    "the request carries the placeholder of credential `{}` to a destination that credential is not bound to",
                    secret.name
                ));
            }
        }
        Ok(())
    }

    /// A plain HTTP request in absolute form, from the proxy port.
    pub(crate) fn forward(&self, mut conn: TcpStream, request: ParsedRequest, via: Via) {
        let kind = via.kind("http");
        let target = request.target.clone();
        let Some(rest) = target.strip_prefix("http://") else {
            let reason = if target.starts_with("https://") {
                "HTTPS goes through CONNECT; set HTTPS_PROXY".to_owned()
            } else {
                format!("`{target}` is not an absolute http:// URL; this is a proxy")
            };
            return self.refuse(&mut conn, kind, &target, reason);
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_owned()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_owned()),
        };
        let (host, port) = match split_authority(authority, 80) {
            Ok(parts) => parts,
            Err(e) => return self.refuse(&mut conn, kind, &target, e.to_string()),
        };
        // The model API's name: the request goes to the upstream, below its path, and names it.
        if let Some(route) = self.inference_route(&host) {
            let mut request = request;
            let default_port = if route.tls.is_some() { 443 } else { 80 };
            let upstream = crate::forward::authority(&route.host, route.port, default_port);
            for (name, value) in &mut request.headers {
                if name == "host" {
                    *value = upstream.clone().into_bytes();
                }
            }
            // The cell's path is made plain first (no `..` may climb out of the prefix), then
            // put below the upstream's.
            let plain = match crate::path::normalize(&path) {
                Ok(target) => target.forwarded,
                Err(e) => return self.refuse(&mut conn, kind, &target, e.to_string()),
            };
            let path = format!("{}{plain}", route.prefix);
            return self.forward_to(
                conn,
                &route.host,
                route.port,
                &path,
                request,
                via,
                false,
                route.tls.clone(),
            );
        }
        self.forward_to(conn, &host, port, &path, request, via, false, None);
    }

    /// A redirected plain-HTTP request, taken with the host its connection was checked for.
    pub(crate) fn transparent_http(&self, conn: TcpStream, host: &Host, early: Vec<u8>, via: Via) {
        let Via::Redirected(destination) = via else {
            return;
        };
        let request = "a redirected request";
        self.request_on(conn, host, destination.port(), early, via, request);
    }

    /// A plain HTTP request a CONNECT tunnel carried (its first bytes `first`), decided and
    /// relayed like a proxied one, for the tunnel's host only.
    pub(crate) fn tunnel_http(&self, conn: TcpStream, host: &Host, port: u16, first: Vec<u8>) {
        let request = "a request in a CONNECT tunnel";
        self.request_on(conn, host, port, first, Via::Proxy, request);
    }

    /// A request on a connection that was decided for `host:port` already (its first bytes
    /// `first`): read, held to origin form (a URL would name a host of its own; `what` says
    /// which request it was, in the refusal), then decided and relayed with its `Host` held to
    /// `host`.
    fn request_on(
        &self,
        mut conn: TcpStream,
        host: &Host,
        port: u16,
        first: Vec<u8>,
        via: Via,
        what: &str,
    ) {
        let until = std::time::Instant::now() + crate::bounds::HEAD_TIMEOUT;
        let read = http::read_request(&mut http::Until {
            inner: first.as_slice().chain(&conn),
            socket: &conn,
            until,
        });
        let Some(request) = http::answer_bad_request(&mut conn, read) else {
            return;
        };
        if !request.target.starts_with('/') {
            let target = format!("{} {}", request.method, request.target);
            let reason = format!("{what} must name a path, not a URL");
            return self.refuse(&mut conn, via.kind("http"), &target, reason);
        }
        let path = request.target.clone();
        self.forward_to(conn, host, port, &path, request, via, true, None);
    }

    /// Checks, decides and relays one request with an origin-form `path` to `host:port`;
    /// with `tls` (an `https://` model API route), the gateway speaks TLS to the upstream
    /// itself, verifying it against the host's roots and the policy's `extra_ca`.
    #[allow(clippy::too_many_arguments)]
    fn forward_to(
        &self,
        mut conn: TcpStream,
        host: &Host,
        port: u16,
        path: &str,
        request: ParsedRequest,
        via: Via,
        host_required: bool,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) {
        let ParsedRequest {
            method,
            headers,
            rest: mut early,
            ..
        } = request;
        let checked = self.check_request(
            via.kind("http"),
            host,
            port,
            80,
            &method,
            path,
            &headers,
            host_required,
        );
        let Checked {
            verdict,
            mut decision,
            target,
            body,
        } = checked;
        let inference = crate::inference::is_inference(&verdict.rule);
        // An `https://` upstream gets its credential inside the TLS the gateway speaks to it
        // (the route), never in plain HTTP a cell sent to its address itself.
        let refused = if inference
            && tls.is_none()
            && self
                .rules()
                .inference
                .as_ref()
                .is_some_and(|route| route.tls.is_some())
        {
            Some(format!(
                "the inference upstream speaks TLS; plain HTTP to {}:{port} would carry its credential in clear (send model requests to the route's name)",
                host.as_text()
            ))
        } else if inference {
            crate::inference::refused_request(&method, &target.path)
        } else {
            None
        };
        if decision.allowed
            && let Some(reason) = refused
        {
            decision.allowed = false;
            decision.reason = reason;
            return self.deny(&mut conn, &decision);
        }
        // A model call off the route is read and counted too, and held to the same budget.
        let read = inference || crate::inference::model_call(&method, &target.path);
        // Its reservation of the budget is given back when it is counted, or on any way out;
        // on a refusal from here on, before the client hears it (a client that went on at
        // once found the budget still held by the call it had been answered for).
        let mut reservation = if read && decision.allowed {
            let _ = conn.set_read_timeout(Some(self.bounds.idle));
            let admitted = self.admit_call(
                &mut decision,
                &mut &conn,
                &headers,
                body,
                &mut early,
                inference,
            );
            match admitted {
                Ok(reservation) => reservation,
                Err(body) => return http::reply(&mut conn, 429, "Too Many Requests", &body),
            }
        } else {
            None
        };
        let Some(upstream) = self.connect_upstream(host, port, &mut decision, via) else {
            drop(reservation.take());
            return self.deny(&mut conn, &decision);
        };
        // A credential goes in clear only to the host's own networks; past them, plain HTTP
        // would carry the secret over networks nobody here vouches for. (Over TLS, the
        // gateway's own to an `https://` upstream or one it intercepted, it is encrypted.)
        let credential = verdict
            .credential
            .as_deref()
            .and_then(|name| self.secrets.get(name));
        if tls.is_none()
            && let Some(secret) = credential
            && let Ok(peer) = upstream.peer_addr()
            && !crate::rules::is_internal(peer.ip())
        {
            let _ = upstream.shutdown(std::net::Shutdown::Both);
            decision.allowed = false;
            decision.reason = format!(
                "credential `{}` goes in clear only to the host's own networks, and {} is outside them; send the request over https:// (the gateway adds the credential inside TLS)",
                secret.name,
                peer.ip()
            );
            drop(reservation.take());
            return self.deny(&mut conn, &decision);
        }
        let started = std::time::Instant::now();
        let default_port = if tls.is_some() { 443 } else { 80 };
        // Over TLS, the same exchange goes through a client session on the upstream socket.
        let mut secured = match tls {
            Some(config) => {
                let session = rustls::pki_types::ServerName::try_from(host.as_text())
                    .map_err(|e| e.to_string())
                    .and_then(|name| {
                        rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())
                    });
                let inner = upstream.try_clone().map_err(|e| e.to_string());
                match (session, inner) {
                    (Ok(session), Ok(inner)) => Some(rustls::StreamOwned::new(
                        session,
                        crate::prefixed::Prefixed::new(Vec::new(), inner, None),
                    )),
                    (Err(e), _) | (_, Err(e)) => {
                        let reason = format!("starting TLS to the upstream: {e}");
                        drop(reservation.take());
                        return self.bad_gateway(&mut conn, &mut decision, reason);
                    }
                }
            }
            None => None,
        };
        let mut plain = &upstream;
        let up: &mut dyn Duplex = match secured.as_mut() {
            Some(stream) => stream,
            None => &mut plain,
        };
        let (mut request_kept, mut response_kept) = (Vec::new(), Vec::new());
        let out = http::upstream_request(
            &method,
            &target.forwarded,
            &authority(host, port, default_port),
            &headers,
            credential,
            read,
        );
        let idle = Some(self.bounds.idle);
        let _ = upstream.set_read_timeout(idle);
        let _ = conn.set_read_timeout(idle);
        // Exactly the announced body, then nothing more from this client.
        let sent = io::Write::write_all(&mut *up, &out).and_then(|()| {
            http::go_on(&mut &conn, &headers, body, &early);
            let mut tap = Tap {
                inner: &mut *up,
                kept: &mut request_kept,
            };
            let to: &mut dyn io::Write = if read { &mut tap } else { tap.inner };
            http::send_body(
                &early,
                &mut &conn,
                &mut &mut *to,
                body,
                credential,
                &self.secrets,
            )
        });
        match sent {
            Ok(n) => decision.bytes_up = out.len() as u64 + n,
            Err(e) if let Some(reason) = placeholder_refusal(&e) => {
                decision.allowed = false;
                decision.reason = reason;
                drop(reservation.take());
                return self.deny(&mut conn, &decision);
            }
            // The body did not get through whole (an upstream that answers early, a client
            // that went away): nothing more goes up, and what the upstream answers comes back.
            Err(e) if secured.is_some() => {
                // Over TLS the session is the only way to the upstream: what failed is said.
                let reason = format!("talking TLS to the upstream: {e}");
                drop(reservation.take());
                return self.bad_gateway(&mut conn, &mut decision, reason);
            }
            Err(_) => {
                let _ = upstream.shutdown(Shutdown::Write);
            }
        }
        let _tracked = self.track(host, port, Some((&method, &target.path)), &conn, &upstream);
        // Whether the response reached the client cut (either side broke off, or the
        // upstream's body ended short of its framing): its end is then a reset.
        let mut cut = false;
        decision.bytes_down = if credential.is_some() || read {
            let mut tap = Tap {
                inner: &conn,
                kept: &mut response_kept,
            };
            let to: &mut dyn io::Write = if read { &mut tap } else { &mut tap.inner };
            let from: &mut dyn Duplex = match secured.as_mut() {
                Some(stream) => stream,
                None => &mut plain,
            };
            let relayed =
                http::relay_inspected(&mut &mut *from, &mut &mut *to, &self.secrets, &method, read);
            match relayed {
                Ok(n) => n,
                Err(ResponseError::Refused(reason)) => {
                    decision.allowed = false;
                    decision.reason = format!("response refused: {reason}");
                    // Given back before the client hears the refusal (the reply is counted
                    // as nothing, as it was).
                    drop(reservation.take());
                    http::reply(
                        &mut conn,
                        502,
                        "Bad Gateway",
                        &json!({ "error": decision.reason }),
                    );
                    0
                }
                Err(ResponseError::Io) => {
                    cut = true;
                    0
                }
            }
        } else if self.secrets.all.is_empty() {
            pump(&upstream, &conn)
        } else {
            let mut scrubbed = Replacer::scrubbing(&conn, &self.secrets);
            let n = io::copy(&mut &upstream, &mut scrubbed).unwrap_or(0);
            let _ = scrubbed.finish();
            n
        };
        // A model call is counted before the client hears the end: its next call, made once
        // this one ended, finds the budget with this one in it.
        if read {
            decision.inference = self.read_exchange(
                &target.path,
                &request_kept,
                &response_kept,
                started.elapsed(),
                inference,
                (decision.bytes_up, decision.bytes_down),
                reservation,
            );
        }
        // A reply cut short ends in a reset: sent on without its length (a model call's,
        // a chunked one), a clean end would make it look whole to the client.
        if !(cut && http::reset_on_close(&conn)) {
            let _ = conn.shutdown(Shutdown::Both);
        }
        self.log_decision(&decision);
    }
}

impl Gateway {
    /// Records `decision` as refused for `reason` (the upstream could not be spoken to) and
    /// answers the client 502 with it.
    fn bad_gateway(&self, conn: &mut TcpStream, decision: &mut crate::Decision, reason: String) {
        decision.allowed = false;
        decision.reason = reason;
        self.log_decision(decision);
        http::reply(
            conn,
            502,
            "Bad Gateway",
            &json!({ "error": decision.reason }),
        );
    }
}

/// A connection both ways: a socket, or a TLS session on one.
trait Duplex: io::Read + io::Write {}
impl<T: io::Read + io::Write> Duplex for T {}

/// `host:port` as a Host header writes it (the port left out where it is the default).
pub(crate) fn authority(host: &Host, port: u16, default_port: u16) -> String {
    let name = match host {
        Host::Ip(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
        other => other.as_text(),
    };
    if port == default_port {
        name
    } else {
        format!("{name}:{port}")
    }
}

/// The methods a request asks the server to take it for instead of its own: the override
/// headers, and a `_method` query parameter.
fn overridden_method(headers: &[(String, Vec<u8>)], target: &str) -> Vec<String> {
    let mut methods: Vec<String> = METHOD_OVERRIDES
        .iter()
        .flat_map(|name| http::values(headers, name))
        .map(|v| String::from_utf8_lossy(v).trim().to_ascii_uppercase())
        .collect();
    if let Some((_, query)) = target.split_once('?') {
        methods.extend(query.split('&').filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            (percent_decoded(key) == b"_method")
                .then(|| String::from_utf8_lossy(&percent_decoded(value)).to_ascii_uppercase())
        }));
    }
    methods
}

/// Every percent-encoding of `text` decoded.
fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// The reason a body was stopped for carrying a placeholder where it is not bound, if that is
/// why `err` came.
pub(crate) fn placeholder_refusal(err: &io::Error) -> Option<String> {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<PlaceholderInBody>())
        .map(ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway of `network` and `secrets` (its record in `log`), serving a proxy port on
    /// 127.0.0.1: the port's address.
    fn serving(
        network: &warden_policy::Network,
        secrets: crate::Secrets,
        log: &std::path::Path,
    ) -> std::net::SocketAddr {
        let gateway = Gateway::new(
            crate::Rules::compile(network).unwrap(),
            log,
            "test",
            secrets,
            None,
            crate::Bounds::default(),
        )
        .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        gateway.serve(listener).unwrap();
        address
    }

    /// A gateway whose one rule asks about `127.0.0.2:9`, serving a proxy port; returns the
    /// port's address and the questions it asks (each answered by the timeout: refused).
    fn asking_gateway() -> (
        std::net::SocketAddr,
        std::sync::Arc<std::sync::Mutex<Vec<crate::approvals::Question>>>,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let place = dir.path();
        let network = warden_policy::Network {
            ask: vec![warden_policy::NetRule {
                host: "127.0.0.2".into(),
                ports: vec![9],
                methods: vec![],
                paths: vec!["/**".into()],
                credential: None,
                dns: warden_policy::NameLookup::Any,
            }],
            ..warden_policy::Network::default()
        };
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = asked.clone();
        let approvals = crate::Approvals::new(
            &place.join("approvals"),
            std::time::Duration::ZERO,
            false,
            move |q| seen.lock().unwrap().push(q.clone()),
        )
        .unwrap();
        let gateway = Gateway::new(
            crate::Rules::compile(&network).unwrap(),
            &place.join("net.jsonl"),
            "test",
            crate::Secrets::default(),
            None,
            crate::Bounds::default(),
        )
        .unwrap()
        .with_approvals(approvals);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        gateway.serve(listener).unwrap();
        (address, asked, dir)
    }

    /// What the cell puts in a path or a query reaches the person asked as printable text that
    /// cannot act on their terminal (C1 `CSI` is U+009B) or pass for something else, and the
    /// query they are asked to let through is shown too.
    #[test]
    fn a_question_shows_the_whole_target_and_nothing_a_terminal_acts_on() {
        use std::io::Write as _;
        let (address, asked, _dir) = asking_gateway();
        let mut conn = TcpStream::connect(address).unwrap();
        let mut request = b"GET http://127.0.0.2:9/api/items".to_vec();
        request.extend_from_slice("\u{9b}2K\u{9b}1G\u{a0}GET\u{202e}safe.test/x".as_bytes());
        request.extend_from_slice(b"?delete=everything HTTP/1.1\r\nHost: 127.0.0.2:9\r\n\r\n");
        conn.write_all(&request).unwrap();
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        let questions = asked.lock().unwrap();
        assert_eq!(questions.len(), 1, "{questions:?}");
        assert_eq!(
            questions[0].request,
            "GET 127.0.0.2:9/api/items%C2%9B2K%C2%9B1G%C2%A0GET%E2%80%AEsafe.test/x?delete=everything"
        );
    }

    /// With an `https://` inference upstream, a cell that sends plain HTTP to the upstream's
    /// address itself (not the route's name) is refused, and the upstream gets no byte: before,
    /// the gateway sent it the request with the API key in its header, in clear.
    #[test]
    fn plain_http_to_an_https_inference_upstream_never_carries_its_key() {
        use std::io::Write as _;
        const KEY: &str = "sk-REAL-SECRET-abcdef0123";
        // The upstream: a TLS port that records whatever comes.
        let upstream = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let port = upstream.local_addr().unwrap().port();
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = got.clone();
        std::thread::spawn(move || {
            for conn in upstream.incoming().flatten() {
                let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                let mut bytes = Vec::new();
                let _ = (&conn).read_to_end(&mut bytes);
                kept.lock().unwrap().extend_from_slice(&bytes);
            }
        });
        let network = warden_policy::Network {
            inference: Some(warden_policy::Inference {
                upstream: format!("https://127.0.0.2:{port}"),
                credential: Some("openai".into()),
                name: "inference.warden".into(),
                max_tokens: None,
            }),
            ..warden_policy::Network::default()
        };
        let secrets = crate::Secrets {
            all: vec![crate::secrets::Secret {
                name: "openai".into(),
                placeholder: "placeholder-abcdefghij".into(),
                value: KEY.into(),
                header: "Authorization".into(),
                format: "Bearer {}".into(),
                env: None,
                in_body: false,
            }],
        };
        let log = std::env::temp_dir().join(format!(
            "warden-forward-inference-{}.jsonl",
            std::process::id()
        ));
        let address = serving(&network, secrets, &log);
        let body = r#"{"model":"m","messages":[]}"#;
        let mut conn = TcpStream::connect(address).unwrap();
        write!(
            conn,
            "POST http://127.0.0.2:{port}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let upstream_got = String::from_utf8_lossy(&got.lock().unwrap()).into_owned();
        assert!(
            !upstream_got.contains(KEY),
            "the key went in clear: {upstream_got}"
        );
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        assert!(answer.contains("speaks TLS"), "{answer}");
        let _ = std::fs::remove_file(&log);
    }

    /// A credential goes in clear only to the host's own networks. In a network namespace of
    /// the test's own, a documentation address (198.51.100.7, outside every internal range)
    /// stands for a host past them: plain HTTP to it is refused and it gets no byte, where an
    /// upstream on 127.0.0.2 gets the request with the secret, as before.
    #[test]
    fn a_credential_never_goes_in_clear_past_the_hosts_networks() {
        use std::io::Write as _;
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: a network namespace of the test's own needs root");
            return;
        }
        const KEY: &str = "s3cr3t-VALUE-0123456789";
        std::thread::spawn(|| {
            // This thread, and every thread and process it starts, in a network of its own.
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            for args in [
                &["link", "set", "lo", "up"][..],
                &["addr", "add", "198.51.100.7/32", "dev", "lo"][..],
            ] {
                let status = std::process::Command::new("ip")
                    .args(args)
                    .status()
                    .unwrap();
                assert!(status.success(), "ip {args:?}");
            }
            // Two upstreams that keep whatever comes, answering each request once.
            let upstream = |address: &str| {
                let listener = std::net::TcpListener::bind(address).unwrap();
                let port = listener.local_addr().unwrap().port();
                let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                let kept = got.clone();
                std::thread::spawn(move || {
                    for mut conn in listener.incoming().flatten() {
                        let mut head = [0u8; 4096];
                        let n = conn.read(&mut head).unwrap_or(0);
                        kept.lock().unwrap().extend_from_slice(&head[..n]);
                        let _ = conn.write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                        );
                    }
                });
                (port, got)
            };
            let (outside, outside_got) = upstream("198.51.100.7:0");
            let (inside, inside_got) = upstream("127.0.0.2:0");
            let rule = |host: &str, port| warden_policy::NetRule {
                host: host.into(),
                ports: vec![port],
                methods: vec![],
                paths: vec![],
                credential: Some("api".into()),
                dns: warden_policy::NameLookup::Any,
            };
            let network = warden_policy::Network {
                allow: vec![rule("198.51.100.7", outside), rule("127.0.0.2", inside)],
                ..warden_policy::Network::default()
            };
            let secrets = crate::Secrets {
                all: vec![crate::secrets::Secret {
                    name: "api".into(),
                    placeholder: "placeholder-abcdefghijk".into(),
                    value: KEY.into(),
                    header: "Authorization".into(),
                    format: "Bearer {}".into(),
                    env: None,
                    in_body: false,
                }],
            };
            let log = std::env::temp_dir()
                .join(format!("warden-forward-clear-{}.jsonl", std::process::id()));
            let address = serving(&network, secrets, &log);
            let get = |to: &str| {
                let mut conn = TcpStream::connect(address).unwrap();
                write!(conn, "GET http://{to}/x HTTP/1.1\r\nHost: {to}\r\n\r\n").unwrap();
                let mut answer = String::new();
                let _ = conn.read_to_string(&mut answer);
                answer
            };
            let refused = get(&format!("198.51.100.7:{outside}"));
            let served = get(&format!("127.0.0.2:{inside}"));
            std::thread::sleep(std::time::Duration::from_millis(200));
            let outside_got = String::from_utf8_lossy(&outside_got.lock().unwrap()).into_owned();
            let inside_got = String::from_utf8_lossy(&inside_got.lock().unwrap()).into_owned();
            assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
            assert!(
                refused.contains("in clear only to the host's own networks"),
                "{refused}"
            );
            assert_eq!(
                outside_got, "",
                "the address past the host's networks got bytes"
            );
            assert!(served.starts_with("HTTP/1.1 200"), "{served}");
            assert!(
                inside_got.contains(&format!("Bearer {KEY}")),
                "{inside_got}"
            );
            let _ = std::fs::remove_file(&log);
        })
        .join()
        .unwrap();
    }

    /// A model call's reply goes to the client without its length (it ends when the gateway
    /// closes, once it has counted it): one the upstream cut short of the length it declared
    /// ends in a reset, never in the clean end that would make it look whole (it had ended
    /// in a FIN, and the client took half a reply for all of it). A whole one ends clean.
    #[test]
    fn a_model_reply_cut_short_reaches_the_client_as_cut() {
        use std::io::Write as _;
        let upstream = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let port = upstream.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut conn in upstream.incoming().flatten() {
                // The request whole (closed with some of it unread, the socket would reset).
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.ends_with(br#""messages":[]}"#) {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let whole = String::from_utf8_lossy(&request).contains("/whole");
                let body = r#"{"id":"c","object":"chat.completion","model":"m","choices":[]}"#;
                let declared = if whole { body.len() } else { body.len() + 100 };
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{body}"
                );
            }
        });
        let network = warden_policy::Network {
            allow: vec![warden_policy::NetRule {
                host: "127.0.0.2".into(),
                ports: vec![port],
                methods: vec![],
                paths: vec![],
                credential: None,
                dns: warden_policy::NameLookup::Any,
            }],
            ..warden_policy::Network::default()
        };
        let log = std::env::temp_dir().join(format!(
            "warden-forward-cut-reply-{}.jsonl",
            std::process::id()
        ));
        let address = serving(&network, crate::Secrets::default(), &log);
        let call = |path: &str| {
            let body = r#"{"model":"m","messages":[]}"#;
            let mut conn = TcpStream::connect(address).unwrap();
            conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            write!(
                conn,
                "POST http://127.0.0.2:{port}{path} HTTP/1.1\r\nHost: 127.0.0.2:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut answer = Vec::new();
            let ended = conn.read_to_end(&mut answer);
            (ended, String::from_utf8_lossy(&answer).into_owned())
        };
        let (ended, answer) = call("/whole/v1/chat/completions");
        assert!(ended.is_ok(), "{ended:?}: {answer}");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with(r#""choices":[]}"#), "{answer}");
        let (ended, answer) = call("/cut/v1/chat/completions");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(
            ended.as_ref().map_err(io::Error::kind).err(),
            Some(io::ErrorKind::ConnectionReset),
            "a reply cut short ended clean: {answer}"
        );
        let _ = std::fs::remove_file(&log);
    }

    #[test]
    fn a_long_target_is_shown_in_part_with_the_count_of_the_rest() {
        let target = format!("/{}", "a".repeat(5000));
        let shown = crate::proxy::shown_target(&target);
        assert!(shown.ends_with("... (2953 bytes more)"), "{shown}");
        assert!(shown.len() < 2100);
    }

    #[test]
    fn method_overrides_are_found_in_headers_and_the_query() {
        let headers = vec![("x-http-method-override".to_owned(), b" delete".to_vec())];
        assert_eq!(overridden_method(&headers, "/x"), vec!["DELETE"]);
        assert_eq!(overridden_method(&[], "/x?a=1&%5Fmethod=put"), vec!["PUT"]);
        assert!(overridden_method(&[], "/x?method=put").is_empty());
    }
}
