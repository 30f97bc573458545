//! The egress gateway as every tier attaches it: what the cell is told (proxy variables, its
//! resolver, credential placeholders, the interception CA), the listening sockets opened in the
//! cell's network namespace, and the gateway served from them outside the cell. Only how the
//! sockets reach the warden is a tier's own: the process tier's init opens them inside the cell
//! and hands them over; the gVisor tier's keeper opens them in the namespace it made for the
//! sandbox.

use std::fs;
use std::io::{self, Write as _};
use std::net::{TcpListener, UdpSocket};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use warden_policy::Policy;

/// Where `warden policy set` drops a new policy for a running cell, and where the gateway's
/// keeper answers (in the cell's runtime folder).
pub const POLICY_UPDATE: &str = "policy-update.yaml";
pub const POLICY_ACK: &str = "policy-update.json";
/// The folder of a running cell where `ask` rules leave their questions.
pub const APPROVALS: &str = "approvals";

/// The most bytes of `ask` rules' questions a gateway tells on its stderr (a daemon's keeper's
/// is the cell's `keeper.log`): each is a line of up to ~2.2 KiB, and a cell asks as often as it
/// likes. The questions themselves stay in the approvals folder, and the daemon's queue.
const QUESTIONS_TOLD: u64 = 1 << 20;

/// The gateway a policy asks for, compiled before the cell exists.
#[derive(Debug)]
pub struct GatewayPlan {
    pub rules: warden_egress::Rules,
    pub secrets: warden_egress::Secrets,
    pub interceptor: Option<warden_egress::Interceptor>,
}

/// Why a gateway could not be planned or started.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Rules(#[from] warden_egress::RulesError),
    #[error(transparent)]
    Secret(#[from] warden_egress::SecretError),
    #[error(transparent)]
    Tls(#[from] warden_egress::TlsError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
}

fn io(what: &'static str) -> impl FnOnce(io::Error) -> GatewayError {
    move |source| GatewayError::Io { what, source }
}

/// Replaces or adds `key` in an environment.
fn set(env: &mut Vec<(std::ffi::OsString, std::ffi::OsString)>, key: &str, value: String) {
    env.retain(|(k, _)| k != key);
    env.push((key.into(), value.into()));
}

/// Plans the gateway of a policy that lets anything out (`None` when it lets nothing out), and
/// tells the cell about it: proxy-aware clients are pointed at the gateway's port on loopback,
/// names resolve through it, credentials become placeholders, and where a rule needs TLS
/// interception the cell trusts its own CA. `env` and `etc` (files under the cell's `/etc`)
/// are added to.
pub fn plan(
    policy: &Policy,
    name: &str,
    env: &mut Vec<(std::ffi::OsString, std::ffi::OsString)>,
    etc: &mut Vec<(String, String)>,
) -> Result<Option<GatewayPlan>, GatewayError> {
    if !policy.network.has_gateway() {
        return Ok(None);
    }
    let proxy = format!("http://127.0.0.1:{}", warden_egress::GATEWAY_PORT);
    for key in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        set(env, key, proxy.clone());
    }
    for key in ["NO_PROXY", "no_proxy"] {
        set(env, key, "localhost,127.0.0.1,::1".to_owned());
    }
    let rules = warden_egress::Rules::compile(&policy.network)?;
    // Names resolve through the gateway, which answers only what the rules let out.
    etc.push((
        "resolv.conf".to_owned(),
        "nameserver 127.0.0.1\n".to_owned(),
    ));
    etc.push((
        "nsswitch.conf".to_owned(),
        "passwd: files\ngroup: files\nhosts: files dns\n".to_owned(),
    ));
    // Credentials: the cell gets placeholders, the gateway keeps the secrets.
    let secrets = warden_egress::Secrets::load(&policy.credentials)?;
    for secret in &secrets.all {
        if let Some(var) = &secret.env {
            set(env, var, secret.placeholder.clone());
        }
    }
    // TLS interception: the cell's own CA, trusted by the cell only.
    let interceptor = if rules.need_interception() {
        let interceptor =
            warden_egress::Interceptor::new(name, policy.network.extra_ca.as_deref())?;
        let ca = interceptor.ca_pem();
        let host_roots =
            fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
        etc.push(("warden/egress-ca.pem".to_owned(), ca.clone()));
        etc.push((
            "warden/ca-bundle.pem".to_owned(),
            format!("{host_roots}\n{ca}"),
        ));
        for (key, file) in [
            ("SSL_CERT_FILE", "ca-bundle.pem"),
            ("REQUESTS_CA_BUNDLE", "ca-bundle.pem"),
            ("CURL_CA_BUNDLE", "ca-bundle.pem"),
            ("GIT_SSL_CAINFO", "ca-bundle.pem"),
            ("NODE_EXTRA_CA_CERTS", "egress-ca.pem"),
        ] {
            set(env, key, format!("/etc/warden/{file}"));
        }
        Some(interceptor)
    } else {
        None
    };
    Ok(Some(GatewayPlan {
        rules,
        secrets,
        interceptor,
    }))
}

/// The gateway's listening sockets in a cell's network namespace.
#[derive(Debug)]
pub struct Sockets {
    /// The proxy port (the proxy variables point here).
    pub proxy: OwnedFd,
    /// Where the namespace's redirect sends every other TCP connection.
    pub transparent: OwnedFd,
    /// DNS, answered by the warden.
    pub dns: OwnedFd,
    /// The transparent and the proxy port on `::1`, where the kernel has IPv6.
    pub transparent6: Option<OwnedFd>,
    pub proxy6: Option<OwnedFd>,
    /// Whether the namespace's other traffic is redirected to the transparent ports (needs
    /// `ip` and `nft` on the host); without it they are not served.
    pub redirected: bool,
}

impl Sockets {
    /// Opens the sockets in the calling thread's network namespace, and redirects the
    /// namespace's other traffic to them (TCP to the transparent port, DNS to the warden's
    /// resolver, the rest dropped). Port 53 needs the capability to bind it.
    pub fn open() -> io::Result<Self> {
        let mut sockets = Self::open_unredirected()?;
        sockets.redirected = Redirecting::start().is_some_and(Redirecting::finish);
        Ok(sockets)
    }

    /// The sockets alone, the namespace's other traffic not redirected to them (`redirected`
    /// false): see `redirect_in`.
    pub fn open_unredirected() -> io::Result<Self> {
        let proxy = TcpListener::bind(("127.0.0.1", warden_egress::GATEWAY_PORT))?;
        let transparent = TcpListener::bind(("127.0.0.1", warden_egress::TRANSPARENT_PORT))?;
        let dns = UdpSocket::bind(("127.0.0.1", 53))?;
        // IPv6 connections are redirected to [::1]; a kernel without IPv6 simply has none.
        let transparent6 = TcpListener::bind(("::1", warden_egress::TRANSPARENT_PORT)).ok();
        // The proxy port on IPv6 too, for clients that reach `localhost` over ::1 (only where
        // the transparent one could bind, so that the two are told apart by position).
        let proxy6 = transparent6
            .as_ref()
            .and_then(|_| TcpListener::bind(("::1", warden_egress::GATEWAY_PORT)).ok());
        Ok(Self {
            proxy: proxy.into(),
            transparent: transparent.into(),
            dns: dns.into(),
            transparent6: transparent6.map(Into::into),
            proxy6: proxy6.map(Into::into),
            redirected: false,
        })
    }

    /// In the order a tier hands them over one channel: the proxy port, the transparent
    /// port, DNS, and where the kernel has IPv6 the transparent and the proxy port on `::1`.
    pub fn into_ordered(self) -> (Vec<OwnedFd>, bool) {
        let mut all = vec![self.proxy, self.transparent, self.dns];
        all.extend(self.transparent6);
        all.extend(self.proxy6);
        (all, self.redirected)
    }

    /// The sockets handed over as `into_ordered` listed them.
    pub fn from_ordered(fds: Vec<OwnedFd>, redirected: bool) -> Option<Self> {
        let mut fds = fds.into_iter();
        Some(Self {
            proxy: fds.next()?,
            transparent: fds.next()?,
            dns: fds.next()?,
            transparent6: fds.next(),
            proxy6: fds.next(),
            redirected,
        })
    }
}

/// The nftables rules of a cell's network namespace.
const REDIRECT_RULES: &str = "table ip warden {
  chain out {
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.1 return
    udp dport 53 redirect to :53
    meta l4proto tcp redirect to :3129
  }
  chain deny {
    type filter hook output priority 0; policy accept;
    ip daddr != 127.0.0.1 meta l4proto != tcp drop
  }
}
table ip6 warden {
  chain out {
    type nat hook output priority -100; policy accept;
    ip6 daddr ::1 return
    meta l4proto tcp redirect to :3129
  }
  chain deny {
    type filter hook output priority 0; policy accept;
    ip6 daddr != ::1 meta l4proto != tcp drop
  }
}
";

/// The whole redirection of the network namespace `netns` (see `Redirecting`), on a thread of
/// its own that enters it: whether it is redirected. For a namespace whose sockets were opened
/// without it (`Sockets::open_unredirected`), by a caller that has other work meanwhile.
pub fn redirect_in(netns: OwnedFd) -> io::Result<std::thread::JoinHandle<bool>> {
    std::thread::Builder::new()
        .name("cell-redirect".to_owned())
        .spawn(move || {
            crate::process::sys::enter_network_namespace(std::os::fd::AsFd::as_fd(&netns)).is_ok()
                && Redirecting::start().is_some_and(Redirecting::finish)
        })
}

/// The programs that give a network namespace a default route through loopback (so that
/// connections to other addresses reach the output hook at all) and redirect its traffic to
/// the gateway (`ip` twice, `nft` with `REDIRECT_RULES`), started by a thread in that namespace
/// (a process takes the namespace of the thread that starts it) and waited for by `finish`.
/// Dropped unfinished, they are killed and waited for.
#[derive(Debug)]
struct Redirecting {
    children: Vec<std::process::Child>,
    /// Whether the rules went to `nft` whole.
    written: bool,
}

impl Redirecting {
    /// Starts the three programs at once (none needs another's work, and one after the other
    /// they were most of what a cell with a gateway adds to a cold start: `ip` 0.7 ms and
    /// `nft` 1.2 ms more than `true` in a fresh network namespace here). `None` where the host
    /// lacks `ip` or `nft`, or one could not be started (those started are ended).
    fn start() -> Option<Self> {
        use std::process::{Command, Stdio};
        let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"]
            .into_iter()
            .find(|p| Path::new(p).exists())?;
        let nft = ["/usr/sbin/nft", "/sbin/nft"]
            .into_iter()
            .find(|p| Path::new(p).exists())?;
        let start = |program: &str, args: &[&str], input: bool| {
            Command::new(program)
                .args(args)
                .stdin(if input { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        };
        // `nft` first: it takes longest (its libraries, its netlink cache), 2-3 ms here.
        let started = [
            start(nft, &["-f", "-"], true),
            // With the loopback address as the source: a route through `lo` alone gives a
            // connection to another network's IPv4 address the source 0.0.0.0, to which the
            // gateway's answers cannot be sent back (IPv6 takes ::1 either way; said for both).
            start(
                ip,
                &["route", "add", "default", "dev", "lo", "src", "127.0.0.1"],
                false,
            ),
            start(
                ip,
                &["-6", "route", "add", "default", "dev", "lo", "src", "::1"],
                false,
            ),
        ];
        let mut redirecting = Self {
            children: Vec::new(),
            written: false,
        };
        for child in started {
            // Those started already are ended by the drop.
            redirecting.children.push(child.ok()?);
        }
        // The rules go to `nft` (its stdin, closed after).
        redirecting.written = redirecting
            .children
            .iter_mut()
            .filter_map(|child| child.stdin.take())
            .all(|mut stdin| stdin.write_all(REDIRECT_RULES.as_bytes()).is_ok());
        Some(redirecting)
    }

    /// Waits for every one of the programs, whatever the others did: whether the namespace
    /// is redirected.
    fn finish(mut self) -> bool {
        let waited: Vec<bool> = std::mem::take(&mut self.children)
            .into_iter()
            .map(|mut child| child.wait().is_ok_and(|s| s.success()))
            .collect();
        waited.into_iter().all(|ok| ok) && self.written
    }
}

impl Drop for Redirecting {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The notice of a cell whose namespace could not be redirected.
pub const NOT_REDIRECTED: &str = "clients that ignore the proxy variables have no route out (install `ip` and `nft` on the host to have them redirected to the gateway)";

/// Where a running gateway keeps what it is told and tells.
#[derive(Debug)]
pub struct Places {
    /// The cell's egress record.
    pub log: PathBuf,
    /// The cell's runtime folder (approvals, policy updates).
    pub folder: PathBuf,
}

/// Serves the gateway from `sockets`, outside the cell, and returns the watch through which
/// its rules are replaced while the cell runs. `ask` rules' questions are told to this
/// process's stderr and answered through the cell's runtime folder.
pub fn start(
    name: &str,
    policy: &Policy,
    planned: GatewayPlan,
    sockets: Sockets,
    places: Places,
) -> Result<PolicyWatch, GatewayError> {
    let GatewayPlan {
        rules,
        secrets,
        interceptor,
    } = planned;
    let mut gateway = warden_egress::Gateway::new(
        rules,
        &places.log,
        name,
        secrets,
        interceptor,
        warden_egress::Bounds::of(&policy.limits),
    )
    .map_err(io("opening the egress log"))?;
    if !policy.network.ask.is_empty() || policy.network.gateway {
        // Questions of `ask` rules: told on this process's stderr, answered by `warden
        // approve` or `warden deny` from anywhere on the host.
        let cell = name.to_owned();
        let told = std::sync::atomic::AtomicU64::new(0);
        let approvals = warden_egress::Approvals::new(
            &places.folder.join(APPROVALS),
            policy.approvals.timeout.0,
            policy.approvals.on_timeout == warden_policy::ApprovalOutcome::Allow,
            move |q| {
                let mut line = format!(
                    "warden: cell `{cell}` asks to {} (rule {}): answer with `warden approve {cell} {id}` or `warden deny {cell} {id}` within {} s\n",
                    q.request,
                    q.rule,
                    q.timeout_s,
                    id = q.id
                );
                // The cell asks as often as it likes (a question a standing grant answers is
                // asked all the same), and a daemon's keeper tells them to the cell's log file:
                // at most `QUESTIONS_TOLD` bytes of them, then one line that says so.
                let before = told.fetch_add(line.len() as u64, Ordering::Relaxed);
                if before >= QUESTIONS_TOLD {
                    return;
                }
                if before + line.len() as u64 > QUESTIONS_TOLD {
                    line = format!(
                        "warden: cell `{cell}` asks more than {} KiB of questions: no more are told here; `warden approvals {cell}` lists those waiting\n",
                        QUESTIONS_TOLD >> 10
                    );
                }
                // Straight to the descriptor: a relay may hold the lock of `stderr` while it
                // forwards the cell's output.
                let _ = nix::unistd::write(std::io::stderr(), line.as_bytes());
            },
        )
        .map_err(io("creating the approvals folder"))?;
        gateway = gateway.with_approvals(approvals);
    }
    let serve = io("starting the egress gateway");
    gateway
        .clone()
        .serve(TcpListener::from(sockets.proxy))
        .map_err(serve)?;
    if let Some(socket) = sockets.proxy6 {
        gateway
            .clone()
            .serve(TcpListener::from(socket))
            .map_err(io("starting the egress gateway"))?;
    }
    if sockets.redirected {
        for socket in std::iter::once(sockets.transparent).chain(sockets.transparent6) {
            gateway
                .clone()
                .serve_transparent(TcpListener::from(socket))
                .map_err(io("starting the egress gateway"))?;
        }
    }
    gateway
        .clone()
        .serve_dns(UdpSocket::from(sockets.dns))
        .map_err(io("starting the egress gateway"))?;
    Ok(PolicyWatch {
        path: places.folder.join(POLICY_UPDATE),
        ack: places.folder.join(POLICY_ACK),
        gateway,
        seen: None,
    })
}

/// A running gateway whose network rules may be replaced through the cell's runtime folder.
#[derive(Debug)]
pub struct PolicyWatch {
    path: PathBuf,
    ack: PathBuf,
    gateway: warden_egress::Gateway,
    seen: Option<SystemTime>,
}

impl PolicyWatch {
    /// Ends the record of the gateway's decisions (the cell is gone).
    pub fn close_record(&self) {
        self.gateway.close_record();
    }

    /// Applies a new policy file once per modification; the answer goes to the ack file.
    pub fn check(&mut self) {
        let Ok(modified) = fs::metadata(&self.path).and_then(|m| m.modified()) else {
            return;
        };
        if self.seen == Some(modified) {
            return;
        }
        self.seen = Some(modified);
        let answer = warden_policy::from_file(&self.path)
            .map_err(|e| e.to_string())
            .and_then(|policy| {
                warden_egress::Rules::compile(&policy.network).map_err(|e| e.to_string())
            })
            .map(|rules| self.gateway.replace_rules(rules));
        let json = match answer {
            Ok(closed) => serde_json::json!({ "ok": true, "closed": closed }),
            Err(error) => serde_json::json!({ "ok": false, "error": error }),
        };
        let tmp = self.ack.with_extension("tmp");
        if fs::write(&tmp, json.to_string()).is_ok() {
            let _ = fs::rename(&tmp, &self.ack);
        }
    }
}
