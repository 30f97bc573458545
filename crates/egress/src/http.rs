//! HTTP/1 as the gateway reads and writes it: request heads (bounded in size, and in time by
//! one deadline for the whole head), unambiguous body framing, the request sent upstream, and
//! the response relayed back, decoded where it must be inspected for secrets.

use std::io::{self, BufRead as _, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use serde_json::json;

use crate::secrets::{PlaceholderGuard, Replacer, Secret, Secrets};

pub(crate) const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 100;
/// A response head may be larger than a request's (cookies, long redirects).
const MAX_RESPONSE_HEAD: usize = 256 * 1024;
const MAX_RESPONSE_HEADERS: usize = 256;

/// Reads from a socket under one deadline for everything read through it: each read waits at
/// most what is left, so a client sending a byte now and then cannot stretch the time.
pub(crate) struct Until<'a, R> {
    pub(crate) inner: R,
    pub(crate) socket: &'a TcpStream,
    pub(crate) until: Instant,
}

impl<R: Read> Read for Until<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.socket.set_read_timeout(Some(left))?;
        match self.inner.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::ErrorKind::TimedOut.into()),
            other => other,
        }
    }
}

/// A request head, read and parsed: method, target as sent, headers with lowercase names, and
/// the bytes read past the head.
pub(crate) struct ParsedRequest {
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) rest: Vec<u8>,
}

pub(crate) enum RequestError {
    TooLarge,
    Malformed,
    TimedOut,
    Io,
}

/// Reads up to the end of a head; returns the head and any bytes read past it.
fn read_head(conn: &mut impl Read, max: usize) -> Result<(Vec<u8>, Vec<u8>), RequestError> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let mut searched: usize = 0;
    loop {
        // Only the bytes that came since the last look (and three before them) are searched.
        if let Some(end) = buf[searched.saturating_sub(3)..]
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
        {
            let end = searched.saturating_sub(3) + end;
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        searched = buf.len();
        if buf.len() > max {
            return Err(RequestError::TooLarge);
        }
        match conn.read(&mut chunk) {
            Ok(0) => return Err(RequestError::Io),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(RequestError::TimedOut),
            Err(_) => return Err(RequestError::Io),
        }
    }
}

/// Reads and parses a request head (at most 64 KiB, 100 headers).
pub(crate) fn read_request(conn: &mut impl Read) -> Result<ParsedRequest, RequestError> {
    let (head, rest) = read_head(conn, MAX_HEAD)?;
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

/// The values of header `name` (lowercase).
pub(crate) fn values<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Vec<&'a [u8]> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
        .collect()
}

/// The request, or `None` once a client that sent an oversized, malformed or too slow head has
/// its answer (one that went away gets none).
pub(crate) fn answer_bad_request(
    conn: &mut TcpStream,
    read: Result<ParsedRequest, RequestError>,
) -> Option<ParsedRequest> {
    let (code, text, message) = match read {
        Ok(request) => return Some(request),
        Err(RequestError::TooLarge) => (
            431,
            "Request Header Fields Too Large",
            "request headers larger than 64 KiB",
        ),
        Err(RequestError::Malformed) => (400, "Bad Request", "malformed HTTP request"),
        Err(RequestError::TimedOut) => (
            408,
            "Request Timeout",
            "the request head did not arrive whole within the gateway's deadline",
        ),
        Err(RequestError::Io) => return None,
    };
    reply(conn, code, text, &json!({ "error": message }));
    None
}

pub(crate) fn reply(conn: &mut TcpStream, code: u16, text: &str, body: &serde_json::Value) {
    write_reply(conn, code, text, body);
    close_after_answer(conn);
}

/// How long, and how many bytes, a refused client's unread request is read and dropped for.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
const LINGER_BYTES: u64 = 64 << 20;

/// Ends a connection whose answer went out before its request was read whole (a refusal
/// decided on the head): the write side is shut (the client sees the answer and its end), and
/// what the client still sends is read and dropped until it closes, for at most `LINGER` and
/// `LINGER_BYTES`. Closed with unread data, the kernel answers with a reset: a client still
/// sending a large body got "Broken pipe" or "Connection reset" instead of the answer.
fn close_after_answer(conn: &mut TcpStream) {
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut left = LINGER_BYTES;
    let mut buf = [0u8; 16 * 1024];
    while left > 0 {
        let now = Instant::now();
        if now >= deadline || conn.set_read_timeout(Some(deadline - now)).is_err() {
            break;
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n as u64),
        }
    }
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

/// Writes a complete JSON response (over plain TCP or TLS).
pub(crate) fn write_reply(conn: &mut impl Write, code: u16, text: &str, body: &serde_json::Value) {
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

/// How a request's body is framed. Ambiguous framing is how requests are smuggled past a
/// proxy, so it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Body {
    Length(u64),
    Chunked,
}

pub(crate) fn request_body(headers: &[(String, Vec<u8>)]) -> Result<Body, &'static str> {
    let lengths = values(headers, "content-length");
    let encodings = values(headers, "transfer-encoding");
    match (lengths.as_slice(), encodings.as_slice()) {
        ([], []) => Ok(Body::Length(0)),
        // Digits only: a number parser's `+5` is read otherwise by some servers.
        ([one], []) => std::str::from_utf8(one.trim_ascii())
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
            .map(Body::Length)
            .ok_or("invalid Content-Length (digits only)"),
        ([], [te]) if te.eq_ignore_ascii_case(b"chunked") => Ok(Body::Chunked),
        ([], _) => Err("a Transfer-Encoding other than a single `chunked` is refused"),
        (_, []) => Err("several Content-Length headers: refused as request smuggling"),
        _ => Err("both Content-Length and Transfer-Encoding: refused as request smuggling"),
    }
}

/// Tells a client that asked to be (`Expect: 100-continue`) and has sent none of its body yet
/// to go on, once its request was decided and its upstream reached: the gateway reads the body
/// before the upstream's answer, so the upstream's own `100` would reach the client only after
/// the body it waits to send (a client that waits for it without a deadline of its own waited
/// until the gateway's idle limit ended the connection).
pub(crate) fn go_on(
    client: &mut impl Write,
    headers: &[(String, Vec<u8>)],
    body: Body,
    early: &[u8],
) {
    let expects = values(headers, "expect")
        .iter()
        .any(|v| v.trim_ascii().eq_ignore_ascii_case(b"100-continue"));
    if expects && early.is_empty() && body != Body::Length(0) {
        // A client that went away is seen when its body is read.
        let _ = client
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .and_then(|()| client.flush());
    }
}

/// Copies the request body; a credential bound with `in_body` gets its secret in place of its
/// placeholder on the way (equal lengths: the framing holds). What is inspected is the body's
/// content: a chunked body is decoded and sent on in chunks of its own, so that a placeholder
/// split across the client's chunks is seen whole.
pub(crate) fn send_body(
    early: &[u8],
    client: &mut impl Read,
    upstream: &mut impl Write,
    body: Body,
    credential: Option<&Secret>,
    secrets: &Secrets,
) -> io::Result<u64> {
    match body {
        Body::Length(_) => send_content(early, client, upstream, body, credential, secrets),
        Body::Chunked => {
            let mut chunks = Rechunk {
                inner: upstream,
                sent: 0,
            };
            send_content(early, client, &mut chunks, body, credential, secrets)?;
            chunks.inner.write_all(b"0\r\n\r\n")?;
            Ok(chunks.sent + 5)
        }
    }
}

/// The content of the body, through the placeholder guard (and the injection of the bound
/// credential), into `out`; the bytes of content copied.
fn send_content(
    early: &[u8],
    client: &mut impl Read,
    out: &mut impl Write,
    body: Body,
    credential: Option<&Secret>,
    secrets: &Secrets,
) -> io::Result<u64> {
    // Another credential's placeholder stops the body; the bound one's (with `in_body`)
    // becomes the secret before the guard sees it.
    let mut guarded = PlaceholderGuard::new(out, secrets, credential.map(|c| c.name.as_str()));
    match credential.filter(|c| c.in_body) {
        Some(secret) => {
            let mut injecting = Replacer::injecting(&mut guarded, secret);
            let sent = copy_content(early, client, &mut injecting, body)?;
            injecting.finish()?;
            Ok(sent)
        }
        None => copy_content(early, client, &mut guarded, body),
    }
}

/// Writes each write as one chunk of a chunked body.
struct Rechunk<W> {
    inner: W,
    sent: u64,
}

impl<W: Write> Write for Rechunk<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let size = format!("{:x}\r\n", buf.len());
        self.inner.write_all(size.as_bytes())?;
        self.inner.write_all(buf)?;
        self.inner.write_all(b"\r\n")?;
        self.sent += (size.len() + buf.len() + 2) as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Copies exactly the body content that `body` announces, starting with the bytes already read
/// past the head; for a chunked body, the content of its chunks up to the last one and its
/// trailers (which are read and dropped, so that nothing the client sends after the body can
/// reach the upstream as a second request).
pub(crate) fn copy_content(
    early: &[u8],
    client: &mut impl Read,
    out: &mut impl Write,
    body: Body,
) -> io::Result<u64> {
    match body {
        Body::Length(length) => {
            let early_body = &early[..early.len().min(length as usize)];
            out.write_all(early_body)?;
            let remaining = length - early_body.len() as u64;
            io::copy(&mut client.take(remaining), out).map(|n| n + early_body.len() as u64)
        }
        Body::Chunked => {
            let mut reader = io::BufReader::new(io::Cursor::new(early.to_vec()).chain(client));
            let mut total = 0u64;
            let mut line = Vec::new();
            loop {
                read_line(&mut reader, &mut line)?;
                let size_text =
                    std::str::from_utf8(&line[..line.len() - 2]).map_err(io::Error::other)?;
                let size =
                    u64::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                        .map_err(|_| io::Error::other("malformed chunk size"))?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    loop {
                        read_line(&mut reader, &mut line)?;
                        if line == b"\r\n" {
                            return Ok(total);
                        }
                    }
                }
                let copied = io::copy(&mut (&mut reader).take(size), out)?;
                if copied < size {
                    return Err(io::Error::other("the body ended inside a chunk"));
                }
                total += copied;
                read_line(&mut reader, &mut line)?;
                if line != b"\r\n" {
                    return Err(io::Error::other("a chunk is longer than its size"));
                }
            }
        }
    }
}

/// One line of chunked framing, at most 4 KiB, ending in CRLF.
fn read_line(reader: &mut impl io::BufRead, line: &mut Vec<u8>) -> io::Result<()> {
    line.clear();
    reader.take(4096).read_until(b'\n', line)?;
    if !line.ends_with(b"\r\n") {
        return Err(io::Error::other("malformed chunked body"));
    }
    Ok(())
}

/// Headers the gateway never forwards: its own, hop-by-hop ones, and the host (it writes the
/// one it decided on).
fn dropped(name: &str) -> bool {
    name.starts_with("proxy-")
        || matches!(
            name,
            "connection" | "keep-alive" | "te" | "trailer" | "upgrade" | "host"
        )
}

/// The request sent upstream: origin form (the normalised target that was decided), exactly
/// one `Host` (the authority that was decided), no proxy or hop-by-hop headers, `Connection:
/// close`, and the bound credential (if any) in its header instead of whatever the cell sent.
/// A request that carries a credential accepts only an unencoded response, so that the secret
/// cannot come back compressed past the scrubber; so does one whose exchange is `read` (a
/// model call), so that the reply can be read as it passes.
pub(crate) fn upstream_request(
    method: &str,
    target: &str,
    authority: &str,
    headers: &[(String, Vec<u8>)],
    credential: Option<&Secret>,
    read: bool,
) -> Vec<u8> {
    let mut out = format!("{method} {target} HTTP/1.1\r\nHost: {authority}\r\n").into_bytes();
    let injected = credential.map(|c| c.header.to_ascii_lowercase());
    let unencoded = credential.is_some() || read;
    for (name, value) in headers {
        if dropped(name)
            || Some(name) == injected.as_ref()
            || (unencoded && name == "accept-encoding")
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
    if unencoded {
        out.extend_from_slice(b"Accept-Encoding: identity\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// Why a response was not relayed.
#[derive(Debug)]
pub(crate) enum ResponseError {
    /// It cannot be inspected for the secret; nothing of it reached the client.
    Refused(String),
    /// The connection to either side broke off, or the upstream's body ended before its
    /// framing did (short of its length, inside a chunk): the client must not see a clean end
    /// (`reset_on_close`), which would make a reply sent without its length look whole.
    Io,
}

/// Makes the last close of `conn` a reset (`SO_LINGER` of zero), and tells whether it could:
/// how a client hears that a reply it got without its length (delimited by the connection's
/// end) was cut short, where a clean end would say it came whole.
pub(crate) fn reset_on_close(conn: &TcpStream) -> bool {
    nix::sys::socket::setsockopt(
        conn,
        nix::sys::socket::sockopt::Linger,
        &nix::libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    )
    .is_ok()
}

impl From<io::Error> for ResponseError {
    fn from(_: io::Error) -> Self {
        Self::Io
    }
}

/// Relays the response to a request that carried a credential (or is read: a model call), with
/// every secret replaced by
/// its placeholder in what the client receives. The head is read first: a response the
/// gateway cannot inspect (an encoded body, a transfer encoding other than `chunked`, a switch
/// of protocols) is refused before any of it reaches the client; a chunked body is decoded
/// (and sent on as the end of the connection delimits it), so that a secret split across
/// chunks is seen whole. With `close_delimited` (a model call's reply, which is counted once
/// relayed), a body of a known length is sent as the end of the connection delimits it too:
/// the client hears the end only once the gateway has counted it and closes. Returns the
/// bytes read from the upstream.
pub(crate) fn relay_inspected(
    upstream: &mut impl Read,
    client: &mut impl Write,
    secrets: &Secrets,
    request_method: &str,
    close_delimited: bool,
) -> Result<u64, ResponseError> {
    let mut scrubbed = Replacer::scrubbing(client, secrets);
    let mut early = Vec::new();
    let mut read = 0u64;
    let framing = loop {
        let mut source = io::Cursor::new(std::mem::take(&mut early)).chain(&mut *upstream);
        let (head, rest) = read_head(&mut source, MAX_RESPONSE_HEAD).map_err(|e| match e {
            RequestError::TooLarge => ResponseError::Refused(
                "the upstream's response head is larger than 256 KiB".to_owned(),
            ),
            _ => ResponseError::Refused("the upstream sent no complete response head".to_owned()),
        })?;
        read += (head.len() + rest.len()) as u64;
        early = rest;
        let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let Ok(httparse::Status::Complete(_)) = response.parse(&head) else {
            return Err(ResponseError::Refused(
                "the upstream's response head is malformed".to_owned(),
            ));
        };
        let code = response.code.unwrap_or(0);
        let named: Vec<(String, &[u8])> = response
            .headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value))
            .collect();
        let original: Vec<&str> = response.headers.iter().map(|h| h.name).collect();
        let refuse = |why: String| Err(ResponseError::Refused(why));
        if code == 101 {
            return refuse("the upstream switched protocols, which the gateway cannot inspect for the credential".to_owned());
        }
        if (100..200).contains(&code) {
            // An interim response (100 Continue, 103 Early Hints): passed on, then the next.
            scrubbed.write_all(&head)?;
            continue;
        }
        let encodings: Vec<&[u8]> = named
            .iter()
            .filter(|(n, _)| n == "content-encoding")
            .map(|(_, v)| *v)
            .collect();
        if let Some(encoding) = encodings
            .iter()
            .find(|e| !e.trim_ascii().eq_ignore_ascii_case(b"identity"))
        {
            // The value is the upstream's: it goes to the cell and the record scrubbed like
            // the response itself would have been.
            return refuse(format!(
                "the upstream answered with a `{}`-encoded body although the gateway asked for none (Accept-Encoding: identity); it cannot be inspected for a credential or read as a model reply",
                secrets.scrubbed_text(&String::from_utf8_lossy(encoding))
            ));
        }
        let transfer: Vec<&[u8]> = named
            .iter()
            .filter(|(n, _)| n == "transfer-encoding")
            .map(|(_, v)| *v)
            .collect();
        let lengths: Vec<u64> = named
            .iter()
            .filter(|(n, _)| n == "content-length")
            .filter_map(|(_, v)| std::str::from_utf8(v).ok()?.trim().parse().ok())
            .collect();
        let framing = if request_method == "HEAD" || code == 204 || code == 304 {
            Framing::Framed(Body::Length(0))
        } else {
            match (transfer.as_slice(), lengths.as_slice()) {
                ([], []) => Framing::UntilClose,
                ([te], _) if te.trim_ascii().eq_ignore_ascii_case(b"chunked") => {
                    Framing::Framed(Body::Chunked)
                }
                ([], [length]) => Framing::Framed(Body::Length(*length)),
                ([], _) => return refuse("the upstream's response has several lengths".to_owned()),
                _ => {
                    return refuse(
                        "the upstream's response has a transfer encoding other than `chunked`"
                            .to_owned(),
                    );
                }
            }
        };
        // The head as sent, but for the framing of a chunked body, which is decoded here.
        let mut out = head[..head.iter().position(|b| *b == b'\n').unwrap_or(0) + 1].to_vec();
        let chunked = framing == Framing::Framed(Body::Chunked);
        for ((name, value), spelled) in named.iter().zip(&original) {
            let reframed = (chunked || close_delimited)
                && matches!(
                    name.as_str(),
                    "transfer-encoding" | "trailer" | "content-length"
                );
            if reframed || name == "connection" {
                continue;
            }
            out.extend_from_slice(spelled.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"Connection: close\r\n\r\n");
        scrubbed.write_all(&out)?;
        break framing;
    };
    let mut counted = Counted {
        inner: &mut *upstream,
        count: 0,
        until_close: framing == Framing::UntilClose,
    };
    match framing {
        Framing::UntilClose => {
            scrubbed.write_all(&early)?;
            io::copy(&mut counted, &mut scrubbed)?;
        }
        Framing::Framed(body) => {
            let copied = copy_content(&early, &mut counted, &mut scrubbed, body)?;
            // Short of its length, the body was cut (the upstream closed early): an error,
            // as a chunked body cut inside a chunk is. Sent on without its length
            // (`close_delimited`), it would otherwise end as a whole one does.
            if let Body::Length(length) = body
                && copied < length
            {
                return Err(ResponseError::Io);
            }
        }
    }
    read += counted.count;
    scrubbed.finish()?;
    Ok(read)
}

/// How a response's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Framed(Body),
    /// When the upstream closes the connection.
    UntilClose,
}

/// Counts what is read through it.
struct Counted<R> {
    inner: R,
    count: u64,
    /// The body ends when the upstream closes: a TLS upstream that closes without
    /// `close_notify` (an unexpected end to rustls) has ended it all the same, as the relay
    /// of a response it does not inspect takes it.
    until_close: bool,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match self.inner.read(buf) {
            Err(e) if self.until_close && e.kind() == io::ErrorKind::UnexpectedEof => 0,
            read => read?,
        };
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal decided on a request's head, while the client is still sending a body larger
    /// than the socket buffers hold: the client sends it whole and reads the answer (shut with
    /// the body unread, the connection was reset and the client got "Broken pipe").
    #[test]
    fn a_refused_client_still_sending_its_body_gets_the_answer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut conn = TcpStream::connect(addr).unwrap();
            let body = vec![b'x'; 16 << 20];
            let head = format!(
                "POST http://127.0.0.2/ HTTP/1.1\r\nHost: 127.0.0.2\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes())
                .and_then(|()| conn.write_all(&body))
                .map_err(|e| format!("sending: {e}"))?;
            let mut answer = String::new();
            conn.read_to_string(&mut answer)
                .map_err(|e| format!("reading: {e}"))?;
            Ok::<_, String>(answer)
        });
        let (mut conn, _) = listener.accept().unwrap();
        let mut head = [0u8; 64];
        conn.read_exact(&mut head).unwrap();
        reply(&mut conn, 403, "Forbidden", &json!({ "error": "no" }));
        let answer = client.join().unwrap().unwrap();
        assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
        assert!(answer.ends_with(r#"{"error":"no"}"#), "{answer}");
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    fn secrets() -> Secrets {
        Secrets {
            all: vec![Secret {
                name: "api".into(),
                placeholder: "PLACEHOLDERXYZ".into(),
                value: "s3cr3t-t0ken-9".into(),
                header: "Authorization".into(),
                format: "Bearer {}".into(),
                env: None,
                in_body: false,
            }],
        }
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
            headers(&[("content-length", "+5")]),
            headers(&[("content-length", "-0")]),
            headers(&[("content-length", "")]),
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
        let sent = send_body(
            early,
            &mut input.as_slice(),
            &mut out,
            Body::Chunked,
            None,
            &Secrets::default(),
        )
        .unwrap();
        // What follows the last chunk never reaches the upstream (the connection ends with
        // this one request).
        assert_eq!(out, b"4\r\nwiki\r\n5\r\npedia\r\n0\r\n\r\n");
        assert_eq!(sent, out.len() as u64);
        let mut sink = Vec::new();
        let lying = b"3\r\ntoo long\r\n0\r\n\r\n";
        assert!(copy_content(b"", &mut lying.as_slice(), &mut sink, Body::Chunked).is_err());
    }

    #[test]
    fn a_placeholder_split_across_chunks_is_seen_whole() {
        let secrets = secrets();
        // Every split of the placeholder over two chunks.
        for cut in 1..14 {
            let (a, b) = "PLACEHOLDERXYZ".split_at(cut);
            let body = format!(
                "{:x}\r\nk={a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                a.len() + 2,
                b.len()
            );
            let mut out = Vec::new();
            let err = send_body(
                b"",
                &mut body.as_bytes(),
                &mut out,
                Body::Chunked,
                None,
                &secrets,
            )
            .unwrap_err();
            assert!(err.to_string().contains("`api`"), "{err}");
            let seen = String::from_utf8_lossy(&out).replace("\r\n", "");
            assert!(!seen.contains("PLACEHOLDERXYZ"), "split at {cut}: {seen}");
        }
    }

    #[test]
    fn a_secret_in_a_chunked_response_is_scrubbed_across_chunks() {
        let secrets = secrets();
        for cut in 1..14 {
            let (a, b) = "s3cr3t-t0ken-9".split_at(cut);
            let response = format!(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                a.len(),
                b.len()
            );
            let mut out = Vec::new();
            relay_inspected(&mut response.as_bytes(), &mut out, &secrets, "GET", false).unwrap();
            let text = String::from_utf8(out).unwrap();
            assert!(
                text.ends_with("\r\n\r\nPLACEHOLDERXYZ"),
                "split at {cut}: {text}"
            );
            assert!(!text.to_ascii_lowercase().contains("transfer-encoding"));
        }
    }

    /// A model call's reply is counted once relayed: sent with its length, a client heard its
    /// end (and sent its next call, to find this one's reservation still held) before it was.
    /// Sent delimited by the end of the connection, it ends when the gateway closes.
    #[test]
    fn a_reply_delimited_by_close_loses_its_length() {
        let response =
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
        for (close_delimited, length) in [(false, true), (true, false)] {
            let mut out = Vec::new();
            relay_inspected(
                &mut response.as_bytes(),
                &mut out,
                &Secrets::default(),
                "POST",
                close_delimited,
            )
            .unwrap();
            let text = String::from_utf8(out).unwrap();
            assert_eq!(text.contains("Content-Length"), length, "{text}");
            assert!(
                text.contains("Connection: close\r\n\r\n{}") && text.ends_with("{}"),
                "{text}"
            );
        }
    }

    /// A body short of its length is an error (the client's end of it is then a reset, not
    /// the clean end of a whole one); a body delimited by the upstream's close ends there,
    /// even where a TLS upstream closed without `close_notify` (an unexpected end to rustls).
    #[test]
    fn a_body_short_of_its_length_is_cut_and_one_until_close_ends_at_any_close() {
        struct ThenUnexpectedEnd<'a>(&'a [u8]);
        impl Read for ThenUnexpectedEnd<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let n = self.0.read(buf)?;
                Ok(n)
            }
        }
        for close_delimited in [false, true] {
            let cut = "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}";
            let mut out = Vec::new();
            let result = relay_inspected(
                &mut cut.as_bytes(),
                &mut out,
                &Secrets::default(),
                "POST",
                close_delimited,
            );
            assert!(matches!(result, Err(ResponseError::Io)), "{result:?}");
            let mut out = Vec::new();
            let result = relay_inspected(
                &mut ThenUnexpectedEnd(cut.as_bytes()),
                &mut out,
                &Secrets::default(),
                "POST",
                close_delimited,
            );
            assert!(matches!(result, Err(ResponseError::Io)), "{result:?}");
            let until_close = "HTTP/1.1 200 OK\r\n\r\n{}";
            let mut out = Vec::new();
            relay_inspected(
                &mut ThenUnexpectedEnd(until_close.as_bytes()),
                &mut out,
                &Secrets::default(),
                "POST",
                close_delimited,
            )
            .unwrap();
            assert!(String::from_utf8(out).unwrap().ends_with("\r\n\r\n{}"));
        }
    }

    #[test]
    fn a_response_the_gateway_cannot_inspect_is_refused_before_any_of_it_passes() {
        let secrets = secrets();
        for response in [
            "HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
            "not http at all\r\n\r\n",
        ] {
            let mut out = Vec::new();
            let result =
                relay_inspected(&mut response.as_bytes(), &mut out, &secrets, "GET", false);
            assert!(
                matches!(result, Err(ResponseError::Refused(_))),
                "{response:?}: {result:?}"
            );
            assert!(out.is_empty(), "{response:?} passed in part");
        }
        // A secret echoed in a header is scrubbed too; an interim response passes before.
        let echoed = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Echo: Bearer s3cr3t-t0ken-9\r\nContent-Length: 2\r\n\r\nok";
        let mut out = Vec::new();
        relay_inspected(&mut echoed.as_bytes(), &mut out, &secrets, "GET", false).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"),
            "{text}"
        );
        assert!(text.contains("X-Echo: Bearer PLACEHOLDERXYZ"), "{text}");
        assert!(text.ends_with("\r\n\r\nok"), "{text}");
    }

    #[test]
    fn a_refusal_never_hands_the_cell_a_secret_the_upstream_put_in_the_refused_header() {
        let secrets = secrets();
        // An upstream that reflects the request's Authorization into the header the refusal
        // names.
        let response = "HTTP/1.1 200 OK\r\nContent-Encoding: Bearer s3cr3t-t0ken-9\r\nContent-Length: 2\r\n\r\nok";
        let mut out = Vec::new();
        let result = relay_inspected(&mut response.as_bytes(), &mut out, &secrets, "GET", false);
        let Err(ResponseError::Refused(reason)) = result else {
            panic!("not refused: {result:?}");
        };
        assert!(!reason.contains("s3cr3t-t0ken-9"), "{reason}");
        assert!(
            reason.contains("`Bearer PLACEHOLDERXYZ`-encoded"),
            "{reason}"
        );
        assert!(out.is_empty());
    }

    #[test]
    fn a_request_carrying_a_credential_accepts_only_identity_and_has_one_host() {
        let secret = &secrets().all[0];
        let out = upstream_request(
            "GET",
            "/x",
            "api.test",
            &headers(&[
                ("host", "api.test"),
                ("host", "evil.test"),
                ("accept-encoding", "gzip, br"),
                ("authorization", "Bearer PLACEHOLDERXYZ"),
            ]),
            Some(secret),
            false,
        );
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer s3cr3t-t0ken-9\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n"
        );
    }
}
