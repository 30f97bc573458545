//! DNS for the cell, answered by the warden: a name the rules let out is resolved by the host
//! (once) and answered; any other name gets NXDOMAIN and never leaves the host, so queries cannot
//! carry data out. The addresses handed out are remembered, so that a connection redirected to
//! the gateway without a name of its own is decided by the name it was resolved from.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

use simple_dns::rdata::{A, AAAA, RData};
use simple_dns::{CLASS, Packet, PacketFlag, QTYPE, RCODE, ResourceRecord, TYPE};

use crate::host::Host;
use crate::proxy::Gateway;

const TTL: u32 = 30;

impl Gateway {
    /// Answers queries on `socket` (UDP, the cell's 127.0.0.1:53) until it fails.
    pub fn serve_dns(self, socket: UdpSocket) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            if socket.set_nonblocking(false).is_err() {
                return;
            }
            loop {
                let (n, from) = match socket.recv_from(&mut buf) {
                    Ok(got) => got,
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::Interrupted
                                | ErrorKind::ConnectionRefused
                                | ErrorKind::ConnectionReset
                        ) =>
                    {
                        continue;
                    }
                    // The cell's network is gone: nothing more will come.
                    Err(_) => return,
                };
                if let Some(reply) = self.answer(&buf[..n]) {
                    let _ = socket.send_to(&reply, from);
                }
            }
        })
    }

    fn answer(&self, query: &[u8]) -> Option<Vec<u8>> {
        let query = Packet::parse(query).ok()?;
        let mut reply = Packet::new_reply(query.id());
        reply.set_flags(PacketFlag::RECURSION_AVAILABLE);
        let Some(question) = query.questions.first() else {
            *reply.rcode_mut() = RCODE::FormatError;
            return reply.build_bytes_vec().ok();
        };
        reply.questions.push(question.clone());
        let wanted = match question.qtype {
            QTYPE::TYPE(TYPE::A) => Some(false),
            QTYPE::TYPE(TYPE::AAAA) => Some(true),
            _ => None,
        };
        let name = question.qname.to_string();
        let host = match Host::parse(&name) {
            Ok(host @ Host::Name(_)) => host,
            _ => {
                *reply.rcode_mut() = RCODE::NameError;
                return reply.build_bytes_vec().ok();
            }
        };
        let rules = self.rules();
        let verdict = rules.decide_name(&host);
        let mut decision = self.record("dns", &host.as_text(), 53, None, &verdict);
        if !verdict.allowed {
            self.log_decision(&decision);
            *reply.rcode_mut() = RCODE::NameError;
            return reply.build_bytes_vec().ok();
        }
        let addresses: Vec<IpAddr> = (host.as_text().as_str(), 0)
            .to_socket_addrs()
            .map(|addrs| addrs.map(|a: SocketAddr| a.ip()).collect())
            .unwrap_or_default();
        let usable: Vec<IpAddr> = addresses
            .into_iter()
            .filter(|ip| rules.address_allowed_any_port(&host, *ip))
            .collect();
        let mut shown = Vec::new();
        for ip in &usable {
            self.remember(*ip, &host);
            let rdata = match (ip, wanted) {
                (IpAddr::V4(v4), Some(false)) => RData::A(A {
                    address: u32::from(*v4),
                }),
                (IpAddr::V6(v6), Some(true)) => RData::AAAA(AAAA {
                    address: u128::from(*v6),
                }),
                _ => continue,
            };
            shown.push(ip.to_string());
            reply.answers.push(ResourceRecord::new(
                question.qname.clone(),
                CLASS::IN,
                TTL,
                rdata,
            ));
        }
        if usable.is_empty() {
            decision.reason =
                "no usable address (none, or only private ones no rule names)".to_owned();
        }
        decision.address = (!shown.is_empty()).then(|| shown.join(","));
        self.log_decision(&decision);
        reply.build_bytes_vec().ok()
    }
}
