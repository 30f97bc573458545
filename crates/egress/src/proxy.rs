//! The gateway of one cell: its rules, record, credentials and bounds, the listeners it serves,
//! and the steps every kind of connection shares (decide, resolve and connect to the checked
//! address, refuse with a reason). The kinds themselves are in their own modules: plain HTTP
//! requests (`forward`), CONNECT tunnels (`tunnel`), opened-up TLS (`intercept`) and
//! connections redirected from clients that ignore the proxy variables (`transparent`).

use std::collections::HashMap;
use std::io::{self, Write as _};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use nix::libc::{EMFILE, ENFILE, ENOBUFS, ENOMEM};
use serde_json::json;

use crate::bounds::{Bounds, Slot, Slots};
use crate::host::Host;
use crate::http::reply;
use crate::record::{Decision, Log};
use crate::rules::{Request, Rules, Verdict};
use crate::secrets::Secrets;
use crate::tls::Interceptor;

pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How a connection reached the gateway: through the proxy port (CONNECT or an absolute URL),
/// or redirected by nftables from the cell's namespace on its way to this address, which the
/// gateway has checked and connects to (rather than resolving the name anew).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Via {
    Proxy,
    Redirected(SocketAddr),
}

impl Via {
    /// The kind recorded for a decision: the proxy's own, or `transparent`.
    pub(crate) fn kind(self, proxied: &'static str) -> &'static str {
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
    pub(crate) secrets: Arc<Secrets>,
    pub(crate) interceptor: Option<Arc<Interceptor>>,
    active: Arc<Mutex<HashMap<u64, Active>>>,
    next_id: Arc<AtomicU64>,
    /// Addresses handed out by the gateway's DNS, with the name they were resolved from.
    pub(crate) names: Arc<Mutex<crate::names::Answered>>,
    /// Names looked up for connections the rules allowed, with what the lookup returned (the
    /// answers for rules with `dns: connected`).
    pub(crate) looked_up: Arc<Mutex<crate::names::LookedUp>>,
    /// Where `ask` rules put their questions; without it, what they match is refused.
    approvals: Option<Arc<crate::Approvals>>,
    /// How names become addresses: the host's resolver, unless replaced.
    resolver: Lookup,
    slots: Arc<Slots>,
    /// The threads that serve connections (and a tunnel's second direction), kept between them.
    pub(crate) workers: Arc<crate::workers::Workers>,
    pub(crate) bounds: Bounds,
    /// Tokens the cell's model exchanges used, and those reserved by the calls under way
    /// (`network.inference.max_tokens` bounds them together).
    pub(crate) inference_budget: Arc<Mutex<crate::inference::Budget>>,
}

#[derive(Clone)]
struct Lookup(Resolver);

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver")
    }
}

/// Looks a name up, as the host's resolver does (`getaddrinfo`): the addresses, or why none.
pub type Resolver = Arc<dyn Fn(&str) -> io::Result<Vec<IpAddr>> + Send + Sync>;

fn host_resolver(name: &str) -> io::Result<Vec<IpAddr>> {
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
pub(crate) struct Tracked {
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
        bounds: Bounds,
    ) -> io::Result<Self> {
        Ok(Self {
            rules: Arc::new(RwLock::new(Arc::new(rules))),
            log: Log::open(log_path, cell, bounds.records)?,
            cell: cell.to_owned(),
            secrets: Arc::new(secrets),
            interceptor: interceptor.map(Arc::new),
            active: Arc::new(Mutex::new(HashMap::new())),
            next_id: Arc::new(AtomicU64::new(0)),
            names: Arc::new(Mutex::new(crate::names::Answered::default())),
            looked_up: Arc::new(Mutex::new(crate::names::LookedUp::default())),
            approvals: None,
            resolver: Lookup(Arc::new(host_resolver)),
            slots: Slots::new(bounds.connections),
            workers: crate::workers::Workers::new("egress-conn"),
            bounds,
            inference_budget: Arc::default(),
        })
    }

    /// Looks names up with `resolver` instead of the host's resolver.
    pub fn with_resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = Lookup(resolver);
        self
    }

    /// The addresses of `name`, by the gateway's resolver.
    pub(crate) fn lookup(&self, name: &str) -> io::Result<Vec<IpAddr>> {
        (self.resolver.0)(name)
    }

    /// Lets `ask` rules hold connections for a person's answer.
    pub fn with_approvals(mut self, approvals: crate::Approvals) -> Self {
        self.approvals = Some(Arc::new(approvals));
        self
    }

    /// Decides `request` by `rules`; where an ask rule matches, holds it for a person's answer.
    pub(crate) fn decide(&self, rules: &Rules, request: &Request<'_>) -> Verdict {
        self.decide_showing(rules, request, None)
    }

    /// [`Gateway::decide`] for a request whose target has a `query` (after `?`): a person asked
    /// about it sees the query too, since it goes upstream with what they allow.
    pub(crate) fn decide_showing(
        &self,
        rules: &Rules,
        request: &Request<'_>,
        query: Option<&str>,
    ) -> Verdict {
        let mut verdict = rules.decide(request);
        // A deny rule that names an address (or a network) refuses a name that leads there:
        // the name is resolved to see (the connection resolves it again, and keeps away from
        // such addresses itself, see `connect`).
        if (verdict.allowed || verdict.ask)
            && rules.denies_addresses()
            && let Host::Name(name) = request.host
            && let Ok(addresses) = self.lookup(name)
            && let Some((ip, rule)) = addresses
                .iter()
                .find_map(|ip| rules.denied_at(request, *ip).map(|rule| (ip, rule)))
        {
            return Verdict::new(
                false,
                rule,
                &format!("denied by rule: {name} resolves to {ip}, which the rule names"),
            );
        }
        if !verdict.ask {
            return verdict;
        }
        let Some(approvals) = &self.approvals else {
            verdict.reason = "an ask rule matched, and this cell has no way to ask".to_owned();
            return verdict;
        };
        let target = match request.http {
            Some((method, path)) => {
                let target = match query {
                    Some(query) => format!("{path}?{query}"),
                    None => path.to_owned(),
                };
                format!(
                    "{method} {}:{}{}",
                    request.host.as_text(),
                    request.port,
                    shown_target(&target)
                )
            }
            None => format!("connect {}:{}", request.host.as_text(), request.port),
        };
        let destination = format!("{}:{}", request.host.as_text(), request.port);
        let (allowed, reason) = approvals.ask(target, destination, &verdict.rule);
        verdict.allowed = allowed;
        verdict.reason = reason;
        verdict
    }

    /// Whether a connection to `host:port` must be opened up so that each request in it is
    /// decided: a rule on methods, paths or credentials covers the host (`Rules::intercepts`),
    /// or a deny rule on methods or paths names an address it resolves to.
    pub(crate) fn opens_up(&self, rules: &Rules, host: &Host, port: u16) -> bool {
        if rules.intercepts(host, port) {
            return true;
        }
        match host {
            Host::Ip(ip) => rules.decides_requests_at(port, *ip),
            Host::Name(name) => {
                rules.decides_requests_at_addresses()
                    && self
                        .lookup(name)
                        .is_ok_and(|ips| ips.iter().any(|ip| rules.decides_requests_at(port, *ip)))
            }
        }
    }

    /// Remembers that the gateway's DNS answered `host` with `ip`.
    pub(crate) fn remember(&self, ip: IpAddr, host: &Host) {
        if let Ok(mut names) = self.names.lock() {
            names.insert(ip, host);
        }
    }

    pub(crate) fn log_decision(&self, decision: &Decision) {
        self.log.write(decision);
    }

    /// Writes the record's last lines (what the last second summed up, what the quota kept
    /// out), once the cell has ended.
    pub fn close_record(&self) {
        self.log.close();
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
    pub(crate) fn track(
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
    /// fails; each connection is served on a thread of its own (one that served an earlier
    /// connection, where one waits), up to the cell's connection limit.
    pub fn serve(self, listener: TcpListener) -> io::Result<()> {
        Acceptor::start(self, listener, true, |gateway, conn, _| {
            gateway.handle(conn)
        })
    }

    /// Accepts connections redirected from the cell's namespace (clients that ignore the proxy
    /// variables): the destination is the original one, the name the client's TLS server name or
    /// Host header, which must resolve to that destination.
    pub fn serve_transparent(self, listener: TcpListener) -> io::Result<()> {
        Acceptor::start(self, listener, false, |gateway, conn, ipv6| {
            gateway.transparent(conn, ipv6);
        })
    }

    /// Refuses a connection past the cell's limit, without waiting on it.
    fn refuse_busy(&self, mut conn: TcpStream, proxy: bool, ipv6: bool) {
        let reason = format!(
            "the cell has {} connections open through its gateway, its limit (limits.connections)",
            self.slots.max()
        );
        let verdict = Verdict::new(false, "limits.connections", &reason);
        let kind = if proxy { "proxy" } else { "transparent" };
        let mut decision = self.record(kind, "", 0, None, &verdict);
        if !proxy && let Some(destination) = crate::redirected::original_destination(&conn, ipv6) {
            decision.host = destination.ip().to_string();
            decision.port = destination.port();
        }
        self.log.write(&decision);
        if proxy {
            // The client may not read: one attempt, never a wait.
            let _ = conn.set_nonblocking(true);
            let body = json!({
                "error": "blocked by the warden egress policy",
                "rule": "limits.connections",
                "reason": reason,
            })
            .to_string();
            let _ = write!(
                conn,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nRetry-After: 1\r\nX-Warden-Egress: refused\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.shutdown(Shutdown::Both);
        } else {
            // A reset: the client learns at once that this connection will not be served.
            crate::http::reset_on_close(&conn);
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
            repeats: 0,
            inference: None,
        }
    }

    /// A connection to the proxy port (`TCP_NODELAY` on: see `Acceptor`).
    fn handle(&self, mut conn: TcpStream) {
        let until = std::time::Instant::now() + crate::bounds::HEAD_TIMEOUT;
        let read = crate::http::read_request(&mut crate::http::Until {
            inner: &conn,
            socket: &conn,
            until,
        });
        let Some(request) = crate::http::answer_bad_request(&mut conn, read) else {
            return;
        };
        if request.method == "CONNECT" {
            self.tunnel(conn, &request.target, request.rest);
        } else {
            self.forward(conn, request, Via::Proxy);
        }
    }

    pub(crate) fn deny(&self, conn: &mut TcpStream, decision: &Decision) {
        self.log.write(decision);
        reply(conn, 403, "Forbidden", &refusal_body(decision));
    }

    pub(crate) fn refuse(&self, conn: &mut TcpStream, kind: &str, target: &str, reason: String) {
        let verdict = Verdict::new(false, "syntax", &reason);
        let decision = self.record(kind, target, 0, None, &verdict);
        self.deny(conn, &decision);
    }

    /// Resolves (once) and connects to the first address the rules allow for the request
    /// `http` (method and path, where the connection carries one): the connection is pinned to
    /// the address that was checked. The name's addresses are remembered for the cell's DNS
    /// (rules with `dns: connected` answer only from them).
    pub(crate) fn connect(
        &self,
        host: &Host,
        port: u16,
        http: Option<(&str, &str)>,
    ) -> Result<(TcpStream, SocketAddr), String> {
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
        // Never an address a deny rule names for this request, whatever the name resolved to
        // when the request was decided.
        let request = Request { host, port, http };
        let denied: Vec<(SocketAddr, &str)> = candidates
            .iter()
            .filter_map(|a| rules.denied_at(&request, a.ip()).map(|rule| (*a, rule)))
            .collect();
        let allowed: Vec<SocketAddr> = candidates
            .iter()
            .copied()
            .filter(|a| rules.address_allowed(host, a.ip(), port))
            .filter(|a| denied.iter().all(|(d, _)| d != a))
            .collect();
        if let (true, Some((address, rule))) = (allowed.is_empty(), denied.first()) {
            return Err(format!(
                "{} resolves to {}, which {rule} denies",
                host.as_text(),
                address.ip()
            ));
        }
        if allowed.is_empty() {
            let shown: Vec<String> = candidates.iter().map(|a| a.ip().to_string()).collect();
            return Err(format!(
                "{} resolves to a private, loopback, link-local or metadata address ({}) that no rule names",
                host.as_text(),
                shown.join(", ")
            ));
        }
        if let (Host::Name(name), Ok(mut looked_up)) = (host, self.looked_up.lock()) {
            looked_up.insert(name, allowed.iter().map(SocketAddr::ip).collect());
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
    pub(crate) fn connect_via(
        &self,
        host: &Host,
        port: u16,
        via: Via,
        http: Option<(&str, &str)>,
    ) -> Result<(TcpStream, SocketAddr), String> {
        match via {
            Via::Proxy => self.connect(host, port, http),
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
    pub(crate) fn open_upstream(
        &self,
        conn: &mut TcpStream,
        host: &Host,
        port: u16,
        decision: &mut Decision,
        via: Via,
    ) -> Option<TcpStream> {
        let upstream = self.connect_upstream(host, port, decision, via);
        if upstream.is_none() {
            self.deny(conn, decision);
        }
        upstream
    }

    /// As `open_upstream`, answering nothing: `None` where the request is refused (as it was,
    /// or now that its upstream cannot be reached), for the caller to answer.
    pub(crate) fn connect_upstream(
        &self,
        host: &Host,
        port: u16,
        decision: &mut Decision,
        via: Via,
    ) -> Option<TcpStream> {
        if !decision.allowed {
            return None;
        }
        let http = decision.method.as_deref().zip(decision.path.as_deref());
        match self.connect_via(host, port, via, http) {
            Ok((upstream, addr)) => {
                decision.address = Some(addr.to_string());
                Some(upstream)
            }
            Err(reason) => {
                decision.allowed = false;
                decision.reason = reason;
                None
            }
        }
    }
}

/// The most of a request's target a question shows; the rest is counted.
const SHOWN_TARGET: usize = 2048;

/// A request's target as a person is shown it in a question (a terminal line, `warden
/// approvals`, the dashboard): every byte that is not printable ASCII percent-encoded, so that
/// escape sequences (C0 and C1 controls), bidirectional overrides and look-alike characters the
/// cell put in its path or query neither act on the terminal nor pass for something else; and
/// at most `SHOWN_TARGET` bytes of it, with the count of the rest.
pub(crate) fn shown_target(target: &str) -> String {
    let mut shown = String::with_capacity(target.len().min(SHOWN_TARGET) + 32);
    for (at, byte) in target.bytes().enumerate() {
        if shown.len() >= SHOWN_TARGET {
            shown.push_str(&format!("... ({} bytes more)", target.len() - at));
            break;
        }
        if (0x21..=0x7e).contains(&byte) {
            shown.push(char::from(byte));
        } else {
            shown.push_str(&format!("%{byte:02X}"));
        }
    }
    shown
}

/// The accepting side of one listener, handed from thread to thread: the thread that accepts a
/// connection serves it itself, and passes the listener to a waiting thread of the gateway's
/// (or a new one) first, so that a connection costs no wake-up of a second thread before it
/// is served (the accept's own is the only one), and a long connection never keeps the next
/// one waiting. A connection beyond the cell's limit is refused at once (a 503 that says why
/// on the proxy port, a reset on the redirected one) and never gets a thread.
#[derive(Clone)]
struct Acceptor {
    gateway: Gateway,
    listener: Arc<TcpListener>,
    proxy: bool,
    /// The listener's family, which its connections have.
    ipv6: bool,
    /// Whether its connections have `TCP_NODELAY` from it (set once on the listener, a
    /// connection takes it at its accept), or need it set each.
    nodelay_inherited: bool,
    serve: fn(&Gateway, TcpStream, bool),
}

impl Acceptor {
    fn start(
        gateway: Gateway,
        listener: TcpListener,
        proxy: bool,
        serve: fn(&Gateway, TcpStream, bool),
    ) -> io::Result<()> {
        let workers = Arc::clone(&gateway.workers);
        // Small TLS records and request heads must not wait for delayed acknowledgements.
        let nodelay_inherited =
            nix::sys::socket::setsockopt(&listener, nix::sys::socket::sockopt::TcpNoDelay, &true)
                .is_ok();
        let acceptor = Self {
            gateway,
            ipv6: listener.local_addr().is_ok_and(|a| a.is_ipv6()),
            listener: Arc::new(listener),
            proxy,
            nodelay_inherited,
            serve,
        };
        workers.run(move || acceptor.accept())
    }

    /// Accepts until a connection comes that this thread serves (having passed the listener
    /// on), or the listener fails (the cell's network is gone).
    fn accept(self) {
        loop {
            let conn = match self.listener.accept() {
                Ok((conn, _)) => conn,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue;
                }
                // Out of descriptors or memory, for now: try again in a moment.
                Err(e) if matches!(e.raw_os_error(), Some(EMFILE | ENFILE | ENOBUFS | ENOMEM)) => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                // The cell's network is gone.
                Err(_) => return,
            };
            let Some(slot) = self.gateway.slots.take() else {
                self.gateway.refuse_busy(conn, self.proxy, self.ipv6);
                continue;
            };
            let next = self.clone();
            if self.gateway.workers.run(move || next.accept()).is_err() {
                // No thread to take the listener: this one keeps it, and the connection is
                // closed (with its slot given back) rather than left without an acceptor.
                drop((conn, slot));
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            if !self.nodelay_inherited {
                let _ = conn.set_nodelay(true);
            }
            let _slot: Slot = slot;
            (self.serve)(&self.gateway, conn, self.ipv6);
            return;
        }
    }
}

/// The JSON body of a 403: what was refused and why, so that an agent can correct itself.
pub(crate) fn refusal_body(decision: &Decision) -> serde_json::Value {
    json!({
        "error": "blocked by the warden egress policy",
        "destination": format!("{}:{}", decision.host, decision.port),
        "method": decision.method,
        "path": decision.path,
        "rule": decision.rule,
        "reason": decision.reason,
    })
}
