//! DNS for the cell, answered by the warden: a name the rules let out is resolved by the host
//! (once) and answered; any other name gets NXDOMAIN and never leaves the host, so queries cannot
//! carry data out. The addresses handed out are remembered, so that a connection redirected to
//! the gateway without a name of its own is decided by the name it was resolved from.

use std::io::ErrorKind;
use std::net::{IpAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use simple_dns::rdata::{A, AAAA, RData};
use simple_dns::{CLASS, Packet, PacketFlag, QTYPE, RCODE, ResourceRecord, TYPE};

use crate::host::Host;
use crate::proxy::Gateway;

const TTL: u32 = 30;
/// Host lookups one cell may have in flight; a query that needs one more gets SERVFAIL at once
/// (the cell's resolver retries), so a flood of queries cannot make threads without end.
const MAX_LOOKUPS: usize = 16;
/// How long a spare answering thread waits for a query before it ends.
const SPARE_IDLE: Duration = Duration::from_secs(30);

/// The threads answering one cell's queries. Each receives a query and answers it itself, so
/// an answer costs no hand-over between threads; a thread about to wait on the host's resolver
/// (which may take seconds) first makes sure another one is receiving, so one slow name never
/// holds back the cell's other queries.
struct Answerers {
    gateway: Gateway,
    socket: UdpSocket,
    /// Threads alive, and those of them waiting for a query.
    threads: AtomicUsize,
    idle: AtomicUsize,
}

impl Gateway {
    /// Answers queries on `socket` (UDP, the cell's 127.0.0.1:53) until it fails.
    pub fn serve_dns(self, socket: UdpSocket) -> std::io::Result<std::thread::JoinHandle<()>> {
        let answerers = Arc::new(Answerers {
            gateway: self,
            socket,
            threads: AtomicUsize::new(1),
            idle: AtomicUsize::new(0),
        });
        std::thread::Builder::new()
            .name("egress-dns".to_owned())
            .spawn(move || {
                if answerers.socket.set_nonblocking(false).is_ok()
                    && answerers.socket.set_read_timeout(Some(SPARE_IDLE)).is_ok()
                {
                    answerers.answer_queries(true);
                }
            })
    }

    /// Answers `query`. Before a host lookup, `may_wait` is asked whether this thread may wait
    /// on the host's resolver; when it says no, the answer is SERVFAIL.
    fn answer(&self, query: &[u8], may_wait: impl FnOnce() -> bool) -> Option<Vec<u8>> {
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
        let addresses = if verdict.lookup == warden_policy::NameLookup::Connected {
            // Only what a lookup for an allowed connection found: the query itself never
            // leaves the host.
            let known = self
                .looked_up
                .lock()
                .ok()
                .and_then(|l| l.get(&host.as_text()));
            let Some(known) = known else {
                decision.allowed = false;
                decision.reason = "the rule answers only names the gateway looked up for a connection it allowed (dns: connected), and none was made to this name yet".to_owned();
                self.log_decision(&decision);
                *reply.rcode_mut() = RCODE::NameError;
                return reply.build_bytes_vec().ok();
            };
            known
        } else {
            if !may_wait() {
                *reply.rcode_mut() = RCODE::ServerFailure;
                return reply.build_bytes_vec().ok();
            }
            self.lookup(&host.as_text()).unwrap_or_default()
        };
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

impl Answerers {
    /// Receives and answers queries; the first thread until the socket fails, a spare one
    /// also until it has waited [`SPARE_IDLE`] for a query.
    fn answer_queries(self: &Arc<Self>, first: bool) {
        let mut buf = [0u8; 4096];
        loop {
            self.idle.fetch_add(1, Ordering::AcqRel);
            let received = self.socket.recv_from(&mut buf);
            self.idle.fetch_sub(1, Ordering::AcqRel);
            let (n, from) = match received {
                Ok(got) => got,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if first {
                        continue;
                    }
                    break;
                }
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
                Err(_) => break,
            };
            let may_wait = || self.idle.load(Ordering::Acquire) > 0 || self.add_spare();
            if let Some(reply) = self.gateway.answer(&buf[..n], may_wait) {
                let _ = self.socket.send_to(&reply, from);
            }
        }
        self.threads.fetch_sub(1, Ordering::AcqRel);
    }

    /// Starts one more answering thread, unless as many wait on lookups as may.
    fn add_spare(self: &Arc<Self>) -> bool {
        if self
            .threads
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n <= MAX_LOOKUPS).then_some(n + 1)
            })
            .is_err()
        {
            return false;
        }
        let answerers = Arc::clone(self);
        let started = std::thread::Builder::new()
            .name("egress-dns".to_owned())
            .spawn(move || answerers.answer_queries(false));
        if started.is_err() {
            self.threads.fetch_sub(1, Ordering::AcqRel);
        }
        started.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::{Name, QCLASS, Question};
    use std::net::{Ipv4Addr, SocketAddr};
    use std::time::Instant;
    use warden_policy::{NetRule, Network};

    /// A gateway that lets out `*.test`, looks names up with `resolver`, and serves DNS on a
    /// loopback port; returns that port's address.
    fn dns_gateway(resolver: crate::Resolver) -> SocketAddr {
        // Denied by default; `*.test` let out on every port.
        let network = Network {
            allow: vec![NetRule {
                host: "*.test".into(),
                ports: vec![],
                methods: vec![],
                paths: vec![],
                credential: None,
                dns: warden_policy::NameLookup::Any,
            }],
            ..Network::default()
        };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let log = std::env::temp_dir().join(format!(
            "warden-dns-test-{}-{}.jsonl",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let gateway = Gateway::new(
            crate::Rules::compile(&network).unwrap(),
            &log,
            "test",
            crate::Secrets::default(),
            None,
            crate::Bounds::default(),
        )
        .unwrap()
        .with_resolver(resolver);
        // The log stays open in the gateway; its name is not needed.
        let _ = std::fs::remove_file(&log);
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let address = socket.local_addr().unwrap();
        gateway.serve_dns(socket).unwrap();
        address
    }

    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut packet = Packet::new_query(id);
        packet.questions.push(Question::new(
            Name::new(name).unwrap(),
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        packet.build_bytes_vec().unwrap()
    }

    /// The next reply: its id, its rcode, and its A records.
    fn reply(client: &UdpSocket) -> (u16, RCODE, Vec<Ipv4Addr>) {
        let mut buf = [0u8; 4096];
        let n = client.recv(&mut buf).expect("no answer came");
        let packet = Packet::parse(&buf[..n]).unwrap();
        let addresses = packet
            .answers
            .iter()
            .filter_map(|r| match &r.rdata {
                RData::A(a) => Some(Ipv4Addr::from(a.address)),
                _ => None,
            })
            .collect();
        (packet.id(), packet.rcode(), addresses)
    }

    #[test]
    fn a_slow_lookup_does_not_hold_back_the_cells_other_queries() {
        let server = dns_gateway(Arc::new(|name: &str| {
            if name.starts_with("slow") {
                std::thread::sleep(Duration::from_millis(1500));
            }
            Ok(vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7))])
        }));
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let sent = Instant::now();
        client.send_to(&query(1, "slow.test"), server).unwrap();
        client.send_to(&query(2, "fast.test"), server).unwrap();
        client.send_to(&query(3, "denied.example"), server).unwrap();
        let mut order = Vec::new();
        for _ in 0..3 {
            let (id, rcode, addresses) = reply(&client);
            order.push((id, sent.elapsed()));
            match id {
                1 | 2 => {
                    assert_eq!(rcode, RCODE::NoError);
                    assert_eq!(addresses, vec![Ipv4Addr::new(192, 0, 2, 7)]);
                }
                3 => assert_eq!(rcode, RCODE::NameError),
                other => panic!("an answer to a query never sent: {other}"),
            }
        }
        let at = |id| {
            order
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, t)| *t)
                .unwrap()
        };
        assert!(
            at(2) < Duration::from_millis(1000) && at(3) < Duration::from_millis(1000),
            "the fast and the denied names waited for the slow one: {order:?}"
        );
        assert!(at(1) >= Duration::from_millis(1500), "{order:?}");
    }

    #[test]
    fn lookups_beyond_the_limit_get_servfail_at_once_and_the_rest_are_answered() {
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let held = Arc::clone(&gate);
        let server = dns_gateway(Arc::new(move |_name: &str| {
            let (open, opened) = &*held;
            let mut open = open.lock().unwrap();
            while !*open {
                open = opened.wait(open).unwrap();
            }
            Ok(vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 8))])
        }));
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        for id in 0..MAX_LOOKUPS as u16 {
            client
                .send_to(&query(id, &format!("n{id}.test")), server)
                .unwrap();
            // Each takes a thread of its own before the next comes.
            std::thread::sleep(Duration::from_millis(20));
        }
        client.send_to(&query(999, "more.test"), server).unwrap();
        let (id, rcode, _) = reply(&client);
        assert_eq!((id, rcode), (999, RCODE::ServerFailure));
        {
            let (open, opened) = &*gate;
            *open.lock().unwrap() = true;
            opened.notify_all();
        }
        let mut answered: Vec<u16> = (0..MAX_LOOKUPS)
            .map(|_| {
                let (id, rcode, addresses) = reply(&client);
                assert_eq!(rcode, RCODE::NoError);
                assert_eq!(addresses, vec![Ipv4Addr::new(192, 0, 2, 8)]);
                id
            })
            .collect();
        answered.sort_unstable();
        assert_eq!(answered, (0..MAX_LOOKUPS as u16).collect::<Vec<_>>());
    }
}
