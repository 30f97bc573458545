//! The HTTP proxy the cell's clients talk to: CONNECT tunnels and plain HTTP requests in
//! absolute form. One request per connection (a kept-alive connection cannot smuggle a second
//! request to another host), headers bounded in size and time, ambiguous framing refused.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde_json::json;

use crate::host::{Host, split_authority};
use crate::pump::pump;
use crate::record::{Decision, Log};
use crate::rules::{Request, Rules, Verdict};
use crate::secrets::{PlaceholderGuard, PlaceholderInBody, Replacer, Secret, Secrets};
use crate::tls::Interceptor;

const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 100;
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a redirected connection may stay silent before it is decided on its address alone.
const FIRST_BYTES_WAIT: Duration = Duration::from_secs(3);

/// How a connection reached the gateway: through the proxy port (CONNECT or an absolute URL),
/// or redirected by nftables from the cell's namespace on its way to this address, which the
/// gateway has checked and connects to (rather than resolving the name anew).
#[derive(Debug, Clone, Copy)]
enum Via {
    Proxy,
    Redirected(SocketAddr),
}

impl Via {
    /// The kind recorded for a decision: the proxy's own, or `transparent`.
    fn kind(self, proxied: &'static str) -> &'static str {
        match self {
            Self::Proxy => proxied,
            Self::Redirected(_) => "transparent",
        }
    }
}

/// A running gateway for one cell.
#[derive(Debug, Clone)]
pub struct Gateway {
    rules: Arc<RwLock<Arc<Rules>>>,
    log: Arc<Log>,
    cell: String,
    secrets: Arc<Secrets>,
    interceptor: Option<Arc<Interceptor>>,
    active: Arc<Mutex<HashMap<u64, Active>>>,
    next_id: Arc<AtomicU64>,
    /// Addresses handed out by the gateway's DNS, with the name they were resolved from.
    names: Arc<Mutex<crate::dns::Answered>>,
    /// Where `ask` rules put their questions; without it, what they match is refused.
    approvals: Option<Arc<crate::Approvals>>,
    /// How names become addresses: the host's resolver, unless replaced.
    resolver: Lookup,
}

#[derive(Clone)]
struct Lookup(Resolver);

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver")
    }
}

/// Looks a name up, as the host's resolver does (`getaddrinfo`): the addresses, or why none.
pub type Resolver = Arc<dyn Fn(&str) -> io::Result<Vec<std::net::IpAddr>> + Send + Sync>;

fn host_resolver(name: &str) -> io::Result<Vec<std::net::IpAddr>> {
    Ok((name, 0).to_socket_addrs()?.map(|a| a.ip()).collect())
}

/// A connection the gateway let out and still relays: re-decided when the rules change.
#[derive(Debug)]
struct Active {
    host: Host,
    port: u16,
    http: Option<(String, String)>,
    client: TcpStream,
    upstream: TcpStream,
}

/// Removes a connection from the active set when its relay ends.
struct Tracked {
    id: u64,
    active: Arc<Mutex<HashMap<u64, Active>>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Ok(mut active) = self.active.lock() {
            active.remove(&self.id);
        }
    }
}

impl Gateway {
    pub fn new(
        rules: Rules,
        log_path: &Path,
        cell: &str,
        secrets: Secrets,
        interceptor: Option<Interceptor>,
    ) -> io::Result<Self> {
        Ok(Self {
            rules: Arc::new(RwLock::new(Arc::new(rules))),
            log: Arc::new(Log::open(log_path)?),
            cell: cell.to_owned(),
            secrets: Arc::new(secrets),
            interceptor: interceptor.map(Arc::new),
            active: Arc::new(Mutex::new(HashMap::new())),
            next_id: Arc::new(AtomicU64::new(0)),
            names: Arc::new(Mutex::new(crate::dns::Answered::default())),
            approvals: None,
            resolver: Lookup(Arc::new(host_resolver)),
        })
    }

    /// Looks names up with `resolver` instead of the host's resolver.
    pub fn with_resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = Lookup(resolver);
        self
    }

    /// The addresses of `name`, by the gateway's resolver.
    pub(crate) fn lookup(&self, name: &str) -> io::Result<Vec<std::net::IpAddr>> {
        (self.resolver.0)(name)
    }

    /// Lets `ask` rules hold connections for a person's answer.
    pub fn with_approvals(mut self, approvals: crate::Approvals) -> Self {
        self.approvals = Some(Arc::new(approvals));
        self
    }

    /// Decides `request` by `rules`; where an ask rule matches, holds it for a person's answer.
    fn decide(&self, rules: &Rules, request: &Request<'_>) -> Verdict {
        let mut verdict = rules.decide(request);
        if !verdict.ask {
            return verdict;
        }
        let Some(approvals) = &self.approvals else {
            verdict.reason = "an ask rule matched, and this cell has no way to ask".to_owned();
            return verdict;
        };
        let target = match request.http {
            Some((method, path)) => {
                format!("{method} {}:{}{path}", request.host.as_text(), request.port)
            }
            None => format!("connect {}:{}", request.host.as_text(), request.port),
        };
        let (allowed, reason) = approvals.ask(target, &verdict.rule);
        verdict.allowed = allowed;
        verdict.reason = reason;
        verdict
    }

    /// Remembers that the gateway's DNS answered `host` with `ip`.
    pub(crate) fn remember(&self, ip: std::net::IpAddr, host: &Host) {
        if let Ok(mut names) = self.names.lock() {
            names.insert(ip, host);
        }
    }

    pub(crate) fn log_decision(&self, decision: &Decision) {
        self.log.write(decision);
    }

    /// The rules in force now.
    pub(crate) fn rules(&self) -> Arc<Rules> {
        match self.rules.read() {
            Ok(rules) => rules.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replaces the rules while the cell runs. Connections the new rules refuse are closed (both
    /// ends) and recorded; returns how many.
    pub fn replace_rules(&self, rules: Rules) -> usize {
        let rules = Arc::new(rules);
        match self.rules.write() {
            Ok(mut current) => *current = rules.clone(),
            Err(poisoned) => *poisoned.into_inner() = rules.clone(),
        }
        let Ok(active) = self.active.lock() else {
            return 0;
        };
        let mut closed = 0;
        for conn in active.values() {
            let http = conn.http.as_ref().map(|(m, p)| (m.as_str(), p.as_str()));
            let verdict = rules.decide(&Request {
                host: &conn.host,
                port: conn.port,
                http,
            });
            if verdict.allowed || verdict.ask {
                continue;
            }
            let _ = conn.client.shutdown(Shutdown::Both);
            let _ = conn.upstream.shutdown(Shutdown::Both);
            closed += 1;
            let kind = if http.is_some() { "http" } else { "connect" };
            let mut decision = self.record(kind, &conn.host.as_text(), conn.port, http, &verdict);
            decision.reason = format!("closed by a policy change: {}", verdict.reason);
            self.log.write(&decision);
        }
        closed
    }

    /// Keeps a relayed connection reachable for [`Gateway::replace_rules`] while the guard lives.
    fn track(
        &self,
        host: &Host,
        port: u16,
        http: Option<(&str, &str)>,
        client: &TcpStream,
        upstream: &TcpStream,
    ) -> Option<Tracked> {
        let (client, upstream) = (client.try_clone().ok()?, upstream.try_clone().ok()?);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Active {
            host: host.clone(),
            port,
            http: http.map(|(m, p)| (m.to_owned(), p.to_owned())),
            client,
            upstream,
        };
        self.active.lock().ok()?.insert(id, entry);
        Some(Tracked {
            id,
            active: self.active.clone(),
        })
    }

    /// Accepts connections on `listener` (a socket in the cell's network namespace) until it
    /// fails; each connection is served on its own thread, so a slow client stalls nobody else.
    pub fn serve(self, listener: TcpListener) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let gateway = self.clone();
                std::thread::spawn(move || gateway.handle(conn));
            }
        })
    }

    /// Accepts connections redirected from the cell's namespace (clients that ignore the proxy
    /// variables): the destination is the original one, the name the client's TLS server name or
    /// Host header, which must resolve to that destination.
    pub fn serve_transparent(self, listener: TcpListener) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let gateway = self.clone();
                std::thread::spawn(move || gateway.transparent(conn));
            }
        })
    }

    fn transparent(&self, mut conn: TcpStream) {
        let _ = conn.set_nodelay(true);
        let Some(destination) = original_destination(&conn) else {
            return;
        };
        // The client's first bytes name the host (TLS server name or HTTP Host); a client that
        // waits for the server to speak first is decided on the address alone.
        let _ = conn.set_read_timeout(Some(FIRST_BYTES_WAIT));
        let early = first_bytes(&mut conn, Vec::new()).unwrap_or_default();
        let _ = conn.set_read_timeout(Some(IDLE_TIMEOUT));
        let looks_http = early.first().is_some_and(u8::is_ascii_uppercase);
        let (tls, claimed) = match crate::sni::client_hello(&early) {
            crate::sni::Hello::Tls(name) => (true, name),
            _ if looks_http => (false, http_host(&early)),
            _ => (false, None),
        };
        let host = match claimed.as_deref().map(Host::parse) {
            Some(Ok(host)) => host,
            Some(Err(e)) => {
                return self.refuse_transparent(&mut conn, destination, looks_http, e.to_string());
            }
            // No name in the bytes: the name the gateway's DNS resolved to this address, if any.
            None => self
                .names
                .lock()
                .ok()
                .and_then(|names| names.get(destination.ip()))
                .unwrap_or(Host::Ip(destination.ip())),
        };
        let rules = self.rules();
        let port = destination.port();
        if rules.intercepts(&host, port) && (tls || looks_http) {
            // Rules on methods, paths or credentials: each request is decided inside, as for a
            // proxied one, once the name is known to lead where the client connected.
            if let Err(verdict) = self.pinned(&rules, &host, destination) {
                let mut decision =
                    self.record("transparent", &host.as_text(), port, None, &verdict);
                decision.address = Some(destination.to_string());
                return if looks_http {
                    self.deny(&mut conn, &decision)
                } else {
                    self.log.write(&decision)
                };
            }
            let via = Via::Redirected(destination);
            return match &self.interceptor {
                Some(interceptor) if tls => {
                    self.intercept(interceptor, conn, host, port, early, via)
                }
                _ if looks_http => self.transparent_http(conn, &host, early, via),
                _ => {
                    let verdict = Verdict::new(
                        false,
                        "interception",
                        "TLS interception is not set up for this cell",
                    );
                    let mut decision =
                        self.record("transparent", &host.as_text(), port, None, &verdict);
                    decision.address = Some(destination.to_string());
                    self.log.write(&decision);
                }
            };
        }
        let mut verdict = self.decide(
            &rules,
            &Request {
                host: &host,
                port,
                http: None,
            },
        );
        if verdict.allowed && rules.intercepts(&host, port) {
            verdict = Verdict::new(
                false,
                &verdict.rule,
                "this destination's rules decide HTTP requests, and the client spoke neither HTTP nor TLS",
            );
        }
        if verdict.allowed {
            if let Err(refused) = self.pinned(&rules, &host, destination) {
                verdict = refused;
            }
        }
        let mut decision = self.record("transparent", &host.as_text(), port, None, &verdict);
        decision.address = Some(destination.to_string());
        if !verdict.allowed {
            // An HTTP client gets the 403 that says why (and `deny` records it); others are closed.
            if looks_http {
                self.deny(&mut conn, &decision);
            } else {
                self.log.write(&decision);
            }
            return;
        }
        let Ok(upstream) = TcpStream::connect_timeout(&destination, CONNECT_TIMEOUT) else {
            decision.allowed = false;
            decision.reason = format!("connecting to {destination} failed");
            self.log.write(&decision);
            return;
        };
        let _ = upstream.set_nodelay(true);
        self.relay_tunnel(conn, upstream, &host, port, &early, decision);
    }

    /// A redirected connection goes where the client connected: its name (if it has one) must
    /// resolve to that address, and a private, loopback, link-local or metadata address needs a
    /// rule that names it.
    fn pinned(&self, rules: &Rules, host: &Host, destination: SocketAddr) -> Result<(), Verdict> {
        if let Host::Name(name) = host {
            let resolves = self
                .lookup(name.as_str())
                .is_ok_and(|a| a.contains(&destination.ip()));
            if !resolves {
                return Err(Verdict::new(
                    false,
                    "pinning",
                    &format!(
                        "{name} does not resolve to {}, where the client connected",
                        destination.ip()
                    ),
                ));
            }
        }
        if !rules.address_allowed(host, destination.ip(), destination.port()) {
            return Err(Verdict::new(
                false,
                "address",
                &format!(
                    "{} is a private, loopback, link-local or metadata address that no rule names",
                    destination.ip()
                ),
            ));
        }
        Ok(())
    }

    /// A redirected plain-HTTP request to a destination whose rules decide requests: read like
    /// a proxied one, its origin-form target taken with the host it was checked for.
    fn transparent_http(&self, mut conn: TcpStream, host: &Host, early: Vec<u8>, via: Via) {
        let Via::Redirected(destination) = via else {
            return;
        };
        let _ = conn.set_read_timeout(Some(HEAD_TIMEOUT));
        let mut reader = early.as_slice().chain(&conn);
        let read = read_request(&mut reader);
        let Some(ParsedRequest {
            method,
            target: path,
            headers: header_list,
            rest,
        }) = answer_bad_request(&mut conn, read)
        else {
            return;
        };
        if !path.starts_with('/') {
            // A URL would name a host of its own; this connection was checked for one already.
            let target = format!("{method} {path}");
            let reason = "a redirected request must name a path, not a URL".to_owned();
            return self.refuse(&mut conn, "transparent", &target, reason);
        }
        let authority = match host {
            Host::Ip(std::net::IpAddr::V6(ip)) => format!("[{ip}]:{}", destination.port()),
            _ => format!("{}:{}", host.as_text(), destination.port()),
        };
        let target = format!("http://{authority}{path}");
        self.forward(conn, &method, &target, &header_list, rest, via);
    }

    fn refuse_transparent(
        &self,
        conn: &mut TcpStream,
        destination: SocketAddr,
        http: bool,
        reason: String,
    ) {
        let verdict = Verdict::new(false, "syntax", &reason);
        let mut decision = self.record(
            "transparent",
            &destination.ip().to_string(),
            destination.port(),
            None,
            &verdict,
        );
        decision.address = Some(destination.to_string());
        if http {
            self.deny(conn, &decision);
        } else {
            self.log.write(&decision);
        }
    }

    pub(crate) fn record(
        &self,
        kind: &str,
        host: &str,
        port: u16,
        http: Option<(&str, &str)>,
        verdict: &Verdict,
    ) -> Decision {
        Decision {
            time_unix_ms: Decision::now_ms(),
            cell: self.cell.clone(),
            kind: kind.to_owned(),
            host: host.to_owned(),
            port,
            method: http.map(|(m, _)| m.to_owned()),
            path: http.map(|(_, p)| p.to_owned()),
            allowed: verdict.allowed,
            rule: verdict.rule.clone(),
            reason: verdict.reason.clone(),
            address: None,
            bytes_up: 0,
            bytes_down: 0,
        }
    }

    fn handle(&self, mut conn: TcpStream) {
        let _ = conn.set_read_timeout(Some(HEAD_TIMEOUT));
        // Small TLS records and request heads must not wait for delayed acknowledgements.
        let _ = conn.set_nodelay(true);
        let read = read_request(&mut conn);
        let Some(ParsedRequest {
            method,
            target,
            headers: header_list,
            rest,
        }) = answer_bad_request(&mut conn, read)
        else {
            return;
        };
        if method == "CONNECT" {
            self.tunnel(conn, &target, rest);
        } else {
            self.forward(conn, &method, &target, &header_list, rest, Via::Proxy);
        }
    }

    fn deny(&self, conn: &mut TcpStream, decision: &Decision) {
        self.log.write(decision);
        reply(conn, 403, "Forbidden", &refusal_body(decision));
    }

    fn refuse(&self, conn: &mut TcpStream, kind: &str, target: &str, reason: String) {
        let verdict = Verdict::new(false, "syntax", &reason);
        let decision = self.record(kind, target, 0, None, &verdict);
        self.deny(conn, &decision);
    }

    /// Resolves (once) and connects to the first address the rules allow: the connection is
    /// pinned to the address that was checked.
    fn connect(&self, host: &Host, port: u16) -> Result<(TcpStream, SocketAddr), String> {
        let rules = self.rules();
        let candidates: Vec<SocketAddr> = match host {
            Host::Ip(ip) => vec![SocketAddr::new(*ip, port)],
            Host::Name(name) => self
                .lookup(name.as_str())
                .map_err(|e| format!("cannot resolve {name}: {e}"))?
                .into_iter()
                .map(|ip| SocketAddr::new(ip, port))
                .collect(),
        };
        let allowed: Vec<SocketAddr> = candidates
            .iter()
            .copied()
            .filter(|a| rules.address_allowed(host, a.ip(), port))
            .collect();
        if allowed.is_empty() {
            let shown: Vec<String> = candidates.iter().map(|a| a.ip().to_string()).collect();
            return Err(format!(
                "{} resolves to a private, loopback, link-local or metadata address ({}) that no rule names",
                host.as_text(),
                shown.join(", ")
            ));
        }
        let mut last = String::new();
        for addr in allowed {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok((stream, addr));
                }
                Err(e) => last = format!("connecting to {addr}: {e}"),
            }
        }
        Err(last)
    }

    /// Connects to the checked destination of a redirected connection, or to an allowed
    /// address of the host a proxied request names.
    fn connect_via(
        &self,
        host: &Host,
        port: u16,
        via: Via,
    ) -> Result<(TcpStream, SocketAddr), String> {
        match via {
            Via::Proxy => self.connect(host, port),
            Via::Redirected(destination) => {
                TcpStream::connect_timeout(&destination, CONNECT_TIMEOUT)
                    .map(|stream| {
                        let _ = stream.set_nodelay(true);
                        (stream, destination)
                    })
                    .map_err(|e| format!("connecting to {destination}: {e}"))
            }
        }
    }

    /// Connects to the destination of an allowed decision; a refusal (by the rules, or because
    /// of the resolved address) is answered and recorded, and gives `None`.
    fn open_upstream(
        &self,
        conn: &mut TcpStream,
        host: &Host,
        port: u16,
        decision: &mut Decision,
        via: Via,
    ) -> Option<TcpStream> {
        if !decision.allowed {
            self.deny(conn, decision);
            return None;
        }
        match self.connect_via(host, port, via) {
            Ok((upstream, addr)) => {
                decision.address = Some(addr.to_string());
                Some(upstream)
            }
            Err(reason) => {
                decision.allowed = false;
                decision.reason = reason;
                self.deny(conn, decision);
                None
            }
        }
    }

    /// A request may carry a credential's placeholder only where a rule binds that credential.
    fn check_placeholders(
        &self,
        headers: &[(String, Vec<u8>)],
        verdict: &Verdict,
    ) -> Result<(), String> {
        for (_, value) in headers {
            if let Some(secret) = self.secrets.placeholder_in(value) {
                if verdict.credential.as_deref() != Some(secret.name.as_str()) {
                    return Err(format!(
                        "the request carries the placeholder of credential `{}` to a destination that credential is not bound to",
                        secret.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// An opened-up tunnel: TLS with the cell's CA toward the client, one request decided on
    /// method and path, the bound credential added, TLS verified toward the upstream, and the
    /// response scrubbed of secrets on its way back.
    fn intercept(
        &self,
        interceptor: &Interceptor,
        mut conn: TcpStream,
        host: Host,
        port: u16,
        early: Vec<u8>,
        via: Via,
    ) {
        let name = host.as_text();
        if matches!(via, Via::Proxy)
            && conn
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .is_err()
        {
            return;
        }
        let (Ok(config), Ok(inner)) = (interceptor.server_for(&name), conn.try_clone()) else {
            return;
        };
        let Ok(server) = rustls::ServerConnection::new(config) else {
            return;
        };
        let mut client = rustls::StreamOwned::new(server, Prefixed::new(early, inner));
        let ParsedRequest {
            method,
            target: path,
            headers,
            rest,
        } = match read_request(&mut client) {
            Ok(request) => request,
            Err(RequestError::Malformed) => {
                return write_reply(
                    &mut client,
                    400,
                    "Bad Request",
                    &json!({"error": "malformed HTTP request"}),
                );
            }
            Err(RequestError::TooLarge | RequestError::Io) => return,
        };
        let sni = client.conn.server_name().map(str::to_owned);
        let path_only = path.split(['?', '#']).next().unwrap_or("/").to_owned();
        let verdict = self.decide(
            &self.rules(),
            &Request {
                host: &host,
                port,
                http: Some((&method, &path_only)),
            },
        );
        let mut decision = self.record(
            via.kind("https"),
            &name,
            port,
            Some((&method, &path_only)),
            &verdict,
        );
        let refusal = if sni
            .as_deref()
            .is_some_and(|s| s.trim_end_matches('.') != name)
        {
            Some(format!(
                "the TLS server name `{}` is not the CONNECT host `{name}`",
                sni.unwrap_or_default()
            ))
        } else if !path.starts_with('/') {
            Some("the request inside TLS must use a path, not a URL".to_owned())
        } else {
            request_body(&headers)
                .err()
                .map(str::to_owned)
                .or_else(|| self.check_placeholders(&headers, &verdict).err())
        };
        let body = request_body(&headers).unwrap_or(Body::Length(0));
        if let Some(reason) = refusal {
            decision.allowed = false;
            decision.reason = reason;
        }
        let upstream_tcp = if decision.allowed {
            match self.connect_via(&host, port, via) {
                Ok((tcp, addr)) => {
                    decision.address = Some(addr.to_string());
                    Some(tcp)
                }
                Err(reason) => {
                    decision.allowed = false;
                    decision.reason = reason;
                    None
                }
            }
        } else {
            None
        };
        let (Some(upstream_tcp), Ok(server_name)) = (
            upstream_tcp,
            rustls::pki_types::ServerName::try_from(name.clone()),
        ) else {
            self.log.write(&decision);
            write_reply(&mut client, 403, "Forbidden", &refusal_body(&decision));
            client.conn.send_close_notify();
            let _ = client.flush();
            return;
        };
        let _tracked = self.track(
            &host,
            port,
            Some((&method, &path_only)),
            &conn,
            &upstream_tcp,
        );
        let _ = upstream_tcp.set_read_timeout(Some(IDLE_TIMEOUT));
        let Ok(tls) = rustls::ClientConnection::new(interceptor.client(), server_name) else {
            return;
        };
        let mut upstream = rustls::StreamOwned::new(tls, Prefixed::new(Vec::new(), upstream_tcp));
        let credential = verdict
            .credential
            .as_deref()
            .and_then(|n| self.secrets.get(n));
        let out = upstream_request(&method, &path, &headers, credential);
        let sent = upstream.write_all(&out).and_then(|()| {
            send_body(
                &rest,
                &mut client,
                &mut upstream,
                body,
                credential,
                &self.secrets,
            )
        });
        match sent {
            Ok(body) => decision.bytes_up = out.len() as u64 + body,
            Err(e) if let Some(reason) = placeholder_refusal(&e) => {
                decision.allowed = false;
                decision.reason = reason;
                self.log.write(&decision);
                write_reply(&mut client, 403, "Forbidden", &refusal_body(&decision));
                client.conn.send_close_notify();
                let _ = client.flush();
                return;
            }
            Err(e) => {
                decision.allowed = false;
                decision.reason = format!("talking TLS to the upstream: {e}");
                self.log.write(&decision);
                return write_reply(
                    &mut client,
                    502,
                    "Bad Gateway",
                    &json!({"error": decision.reason}),
                );
            }
        }
        let mut scrubbed = Replacer::scrubbing(&mut client, &self.secrets);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // An upstream that closes without close_notify has still sent its whole response.
            let n = match upstream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            decision.bytes_down += n as u64;
            if scrubbed.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        if let Ok(client) = scrubbed.finish() {
            client.conn.send_close_notify();
            let _ = client.flush();
        }
        self.log.write(&decision);
    }

    fn tunnel(&self, mut conn: TcpStream, target: &str, early: Vec<u8>) {
        let (host, port) = match split_authority(target, 443) {
            Ok(parts) => parts,
            Err(e) => return self.refuse(&mut conn, "connect", target, e.to_string()),
        };
        if let Some(interceptor) = &self.interceptor {
            if self.rules().intercepts(&host, port) {
                return self.intercept(interceptor, conn, host, port, early, Via::Proxy);
            }
        }
        let verdict = self.decide(
            &self.rules(),
            &Request {
                host: &host,
                port,
                http: None,
            },
        );
        let mut decision = self.record("connect", &host.as_text(), port, None, &verdict);
        let Some(upstream) = self.open_upstream(&mut conn, &host, port, &mut decision, Via::Proxy)
        else {
            return;
        };
        if conn
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .is_err()
        {
            return;
        }
        self.relay_tunnel(conn, upstream, &host, port, &early, decision);
    }

    /// Relays a tunnel the gateway let out until either side ends it, then records it with the
    /// bytes each way (and the reason, where the relay refused the client's first bytes).
    fn relay_tunnel(
        &self,
        conn: TcpStream,
        upstream: TcpStream,
        host: &Host,
        port: u16,
        early: &[u8],
        mut decision: Decision,
    ) {
        let _tracked = self.track(host, port, None, &conn, &upstream);
        let (up, down, refused) = tunnel_bytes(conn, upstream, early, host.as_text());
        decision.bytes_up = up;
        decision.bytes_down = down;
        if let Some(reason) = refused {
            decision.allowed = false;
            decision.reason = reason;
        }
        self.log.write(&decision);
    }

    fn forward(
        &self,
        mut conn: TcpStream,
        method: &str,
        target: &str,
        headers: &[(String, Vec<u8>)],
        early: Vec<u8>,
        via: Via,
    ) {
        let kind = via.kind("http");
        let Some(rest) = target.strip_prefix("http://") else {
            let reason = if target.starts_with("https://") {
                "HTTPS goes through CONNECT; set HTTPS_PROXY".to_owned()
            } else {
                format!("`{target}` is not an absolute http:// URL; this is a proxy")
            };
            return self.refuse(&mut conn, kind, target, reason);
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = match split_authority(authority, 80) {
            Ok(parts) => parts,
            Err(e) => return self.refuse(&mut conn, kind, target, e.to_string()),
        };
        let body = match request_body(headers) {
            Ok(body) => body,
            Err(reason) => return self.refuse(&mut conn, kind, target, reason.to_owned()),
        };
        let header = |name: &str| {
            headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
                .collect::<Vec<_>>()
        };
        if let Some(host_header) = header("host").first() {
            let named = std::str::from_utf8(host_header)
                .ok()
                .and_then(|h| split_authority(h, 80).ok());
            if named.as_ref() != Some(&(host.clone(), port)) {
                return self.refuse(
                    &mut conn,
                    kind,
                    target,
                    "the Host header names another host than the URL".to_owned(),
                );
            }
        }
        let path_only = path.split(['?', '#']).next().unwrap_or("/");
        let verdict = self.decide(
            &self.rules(),
            &Request {
                host: &host,
                port,
                http: Some((method, path_only)),
            },
        );
        let mut decision = self.record(
            kind,
            &host.as_text(),
            port,
            Some((method, path_only)),
            &verdict,
        );
        if let Err(reason) = self.check_placeholders(headers, &verdict) {
            decision.allowed = false;
            decision.reason = reason;
        }
        let Some(mut upstream) = self.open_upstream(&mut conn, &host, port, &mut decision, via)
        else {
            return;
        };
        let credential = verdict
            .credential
            .as_deref()
            .and_then(|name| self.secrets.get(name));
        let out = upstream_request(method, path, headers, credential);
        let _ = upstream.set_read_timeout(Some(IDLE_TIMEOUT));
        let _ = conn.set_read_timeout(Some(IDLE_TIMEOUT));
        // Exactly the announced body, then nothing more from this client.
        let sent = upstream.write_all(&out).and_then(|()| {
            send_body(
                &early,
                &mut &conn,
                &mut upstream,
                body,
                credential,
                &self.secrets,
            )
        });
        let body_bytes = match sent {
            Ok(n) => n,
            Err(e) => {
                if let Some(reason) = placeholder_refusal(&e) {
                    decision.allowed = false;
                    decision.reason = reason;
                    self.deny(&mut conn, &decision);
                }
                return;
            }
        };
        decision.bytes_up = out.len() as u64 + body_bytes;
        let _tracked = self.track(&host, port, Some((method, path_only)), &conn, &upstream);
        decision.bytes_down = if self.secrets.all.is_empty() {
            pump(&upstream, &conn)
        } else {
            let mut scrubbed = Replacer::scrubbing(&conn, &self.secrets);
            let n = io::copy(&mut upstream, &mut scrubbed).unwrap_or(0);
            let _ = scrubbed.finish();
            n
        };
        let _ = conn.shutdown(Shutdown::Both);
        self.log.write(&decision);
    }
}

/// Reads the client's first bytes in a tunnel, up to a whole TLS ClientHello (which a client
/// sends at once), so that its server name can be checked before anything is relayed.
fn first_bytes(conn: &mut TcpStream, mut bytes: Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 4096];
    while crate::sni::client_hello(&bytes) == crate::sni::Hello::Incomplete && bytes.len() < 20_000
    {
        match conn.read(&mut chunk) {
            Ok(0) => return if bytes.is_empty() { None } else { Some(bytes) },
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(_) => return None,
        }
    }
    Some(bytes)
}

/// The host of the Host header of a request head (without the port).
fn http_host(head: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(head).ok()?;
    let value = text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("host")
            .then(|| value.trim().to_owned())
    })?;
    split_authority(&value, 80)
        .ok()
        .map(|(host, _)| host.as_text())
}

/// How a request's body is framed. Ambiguous framing is how requests are smuggled past a
/// proxy, so it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Length(u64),
    Chunked,
}

fn request_body(headers: &[(String, Vec<u8>)]) -> Result<Body, &'static str> {
    let values = |name: &str| {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect::<Vec<_>>()
    };
    let lengths = values("content-length");
    let encodings = values("transfer-encoding");
    match (lengths.as_slice(), encodings.as_slice()) {
        ([], []) => Ok(Body::Length(0)),
        ([one], []) => std::str::from_utf8(one)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map(Body::Length)
            .ok_or("invalid Content-Length"),
        ([], [te]) if te.eq_ignore_ascii_case(b"chunked") => Ok(Body::Chunked),
        ([], _) => Err("a Transfer-Encoding other than a single `chunked` is refused"),
        (_, []) => Err("several Content-Length headers: refused as request smuggling"),
        _ => Err("both Content-Length and Transfer-Encoding: refused as request smuggling"),
    }
}

/// Copies the request body; a credential bound with `in_body` gets its secret in place of its
/// placeholder on the way (equal lengths: the framing holds).
fn send_body(
    early: &[u8],
    client: &mut impl Read,
    upstream: &mut impl Write,
    body: Body,
    credential: Option<&Secret>,
    secrets: &Secrets,
) -> io::Result<u64> {
    // Another credential's placeholder stops the body; the bound one's (with `in_body`)
    // becomes the secret before the guard sees it.
    let mut guarded = PlaceholderGuard::new(upstream, secrets, credential.map(|c| c.name.as_str()));
    match credential.filter(|c| c.in_body) {
        Some(secret) => {
            let mut injecting = Replacer::injecting(&mut guarded, secret);
            let sent = copy_body(early, client, &mut injecting, body)?;
            injecting.finish()?;
            Ok(sent)
        }
        None => copy_body(early, client, &mut guarded, body),
    }
}

/// The reason a body was stopped for carrying a placeholder where it is not bound, if that is
/// why `err` came.
fn placeholder_refusal(err: &io::Error) -> Option<String> {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<PlaceholderInBody>())
        .map(ToString::to_string)
}

/// The JSON body of a 403: what was refused and why, so that an agent can correct itself.
fn refusal_body(decision: &Decision) -> serde_json::Value {
    json!({
        "error": "blocked by the warden egress policy",
        "destination": format!("{}:{}", decision.host, decision.port),
        "method": decision.method,
        "path": decision.path,
        "rule": decision.rule,
        "reason": decision.reason,
    })
}

/// Copies exactly the request body that `body` announces, starting with the bytes already read
/// past the head; for a chunked body, up to its last chunk and trailers (so that nothing the
/// client sends after it can reach the upstream as a second request).
fn copy_body(
    early: &[u8],
    client: &mut impl Read,
    upstream: &mut impl Write,
    body: Body,
) -> io::Result<u64> {
    use std::io::BufRead as _;
    match body {
        Body::Length(length) => {
            let early_body = &early[..early.len().min(length as usize)];
            upstream.write_all(early_body)?;
            let remaining = length - early_body.len() as u64;
            io::copy(&mut client.take(remaining), upstream).map(|n| n + early_body.len() as u64)
        }
        Body::Chunked => {
            let mut reader = io::BufReader::new(io::Cursor::new(early.to_vec()).chain(client));
            let mut total = 0u64;
            let mut line = Vec::new();
            let read_line = |reader: &mut io::BufReader<_>, line: &mut Vec<u8>| -> io::Result<()> {
                line.clear();
                (&mut *reader).take(4096).read_until(b'\n', line)?;
                if !line.ends_with(b"\r\n") {
                    return Err(io::Error::other("malformed chunked body"));
                }
                Ok(())
            };
            loop {
                read_line(&mut reader, &mut line)?;
                let size_text =
                    std::str::from_utf8(&line[..line.len() - 2]).map_err(io::Error::other)?;
                let size =
                    u64::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                        .map_err(|_| io::Error::other("malformed chunk size"))?;
                upstream.write_all(&line)?;
                total += line.len() as u64;
                if size == 0 {
                    // Trailers, up to the empty line.
                    loop {
                        read_line(&mut reader, &mut line)?;
                        upstream.write_all(&line)?;
                        total += line.len() as u64;
                        if line == b"\r\n" {
                            return Ok(total);
                        }
                    }
                }
                total += io::copy(&mut (&mut reader).take(size), upstream)?;
                read_line(&mut reader, &mut line)?;
                if line != b"\r\n" {
                    return Err(io::Error::other("a chunk is longer than its size"));
                }
                upstream.write_all(&line)?;
                total += 2;
            }
        }
    }
}

/// The request sent upstream: origin form, no proxy or hop-by-hop headers, `Connection:
/// close`, and the bound credential (if any) in its header instead of whatever the cell sent.
fn upstream_request(
    method: &str,
    path: &str,
    headers: &[(String, Vec<u8>)],
    credential: Option<&Secret>,
) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    let injected = credential.map(|c| c.header.to_ascii_lowercase());
    for (name, value) in headers {
        if name.starts_with("proxy-")
            || name == "connection"
            || name == "keep-alive"
            || Some(name) == injected.as_ref()
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if let Some(secret) = credential {
        out.extend_from_slice(
            format!(
                "{}: {}\r\n",
                secret.header,
                secret.format.replace("{}", &secret.value)
            )
            .as_bytes(),
        );
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// Reads from an already-read prefix, then from the stream; writes go to the stream. Reads
/// from the stream are made ahead, into a buffer that grows (16 KiB to 1 MiB) while they fill
/// it: rustls asks for 4 KiB at a time, which on a bulk transfer would be a system call for
/// every TLS record.
struct Prefixed {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    inner: TcpStream,
}

impl Prefixed {
    const FIRST_AHEAD: usize = 16 * 1024;
    const MAX_AHEAD: usize = 1 << 20;

    fn new(early: Vec<u8>, inner: TcpStream) -> Self {
        let end = early.len();
        let mut buf = early;
        buf.resize(end.max(Self::FIRST_AHEAD), 0);
        Self {
            buf,
            start: 0,
            end,
            inner,
        }
    }
}

impl Read for Prefixed {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.start == self.end {
            let n = self.inner.read(&mut self.buf)?;
            (self.start, self.end) = (0, n);
            if n == self.buf.len() && n < Self::MAX_AHEAD {
                self.buf.resize(n * 2, 0);
            }
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

impl Write for Prefixed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

enum HeadError {
    TooLarge,
    Io,
}

/// Reads up to the end of the request head; returns the head and any bytes read past it.
fn read_head(conn: &mut impl Read) -> Result<(Vec<u8>, Vec<u8>), HeadError> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return Err(HeadError::Io),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A request head, read and parsed: method, target as sent, headers with lowercase names, and
/// the bytes read past the head.
struct ParsedRequest {
    method: String,
    target: String,
    headers: Vec<(String, Vec<u8>)>,
    rest: Vec<u8>,
}

enum RequestError {
    TooLarge,
    Malformed,
    Io,
}

/// Reads and parses a request head (at most 64 KiB, 100 headers).
fn read_request(conn: &mut impl Read) -> Result<ParsedRequest, RequestError> {
    let (head, rest) = read_head(conn).map_err(|e| match e {
        HeadError::TooLarge => RequestError::TooLarge,
        HeadError::Io => RequestError::Io,
    })?;
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let parsed = request.parse(&head);
    let (Ok(httparse::Status::Complete(_)), Some(method), Some(target)) =
        (parsed, request.method, request.path)
    else {
        return Err(RequestError::Malformed);
    };
    Ok(ParsedRequest {
        method: method.to_owned(),
        target: target.to_owned(),
        headers: request
            .headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
            .collect(),
        rest,
    })
}

/// The request, or `None` once a client that sent an oversized or malformed head has its answer
/// (one that went away gets none).
fn answer_bad_request(
    conn: &mut TcpStream,
    read: Result<ParsedRequest, RequestError>,
) -> Option<ParsedRequest> {
    match read {
        Ok(request) => Some(request),
        Err(RequestError::TooLarge) => {
            reply(
                conn,
                431,
                "Request Header Fields Too Large",
                &json!({"error": "request headers larger than 64 KiB"}),
            );
            None
        }
        Err(RequestError::Malformed) => {
            reply(
                conn,
                400,
                "Bad Request",
                &json!({"error": "malformed HTTP request"}),
            );
            None
        }
        Err(RequestError::Io) => None,
    }
}

fn reply(conn: &mut TcpStream, code: u16, text: &str, body: &serde_json::Value) {
    write_reply(conn, code, text, body);
    let _ = conn.shutdown(Shutdown::Both);
}

/// Writes a complete JSON response (over plain TCP or TLS).
fn write_reply(conn: &mut impl Write, code: u16, text: &str, body: &serde_json::Value) {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 {code} {text}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nX-Warden-Egress: refused\r\n\r\n",
        body.len()
    );
    let _ = conn
        .write_all(head.as_bytes())
        .and_then(|()| conn.write_all(body.as_bytes()))
        .and_then(|()| conn.flush());
}

/// Relays a tunnel both ways. The client's first bytes are held back until they show whether
/// they are a TLS ClientHello, whose server name must be `expected` (whenever they come: the
/// server may speak first). Returns the bytes each way, and the refusal if the name differed.
fn tunnel_bytes(
    client: TcpStream,
    upstream: TcpStream,
    early: &[u8],
    expected: String,
) -> (u64, u64, Option<String>) {
    let _ = client.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = upstream.set_read_timeout(Some(IDLE_TIMEOUT));
    let (Ok(mut client_read), Ok(mut upstream_write)) = (client.try_clone(), upstream.try_clone())
    else {
        return (0, 0, None);
    };
    let early = early.to_vec();
    let up = std::thread::spawn(move || {
        let Some(first) = first_bytes(&mut client_read, early) else {
            let _ = upstream_write.shutdown(Shutdown::Write);
            return (0, None);
        };
        if let crate::sni::Hello::Tls(Some(name)) = crate::sni::client_hello(&first) {
            if name.trim_end_matches('.') != expected {
                let _ = upstream_write.shutdown(Shutdown::Both);
                let _ = client_read.shutdown(Shutdown::Both);
                return (
                    0,
                    Some(format!(
                        "the TLS server name `{name}` is not the CONNECT host `{expected}`"
                    )),
                );
            }
        }
        let mut sent = 0u64;
        if upstream_write.write_all(&first).is_ok() {
            sent = first.len() as u64 + pump(&client_read, &upstream_write);
        }
        let _ = upstream_write.shutdown(Shutdown::Write);
        (sent, None)
    });
    let (upstream_read, client_write) = (upstream, client);
    let down = pump(&upstream_read, &client_write);
    let _ = client_write.shutdown(Shutdown::Write);
    let (up, refused) = up.join().unwrap_or((0, None));
    (up, down, refused)
}

/// Where a redirected connection was going before nftables sent it to the gateway.
fn original_destination(conn: &TcpStream) -> Option<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    if conn.local_addr().ok()?.is_ipv6() {
        let original = getsockopt(conn, sockopt::Ip6tOriginalDst).ok()?;
        let ip = Ipv6Addr::from(original.sin6_addr.s6_addr);
        Some(SocketAddr::new(
            IpAddr::V6(ip),
            u16::from_be(original.sin6_port),
        ))
    } else {
        let original = getsockopt(conn, sockopt::OriginalDst).ok()?;
        let ip = Ipv4Addr::from(u32::from_be(original.sin_addr.s_addr));
        Some(SocketAddr::new(
            IpAddr::V4(ip),
            u16::from_be(original.sin_port),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_prefixed_stream_gives_the_prefix_then_the_stream_whole_and_reads_ahead() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        let data: Vec<u8> = (0..5u32 << 20).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let feeder = std::thread::spawn(move || {
            writer.write_all(&sent).unwrap();
        });
        let mut stream = Prefixed::new(b"early bytes|".to_vec(), reader);
        let mut received = Vec::new();
        // rustls's way: 4 KiB at a time, and an empty read that must not wait.
        let mut chunk = [0u8; 4096];
        assert_eq!(stream.read(&mut []).unwrap(), 0);
        while received.len() < 12 + data.len() {
            let n = stream.read(&mut chunk).unwrap();
            assert!(n > 0, "the stream ended early");
            received.extend_from_slice(&chunk[..n]);
        }
        feeder.join().unwrap();
        assert_eq!(&received[..12], b"early bytes|");
        assert!(received[12..] == data[..], "the stream's bytes differ");
        assert!(
            stream.buf.len() > Prefixed::FIRST_AHEAD,
            "no read was made ahead"
        );
    }

    #[test]
    fn framing_is_unambiguous_or_refused() {
        assert_eq!(request_body(&headers(&[])), Ok(Body::Length(0)));
        assert_eq!(
            request_body(&headers(&[("content-length", "5")])),
            Ok(Body::Length(5))
        );
        assert_eq!(
            request_body(&headers(&[("transfer-encoding", "Chunked")])),
            Ok(Body::Chunked)
        );
        for bad in [
            headers(&[("content-length", "5"), ("transfer-encoding", "chunked")]),
            headers(&[("content-length", "5"), ("content-length", "6")]),
            headers(&[("transfer-encoding", "gzip, chunked")]),
            headers(&[("content-length", "five")]),
        ] {
            assert!(request_body(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_chunked_body_ends_at_its_last_chunk() {
        let body = b"4\r\nwiki\r\n5;ext=1\r\npedia\r\n0\r\nTrailer: x\r\n\r\n";
        let smuggled = b"GET http://evil.test/ HTTP/1.1\r\n\r\n";
        let (early, rest) = body.split_at(7);
        let mut input = rest.to_vec();
        input.extend_from_slice(smuggled);
        let mut out = Vec::new();
        let copied = copy_body(early, &mut input.as_slice(), &mut out, Body::Chunked).unwrap();
        assert_eq!(out, body);
        assert_eq!(copied, body.len() as u64);
        let mut sink = Vec::new();
        let lying = b"3\r\ntoo long\r\n0\r\n\r\n";
        assert!(copy_body(b"", &mut lying.as_slice(), &mut sink, Body::Chunked).is_err());
    }
}
