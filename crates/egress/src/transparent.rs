//! Connections redirected to the gateway by nftables in the cell's namespace, from clients that
//! ignore the proxy variables. The destination is where the client connected; the name is the
//! TLS server name or the Host header of the client's first bytes (or the name the gateway's
//! DNS resolved to that address), and it must resolve to that destination.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::host::{Host, split_authority};
use crate::proxy::{Gateway, Via};
use crate::redirected::original_destination;
use crate::rules::{Request, Rules, Verdict};
use crate::sni::Hello;
use crate::tunnel::{first_bytes, looks_http};

/// How long a redirected connection may stay silent before it is decided on its address alone.
const FIRST_BYTES_WAIT: Duration = Duration::from_secs(3);

impl Gateway {
    /// A redirected connection (`TCP_NODELAY` on: see `proxy::Acceptor`), accepted on an IPv6
    /// listener or not.
    pub(crate) fn transparent(&self, mut conn: TcpStream, ipv6: bool) {
        let Some(destination) = original_destination(&conn, ipv6) else {
            return;
        };
        // The client's first bytes name the host (TLS server name or HTTP Host); a client that
        // waits for the server to speak first is decided on the address alone.
        let early = first_bytes(
            &mut conn,
            Vec::new(),
            FIRST_BYTES_WAIT,
            crate::bounds::HEAD_TIMEOUT,
        )
        .unwrap_or_default();
        let _ = conn.set_read_timeout(Some(self.bounds.idle));
        let http = looks_http(&early);
        let (tls, claimed) = match crate::sni::client_hello(&early) {
            Hello::Tls(name) => (true, name.map(Ok)),
            Hello::Malformed(why) => {
                let reason = format!("the TLS ClientHello was refused: {why}");
                return self.refuse_transparent(&mut conn, destination, false, reason);
            }
            _ if http => (false, http_host(&early)),
            _ => (false, None),
        };
        let host = match claimed {
            Some(Ok(raw)) => match split_authority(&raw, destination.port()).map(|(h, _)| h) {
                Ok(host) => host,
                Err(e) => {
                    return self.refuse_transparent(&mut conn, destination, http, e.to_string());
                }
            },
            Some(Err(reason)) => {
                return self.refuse_transparent(&mut conn, destination, http, reason);
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
        // Plain HTTP is always decided request by request (and one request a connection, as
        // through the proxy): relayed raw after its first head, a kept-alive connection could
        // carry a next request for another host at the same address. TLS is opened up where
        // rules on methods, paths or credentials decide what goes through it.
        let opened_up =
            rules.intercepts(&host, port) || rules.decides_requests_at(port, destination.ip());
        if http || (tls && opened_up) {
            // Each request is decided inside, as for a proxied one, once the name is known to
            // lead where the client connected.
            if let Err(verdict) = self.pinned(&rules, &host, destination) {
                let mut decision =
                    self.record("transparent", &host.as_text(), port, None, &verdict);
                decision.address = Some(destination.to_string());
                return if http {
                    self.deny(&mut conn, &decision)
                } else {
                    self.log_decision(&decision)
                };
            }
            let via = Via::Redirected(destination);
            return match &self.interceptor {
                Some(interceptor) if tls => {
                    self.intercept(interceptor, conn, host, port, early, via);
                }
                _ if http => self.transparent_http(conn, &host, early, via),
                _ => {
                    let verdict = Verdict::new(
                        false,
                        "interception",
                        "TLS interception is not set up for this cell",
                    );
                    let mut decision =
                        self.record("transparent", &host.as_text(), port, None, &verdict);
                    decision.address = Some(destination.to_string());
                    self.log_decision(&decision);
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
        if verdict.allowed && opened_up {
            verdict = Verdict::new(
                false,
                &verdict.rule,
                "this destination's rules decide HTTP requests, and the client spoke neither HTTP nor TLS",
            );
        }
        if verdict.allowed
            && let Err(refused) = self.pinned(&rules, &host, destination)
        {
            verdict = refused;
        }
        let mut decision = self.record("transparent", &host.as_text(), port, None, &verdict);
        decision.address = Some(destination.to_string());
        if !verdict.allowed {
            // An HTTP client gets the 403 that says why (and `deny` records it); others are closed.
            if http {
                self.deny(&mut conn, &decision);
            } else {
                self.log_decision(&decision);
            }
            return;
        }
        let Ok(upstream) = TcpStream::connect_timeout(&destination, crate::proxy::CONNECT_TIMEOUT)
        else {
            decision.allowed = false;
            decision.reason = format!("connecting to {destination} failed");
            self.log_decision(&decision);
            return;
        };
        let _ = upstream.set_nodelay(true);
        self.relay_tunnel(conn, upstream, &host, port, &early, decision, None);
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
        let request = Request {
            host,
            port: destination.port(),
            http: None,
        };
        if let Some(rule) = rules.denied_at(&request, destination.ip()) {
            return Err(Verdict::new(
                false,
                rule,
                &format!(
                    "the client connected to {}, which the rule denies",
                    destination.ip()
                ),
            ));
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
            self.log_decision(&decision);
        }
    }
}

/// The Host header of a whole request head at the start of `bytes` (none while the head is not
/// whole: its body, or the bytes of a second request, never name the host). Several Host
/// headers are an error.
fn http_host(bytes: &[u8]) -> Option<Result<String, String>> {
    let head = crate::tunnel::http_head(bytes).ok()??;
    head.host.transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_comes_from_the_head_only() {
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"),
            Some(Ok("a.test".to_owned()))
        );
        // A body (or anything past the head) naming a host is not a Host header.
        assert_eq!(
            http_host(b"POST / HTTP/1.1\r\nContent-Length: 20\r\n\r\nHost: allowed.test\r\n"),
            None
        );
        assert_eq!(http_host(b"GET / HTTP/1.1\r\nX: 1\r\nHost: a.test"), None);
        assert!(matches!(
            http_host(b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n"),
            Some(Err(_))
        ));
    }
}
