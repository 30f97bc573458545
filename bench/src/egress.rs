//! Egress benchmark: small HTTP requests and 100 MiB downloads through the warden's gateway
//! beside the same traffic sent directly, on loopback, in one run; plain HTTP, and HTTPS both
//! direct and through the gateway's TLS interception. The gateway is the real one
//! (`warden-egress`), serving a listener on the host's loopback exactly as it serves the one in
//! a cell's namespace. Then name lookups: the gateway's DNS answering over UDP beside the host's
//! own resolver for the same name.
//!
//! Usage: `egress [--requests N]`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use warden_policy::{NetRule, Network, NetworkDefault};

const DOWNLOAD: usize = 100 << 20;
/// Downloads per path; the median rate is reported.
const DOWNLOADS: usize = 9;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Answers `/small` with 2 bytes and `/big` with 100 MiB, then closes.
fn serve(mut conn: impl Read + Write) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    if head.windows(4).any(|w| w == b"/big") {
        let chunk = vec![b'x'; 1 << 20];
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {DOWNLOAD}\r\nConnection: close\r\n\r\n"
        );
        for _ in 0..DOWNLOAD / chunk.len() {
            if conn.write_all(&chunk).is_err() {
                return;
            }
        }
    } else {
        let _ =
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
    }
    let _ = conn.flush();
}

/// A plain upstream and a TLS one (certificate signed by a fresh CA, returned as PEM).
fn upstreams() -> Result<(SocketAddr, SocketAddr, String)> {
    let plain = TcpListener::bind("127.0.0.2:0")?;
    let plain_addr = plain.local_addr()?;
    std::thread::spawn(move || {
        for conn in plain.incoming().flatten() {
            std::thread::spawn(move || serve(conn));
        }
    });
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.2".to_owned()])?.signed_by(&key, &ca)?;
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )?,
    );
    let tls = TcpListener::bind("127.0.0.2:0")?;
    let tls_addr = tls.local_addr()?;
    std::thread::spawn(move || {
        for tcp in tls.incoming().flatten() {
            let config = config.clone();
            std::thread::spawn(move || {
                if let Ok(conn) = rustls::ServerConnection::new(config) {
                    let mut stream = rustls::StreamOwned::new(conn, tcp);
                    serve(&mut stream);
                    stream.conn.send_close_notify();
                    let _ = stream.flush();
                }
            });
        }
    });
    Ok((plain_addr, tls_addr, ca.pem()))
}

fn client_config(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    Ok(Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
}

/// How a request travels.
enum Path {
    Direct(SocketAddr),
    Proxied {
        proxy: SocketAddr,
        upstream: SocketAddr,
    },
    DirectTls(SocketAddr, Arc<rustls::ClientConfig>),
    InterceptedTls {
        proxy: SocketAddr,
        upstream: SocketAddr,
        trust: Arc<rustls::ClientConfig>,
    },
}

fn read_all(mut stream: impl Read) -> usize {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return total,
            Ok(n) => total += n,
        }
    }
}

/// One request over a fresh connection; returns the bytes of the response.
fn get(path: &Path, target: &str) -> Result<usize> {
    let origin = |addr: SocketAddr| {
        format!("GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
    };
    let tls_get = |tcp: TcpStream,
                   trust: &Arc<rustls::ClientConfig>,
                   upstream: SocketAddr|
     -> Result<usize> {
        let name = ServerName::try_from("127.0.0.2")?;
        let mut tls =
            rustls::StreamOwned::new(rustls::ClientConnection::new(trust.clone(), name)?, tcp);
        tls.write_all(origin(upstream).as_bytes())?;
        Ok(read_all(tls))
    };
    match path {
        Path::Direct(addr) => {
            let mut tcp = TcpStream::connect(addr)?;
            tcp.write_all(origin(*addr).as_bytes())?;
            Ok(read_all(tcp))
        }
        Path::Proxied { proxy, upstream } => {
            let mut tcp = TcpStream::connect(proxy)?;
            write!(
                tcp,
                "GET http://{upstream}{target} HTTP/1.1\r\nHost: {upstream}\r\nConnection: close\r\n\r\n"
            )?;
            Ok(read_all(tcp))
        }
        Path::DirectTls(addr, trust) => tls_get(TcpStream::connect(addr)?, trust, *addr),
        Path::InterceptedTls {
            proxy,
            upstream,
            trust,
        } => {
            let mut tcp = TcpStream::connect(proxy)?;
            write!(tcp, "CONNECT {upstream} HTTP/1.1\r\n\r\n")?;
            let mut reply = Vec::new();
            let mut byte = [0u8; 1];
            while !reply.ends_with(b"\r\n\r\n") {
                if tcp.read(&mut byte)? == 0 {
                    bail!("the gateway closed the tunnel");
                }
                reply.push(byte[0]);
            }
            if !reply.starts_with(b"HTTP/1.1 200") {
                bail!("the gateway refused: {}", String::from_utf8_lossy(&reply));
            }
            tls_get(tcp, trust, *upstream)
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<()> {
    let mut requests = 2000usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--requests" => requests = args.next().context("--requests needs a number")?.parse()?,
            other => bail!("unknown argument {other}; usage: egress [--requests N]"),
        }
    }
    let (plain, tls, upstream_ca) = upstreams()?;
    let ca_file =
        std::env::temp_dir().join(format!("warden-bench-egress-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, &upstream_ca)?;
    let rule = |port: u16, paths: Vec<String>| NetRule {
        host: "127.0.0.2".into(),
        ports: vec![port],
        methods: vec![],
        paths,
        credential: None,
        dns: warden_policy::NameLookup::Any,
    };
    let network = Network {
        default: NetworkDefault::Deny,
        // A path rule on the TLS upstream makes the gateway open its TLS up.
        allow: vec![
            rule(plain.port(), vec![]),
            rule(tls.port(), vec!["/**".to_owned()]),
            NetRule {
                host: "localhost".into(),
                ports: vec![],
                methods: vec![],
                paths: vec![],
                credential: None,
                dns: warden_policy::NameLookup::Any,
            },
        ],
        deny: vec![],
        ask: vec![],
        extra_ca: Some(ca_file.clone()),
        gateway: false,
        inference: None,
    };
    let interceptor = warden_egress::Interceptor::new("bench", Some(&ca_file))?;
    let cell_trust = client_config(&interceptor.ca_pem())?;
    let log =
        std::env::temp_dir().join(format!("warden-bench-egress-{}.jsonl", std::process::id()));
    let rules = warden_egress::Rules::compile(&network)?;
    let gateway = warden_egress::Gateway::new(
        rules,
        &log,
        "bench",
        warden_egress::Secrets::default(),
        Some(interceptor),
        warden_egress::Bounds::default(),
    )?;
    let dns = UdpSocket::bind("127.0.0.1:0")?;
    let dns_address = dns.local_addr()?;
    gateway.clone().serve_dns(dns)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let proxy = listener.local_addr()?;
    gateway.serve(listener)?;

    let paths = [
        ("HTTP, direct", Path::Direct(plain)),
        (
            "HTTP, through the gateway",
            Path::Proxied {
                proxy,
                upstream: plain,
            },
        ),
        (
            "HTTPS, direct",
            Path::DirectTls(tls, client_config(&upstream_ca)?),
        ),
        (
            "HTTPS, intercepted",
            Path::InterceptedTls {
                proxy,
                upstream: tls,
                trust: cell_trust,
            },
        ),
    ];
    let mut rows = Vec::new();
    for (name, path) in &paths {
        for _ in 0..20 {
            get(path, "/small")?;
        }
        let mut samples = Vec::with_capacity(requests);
        let started = Instant::now();
        for _ in 0..requests {
            let t = Instant::now();
            get(path, "/small")?;
            samples.push(t.elapsed());
        }
        let per_second = requests as f64 / started.elapsed().as_secs_f64();
        samples.sort();
        rows.push((
            *name,
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            per_second,
            0.0,
        ));
    }
    // Downloads take turns across the paths, so that a slow moment of the host falls on all of
    // them alike rather than on whichever path ran then.
    let mut rates = vec![Vec::with_capacity(DOWNLOADS); paths.len()];
    for _ in 0..DOWNLOADS {
        for ((name, path), rates) in paths.iter().zip(&mut rates) {
            let t = Instant::now();
            let bytes = get(path, "/big")?;
            if bytes < DOWNLOAD {
                bail!("{name}: the download ended after {bytes} bytes");
            }
            rates.push(bytes as f64 / (1 << 20) as f64 / t.elapsed().as_secs_f64());
        }
    }
    for (row, mut rates) in rows.iter_mut().zip(rates) {
        rates.sort_by(f64::total_cmp);
        row.4 = rates[rates.len() / 2];
    }
    let lookups = lookups(requests, dns_address)?;
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(&ca_file);
    println!(
        "egress on loopback: {requests} small requests (a new connection each), {DOWNLOADS} downloads of 100 MiB (median rate)"
    );
    println!();
    println!(
        "| {:<26} | {:>11} | {:>9} | {:>10} | {:>14} |",
        "path", "median (ms)", "p99 (ms)", "requests/s", "download MiB/s"
    );
    println!(
        "|{:-<28}|{:->13}|{:->11}|{:->12}|{:->16}|",
        "", "", "", "", ""
    );
    for (name, median, p99, rps, mibs) in &rows {
        println!(
            "| {:<26} | {:>11.3} | {:>9.3} | {:>10.0} | {:>14.0} |",
            name,
            median.as_secs_f64() * 1000.0,
            p99.as_secs_f64() * 1000.0,
            rps,
            mibs
        );
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!();
    for (label, direct, via) in [
        ("HTTP", &rows[0], &rows[1]),
        ("HTTPS (intercepted)", &rows[2], &rows[3]),
    ] {
        println!(
            "{label}: added median latency {:.3} ms; throughput through the gateway {:.0}% of direct",
            ms(via.1) - ms(direct.1),
            via.4 / direct.4 * 100.0
        );
    }
    println!();
    println!("name lookups of `localhost`, {requests} each (median, p99 in ms):");
    println!();
    println!(
        "| {:<34} | {:>11} | {:>9} |",
        "path", "median (ms)", "p99 (ms)"
    );
    println!("|{:-<36}|{:->13}|{:->11}|", "", "", "");
    for (name, samples) in &lookups {
        println!(
            "| {:<34} | {:>11.3} | {:>9.3} |",
            name,
            ms(percentile(samples, 0.5)),
            ms(percentile(samples, 0.99))
        );
    }
    println!(
        "DNS through the gateway: {:.1}x the host resolver's median",
        ms(percentile(&lookups[1].1, 0.5)) / ms(percentile(&lookups[0].1, 0.5))
    );
    Ok(())
}

/// Times `count` lookups of `localhost` by the host's resolver and by the gateway's DNS (a UDP
/// query and its answer, as a cell's resolver sends it); sorted samples for each.
fn lookups(count: usize, server: SocketAddr) -> Result<[(&'static str, Vec<Duration>); 2]> {
    use simple_dns::{CLASS, Name, Packet, QCLASS, QTYPE, Question, TYPE};
    let mut host = Vec::with_capacity(count);
    for _ in 0..count {
        let t = Instant::now();
        let found = ("localhost", 0).to_socket_addrs()?.count();
        host.push(t.elapsed());
        anyhow::ensure!(found > 0, "the host does not resolve localhost");
    }
    let client = UdpSocket::bind("127.0.0.1:0")?;
    client.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut via = Vec::with_capacity(count);
    let mut buf = [0u8; 512];
    for id in 0..count {
        let mut query = Packet::new_query(id as u16);
        query.questions.push(Question::new(
            Name::new("localhost")?,
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        let query = query.build_bytes_vec()?;
        let t = Instant::now();
        client.send_to(&query, server)?;
        let n = client
            .recv(&mut buf)
            .context("the gateway's DNS did not answer")?;
        via.push(t.elapsed());
        let reply = Packet::parse(&buf[..n])?;
        anyhow::ensure!(!reply.answers.is_empty(), "no answer for localhost");
    }
    host.sort();
    via.sort();
    Ok([
        ("host resolver (getaddrinfo)", host),
        ("gateway DNS (UDP query + answer)", via),
    ])
}
