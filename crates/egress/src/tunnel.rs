//! CONNECT tunnels: decided on host and port, then relayed both ways. A tunnel carries TLS only
//! for the host it was opened for: the ClientHello (put together from however many records
//! and reads it comes in) must name that host, and one that names none, or cannot be read, is
//! refused. A tunnel silent in both directions for the cell's idle limit is closed.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use crate::host::{Host, split_authority};
use crate::proxy::{Gateway, Via};
use crate::pump::pump;
use crate::record::Decision;
use crate::rules::Request;
use crate::sni::{Hello, MAX_INPUT, client_hello};

/// The answer to a CONNECT the gateway lets through.
const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

impl Gateway {
    pub(crate) fn tunnel(&self, mut conn: TcpStream, target: &str, early: Vec<u8>) {
        let (host, port) = match split_authority(target, 443) {
            Ok(parts) => parts,
            Err(e) => return self.refuse(&mut conn, "connect", target, e.to_string()),
        };
        // The inference upstream is spoken to in plain HTTP through the gateway, each exchange
        // read and counted: neither a raw tunnel nor one opened up with TLS.
        let upstream = self
            .rules()
            .inference
            .as_ref()
            .is_some_and(|r| r.host == host && r.port == port);
        if upstream {
            let route = crate::rules::Verdict::new(false, crate::rules::INFERENCE_RULE, "");
            let mut decision = self.record("connect", &host.as_text(), port, None, &route);
            decision.allowed = false;
            decision.reason = "the inference upstream takes plain HTTP requests through the gateway (network.inference.name), each read and counted; not a tunnel".to_owned();
            return self.deny(&mut conn, &decision);
        }
        if let Some(interceptor) = &self.interceptor
            && self.opens_up(&self.rules(), &host, port)
        {
            if conn.write_all(ESTABLISHED).is_err() {
                return;
            }
            // A client that speaks plain HTTP in the tunnel (`curl --proxytunnel` of an
            // http:// URL, undici's ProxyAgent) has its request decided as a proxied one.
            let early = match early.is_empty() {
                true => first_bytes(
                    &mut conn,
                    early,
                    crate::bounds::HEAD_TIMEOUT,
                    crate::bounds::HEAD_TIMEOUT,
                )
                .unwrap_or_default(),
                false => early,
            };
            if looks_http(&early) {
                return self.tunnel_http(conn, &host, port, early);
            }
            return self.intercept(interceptor, conn, host, port, early, Via::Proxy);
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
        if conn.write_all(ESTABLISHED).is_err() {
            return;
        }
        // Plain HTTP in the tunnel is served as a proxied request would be: decided on its own,
        // its Host held to the tunnel's host, one request for the connection.
        let gateway = self.clone();
        let (named, at) = (host.clone(), port);
        let take_over: TakeOver = Box::new(move |client, first| {
            gateway.tunnel_http(client, &named, at, first);
        });
        self.relay_tunnel(
            conn,
            upstream,
            &host,
            port,
            &early,
            decision,
            Some(take_over),
        );
    }

    /// Relays a tunnel the gateway let out until either side ends it, then records it with the
    /// bytes each way (and the reason, where the relay refused the client's first bytes).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn relay_tunnel(
        &self,
        conn: TcpStream,
        upstream: TcpStream,
        host: &Host,
        port: u16,
        early: &[u8],
        mut decision: Decision,
        take_over: Option<TakeOver>,
    ) {
        let tracked = self.track(host, port, None, &conn, &upstream);
        let (up, down, end) = tunnel_bytes(
            &self.workers,
            conn,
            upstream,
            early,
            host,
            self.bounds.idle,
            take_over,
        );
        drop(tracked);
        decision.bytes_up = up;
        decision.bytes_down = down;
        match end {
            End::Relayed => {}
            End::Refused(reason) => {
                decision.allowed = false;
                decision.reason = reason;
            }
            End::TakenOver => {
                decision.reason =
                    "the tunnel carried a plain HTTP request, decided on its own".to_owned();
            }
        }
        self.log_decision(&decision);
    }
}

/// Reads a client's first bytes: up to a whole TLS ClientHello, or an HTTP head, or whatever
/// the first read brought for other protocols. The first bytes may take `first_wait` (a server
/// may speak first: then nothing is returned); once they came, the rest must come within
/// `whole_within` (then what came is returned). `None` when the client closed without a byte,
/// or failed.
pub(crate) fn first_bytes(
    conn: &mut TcpStream,
    mut bytes: Vec<u8>,
    first_wait: Duration,
    whole_within: Duration,
) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 4096];
    let mut until: Option<Instant> = None;
    loop {
        if (!bytes.is_empty() && !needs_more(&bytes)) || bytes.len() >= MAX_INPUT {
            return Some(bytes);
        }
        let wait = if bytes.is_empty() {
            first_wait
        } else {
            let deadline = *until.get_or_insert_with(|| Instant::now() + whole_within);
            deadline.saturating_duration_since(Instant::now())
        };
        if wait.is_zero() {
            return Some(bytes);
        }
        conn.set_read_timeout(Some(wait)).ok()?;
        match conn.read(&mut chunk) {
            Ok(0) => return (!bytes.is_empty()).then_some(bytes),
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            // What came in time (nothing, when the client stayed silent).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Some(bytes);
            }
            Err(_) => return None,
        }
    }
}

/// Whether the first bytes so far are the start of a ClientHello or an HTTP head that is not
/// whole yet.
fn needs_more(bytes: &[u8]) -> bool {
    match client_hello(bytes) {
        Hello::Incomplete => true,
        Hello::NotTls => {
            looks_http(bytes)
                && !bytes.windows(4).any(|w| w == b"\r\n\r\n")
                && bytes.len() < crate::http::MAX_HEAD
        }
        _ => false,
    }
}

/// Whether a client's first bytes are (or begin) what an HTTP/1 server reads as a request
/// (`request_line` says what that takes). Bytes that stop short of telling (a lone token,
/// `ping`) are counted as a request: the caller reads on until they tell, and refuses them if
/// they never do (a client sending a request a piece at a time, and pausing, must not have it
/// taken for another protocol and relayed raw).
pub(crate) fn looks_http(bytes: &[u8]) -> bool {
    request_line(bytes) != Line::Not
}

/// What a client's first line is, so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    Request,
    /// Too short to tell yet.
    Maybe,
    Not,
}

/// What servers read as a request line: a method of any token (RFC 9110; `M-SEARCH`, `_GET`,
/// `get`), of any length, after any white space or empty lines (RFC 9112 2.2), then white space
/// of any kind, and a line that names a version (`HTTP/`, in any case) or, with none, a path
/// (HTTP/0.9). `SSH-2.0-OpenSSH_9.2p1 Debian-2`, `EHLO mail.test` or a TLS record are not one.
fn request_line(bytes: &[u8]) -> Line {
    let is_token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    // What some server splits a request line at: ASCII white space, and the Latin-1 bytes
    // Python's `str.split` counts too.
    let is_space = |b: u8| matches!(b, b' ' | b'\t' | 0x0b | 0x0c | 0x1c..=0x1f | 0x85 | 0xa0);
    let start = bytes
        .iter()
        .position(|b| !is_space(*b) && *b != b'\r' && *b != b'\n')
        .unwrap_or(bytes.len());
    let line = &bytes[start..];
    let short = bytes.len() < crate::http::MAX_HEAD;
    if line.is_empty() {
        return if !bytes.is_empty() && short {
            Line::Maybe
        } else {
            Line::Not
        };
    }
    let method = line.iter().take_while(|b| is_token(**b)).count();
    match line.get(method) {
        // A token so far, however long: it may still become a method.
        None if method > 0 && short => return Line::Maybe,
        Some(b) if method > 0 && is_space(*b) => {}
        _ => return Line::Not,
    }
    // The rest of the line: a request's is printable (a control byte other than white space
    // and the line's end is another protocol's), and names its version (`HTTP/`), or, with
    // none, a path (HTTP/0.9's `GET /path`).
    let rest = &line[method..];
    let end = rest.iter().position(|b| *b == b'\n');
    let upto = &rest[..end.unwrap_or(rest.len())];
    if upto
        .iter()
        .any(|b| (b.is_ascii_control() || *b == 0x7f) && !is_space(*b) && *b != b'\r')
    {
        return Line::Not;
    }
    let versioned = upto.windows(5).any(|w| w.eq_ignore_ascii_case(b"HTTP/"));
    let path = upto
        .iter()
        .find(|b| !is_space(**b))
        .is_some_and(|b| *b == b'/');
    match (versioned || (end.is_some() && path), end) {
        (true, _) => Line::Request,
        // The line is not over: its version may still come.
        (false, None) if short => Line::Maybe,
        _ => Line::Not,
    }
}

/// Whether the first bytes are (or begin) HTTP/2's connection preface, spoken without TLS
/// ("prior knowledge"): its requests name their host inside frames the gateway does not read.
fn h2_preface(bytes: &[u8]) -> bool {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let n = bytes.len().min(PREFACE.len());
    n >= 3 && bytes[..n] == PREFACE[..n]
}

/// A plain HTTP request head at the start of a connection's first bytes: whether it asks for
/// an upgrade (a WebSocket's), and the host its Host header names (`Err`: why none can be
/// taken from it).
pub(crate) struct Head {
    /// Whether it asks to upgrade to a WebSocket, and to nothing else.
    upgrade: bool,
    pub(crate) host: Result<Option<String>, String>,
    /// The head's length in the bytes (what follows it is a body, or a next request).
    len: usize,
    /// Whether its target is a path (`/...`), not a URL or `*`.
    origin_form: bool,
}

/// The request head that `bytes` begin with: `Ok(None)` where they do not look like one,
/// `Err` where they do but cannot be read whole (its body, or the bytes of a second request,
/// never name the host).
pub(crate) fn http_head(bytes: &[u8]) -> Result<Option<Head>, ()> {
    if !looks_http(bytes) {
        return Ok(None);
    }
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut request = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(len)) = request.parse(bytes) else {
        return Err(());
    };
    let named = |name: &'static str| {
        request
            .headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
    };
    let hosts: Vec<&[u8]> = named("host").map(|h| h.value).collect();
    let host = match hosts.as_slice() {
        [] => Ok(None),
        [one] => std::str::from_utf8(one)
            .map(|h| Some(h.trim().to_owned()))
            .map_err(|_| "the Host header is not text".to_owned()),
        _ => Err("the request has several Host headers".to_owned()),
    };
    // Only a WebSocket is relayed raw after the switch: HTTP/2 (`h2c`) names its hosts inside
    // frames and TLS (`TLS/1.2`) its server in a ClientHello, neither of which the gateway
    // would read once the connection is relayed. A request that names any other protocol goes
    // to the request path, which sends it without its `Upgrade`.
    let mut protocols = named("upgrade")
        .flat_map(|h| h.value.split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|p| !p.is_empty())
        .peekable();
    let websocket =
        protocols.peek().is_some() && protocols.all(|p| p.eq_ignore_ascii_case(b"websocket"));
    Ok(Some(Head {
        upgrade: websocket,
        host,
        len,
        origin_form: request.path.is_some_and(|p| p.starts_with('/')),
    }))
}

/// What becomes of a tunnel's first bytes (whole, or all that came in time).
#[derive(Debug, PartialEq, Eq)]
enum Opening {
    /// Relayed as they are: TLS for the tunnel's host, or a protocol the gateway does not read.
    Relay,
    /// A request to upgrade (a WebSocket's) that names the tunnel's host, whose head is the
    /// first `head` bytes: sent up alone, and the rest of the connection relayed only once the
    /// server has switched protocols (`101`); after any other answer the client's next bytes
    /// (a next request, for another host at the same address) go nowhere.
    Upgrade {
        head: usize,
    },
    /// A plain HTTP request: decided on its own, never relayed raw (a kept-alive connection
    /// could carry a next request for another host at the same address).
    Http,
    Refused(String),
}

fn opening(bytes: &[u8], host: &Host) -> Opening {
    if let Some(reason) = refused_hello(bytes, host) {
        return Opening::Refused(reason);
    }
    if h2_preface(bytes) {
        return Opening::Refused(format!(
            "HTTP/2 without TLS is not relayed: its requests name their host inside, where the gateway does not look (speak HTTP/1.1 or TLS to `{}`)",
            host.as_text()
        ));
    }
    let head = match http_head(bytes) {
        Ok(None) => return Opening::Relay,
        Ok(Some(head)) => head,
        // A request the gateway cannot read whole: the request path answers it with the
        // reason (a 400), and nothing of it goes up.
        Err(()) => return Opening::Http,
    };
    // A request to upgrade is relayed only in origin form: a URL names a host of its own, which
    // a server may serve instead of the one in `Host`.
    if !head.upgrade || !head.origin_form {
        return Opening::Http;
    }
    let expected = host.as_text();
    match head.host {
        Ok(Some(named)) if split_authority(&named, 0).is_ok_and(|(h, _)| h == *host) => {
            Opening::Upgrade { head: head.len }
        }
        Ok(Some(named)) => Opening::Refused(format!(
            "the request's Host `{named}` is not the tunnel's host `{expected}`"
        )),
        Ok(None) => Opening::Refused(format!(
            "the upgrade request names no Host, and the tunnel was opened for `{expected}`"
        )),
        Err(reason) => Opening::Refused(reason),
    }
}

/// How a tunnel's relay ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum End {
    Relayed,
    /// Its first bytes were refused: nothing of them reached the upstream.
    Refused(String),
    /// Its first bytes were a plain HTTP request, handed to the gateway's request path.
    TakenOver,
}

/// Serves a tunnel's connection from its first bytes on, where they are a plain HTTP request.
pub(crate) type TakeOver = Box<dyn FnOnce(TcpStream, Vec<u8>) + Send>;

/// Answers a client that spoke plain HTTP in a tunnel that cannot decide requests (nothing
/// can take its request over) with a 403 that says why, then closes it.
fn refuse_http(client: &mut TcpStream, reason: &str) {
    let body = serde_json::json!({
        "error": "plain HTTP is not relayed through this connection",
        "reason": reason,
    });
    crate::http::reply(client, 403, "Forbidden", &body);
}

/// Why a tunnel's first bytes are refused for a tunnel opened for `host`, if they are.
pub(crate) fn refused_hello(bytes: &[u8], host: &Host) -> Option<String> {
    let expected = host.as_text();
    match client_hello(bytes) {
        Hello::NotTls => None,
        Hello::Tls(Some(name)) if name.trim_end_matches('.') == expected => None,
        Hello::Tls(Some(name)) => Some(format!(
            "the TLS server name `{name}` is not the CONNECT host `{expected}`"
        )),
        // A name was asked for: the handshake must carry it.
        Hello::Tls(None) if matches!(host, Host::Name(_)) => Some(format!(
            "the TLS ClientHello names no server, and the tunnel was opened for `{expected}`"
        )),
        Hello::Tls(None) => None,
        Hello::Malformed(why) => Some(format!("the TLS ClientHello was refused: {why}")),
        Hello::Incomplete => Some(
            "the TLS ClientHello did not arrive whole within the gateway's deadline".to_owned(),
        ),
    }
}

/// Relays a tunnel both ways. The client's first bytes are held back until they show what
/// they are (`opening`): a TLS ClientHello, whose server name must be `host`'s (whenever they
/// come: the server may speak first); a plain HTTP request, never relayed raw (handed to
/// `take_over`, or refused); a request to upgrade, relayed on only once the server switched
/// protocols. Returns the bytes each way, and how the relay ended. Each direction ends after
/// `idle` without a byte; so the tunnel does, once both have.
///
/// First bytes that came whole with the connection (`early`: a redirected client's request or
/// ClientHello, read to learn where it goes) are checked and sent up by this thread, before
/// the thread for the client-to-upstream direction is woken: the upstream gets them without
/// waiting for that wake-up.
fn tunnel_bytes(
    workers: &std::sync::Arc<crate::workers::Workers>,
    mut client: TcpStream,
    upstream: TcpStream,
    early: &[u8],
    host: &Host,
    idle: Duration,
    take_over: Option<TakeOver>,
) -> (u64, u64, End) {
    let _ = client.set_read_timeout(Some(idle));
    let _ = upstream.set_read_timeout(Some(idle));
    let gate = std::sync::Arc::new(Gate::default());
    // (Whole, and small enough for the sockets' buffers to take at once: a write of it here
    // does not wait on the upstream's reading before the downward relay begins.)
    let first = if !early.is_empty() && early.len() <= SENT_AHEAD && !needs_more(early) {
        match opening(early, host) {
            Opening::Relay => First::Sent(
                (&upstream)
                    .write_all(early)
                    .is_ok()
                    .then_some(early.len() as u64),
            ),
            Opening::Upgrade { head } => {
                gate.expect_switch();
                match (&upstream).write_all(&early[..head]) {
                    Ok(()) => First::Upgrading {
                        sent: head as u64,
                        rest: early[head..].to_vec(),
                    },
                    Err(_) => First::Sent(None),
                }
            }
            Opening::Http => {
                let _ = upstream.shutdown(Shutdown::Both);
                return match take_over {
                    Some(take_over) => {
                        take_over(client, early.to_vec());
                        (0, 0, End::TakenOver)
                    }
                    None => {
                        let reason = NO_REQUESTS.to_owned();
                        refuse_http(&mut client, &reason);
                        (0, 0, End::Refused(reason))
                    }
                };
            }
            Opening::Refused(reason) => {
                let _ = upstream.shutdown(Shutdown::Both);
                let _ = client.shutdown(Shutdown::Both);
                return (0, 0, End::Refused(reason));
            }
        }
    } else {
        First::Held(early.to_vec())
    };
    let (Ok(client_read), Ok(upstream_write)) = (client.try_clone(), upstream.try_clone()) else {
        return (0, 0, End::Relayed);
    };
    let host = host.clone();
    let (done, up) = std::sync::mpsc::sync_channel(1);
    let up_gate = std::sync::Arc::clone(&gate);
    let started = workers.run(move || {
        let _ = done.send(relay_up(
            client_read,
            upstream_write,
            first,
            &host,
            idle,
            take_over,
            &up_gate,
        ));
    });
    if started.is_err() {
        // No thread for the other direction: the tunnel cannot be relayed.
        let _ = client.shutdown(Shutdown::Both);
        return (
            0,
            0,
            End::Refused("the warden could not start the tunnel's relay".to_owned()),
        );
    }
    let (upstream_read, client_write) = (upstream, client);
    let down = relay_down(&upstream_read, &client_write, &gate);
    // The client hears the upstream's end at once, unless the connection was handed over (the
    // other direction says so before it ends the upstream, which is what ended this one).
    if !gate.handed_over() {
        let _ = client_write.shutdown(Shutdown::Write);
    }
    let (up, end) = up.recv().unwrap_or((0, End::Relayed));
    (up, down, end)
}

/// What the two directions of a tunnel tell each other: whether the connection was handed
/// over (the downward direction then leaves the client's side alone), and, for a request to
/// upgrade, whether the server switched protocols.
#[derive(Debug, Default)]
struct Gate {
    state: std::sync::Mutex<GateState>,
    changed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    handed_over: bool,
    /// An upgrade's head went up: the upstream's first bytes are its answer.
    expecting: bool,
    /// The answer, once read: `true` for `101 Switching Protocols`.
    switched: Option<bool>,
}

impl Gate {
    fn hand_over(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.handed_over = true;
        }
    }

    fn handed_over(&self) -> bool {
        self.state.lock().is_ok_and(|state| state.handed_over)
    }

    fn expect_switch(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.expecting = true;
        }
    }

    fn expecting(&self) -> bool {
        self.state
            .lock()
            .is_ok_and(|state| state.expecting && state.switched.is_none())
    }

    fn answer(&self, switched: bool) {
        if let Ok(mut state) = self.state.lock() {
            state.switched = Some(switched);
        }
        self.changed.notify_all();
    }

    /// Waits (at most `within`) for the server's answer to an upgrade: whether it switched.
    fn switched(&self, within: Duration) -> bool {
        let Ok(state) = self.state.lock() else {
            return false;
        };
        self.changed
            .wait_timeout_while(state, within, |state| state.switched.is_none())
            .is_ok_and(|(state, _)| state.switched == Some(true))
    }
}

/// The upstream-to-client direction: pumped, after the status line of an upgrade's answer is
/// read and told to the other direction (the upstream speaks only after the head it answers,
/// which the other direction marks as sent before it sends it).
fn relay_down(upstream: &TcpStream, client: &TcpStream, gate: &Gate) -> u64 {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut first = true;
    loop {
        if !first && !gate.expecting() {
            break;
        }
        // The first read waits as a pump's would; it tells whether an answer is expected.
        match (&*upstream).read(&mut chunk) {
            Ok(0) | Err(_) => {
                if gate.expecting() {
                    gate.answer(false);
                }
                let _ = (&*client).write_all(&answer);
                return answer.len() as u64;
            }
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
        }
        first = false;
        if !gate.expecting() {
            break;
        }
        match switched(&answer) {
            Some(switched) => {
                gate.answer(switched);
                break;
            }
            // An answer that never tells is not waited on for ever.
            None if answer.len() > crate::http::MAX_HEAD => {
                gate.answer(false);
                break;
            }
            None => {}
        }
    }
    if (&*client).write_all(&answer).is_err() {
        return 0;
    }
    answer.len() as u64 + pump(upstream, client)
}

/// Whether the answer to a request to upgrade, as far as it came, switched protocols: its
/// status line past any `100 Continue` is `HTTP/1.1 101` and then its reason or the line's end
/// (`None`: not told yet).
fn switched(answer: &[u8]) -> Option<bool> {
    let mut at = answer;
    loop {
        const INTERIM: &[u8] = b"HTTP/1.1 100";
        if at.len() > INTERIM.len() && at.starts_with(INTERIM) && matches!(at[12], b' ' | b'\r') {
            // An interim answer: the final one follows it.
            let end = at.windows(4).position(|w| w == b"\r\n\r\n")?;
            at = &at[end + 4..];
            continue;
        }
        const SWITCHED: &[u8] = b"HTTP/1.1 101";
        let n = at.len().min(SWITCHED.len() + 1);
        return match at.get(SWITCHED.len()) {
            Some(b' ' | b'\r') => Some(at.starts_with(SWITCHED)),
            Some(_) => Some(false),
            // Shorter: what came so far must agree, or it is some other answer already.
            None if SWITCHED[..n] == at[..n] || INTERIM[..n] == at[..n] => None,
            None => Some(false),
        };
    }
}

/// Why plain HTTP is refused in a tunnel whose requests nothing decides.
const NO_REQUESTS: &str = "plain HTTP through a redirected connection that was not decided as HTTP (the client waited before it spoke) is not relayed: connect again and send the request at once";

/// The most first bytes the accepting thread sends up itself (a ClientHello or a request head
/// is a few KiB).
const SENT_AHEAD: usize = 16 * 1024;

/// A tunnel's first bytes from the client, for the thread of its client-to-upstream direction.
enum First {
    /// Not yet checked: what came with the connection (maybe nothing), to be read on to a
    /// whole ClientHello or HTTP head.
    Held(Vec<u8>),
    /// Checked and sent up already: how many (`None`: the upstream would not take them).
    Sent(Option<u64>),
    /// An upgrade's head sent up (`sent` bytes), what came after it held until the server
    /// switches protocols.
    Upgrading { sent: u64, rest: Vec<u8> },
}

/// The client-to-upstream direction of a tunnel, on a thread of its own: the first bytes are
/// checked, then the rest pumped. Returns the bytes sent and how the relay ended.
fn relay_up(
    mut client_read: TcpStream,
    upstream_write: TcpStream,
    first: First,
    host: &Host,
    idle: Duration,
    take_over: Option<TakeOver>,
    gate: &Gate,
) -> (u64, End) {
    let early = match first {
        First::Held(early) => early,
        First::Sent(Some(n)) => {
            let sent = n + pump(&client_read, &upstream_write);
            let _ = upstream_write.shutdown(Shutdown::Write);
            return (sent, End::Relayed);
        }
        First::Sent(None) => {
            let _ = upstream_write.shutdown(Shutdown::Write);
            return (0, End::Relayed);
        }
        First::Upgrading { sent, rest } => {
            return upgrade_on(&client_read, &upstream_write, sent, &rest, idle, gate);
        }
    };
    let Some(first) = first_bytes(&mut client_read, early, idle, crate::bounds::HEAD_TIMEOUT)
    else {
        let _ = upstream_write.shutdown(Shutdown::Write);
        return (0, End::Relayed);
    };
    let _ = client_read.set_read_timeout(Some(idle));
    if first.is_empty() {
        // Silent for the whole idle limit.
        let _ = upstream_write.shutdown(Shutdown::Write);
        return (0, End::Relayed);
    }
    match opening(&first, host) {
        Opening::Relay => {}
        Opening::Upgrade { head } => {
            gate.expect_switch();
            if (&upstream_write).write_all(&first[..head]).is_err() {
                let _ = upstream_write.shutdown(Shutdown::Write);
                return (0, End::Relayed);
            }
            return upgrade_on(
                &client_read,
                &upstream_write,
                head as u64,
                &first[head..],
                idle,
                gate,
            );
        }
        Opening::Http => {
            // The upstream connection made for the tunnel goes unused (its end ends the other
            // direction's pump); the request is decided and sent on a connection of its own, or
            // refused with an answer: either way the client's side is this thread's now.
            gate.hand_over();
            let _ = upstream_write.shutdown(Shutdown::Both);
            return match take_over {
                Some(take_over) => {
                    take_over(client_read, first);
                    (0, End::TakenOver)
                }
                None => {
                    refuse_http(&mut client_read, NO_REQUESTS);
                    (0, End::Refused(NO_REQUESTS.to_owned()))
                }
            };
        }
        Opening::Refused(reason) => {
            let _ = upstream_write.shutdown(Shutdown::Both);
            let _ = client_read.shutdown(Shutdown::Both);
            return (0, End::Refused(reason));
        }
    }
    let mut sent = 0u64;
    if (&upstream_write).write_all(&first).is_ok() {
        sent = first.len() as u64 + pump(&client_read, &upstream_write);
    }
    let _ = upstream_write.shutdown(Shutdown::Write);
    (sent, End::Relayed)
}

/// After an upgrade's head went up (`sent` bytes): what the client sent after it (`rest`) and
/// everything after that goes up only once the server answered `101`; after another answer the
/// client's bytes go nowhere (a next request, for another host at the same address, would be
/// read by the server), the upstream is told the client is done, and its answer still comes
/// down to the client.
fn upgrade_on(
    client_read: &TcpStream,
    upstream_write: &TcpStream,
    sent: u64,
    rest: &[u8],
    idle: Duration,
    gate: &Gate,
) -> (u64, End) {
    if !gate.switched(idle) {
        let _ = upstream_write.shutdown(Shutdown::Write);
        return (sent, End::Relayed);
    }
    if (&*upstream_write).write_all(rest).is_err() {
        let _ = upstream_write.shutdown(Shutdown::Write);
        return (sent, End::Relayed);
    }
    let pumped = pump(client_read, upstream_write);
    let _ = upstream_write.shutdown(Shutdown::Write);
    (sent + rest.len() as u64 + pumped, End::Relayed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// `tunnel_bytes` on a thread of its own, as the gateway runs it for a connection.
    fn spawn_relay(
        workers: &std::sync::Arc<crate::workers::Workers>,
        gateway_side: TcpStream,
        upstream_side: TcpStream,
        early: Vec<u8>,
        host: &Host,
        idle: Duration,
        take_over: Option<TakeOver>,
    ) -> std::thread::JoinHandle<(u64, u64, End)> {
        let workers = std::sync::Arc::clone(workers);
        let host = host.clone();
        std::thread::spawn(move || {
            tunnel_bytes(
                &workers,
                gateway_side,
                upstream_side,
                &early,
                &host,
                idle,
                take_over,
            )
        })
    }

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    #[test]
    fn a_hello_trickled_byte_by_byte_has_one_deadline() {
        let (mut client, mut server) = pair();
        let hello = crate::sni::tests::hello_with_sni("slow.test");
        let trickle = std::thread::spawn(move || {
            for byte in hello {
                if client.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let begun = Instant::now();
        let got = first_bytes(
            &mut server,
            Vec::new(),
            Duration::from_secs(5),
            Duration::from_millis(400),
        )
        .unwrap();
        let took = begun.elapsed();
        assert!(took < Duration::from_millis(900), "{took:?}");
        assert_eq!(
            refused_hello(&got, &Host::Name("slow.test".into())).as_deref(),
            Some("the TLS ClientHello did not arrive whole within the gateway's deadline")
        );
        drop(server);
        let _ = trickle.join();
    }

    /// First bytes that came whole with the connection go up from the tunnel's own thread,
    /// and what follows is pumped after them; a whole hello naming another host sends nothing.
    #[test]
    fn whole_first_bytes_are_checked_and_sent_before_the_rest() {
        let workers = crate::workers::Workers::new("test-tunnel");
        let host = Host::Name("a.test".into());
        // Bytes of a protocol the gateway does not read, whole with the connection, then more.
        let (mut client, gateway_side) = pair();
        let (upstream_side, mut upstream) = pair();
        const BANNER: &[u8] = b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n";
        let relay = spawn_relay(
            &workers,
            gateway_side,
            upstream_side,
            BANNER.to_vec(),
            &host,
            Duration::from_secs(5),
            None,
        );
        let mut got = vec![0u8; BANNER.len()];
        upstream.read_exact(&mut got).unwrap();
        assert_eq!(got, BANNER);
        client.write_all(b"body").unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        upstream.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"body");
        upstream.write_all(b"answer").unwrap();
        drop(upstream);
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        assert_eq!(answer, b"answer");
        assert_eq!(
            relay.join().unwrap(),
            (BANNER.len() as u64 + 4, 6, End::Relayed)
        );
        // A whole hello for another host: refused, and the upstream gets no byte of it.
        let (client, gateway_side) = pair();
        let (upstream_side, mut upstream) = pair();
        let hello = crate::sni::tests::hello_with_sni("b.test");
        let (up, down, end) = tunnel_bytes(
            &workers,
            gateway_side,
            upstream_side,
            &hello,
            &host,
            Duration::from_secs(5),
            None,
        );
        assert_eq!((up, down), (0, 0));
        assert_eq!(
            end,
            End::Refused("the TLS server name `b.test` is not the CONNECT host `a.test`".into())
        );
        let mut seen = Vec::new();
        upstream.read_to_end(&mut seen).unwrap();
        assert!(seen.is_empty(), "{} bytes reached the upstream", seen.len());
        drop(client);
    }

    #[test]
    fn hellos_are_checked_against_the_tunnels_host() {
        let named = Host::Name("a.test".into());
        let hello = crate::sni::tests::hello_with_sni("a.test");
        assert_eq!(refused_hello(&hello, &named), None);
        let split = crate::sni::tests::hello_with_sni("b.test");
        assert!(refused_hello(&split, &named).is_some());
        assert_eq!(refused_hello(b"SSH-2.0-x\r\n", &named), None);
    }

    #[test]
    fn first_bytes_are_told_apart() {
        let host = Host::Name("a.test".into());
        assert!(looks_http(b"GET / HTTP/1.1\r\n"));
        assert!(looks_http(b"GE"));
        assert!(!looks_http(b"SSH-2.0-OpenSSH_9.2\r\n"));
        assert!(!looks_http(b"\x16\x03\x01"));
        // A lone token could still become a request (a client may send it a byte at a time):
        // it is waited on, as a request head is.
        assert!(looks_http(b"ping"));
        assert!(!looks_http(b"ping\n"));
        assert!(!looks_http(b"\x00ping"));
        let hello = crate::sni::tests::hello_with_sni("a.test");
        assert_eq!(opening(&hello, &host), Opening::Relay);
        assert_eq!(opening(b"SSH-2.0-x\r\n", &host), Opening::Relay);
        assert_eq!(
            opening(b"GET /admin HTTP/1.1\r\nHost: a.test\r\n\r\n", &host),
            Opening::Http
        );
        // Another host in the head is the request path's to refuse; an upgrade is relayed
        // only for the tunnel's host.
        assert_eq!(
            opening(b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n", &host),
            Opening::Http
        );
        const UPGRADE: &[u8] = b"GET / HTTP/1.1\r\nHost: a.test:8080\r\nUpgrade: websocket\r\n\r\n";
        assert_eq!(
            opening(UPGRADE, &host),
            Opening::Upgrade {
                head: UPGRADE.len()
            }
        );
        // An upgrade to anything but a WebSocket (HTTP/2, TLS: hosts named where the gateway
        // would not read once relayed) is a request for the request path, sent without it.
        for upgrade in [
            &b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: h2c\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: TLS/1.2\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket, h2c\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\nUpgrade: h2c\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: \r\n\r\n",
        ] {
            assert_eq!(opening(upgrade, &host), Opening::Http, "{upgrade:?}");
        }
        assert_eq!(
            opening(
                b"GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: WebSocket\r\n\r\n",
                &host
            ),
            Opening::Upgrade { head: 52 }
        );
        // What servers read as a request, though not in the plainest form.
        for request in [
            &b"\r\nGET / HTTP/1.1\r\nHost: a.test\r\n\r\n"[..],
            b"\n\nGET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"M-SEARCH * HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"_GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"get / HTTP/1.1\r\nHost: a.test\r\n\r\n",
        ] {
            assert_eq!(request_line(request), Line::Request, "{request:?}");
            assert_eq!(opening(request, &host), Opening::Http, "{request:?}");
        }
        // HTTP/0.9, which names no host and carries no version: a request, which the request
        // path refuses.
        assert_eq!(request_line(b"GET /secret\r\n"), Line::Request);
        // Not requests: other protocols' first lines.
        for other in [
            &b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n"[..],
            b"EHLO mail.test\r\n",
            b"GET key\r\n",
            b"*1\r\n$4\r\nPING\r\n",
        ] {
            assert_eq!(request_line(other), Line::Not, "{other:?}");
        }
        assert_eq!(request_line(b"SSH-2.0-Op"), Line::Maybe);
        assert_eq!(request_line(b"GET /x HTT"), Line::Maybe);
        // White space as servers take it, and methods of any length.
        for request in [
            &b"GET  /x HTTP/1.1\r\n"[..],
            b"GET /x  HTTP/1.1\r\n",
            b"GET\t/x HTTP/1.1\r\n",
            b" GET /x HTTP/1.1\r\n",
            b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA /x HTTP/1.1\r\n",
            b"GET /x http/1.1\r\n",
        ] {
            assert_eq!(request_line(request), Line::Request, "{request:?}");
        }
        assert_eq!(request_line(&[b'A'; 40]), Line::Maybe);
        // Binary protocols are told at once.
        assert_eq!(request_line(b"F\0\0\0\x01\x02"), Line::Not);
        // HTTP/2 without TLS names its hosts where the gateway does not read: refused.
        assert!(matches!(
            opening(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", &host),
            Opening::Refused(reason) if reason.contains("HTTP/2")
        ));
        assert!(matches!(
            opening(b"GET / HTTP/1.1\r\nHost: evil.test\r\nUpgrade: websocket\r\n\r\n", &host),
            Opening::Refused(reason) if reason.contains("evil.test")
        ));
        assert_eq!(
            opening(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", &host),
            Opening::Http
        );
        // An upgrade that names a URL (a host of its own) is a request for the request path.
        assert_eq!(
            opening(
                b"GET http://evil.test/ HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\n\r\n",
                &host
            ),
            Opening::Http
        );
        // Whether the server switched: its final status line, past interim ones.
        for (answer, told) in [
            (&b"HTTP/1.1 101 Switching Protocols\r\n"[..], Some(true)),
            (b"HTTP/1.1 101\r\n", Some(true)),
            (b"HTTP/1.1 1010 Odd\r\n", Some(false)),
            (b"HTTP/1.0 101 Old\r\n", Some(false)),
            (b"HTTP/1.1 200 OK\r\n", Some(false)),
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 101 Switching\r\n",
                Some(true),
            ),
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n",
                Some(false),
            ),
            (b"HTTP/1.1 100 Continue\r\n", None),
            (b"HTTP/1.1 10", None),
            (b"garbage", Some(false)),
        ] {
            assert_eq!(switched(answer), told, "{answer:?}");
        }
    }

    /// A plain HTTP request in a tunnel never reaches the upstream raw: it is handed to the
    /// request path where one is given, and refused with a 403 where none is.
    #[test]
    fn plain_http_in_a_tunnel_is_never_relayed_raw() {
        let workers = crate::workers::Workers::new("test-tunnel-http");
        let host = Host::Name("a.test".into());
        const REQUEST: &[u8] = b"GET /admin HTTP/1.1\r\nHost: evil.test\r\n\r\n";
        for (early, take) in [(true, true), (false, true), (false, false)] {
            let (mut client, gateway_side) = pair();
            let (upstream_side, mut upstream) = pair();
            let (handed, taken) = std::sync::mpsc::channel();
            let take_over: Option<TakeOver> = take.then(|| {
                Box::new(move |conn: TcpStream, first: Vec<u8>| {
                    let _ = handed.send(first);
                    drop(conn);
                }) as TakeOver
            });
            let relay = spawn_relay(
                &workers,
                gateway_side,
                upstream_side,
                (if early { REQUEST } else { b"" }).to_vec(),
                &host,
                Duration::from_secs(5),
                take_over,
            );
            if !early {
                client.write_all(REQUEST).unwrap();
            }
            let (_, _, end) = relay.join().unwrap();
            let mut seen = Vec::new();
            upstream.read_to_end(&mut seen).unwrap();
            assert!(seen.is_empty(), "{early} {take}: the upstream got {seen:?}");
            if take {
                assert_eq!(end, End::TakenOver);
                assert_eq!(taken.recv().unwrap(), REQUEST);
            } else {
                assert!(matches!(end, End::Refused(_)), "{end:?}");
                let mut answer = String::new();
                client.read_to_string(&mut answer).unwrap();
                assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
            }
        }
    }

    /// An upgrade's head goes up alone; what the client sends after it goes up only once the
    /// server has switched protocols.
    #[test]
    fn after_an_upgrade_that_was_not_taken_nothing_more_goes_up() {
        let workers = crate::workers::Workers::new("test-tunnel-upgrade");
        let host = Host::Name("a.test".into());
        const HEAD: &[u8] = b"GET /ws HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        const NEXT: &[u8] = b"GET /theirs HTTP/1.1\r\nHost: evil.test\r\n\r\n";
        for (early, answer) in [
            (true, &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"[..]),
            (
                false,
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
            ),
            (
                true,
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            ),
            (
                false,
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            ),
        ] {
            let switched = answer.starts_with(b"HTTP/1.1 101");
            let (mut client, gateway_side) = pair();
            let (upstream_side, mut upstream) = pair();
            let first: Vec<u8> = if early {
                [HEAD, NEXT].concat()
            } else {
                Vec::new()
            };
            let relay = spawn_relay(
                &workers,
                gateway_side,
                upstream_side,
                first,
                &host,
                Duration::from_secs(5),
                None,
            );
            if !early {
                client.write_all(HEAD).unwrap();
            }
            let mut got = vec![0u8; HEAD.len()];
            upstream.read_exact(&mut got).unwrap();
            assert_eq!(got, HEAD);
            upstream.write_all(answer).unwrap();
            if !early {
                // After the answer: a next request (or, once switched, the protocol's bytes).
                std::thread::sleep(Duration::from_millis(100));
                client.write_all(NEXT).unwrap();
            }
            let mut answered = vec![0u8; answer.len()];
            client.read_exact(&mut answered).unwrap();
            assert_eq!(answered, answer);
            client.shutdown(Shutdown::Write).unwrap();
            let mut rest = Vec::new();
            upstream.read_to_end(&mut rest).unwrap();
            match switched {
                true => assert_eq!(rest, NEXT, "{early}"),
                false => assert!(rest.is_empty(), "{early}: {rest:?} went up"),
            }
            drop(upstream);
            let (_, _, end) = relay.join().unwrap();
            assert_eq!(end, End::Relayed);
        }
    }

    /// The client hears the upstream's end at once, whatever it sends or not after.
    #[test]
    fn the_upstreams_end_reaches_the_client_at_once() {
        let workers = crate::workers::Workers::new("test-tunnel-end");
        let host = Host::Name("a.test".into());
        let (mut client, gateway_side) = pair();
        let (upstream_side, mut upstream) = pair();
        let relay = spawn_relay(
            &workers,
            gateway_side,
            upstream_side,
            Vec::new(),
            &host,
            Duration::from_secs(30),
            None,
        );
        upstream.write_all(b"220 hello\r\n").unwrap();
        drop(upstream);
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut seen = Vec::new();
        client.read_to_end(&mut seen).unwrap();
        assert_eq!(seen, b"220 hello\r\n");
        drop(client);
        let _ = relay.join().unwrap();
    }
}
