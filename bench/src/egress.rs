//! Egress benchmark: small HTTP requests and 100 MiB downloads through the warden's gateway
//! beside the same traffic sent directly and through the proxies a user would otherwise put in
//! front of a sandbox, on loopback, in one run: `squid` as a forward proxy (absolute-form HTTP,
//! CONNECT tunnels) and `haproxy` as a plain TCP relay (the ceiling of a user-space relay here),
//! where they are installed; plain HTTP, HTTPS tunnels, and HTTPS opened up by the gateway's TLS
//! interception. The gateway is the real one (`warden-egress`), serving a listener on the host's
//! loopback exactly as it serves the one in a cell's namespace, in a process of its own (this
//! program, started again with `--serve-gateway`) so that its CPU time is its own: each relay's
//! CPU seconds per GiB relayed are read from `/proc` around each download. Then name lookups:
//! the gateway's DNS answering over UDP beside the host's own resolver for the same name.
//!
//! As root, the gateway's other way in is measured too: connections redirected to it (nftables)
//! in a network namespace of the benchmark's own, as a cell's clients that ignore the proxy
//! variables reach it (no CONNECT: the client speaks to the upstream's address, as through
//! haproxy's relay). The namespace is held by `unshare -n sleep infinity`; a client thread joins
//! it, and the gateway binds its transparent listener there from a thread that joins it too.
//!
//! Usage: `egress [--requests N] [--baseline PATH]`. `--baseline` serves a second gateway from
//! another build of this program (an older one) and adds its rows, so that a change to the
//! gateway is measured against what it changed in one run. The small requests take turns
//! across the paths (one request each, round after round), as the downloads do, so that a slow
//! moment of the host falls on all of them alike.

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

/// A plain upstream and two TLS ones (one to intercept, one to tunnel; the certificate signed by
/// a fresh CA, returned as PEM).
fn upstreams() -> Result<(SocketAddr, SocketAddr, SocketAddr, String)> {
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
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let tls = TcpListener::bind("127.0.0.2:0")?;
        addrs.push(tls.local_addr()?);
        let config = config.clone();
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
    }
    Ok((plain_addr, addrs[0], addrs[1], ca.pem()))
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
#[derive(Clone)]
enum Path {
    Direct(SocketAddr),
    Proxied {
        proxy: SocketAddr,
        upstream: SocketAddr,
    },
    DirectTls(SocketAddr, Arc<rustls::ClientConfig>),
    /// A CONNECT tunnel, TLS inside it (to the upstream itself, or to the gateway's
    /// interception when it opens the tunnel up).
    Tunnel {
        proxy: SocketAddr,
        upstream: SocketAddr,
        trust: Arc<rustls::ClientConfig>,
    },
    /// A TCP relay in front of the upstream (haproxy): the client speaks to it as to the
    /// upstream.
    Relay {
        relay: SocketAddr,
        upstream: SocketAddr,
    },
    RelayTls {
        relay: SocketAddr,
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

/// A client's connection, with Nagle's algorithm off as curl and the HTTP libraries have it
/// (otherwise a TLS client's second small write waits for the peer's delayed ACK).
fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let tcp = TcpStream::connect(addr)?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
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
            let mut tcp = connect(*addr)?;
            tcp.write_all(origin(*addr).as_bytes())?;
            Ok(read_all(tcp))
        }
        Path::Proxied { proxy, upstream } => {
            let mut tcp = connect(*proxy)?;
            // One write, as for the other paths (`write!` would send the head in pieces).
            let head = format!(
                "GET http://{upstream}{target} HTTP/1.1\r\nHost: {upstream}\r\nConnection: close\r\n\r\n"
            );
            tcp.write_all(head.as_bytes())?;
            Ok(read_all(tcp))
        }
        Path::DirectTls(addr, trust) => tls_get(connect(*addr)?, trust, *addr),
        Path::Relay { relay, upstream } => {
            let mut tcp = connect(*relay)?;
            tcp.write_all(origin(*upstream).as_bytes())?;
            Ok(read_all(tcp))
        }
        Path::RelayTls { relay, trust } => tls_get(connect(*relay)?, trust, *relay),
        Path::Tunnel {
            proxy,
            upstream,
            trust,
        } => {
            let mut tcp = connect(*proxy)?;
            tcp.write_all(format!("CONNECT {upstream} HTTP/1.1\r\n\r\n").as_bytes())?;
            let mut reply = Vec::new();
            let mut byte = [0u8; 1];
            while !reply.ends_with(b"\r\n\r\n") {
                if tcp.read(&mut byte)? == 0 {
                    bail!("the proxy closed the tunnel");
                }
                reply.push(byte[0]);
            }
            if !reply.starts_with(b"HTTP/1.1 200") {
                bail!("the proxy refused: {}", String::from_utf8_lossy(&reply));
            }
            tls_get(tcp, trust, *upstream)
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The rules the gateway runs under: the plain upstream and the tunnelled TLS one by host and
/// port; a path rule on the intercepted one, which makes the gateway open its TLS up.
fn network(plain: u16, tunnel: u16, intercepted: u16, ca_file: &std::path::Path) -> Network {
    let rule = |port: u16, paths: Vec<String>| NetRule {
        host: "127.0.0.2".into(),
        ports: vec![port],
        methods: vec![],
        paths,
        credential: None,
        dns: warden_policy::NameLookup::Any,
    };
    Network {
        default: NetworkDefault::Deny,
        allow: vec![
            rule(plain, vec![]),
            rule(tunnel, vec![]),
            rule(intercepted, vec!["/**".to_owned()]),
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
        extra_ca: Some(ca_file.to_path_buf()),
        gateway: false,
        inference: None,
    }
}

/// `--serve-gateway PLAIN TUNNEL INTERCEPTED CA_FILE OUT_CA`: the gateway in this process, its
/// proxy and DNS ports on stdout, its interception CA in OUT_CA; serves until killed.
fn serve_gateway(args: &[String]) -> Result<()> {
    let (args, netns) = match args {
        [rest @ .., netns] if rest.len() == 5 => (rest, Some(std::path::PathBuf::from(netns))),
        _ => (args, None),
    };
    let [plain, tunnel, intercepted, ca_file, out_ca] = args else {
        bail!("--serve-gateway PLAIN TUNNEL INTERCEPTED CA_FILE OUT_CA [NETNS]");
    };
    let ca_file = std::path::PathBuf::from(ca_file);
    let network = network(
        plain.parse()?,
        tunnel.parse()?,
        intercepted.parse()?,
        &ca_file,
    );
    let interceptor = warden_egress::Interceptor::new("bench", Some(&ca_file))?;
    std::fs::write(out_ca, interceptor.ca_pem())?;
    // Beside the CA, in the relay's folder, which goes with the relay (this process is killed).
    let log = std::path::Path::new(out_ca)
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join("egress.jsonl");
    let gateway = warden_egress::Gateway::new(
        warden_egress::Rules::compile(&network)?,
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
    gateway.clone().serve(listener)?;
    if let Some(netns) = netns {
        // Bound in the namespace by a thread that joins it; served from here, so that the
        // gateway's own connections to the upstreams are made on the host.
        let listener = std::thread::spawn(move || -> Result<TcpListener> {
            join_netns(&netns)?;
            Ok(TcpListener::bind(("127.0.0.1", REDIRECT_PORT))?)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread that binds the redirected port panicked"))??;
        gateway.serve_transparent(listener)?;
    }
    warden_bench::say!("{} {}", proxy.port(), dns_address.port());
    std::io::stdout().flush()?;
    // Until the parent goes (it kills this process; a closed stdin says it went).
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    let _ = std::fs::remove_file(&log);
    Ok(())
}

/// The port the gateway's transparent listener has in the benchmark's namespace (a cell's).
const REDIRECT_PORT: u16 = 3129;

/// Moves the calling thread into the network namespace at `path` (`/proc/PID/ns/net`).
fn join_netns(path: &std::path::Path) -> Result<()> {
    use std::os::fd::AsFd as _;
    let ns = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    rustix::thread::move_into_link_name_space(
        ns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .with_context(|| format!("joining the network namespace {}", path.display()))?;
    Ok(())
}

/// A request to the client thread in the namespace: the path, the target, where the answer
/// goes (the bytes read and the time the request took there).
type Job = (
    Path,
    &'static str,
    std::sync::mpsc::Sender<Result<(usize, Duration)>>,
);

/// The benchmark's network namespace, in which TCP to the upstreams' ports is redirected to
/// the gateway's transparent listener, with a client thread in it; the holder is killed when
/// dropped.
struct Redirect {
    holder: std::process::Child,
    netns: std::path::PathBuf,
    jobs: std::sync::mpsc::Sender<Job>,
}

impl Redirect {
    /// Makes the namespace (as root, with `unshare`, `ip` and `nft`): `Err` says what is
    /// missing.
    fn start(ports: &[u16]) -> Result<Self> {
        if !rustix::process::geteuid().is_root() {
            bail!("root, for the redirected rows");
        }
        let (Some(unshare), Some(ip), Some(nft)) = (which("unshare"), which("ip"), which("nft"))
        else {
            bail!(
                "unshare, ip and nft (apt-get install util-linux iproute2 nftables), for the redirected rows"
            );
        };
        let mut holder = std::process::Command::new(unshare)
            .args(["--net", "sleep", "infinity"])
            .stdin(std::process::Stdio::null())
            .spawn()?;
        let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", holder.id()));
        // Until the holder has its namespace (before, its link is still this process's).
        let ours = std::fs::read_link("/proc/self/ns/net")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(&netns).ok().is_none_or(|l| l == ours) {
            if Instant::now() > deadline || holder.try_wait()?.is_some() {
                let _ = holder.kill();
                bail!("`unshare --net` made no network namespace");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let rules = format!(
            "table ip warden_bench {{
  chain out {{
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.2 tcp dport {{ {} }} redirect to :{REDIRECT_PORT}
  }}
}}
",
            ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let (jobs, inbox) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready) = std::sync::mpsc::channel::<Result<()>>();
        let path = netns.clone();
        std::thread::spawn(move || {
            let setup = (|| -> Result<()> {
                join_netns(&path)?;
                // Started from this thread: in its namespace.
                let up = std::process::Command::new(&ip)
                    .args(["link", "set", "lo", "up"])
                    .status()?;
                if !up.success() {
                    bail!("`ip link set lo up` failed in the namespace");
                }
                let mut load = std::process::Command::new(&nft)
                    .args(["-f", "-"])
                    .stdin(std::process::Stdio::piped())
                    .spawn()?;
                load.stdin
                    .take()
                    .context("nft's stdin")?
                    .write_all(rules.as_bytes())?;
                if !load.wait()?.success() {
                    bail!("nft refused the redirect rules");
                }
                Ok(())
            })();
            let ok = setup.is_ok();
            let _ = ready_tx.send(setup);
            if !ok {
                return;
            }
            for (path, target, answer) in inbox {
                let t = Instant::now();
                let got = get(&path, target).map(|bytes| (bytes, t.elapsed()));
                let _ = answer.send(got);
            }
        });
        match ready.recv() {
            Ok(Ok(())) => Ok(Self {
                holder,
                netns,
                jobs,
            }),
            Ok(Err(e)) => {
                let _ = holder.kill();
                let _ = holder.wait();
                Err(e)
            }
            Err(_) => {
                let _ = holder.kill();
                let _ = holder.wait();
                bail!("the client thread in the namespace ended")
            }
        }
    }

    /// One request from inside the namespace: the bytes read and the time it took there.
    fn get(&self, path: &Path, target: &'static str) -> Result<(usize, Duration)> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.jobs
            .send((path.clone(), target, tx))
            .map_err(|_| anyhow::anyhow!("the client thread in the namespace ended"))?;
        rx.recv()
            .map_err(|_| anyhow::anyhow!("the client thread in the namespace ended"))?
    }
}

impl Drop for Redirect {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A relay in a process of its own, killed when dropped.
struct Relay {
    name: &'static str,
    child: std::process::Child,
    dir: std::path::PathBuf,
}

impl Relay {
    /// Writes `config` into `dir` as `file` and starts `program FOREGROUND -f FILE` (squid and
    /// haproxy alike), its output discarded.
    fn start(
        name: &'static str,
        program: &std::path::Path,
        foreground: &str,
        dir: std::path::PathBuf,
        file: &str,
        config: &str,
    ) -> Result<Self> {
        let file = dir.join(file);
        std::fs::write(&file, config)?;
        let child = std::process::Command::new(program)
            .arg(foreground)
            .arg("-f")
            .arg(&file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok(Self { name, child, dir })
    }

    /// CPU seconds (user and system) it has used so far.
    fn cpu_seconds(&self) -> f64 {
        cpu_seconds(self.child.id())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cpu_seconds(pid: u32) -> f64 {
    // Threads' and reaped children's time alike: fields 14-17 of /proc/PID/stat.
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(rest) = text.rfind(')').map(|i| &text[i + 1..]) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..15)
        .map(|f| f.iter().filter_map(|t| t.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    ticks as f64 / 100.0
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
    ]
    .iter()
    .map(|d| std::path::Path::new(d).join(program))
    .find(|p| p.is_file())
}

fn wait_listening(addr: SocketAddr, name: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("{name} did not listen on {addr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn bench_dir(name: &str) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("warden-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // squid drops to its own user: it writes its pid and logs here.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    Ok(dir)
}

/// haproxy as a plain TCP relay: one frontend per upstream.
fn haproxy(upstreams: &[SocketAddr]) -> Result<Option<(Relay, Vec<SocketAddr>)>> {
    let Some(program) = which("haproxy") else {
        return Ok(None);
    };
    let dir = bench_dir("haproxy")?;
    let mut config = String::from(
        "global\n  maxconn 4096\n  nbthread 1\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n",
    );
    let mut fronts = Vec::new();
    for (i, up) in upstreams.iter().enumerate() {
        let front = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        config.push_str(&format!(
            "frontend f{i}\n  bind {front}\n  default_backend b{i}\nbackend b{i}\n  server s{i} {up}\n"
        ));
        fronts.push(front);
    }
    let relay = Relay::start("haproxy", &program, "-db", dir, "haproxy.cfg", &config)?;
    for front in &fronts {
        wait_listening(*front, "haproxy")?;
    }
    Ok(Some((relay, fronts)))
}

/// squid as a forward proxy (no cache, no logs, every destination allowed) and, where it is
/// built with OpenSSL (`squid-openssl`), a second port that bumps TLS (interception, as the
/// gateway's path rules do): its own CA, certificates generated per host, the upstream verified
/// against `upstream_ca` (host-name errors allowed: the upstream is named by an IP).
struct Squid {
    relay: Relay,
    forward: SocketAddr,
    /// The bumping port and the CA a client must trust there.
    bump: Option<(SocketAddr, String)>,
}

fn squid(upstream_ca: &std::path::Path) -> Result<Option<Squid>> {
    let Some(program) = which("squid") else {
        return Ok(None);
    };
    let dir = bench_dir("squid")?;
    let forward = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let mut config = format!(
        "http_port {forward}\nhttp_access allow all\ncache deny all\ncache_mem 8 MB\naccess_log none\ncache_log {log}\npid_filename {pid}\ncoredump_dir {dir}\nvisible_hostname bench\nvia off\nforwarded_for delete\nshutdown_lifetime 0 seconds\nworkers 1\n",
        log = dir.join("cache.log").display(),
        pid = dir.join("squid.pid").display(),
        dir = dir.display(),
    );
    let version = std::process::Command::new(&program).arg("-v").output()?;
    let mut bump = None;
    if String::from_utf8_lossy(&version.stdout).contains("--with-openssl")
        && let Some(certgen) = [
            "/usr/lib/squid/security_file_certgen",
            "/usr/libexec/squid/security_file_certgen",
        ]
        .iter()
        .map(std::path::Path::new)
        .find(|p| p.is_file())
    {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "bench squid CA");
        let key = KeyPair::generate()?;
        let ca = CertifiedIssuer::self_signed(params, key)?;
        let (cert_file, key_file) = (dir.join("bump-ca.pem"), dir.join("bump-ca.key"));
        std::fs::write(&cert_file, ca.pem())?;
        std::fs::write(&key_file, ca.key().serialize_pem())?;
        let db = dir.join("ssl_db");
        let made = std::process::Command::new(certgen)
            .args(["-c", "-s"])
            .arg(&db)
            .args(["-M", "16MB"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        if made.success() {
            // squid drops to its own user, which must write the certificate cache.
            let _ = std::process::Command::new("chmod")
                .args(["-R", "a+rwX"])
                .arg(&db)
                .status();
            let port = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            config.push_str(&format!(
                "http_port {port} ssl-bump cert={} key={} generate-host-certificates=on dynamic_cert_mem_cache_size=16MB\nsslcrtd_program {} -s {} -M 16MB\nsslcrtd_children 2\nacl step1 at_step SslBump1\nssl_bump peek step1\nssl_bump bump all\ntls_outgoing_options cafile={}\nsslproxy_cert_error allow all\nsslproxy_cert_sign signTrusted all\n",
                cert_file.display(),
                key_file.display(),
                certgen.display(),
                db.display(),
                upstream_ca.display()
            ));
            bump = Some((port, ca.pem()));
        }
    }
    let relay = Relay::start("squid", &program, "-N", dir, "squid.conf", &config)?;
    wait_listening(forward, "squid")?;
    if let Some((port, _)) = &bump {
        wait_listening(*port, "squid (ssl-bump)")?;
    }
    Ok(Some(Squid {
        relay,
        forward,
        bump,
    }))
}

/// The gateway in a process of its own (this program again).
fn gateway(
    program: &std::path::Path,
    name: &'static str,
    plain: SocketAddr,
    tunnel: SocketAddr,
    intercepted: SocketAddr,
    ca_file: &std::path::Path,
    netns: Option<&std::path::Path>,
) -> Result<(Relay, SocketAddr, SocketAddr, String)> {
    let dir = bench_dir(&name.replace(' ', "-"))?;
    let out_ca = dir.join("cell-ca.pem");
    let mut child = std::process::Command::new(program)
        .arg("--serve-gateway")
        .args([plain.port(), tunnel.port(), intercepted.port()].map(|p| p.to_string()))
        .arg(ca_file)
        .arg(&out_ca)
        .args(netns)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().context("the gateway's stdout")?),
        &mut line,
    )?;
    let mut ports = line.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(proxy)), Some(Ok(dns))) = (ports.next(), ports.next()) else {
        bail!("the gateway process said {line:?}");
    };
    let ca = std::fs::read_to_string(&out_ca)?;
    let relay = Relay { name, child, dir };
    Ok((
        relay,
        SocketAddr::from(([127, 0, 0, 1], proxy)),
        SocketAddr::from(([127, 0, 0, 1], dns)),
        ca,
    ))
}

/// One row of the table: a way of reaching an upstream, which relay (by index) carries it, and
/// whether the client is in the benchmark's namespace (its connections redirected).
struct Row {
    name: &'static str,
    path: Path,
    relay: Option<usize>,
    redirected: bool,
}

/// One request of `row`'s: the bytes read and the time it took.
fn timed(
    row: &Row,
    redirect: Option<&Redirect>,
    target: &'static str,
) -> Result<(usize, Duration)> {
    match (row.redirected, redirect) {
        (true, Some(redirect)) => redirect.get(&row.path, target),
        (true, None) => bail!("{}: no namespace to send it from", row.name),
        (false, _) => {
            let t = Instant::now();
            let bytes = get(&row.path, target)?;
            Ok((bytes, t.elapsed()))
        }
    }
}

fn main() -> Result<()> {
    let all: Vec<String> = std::env::args().skip(1).collect();
    if all.first().is_some_and(|a| a == "--serve-gateway") {
        return serve_gateway(&all[1..]);
    }
    warden_bench::end_on_signal()?;
    let mut requests = 2000usize;
    let mut baseline = None;
    let mut args = all.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--requests" => requests = args.next().context("--requests needs a number")?.parse()?,
            "--baseline" => {
                let path = std::path::PathBuf::from(
                    args.next().context("--baseline needs an egress binary")?,
                );
                if !path.is_file() {
                    bail!("--baseline {}: no such file", path.display());
                }
                baseline = Some(path);
            }
            "--help" | "-h" => {
                warden_bench::say!("usage: egress [--requests N] [--baseline PATH]");
                return Ok(());
            }
            other => {
                bail!("unknown argument {other}; usage: egress [--requests N] [--baseline PATH]")
            }
        }
    }
    // The second TLS upstream is tunnelled by the gateway without being opened.
    let (plain, tls, tunnel_tls, upstream_ca) = upstreams()?;
    let ca_file =
        std::env::temp_dir().join(format!("warden-bench-egress-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, &upstream_ca)?;
    let upstream_trust = client_config(&upstream_ca)?;

    let mut missing = Vec::new();
    let redirect = match Redirect::start(&[plain.port(), tunnel_tls.port()]) {
        Ok(redirect) => Some(redirect),
        Err(e) => {
            missing.push(format!("{e:#}"));
            None
        }
    };
    let mut relays: Vec<Relay> = Vec::new();
    let (gw, proxy, dns_address, cell_ca) = gateway(
        &std::env::current_exe()?,
        "warden gateway",
        plain,
        tunnel_tls,
        tls,
        &ca_file,
        redirect.as_ref().map(|r| r.netns.as_path()),
    )?;
    relays.push(gw);
    let cell_trust = client_config(&cell_ca)?;
    let mut rows = vec![
        Row {
            name: "HTTP, direct",
            path: Path::Direct(plain),
            relay: None,
            redirected: false,
        },
        Row {
            name: "HTTP, warden gateway",
            path: Path::Proxied {
                proxy,
                upstream: plain,
            },
            relay: Some(0),
            redirected: false,
        },
    ];
    let squid = squid(&ca_file)?;
    let haproxy = haproxy(&[plain, tunnel_tls])?;
    let mut squid_bump = None;
    if let Some(Squid {
        relay,
        forward,
        bump,
    }) = squid
    {
        relays.push(relay);
        rows.push(Row {
            name: "HTTP, squid (forward proxy)",
            path: Path::Proxied {
                proxy: forward,
                upstream: plain,
            },
            relay: Some(relays.len() - 1),
            redirected: false,
        });
        match bump {
            Some((port, ca)) => squid_bump = Some((relays.len() - 1, port, client_config(&ca)?)),
            None => missing.push(
                "squid built with OpenSSL (apt-get install squid-openssl), for its ssl-bump row"
                    .to_owned(),
            ),
        }
    } else {
        missing.push("squid (apt-get install squid-openssl)".to_owned());
    }
    let haproxy_fronts = if let Some((relay, fronts)) = haproxy {
        relays.push(relay);
        rows.push(Row {
            name: "HTTP, haproxy (TCP relay)",
            path: Path::Relay {
                relay: fronts[0],
                upstream: plain,
            },
            relay: Some(relays.len() - 1),
            redirected: false,
        });
        Some((relays.len() - 1, fronts))
    } else {
        missing.push("haproxy (apt-get install haproxy)".to_owned());
        None
    };
    if redirect.is_some() {
        rows.push(Row {
            name: "HTTP, warden (redirected)",
            path: Path::Direct(plain),
            relay: Some(0),
            redirected: true,
        });
    }
    rows.push(Row {
        name: "HTTPS, direct",
        path: Path::DirectTls(tunnel_tls, upstream_trust.clone()),
        relay: None,
        redirected: false,
    });
    rows.push(Row {
        name: "HTTPS tunnel, warden gateway",
        path: Path::Tunnel {
            proxy,
            upstream: tunnel_tls,
            trust: upstream_trust.clone(),
        },
        relay: Some(0),
        redirected: false,
    });
    if let Some(index) = relays.iter().position(|r| r.name == "squid") {
        let addr = rows.iter().find_map(|r| match (&r.path, r.relay) {
            (Path::Proxied { proxy, .. }, Some(i)) if i == index => Some(*proxy),
            _ => None,
        });
        if let Some(addr) = addr {
            rows.push(Row {
                name: "HTTPS tunnel, squid (CONNECT)",
                path: Path::Tunnel {
                    proxy: addr,
                    upstream: tunnel_tls,
                    trust: upstream_trust.clone(),
                },
                relay: Some(index),
                redirected: false,
            });
        }
    }
    if let Some((index, fronts)) = &haproxy_fronts {
        rows.push(Row {
            name: "HTTPS, haproxy (TCP relay)",
            path: Path::RelayTls {
                relay: fronts[1],
                trust: upstream_trust.clone(),
            },
            relay: Some(*index),
            redirected: false,
        });
    }
    if redirect.is_some() {
        rows.push(Row {
            name: "HTTPS, warden (redirected)",
            path: Path::DirectTls(tunnel_tls, upstream_trust.clone()),
            relay: Some(0),
            redirected: true,
        });
    }
    rows.push(Row {
        name: "HTTPS, warden interception",
        path: Path::Tunnel {
            proxy,
            upstream: tls,
            trust: cell_trust,
        },
        relay: Some(0),
        redirected: false,
    });
    if let Some((index, port, trust)) = squid_bump {
        rows.push(Row {
            name: "HTTPS, squid ssl-bump",
            path: Path::Tunnel {
                proxy: port,
                upstream: tls,
                trust,
            },
            relay: Some(index),
            redirected: false,
        });
    }

    if let Some(program) = &baseline {
        let (relay, proxy, _, ca) = gateway(
            program,
            "baseline gateway",
            plain,
            tunnel_tls,
            tls,
            &ca_file,
            None,
        )?;
        relays.push(relay);
        let index = Some(relays.len() - 1);
        rows.push(Row {
            name: "HTTP, baseline gateway",
            path: Path::Proxied {
                proxy,
                upstream: plain,
            },
            relay: index,
            redirected: false,
        });
        rows.push(Row {
            name: "HTTPS tunnel, baseline gateway",
            path: Path::Tunnel {
                proxy,
                upstream: tunnel_tls,
                trust: upstream_trust.clone(),
            },
            relay: index,
            redirected: false,
        });
        rows.push(Row {
            name: "HTTPS, baseline interception",
            path: Path::Tunnel {
                proxy,
                upstream: tls,
                trust: client_config(&ca)?,
            },
            relay: index,
            redirected: false,
        });
    }

    struct Measured {
        median: Duration,
        p99: Duration,
        per_second: f64,
        mibs: f64,
        cpu_per_gib: Option<f64>,
    }
    let redirect = redirect.as_ref();
    for row in &rows {
        for _ in 0..20 {
            timed(row, redirect, "/small").with_context(|| row.name)?;
        }
    }
    // One request per path a round: the samples of every path spread over the same time. The
    // rate of new connections is each path's own time summed (its requests one after another).
    // The paths take their turns in a new order each round: what one relay leaves to do after
    // its answer (squid's logging and teardown, a TLS session's end) falls on whichever path
    // comes next, so no path may always follow the same one. (In one fixed order, a second
    // gateway of the same build, placed after squid's ssl-bump, measured 0.08 ms slower.)
    let mut samples = vec![Vec::with_capacity(requests); rows.len()];
    let mut order: Vec<usize> = (0..rows.len()).collect();
    let mut seed = warden_bench::SHUFFLE_SEED;
    for _ in 0..requests {
        warden_bench::shuffle(&mut order, &mut seed);
        for &i in &order {
            let (_, took) = timed(&rows[i], redirect, "/small").with_context(|| rows[i].name)?;
            samples[i].push(took);
        }
    }
    let mut measured: Vec<Measured> = samples
        .into_iter()
        .map(|mut samples| {
            let total: Duration = samples.iter().sum();
            samples.sort();
            Measured {
                median: percentile(&samples, 0.5),
                p99: percentile(&samples, 0.99),
                per_second: requests as f64 / total.as_secs_f64(),
                mibs: 0.0,
                cpu_per_gib: None,
            }
        })
        .collect();
    // Downloads take turns across the paths, so that a slow moment of the host falls on all of
    // them alike rather than on whichever path ran then; each relay's CPU time is read around
    // each of its downloads (one runs at a time).
    let mut rates = vec![Vec::with_capacity(DOWNLOADS); rows.len()];
    let mut cpu = vec![(0.0f64, 0u64); rows.len()];
    for _ in 0..DOWNLOADS {
        for (i, row) in rows.iter().enumerate() {
            let before = row.relay.map(|r| relays[r].cpu_seconds());
            let (bytes, elapsed) = timed(row, redirect, "/big").with_context(|| row.name)?;
            if bytes < DOWNLOAD {
                bail!("{}: the download ended after {bytes} bytes", row.name);
            }
            if let (Some(r), Some(before)) = (row.relay, before) {
                cpu[i].0 += relays[r].cpu_seconds() - before;
                cpu[i].1 += bytes as u64;
            }
            rates[i].push(bytes as f64 / (1 << 20) as f64 / elapsed.as_secs_f64());
        }
    }
    for ((m, mut rates), (seconds, bytes)) in measured.iter_mut().zip(rates).zip(cpu) {
        rates.sort_by(f64::total_cmp);
        m.mibs = rates[rates.len() / 2];
        if bytes > 0 {
            m.cpu_per_gib = Some(seconds / (bytes as f64 / (1u64 << 30) as f64));
        }
    }
    let lookups = lookups(requests, dns_address)?;
    drop(relays);
    let _ = std::fs::remove_file(&ca_file);
    warden_bench::say!(
        "egress on loopback: {requests} small requests (a new connection each), {DOWNLOADS} downloads of 100 MiB (median rate); each relay in its own process, its CPU time read from /proc around its downloads"
    );
    if !missing.is_empty() {
        warden_bench::say!("not installed, left out: {}", missing.join("; "));
    }
    warden_bench::say!();
    warden_bench::say!(
        "| {:<30} | {:>11} | {:>9} | {:>10} | {:>14} | {:>13} |",
        "path",
        "median (ms)",
        "p99 (ms)",
        "conns/s",
        "download MiB/s",
        "CPU s per GiB"
    );
    warden_bench::say!(
        "|{:-<32}|{:->13}|{:->11}|{:->12}|{:->16}|{:->15}|",
        "",
        "",
        "",
        "",
        "",
        ""
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    for (row, m) in rows.iter().zip(&measured) {
        warden_bench::say!(
            "| {:<30} | {:>11.3} | {:>9.3} | {:>10.0} | {:>14.0} | {:>13} |",
            row.name,
            ms(m.median),
            ms(m.p99),
            m.per_second,
            m.mibs,
            m.cpu_per_gib
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.2}"))
        );
    }
    warden_bench::say!();
    let find = |name: &str| {
        rows.iter()
            .position(|r| r.name == name)
            .map(|i| &measured[i])
    };
    let ratio = |label: &str, a: &str, b: &str| {
        if let (Some(x), Some(y)) = (find(a), find(b)) {
            warden_bench::say!(
                "{label}: throughput {:.2}x, added median latency {:+.3} ms, CPU per GiB {}",
                x.mibs / y.mibs,
                ms(x.median) - ms(y.median),
                match (x.cpu_per_gib, y.cpu_per_gib) {
                    (Some(p), Some(q)) => format!("{:.2}x", p / q),
                    _ => "-".to_owned(),
                }
            );
        }
    };
    ratio(
        "gateway / direct (HTTP)",
        "HTTP, warden gateway",
        "HTTP, direct",
    );
    ratio(
        "gateway / haproxy (HTTP)",
        "HTTP, warden gateway",
        "HTTP, haproxy (TCP relay)",
    );
    ratio(
        "gateway / squid (HTTP)",
        "HTTP, warden gateway",
        "HTTP, squid (forward proxy)",
    );
    ratio(
        "gateway / haproxy (HTTPS tunnel)",
        "HTTPS tunnel, warden gateway",
        "HTTPS, haproxy (TCP relay)",
    );
    ratio(
        "redirected to the gateway / haproxy (HTTP)",
        "HTTP, warden (redirected)",
        "HTTP, haproxy (TCP relay)",
    );
    ratio(
        "redirected to the gateway / haproxy (HTTPS)",
        "HTTPS, warden (redirected)",
        "HTTPS, haproxy (TCP relay)",
    );
    ratio(
        "gateway / squid (HTTPS tunnel)",
        "HTTPS tunnel, warden gateway",
        "HTTPS tunnel, squid (CONNECT)",
    );
    ratio(
        "interception / direct (HTTPS)",
        "HTTPS, warden interception",
        "HTTPS, direct",
    );
    ratio(
        "interception / squid ssl-bump",
        "HTTPS, warden interception",
        "HTTPS, squid ssl-bump",
    );
    ratio(
        "gateway / baseline (HTTP)",
        "HTTP, warden gateway",
        "HTTP, baseline gateway",
    );
    ratio(
        "gateway / baseline (HTTPS tunnel)",
        "HTTPS tunnel, warden gateway",
        "HTTPS tunnel, baseline gateway",
    );
    ratio(
        "interception / baseline",
        "HTTPS, warden interception",
        "HTTPS, baseline interception",
    );
    warden_bench::say!();
    warden_bench::say!("name lookups of `localhost`, {requests} each (median, p99 in ms):");
    warden_bench::say!();
    warden_bench::say!(
        "| {:<34} | {:>11} | {:>9} |",
        "path",
        "median (ms)",
        "p99 (ms)"
    );
    warden_bench::say!("|{:-<36}|{:->13}|{:->11}|", "", "", "");
    for (name, samples) in &lookups {
        warden_bench::say!(
            "| {:<34} | {:>11.3} | {:>9.3} |",
            name,
            ms(percentile(samples, 0.5)),
            ms(percentile(samples, 0.99))
        );
    }
    warden_bench::say!(
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
