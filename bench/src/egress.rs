//! Egress benchmark: small HTTP requests and a 100 MiB download through the warden's gateway
//! beside the same traffic sent directly, on loopback, in one run. The gateway is the real one
//! (`warden-egress`), serving a listener on the host's loopback exactly as it serves the one in
//! a cell's namespace.
//!
//! Usage: `egress [--requests N]`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use warden_policy::{NetRule, Network, NetworkDefault};

const DOWNLOAD: usize = 100 << 20;
/// Downloads per path; the median rate is reported.
const DOWNLOADS: usize = 7;

/// An upstream that answers `/small` with 2 bytes and `/big` with 100 MiB.
fn upstream() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.2:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        let chunk = vec![b'x'; 1 << 20];
        for conn in listener.incoming().flatten() {
            let chunk = chunk.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(match conn.try_clone() {
                    Ok(c) => c,
                    Err(_) => return,
                });
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    return;
                }
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let mut conn = conn;
                if line.contains("/big") {
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
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    );
                }
            });
        }
    });
    Ok(addr)
}

/// One request over a fresh connection; returns the bytes of the response.
fn get(connect_to: SocketAddr, target: &str, host: &str) -> Result<usize> {
    let mut conn = TcpStream::connect(connect_to)?;
    conn.set_nodelay(true)?;
    write!(
        conn,
        "GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n;
    }
    Ok(total)
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
    let up = upstream()?;
    let network = Network {
        default: NetworkDefault::Deny,
        allow: vec![NetRule {
            host: "127.0.0.2".into(),
            ports: vec![up.port()],
            methods: vec![],
            paths: vec![],
            credential: None,
        }],
        deny: vec![],
        ask: vec![],
        extra_ca: None,
    };
    let log =
        std::env::temp_dir().join(format!("warden-bench-egress-{}.jsonl", std::process::id()));
    let gateway = warden_egress::Gateway::new(
        warden_egress::Rules::compile(&network)?,
        &log,
        "bench",
        warden_egress::Secrets::default(),
        None,
    )?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let proxy = listener.local_addr()?;
    gateway.serve(listener);

    let host = format!("127.0.0.2:{}", up.port());
    let absolute = |path: &str| format!("http://{host}{path}");
    let mut rows = Vec::new();
    for (name, via_proxy) in [("direct", false), ("through the gateway", true)] {
        let (addr, target) = if via_proxy {
            (proxy, absolute("/small"))
        } else {
            (up, "/small".to_owned())
        };
        for _ in 0..50 {
            get(addr, &target, &host)?;
        }
        let mut samples = Vec::with_capacity(requests);
        let started = Instant::now();
        for _ in 0..requests {
            let t = Instant::now();
            get(addr, &target, &host)?;
            samples.push(t.elapsed());
        }
        let per_second = requests as f64 / started.elapsed().as_secs_f64();
        samples.sort();
        let big = if via_proxy {
            absolute("/big")
        } else {
            "/big".to_owned()
        };
        let mut rates = Vec::new();
        for _ in 0..DOWNLOADS {
            let t = Instant::now();
            let bytes = get(addr, &big, &host)?;
            rates.push(bytes as f64 / (1 << 20) as f64 / t.elapsed().as_secs_f64());
        }
        rates.sort_by(f64::total_cmp);
        let mib_per_s = rates[rates.len() / 2];
        rows.push((
            name,
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            per_second,
            mib_per_s,
        ));
    }
    let _ = std::fs::remove_file(&log);
    println!(
        "egress on loopback: {requests} small requests (a new connection each), {DOWNLOADS} downloads of 100 MiB (median rate)"
    );
    println!();
    println!(
        "| {:<20} | {:>12} | {:>12} | {:>12} | {:>14} |",
        "path", "median (ms)", "p99 (ms)", "requests/s", "download MiB/s"
    );
    println!(
        "|{:-<22}|{:->14}|{:->14}|{:->14}|{:->16}|",
        "", "", "", "", ""
    );
    for (name, median, p99, rps, mibs) in &rows {
        println!(
            "| {:<20} | {:>12.3} | {:>12.3} | {:>12.0} | {:>14.0} |",
            name,
            median.as_secs_f64() * 1000.0,
            p99.as_secs_f64() * 1000.0,
            rps,
            mibs
        );
    }
    let (direct, gateway) = (&rows[0], &rows[1]);
    println!();
    println!(
        "added median latency: {:.3} ms; throughput through the gateway: {:.0}% of direct",
        (gateway.1.as_secs_f64() - direct.1.as_secs_f64()) * 1000.0,
        gateway.4 / direct.4 * 100.0
    );
    Ok(())
}
