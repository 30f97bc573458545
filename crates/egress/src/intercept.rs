//! Opened-up TLS, for destinations whose rules decide methods, paths or bind a credential: TLS
//! with the cell's CA toward the client, one request checked and decided as a plain one is
//! (its Host included: it must name the host the tunnel was opened for), the bound credential
//! added, TLS verified toward the upstream, and the response inspected for secrets on its way
//! back. A model call in it is read and counted (`inference`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use serde_json::json;

use crate::forward::{Checked, authority, placeholder_refusal};
use crate::host::Host;
use crate::http::{self, ParsedRequest, RequestError, ResponseError, write_reply};
use crate::inference::Tap;
use crate::prefixed::Prefixed;
use crate::proxy::{Gateway, Via, refusal_body};
use crate::secrets::Replacer;
use crate::tls::Interceptor;

impl Gateway {
    /// Opens up a connection's TLS (a CONNECT tunnel answered already, or a redirected
    /// connection), with the client's first bytes `early`.
    pub(crate) fn intercept(
        &self,
        interceptor: &Interceptor,
        conn: TcpStream,
        host: Host,
        port: u16,
        early: Vec<u8>,
        via: Via,
    ) {
        let name = host.as_text();
        let (Ok(config), Ok(inner)) = (interceptor.server_for(&name), conn.try_clone()) else {
            return;
        };
        let Ok(server) = rustls::ServerConnection::new(config) else {
            return;
        };
        // The handshake and the request head, under one deadline.
        let until = Instant::now() + crate::bounds::HEAD_TIMEOUT;
        let mut client = rustls::StreamOwned::new(server, Prefixed::new(early, inner, Some(until)));
        let ParsedRequest {
            method,
            target: path,
            headers,
            mut rest,
        } = match http::read_request(&mut client) {
            Ok(request) => request,
            Err(RequestError::Malformed) => {
                return write_reply(
                    &mut client,
                    400,
                    "Bad Request",
                    &json!({"error": "malformed HTTP request"}),
                );
            }
            Err(RequestError::TimedOut) => {
                return write_reply(
                    &mut client,
                    408,
                    "Request Timeout",
                    &json!({"error": "the request head did not arrive whole within the gateway's deadline"}),
                );
            }
            Err(RequestError::TooLarge | RequestError::Io) => return,
        };
        client.sock.until = None;
        let sni = client.conn.server_name().map(str::to_owned);
        let kind = via.kind("https");
        let Checked {
            verdict,
            mut decision,
            target,
            body,
        } = self.check_request(kind, &host, port, 443, &method, &path, &headers, true);
        if decision.allowed
            && sni
                .as_deref()
                .is_none_or(|s| s.trim_end_matches('.') != name)
            && matches!(host, Host::Name(_))
        {
            decision.allowed = false;
            decision.reason = format!(
                "the TLS server name `{}` is not the host `{name}` the tunnel was opened for",
                sni.unwrap_or_default()
            );
        }
        // A model call (a coding agent speaking to its provider itself) is read and counted as
        // on the inference route, and held to its budget.
        let read = crate::inference::model_call(&method, &target.path);
        // Its reservation of the budget is given back when it is counted, or on any way out;
        // on a refusal from here on, before the client hears it (as in `forward_to`).
        let mut reservation = if read && decision.allowed {
            let _ = conn.set_read_timeout(Some(self.bounds.idle));
            match self.admit_call(&mut decision, &mut client, &headers, body, &mut rest, false) {
                Ok(reservation) => reservation,
                Err(body) => {
                    write_reply(&mut client, 429, "Too Many Requests", &body);
                    client.conn.send_close_notify();
                    let _ = client.flush();
                    return;
                }
            }
        } else {
            None
        };
        let upstream_tcp = if decision.allowed {
            match self.connect_via(&host, port, via, Some((&method, &target.path))) {
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
        let refuse = |client: &mut rustls::StreamOwned<rustls::ServerConnection, Prefixed>,
                      decision: &crate::Decision| {
            self.log_decision(decision);
            write_reply(client, 403, "Forbidden", &refusal_body(decision));
            client.conn.send_close_notify();
            let _ = client.flush();
        };
        let (Some(upstream_tcp), Ok(server_name)) = (
            upstream_tcp,
            rustls::pki_types::ServerName::try_from(name.clone()),
        ) else {
            drop(reservation.take());
            return refuse(&mut client, &decision);
        };
        let _tracked = self.track(
            &host,
            port,
            Some((&method, &target.path)),
            &conn,
            &upstream_tcp,
        );
        let _ = upstream_tcp.set_read_timeout(Some(self.bounds.idle));
        let _ = conn.set_read_timeout(Some(self.bounds.idle));
        let Ok(tls) = rustls::ClientConnection::new(interceptor.client(), server_name) else {
            drop(reservation.take());
            return;
        };
        let mut upstream =
            rustls::StreamOwned::new(tls, Prefixed::new(Vec::new(), upstream_tcp, None));
        let credential = verdict
            .credential
            .as_deref()
            .and_then(|n| self.secrets.get(n));
        let out = http::upstream_request(
            &method,
            &target.forwarded,
            &authority(&host, port, 443),
            &headers,
            credential,
            read,
        );
        let started = Instant::now();
        let (mut request_kept, mut response_kept) = (Vec::new(), Vec::new());
        let sent = upstream.write_all(&out).and_then(|()| {
            http::go_on(&mut client, &headers, body, &rest);
            let mut tap = Tap {
                inner: &mut upstream,
                kept: &mut request_kept,
            };
            let to: &mut dyn Write = if read { &mut tap } else { tap.inner };
            http::send_body(
                &rest,
                &mut client,
                &mut &mut *to,
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
                drop(reservation.take());
                return refuse(&mut client, &decision);
            }
            Err(e) => {
                decision.allowed = false;
                decision.reason = format!("talking TLS to the upstream: {e}");
                drop(reservation.take());
                self.log_decision(&decision);
                return write_reply(
                    &mut client,
                    502,
                    "Bad Gateway",
                    &json!({"error": decision.reason}),
                );
            }
        }
        if credential.is_some() || read {
            let mut cut = false;
            let mut tap = Tap {
                inner: &mut client,
                kept: &mut response_kept,
            };
            let to: &mut dyn Write = if read { &mut tap } else { tap.inner };
            let relayed =
                http::relay_inspected(&mut upstream, &mut &mut *to, &self.secrets, &method, read);
            match relayed {
                Ok(n) => decision.bytes_down = n,
                Err(ResponseError::Refused(reason)) => {
                    decision.allowed = false;
                    decision.reason = format!("response refused: {reason}");
                    // Given back before the client hears the refusal (as in `forward_to`).
                    drop(reservation.take());
                    write_reply(
                        &mut client,
                        502,
                        "Bad Gateway",
                        &json!({"error": decision.reason}),
                    );
                }
                // Cut (either side broke off, or the upstream's body ended short of its
                // framing): no close_notify, and a reset, for a clean end would make a reply
                // sent on without its length look whole to the client.
                Err(ResponseError::Io) => {
                    cut = true;
                    http::reset_on_close(&conn);
                }
            }
            // Counted before the client hears the end (as in `forward_to`).
            if read {
                decision.inference = self.read_exchange(
                    &target.path,
                    &request_kept,
                    &response_kept,
                    started.elapsed(),
                    false,
                    (decision.bytes_up, decision.bytes_down),
                    reservation,
                );
            }
            if !cut {
                client.conn.send_close_notify();
                let _ = client.flush();
            }
        } else {
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
        }
        self.log_decision(&decision);
    }
}
