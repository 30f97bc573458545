//! Network rules compiled once into matchers. Deny rules win over allow rules; with no match
//! the policy's default decides; a private, loopback, link-local or metadata address is refused
//! unless an allow rule names it (by its IP or CIDR, or by the exact host name asked for).

use std::net::IpAddr;

use globset::{Glob, GlobMatcher, GlobSet, GlobSetBuilder};
use ipnet::IpNet;
use serde::Serialize;
use warden_policy::{NameLookup, NetRule, Network, NetworkDefault};

use crate::host::Host;

#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("network rule `{rule}`: {message}")]
    Rule { rule: String, message: String },
}

#[derive(Debug)]
enum HostMatch {
    Exact(String),
    /// `*.example.com`: any subdomain, not the apex.
    Subdomains(GlobMatcher),
    Ip(IpAddr),
    Net(IpNet),
}

#[derive(Debug)]
struct Rule {
    label: String,
    credential: Option<String>,
    host: HostMatch,
    ports: Vec<u16>,
    methods: Vec<String>,
    paths: Option<GlobSet>,
    /// The path globs as written, for messages.
    path_globs: Option<Vec<String>>,
    dns: NameLookup,
}

/// What a connection asks for.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub host: &'a Host,
    pub port: u16,
    /// Method and path of a plain HTTP request; absent for a CONNECT tunnel.
    pub http: Option<(&'a str, &'a str)>,
}

/// A decision and the rule or reason behind it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub allowed: bool,
    /// The rule that decided (`allow[0] host=pypi.org`), or `default`.
    pub rule: String,
    pub reason: String,
    /// The credential the allowing rule binds to this request.
    #[serde(skip)]
    pub credential: Option<String>,
    /// An `ask` rule matched: a person decides (until then, not allowed).
    #[serde(skip)]
    pub ask: bool,
    /// For a name: whether the cell's own query may make a lookup (see `NameLookup`).
    #[serde(skip)]
    pub lookup: NameLookup,
}

impl Verdict {
    pub fn new(allowed: bool, rule: &str, reason: &str) -> Self {
        Self {
            allowed,
            rule: rule.to_owned(),
            reason: reason.to_owned(),
            credential: None,
            ask: false,
            lookup: NameLookup::Any,
        }
    }
}

/// A compiled `network` section.
#[derive(Debug)]
pub struct Rules {
    default_allow: bool,
    allow: Vec<Rule>,
    deny: Vec<Rule>,
    ask: Vec<Rule>,
    /// `network.inference`, when set.
    pub(crate) inference: Option<InferenceRoute>,
}

/// The label of the rule that lets a cell's model traffic out to its inference upstream.
pub(crate) const INFERENCE_RULE: &str = "inference";

/// Where the cell's model traffic goes (`network.inference`).
#[derive(Debug, Clone)]
pub(crate) struct InferenceRoute {
    /// The name the cell's clients use.
    pub(crate) name: String,
    pub(crate) host: Host,
    pub(crate) port: u16,
    /// The upstream's path before the cell's (`/prefix`, or empty).
    pub(crate) prefix: String,
    pub(crate) max_tokens: Option<u64>,
    /// For an `https://` upstream: what the gateway trusts when it speaks TLS to it.
    pub(crate) tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

/// `network.inference` compiled: its route, and the allow rule for its upstream (which binds
/// its credential).
fn compile_inference(
    inference: &warden_policy::Inference,
    extra_ca: Option<&std::path::Path>,
) -> Result<(InferenceRoute, Rule), RulesError> {
    let err = |message: String| RulesError::Rule {
        rule: format!("network.inference upstream={}", inference.upstream),
        message,
    };
    let (rest, default_port, tls) = match (
        inference.upstream.strip_prefix("http://"),
        inference.upstream.strip_prefix("https://"),
    ) {
        (Some(rest), _) => (rest, 80, None),
        (_, Some(rest)) => (
            rest,
            443,
            Some(
                crate::tls::upstream_client(extra_ca)
                    .map_err(|e| err(format!("trusting the upstream: {e}")))?,
            ),
        ),
        _ => {
            return Err(err(
                "the upstream must be an http:// or https:// URL".to_owned()
            ));
        }
    };
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_owned()),
        None => (rest, String::new()),
    };
    let (host, port) =
        crate::host::split_authority(authority, default_port).map_err(|e| err(e.to_string()))?;
    let rule = Rule {
        label: format!("{INFERENCE_RULE} upstream={}", inference.upstream),
        credential: inference.credential.clone(),
        host: match &host {
            Host::Name(name) => HostMatch::Exact(name.clone()),
            Host::Ip(ip) => HostMatch::Ip(*ip),
        },
        ports: vec![port],
        methods: Vec::new(),
        // Decided request by request (so observed, counted and bounded), never as a raw
        // connection: a path rule makes it so.
        paths: Some({
            let mut builder = GlobSetBuilder::new();
            builder.add(Glob::new(&format!("{prefix}/**")).map_err(|e| err(e.to_string()))?);
            builder.build().map_err(|e| err(e.to_string()))?
        }),
        path_globs: Some(vec![format!("{prefix}/**")]),
        dns: NameLookup::Connected,
    };
    let route = InferenceRoute {
        name: inference.name.to_ascii_lowercase(),
        host,
        port,
        prefix,
        max_tokens: inference.max_tokens,
        tls,
    };
    Ok((route, rule))
}

impl Rules {
    pub fn compile(network: &Network) -> Result<Self, RulesError> {
        let compile_list = |list: &[NetRule], name: &str| -> Result<Vec<Rule>, RulesError> {
            list.iter()
                .enumerate()
                .map(|(i, r)| compile_rule(r, &format!("{name}[{i}]")))
                .collect()
        };
        let mut allow = compile_list(&network.allow, "allow")?;
        let inference = match &network.inference {
            Some(inference) => {
                let (route, rule) = compile_inference(inference, network.extra_ca.as_deref())?;
                // First: the upstream's rule decides (and binds its credential) before any
                // broader one.
                allow.insert(0, rule);
                Some(route)
            }
            None => None,
        };
        Ok(Self {
            default_allow: network.default == NetworkDefault::Allow,
            allow,
            deny: compile_list(&network.deny, "deny")?,
            ask: compile_list(&network.ask, "ask")?,
            inference,
        })
    }

    /// Decides a request by its host name or address, before any resolution: deny rules win,
    /// then ask rules (the verdict says a person must decide), then allow rules, then the default.
    pub fn decide(&self, request: &Request<'_>) -> Verdict {
        if let Some(rule) = self.deny.iter().find(|r| r.matches_any_form(request)) {
            return Verdict::new(false, &rule.label, "denied by rule");
        }
        if let Some(rule) = self.ask.iter().find(|r| r.matches(request)) {
            let mut verdict = Verdict::new(false, &rule.label, "waiting for a person's answer");
            verdict.ask = true;
            return verdict;
        }
        if let Some(rule) = self.allow.iter().find(|r| r.matches(request)) {
            let mut verdict = Verdict::new(true, &rule.label, "allowed by rule");
            verdict.credential = rule.credential.clone();
            return verdict;
        }
        if self.default_allow {
            return Verdict::new(true, "default", "network.default is allow");
        }
        // A rule for this host that the request misses on its method or path says what it
        // would take, so that an agent can correct itself.
        if let Some((method, path)) = request.http
            && let Some(near) = self
                .allow
                .iter()
                .find(|r| r.host_matches(request.host) && r.port_matches(request.port))
        {
            return Verdict::new(
                false,
                "default",
                &format!(
                    "no rule allows this request: {} covers the host but allows {} (this is {method} {path}); network.default is deny",
                    near.label,
                    near.allows()
                ),
            );
        }
        Verdict::new(
            false,
            "default",
            "no rule allows this destination (network.default is deny)",
        )
    }

    /// Whether a tunnel to `host:port` must be opened up (TLS interception): a rule for it
    /// restricts methods or paths (an allow, ask or deny rule: a deny rule on a path can only be
    /// held to where each request is seen), or binds a credential, and no deny rule refuses it
    /// outright.
    pub fn intercepts(&self, host: &Host, port: u16) -> bool {
        let tunnel = Request {
            host,
            port,
            http: None,
        };
        !self.deny.iter().any(|r| r.matches(&tunnel))
            && self
                .allow
                .iter()
                .chain(&self.ask)
                .chain(&self.deny)
                .any(|r| {
                    r.host_matches(host)
                        && r.port_matches(port)
                        && (r.is_l7() || r.credential.is_some())
                })
    }

    /// The deny rule that refuses `request` once its host is known to be at `ip` (a rule that
    /// names the address, or a network holding it), if one does: a name that resolves to a
    /// denied address, or a redirected connection to one, is refused like the address itself.
    pub fn denied_at(&self, request: &Request<'_>, ip: IpAddr) -> Option<&str> {
        let at = Host::Ip(ip.to_canonical());
        let request = Request {
            host: &at,
            ..request.clone()
        };
        self.address_denials()
            .find(|r| r.matches_any_form(&request))
            .map(|r| r.label.as_str())
    }

    /// The deny rules that name an address or a network.
    fn address_denials(&self) -> impl Iterator<Item = &Rule> {
        self.deny
            .iter()
            .filter(|r| matches!(r.host, HostMatch::Ip(_) | HostMatch::Net(_)))
    }

    /// Whether a deny rule on methods or paths names `ip` (an address or a network holding it)
    /// for `port`: a connection there must be opened up for its requests to be seen, whatever
    /// name it was opened for.
    pub fn decides_requests_at(&self, port: u16, ip: IpAddr) -> bool {
        let at = Host::Ip(ip.to_canonical());
        self.address_denials()
            .any(|r| r.is_l7() && r.port_matches(port) && r.host_matches(&at))
    }

    /// Whether some deny rule on methods or paths names an address or a network.
    pub fn decides_requests_at_addresses(&self) -> bool {
        self.address_denials().any(Rule::is_l7)
    }

    /// Whether some deny rule names an address or a network (`denied_at` can refuse).
    pub fn denies_addresses(&self) -> bool {
        self.address_denials().next().is_some()
    }

    /// Whether a name may be resolved for the cell: some allow rule covers it on some port (or
    /// the default allows), and no deny rule covers it on every port.
    pub fn decide_name(&self, host: &Host) -> Verdict {
        if let Some(rule) = self
            .deny
            .iter()
            .find(|r| r.host_matches(host) && r.ports.is_empty() && !r.is_l7())
        {
            return Verdict::new(false, &rule.label, "denied by rule");
        }
        let mut covering = self
            .allow
            .iter()
            .chain(&self.ask)
            .filter(|r| r.host_matches(host))
            .peekable();
        if let Some(first) = covering.peek() {
            let mut verdict = Verdict::new(true, &first.label, "allowed by rule");
            // One rule that lets the cell's queries make lookups is enough.
            verdict.lookup = if covering.any(|r| r.dns == NameLookup::Any) {
                NameLookup::Any
            } else {
                NameLookup::Connected
            };
            return verdict;
        }
        if self.default_allow {
            return Verdict::new(true, "default", "network.default is allow");
        }
        Verdict::new(
            false,
            "default",
            "no rule allows this name (network.default is deny)",
        )
    }

    /// Like [`Rules::address_allowed`], for any port of the rules that name the address.
    pub fn address_allowed_any_port(&self, asked: &Host, ip: IpAddr) -> bool {
        if !is_internal(ip) {
            return true;
        }
        self.allow.iter().chain(&self.ask).any(|r| match &r.host {
            HostMatch::Ip(rule_ip) => *rule_ip == ip,
            HostMatch::Net(net) => net.contains(&ip),
            HostMatch::Exact(name) => matches!(asked, Host::Name(n) if n == name),
            HostMatch::Subdomains(_) => false,
        })
    }

    /// Whether any rule needs TLS interception at all.
    pub fn need_interception(&self) -> bool {
        self.allow
            .iter()
            .chain(&self.ask)
            .chain(&self.deny)
            .any(|r| r.is_l7() || r.credential.is_some())
    }

    /// Whether a resolved address may be used: public addresses always; private, loopback,
    /// link-local and metadata addresses only when an allow (or ask) rule names them.
    pub fn address_allowed(&self, asked: &Host, ip: IpAddr, port: u16) -> bool {
        if !is_internal(ip) {
            return true;
        }
        self.allow
            .iter()
            .chain(&self.ask)
            .filter(|r| r.port_matches(port))
            .any(|r| match &r.host {
                HostMatch::Ip(rule_ip) => *rule_ip == ip,
                HostMatch::Net(net) => net.contains(&ip),
                HostMatch::Exact(name) => matches!(asked, Host::Name(n) if n == name),
                HostMatch::Subdomains(_) => false,
            })
    }
}

impl Rule {
    /// What the rule allows of a request, in words.
    fn allows(&self) -> String {
        let methods = if self.methods.is_empty() {
            "any method".to_owned()
        } else {
            format!("only {}", self.methods.join(", "))
        };
        match &self.path_globs {
            Some(globs) => format!("{methods} on {}", globs.join(", ")),
            None => format!("{methods} on any path"),
        }
    }

    fn is_l7(&self) -> bool {
        !self.methods.is_empty() || self.paths.is_some()
    }

    fn port_matches(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.contains(&port)
    }

    fn host_matches(&self, host: &Host) -> bool {
        match (&self.host, host) {
            (HostMatch::Exact(name), Host::Name(n)) => name == n,
            (HostMatch::Subdomains(glob), Host::Name(n)) => glob.is_match(n),
            (HostMatch::Ip(_) | HostMatch::Net(_), Host::Ip(asked)) => {
                // An address that carries an IPv4 one (NAT64, 6to4, ...) leads there too.
                let leads_to = |ip: &IpAddr| match &self.host {
                    HostMatch::Ip(rule) => rule == ip,
                    HostMatch::Net(net) => net.contains(ip),
                    _ => false,
                };
                leads_to(asked)
                    || matches!(asked, IpAddr::V6(v6) if embedded_v4(*v6)
                        .into_iter()
                        .any(|v4| leads_to(&IpAddr::V4(v4))))
            }
            _ => false,
        }
    }

    /// Whether the rule decides `request`; a path must match both as written and with runs of
    /// `/` merged (see `matches_any_form`): an allow rule covers what every server reads.
    fn matches(&self, request: &Request<'_>) -> bool {
        self.matches_path_by(request, false, |paths, path| {
            paths.is_match(path) && (!path.contains("//") || paths.is_match(merge_slashes(path)))
        })
    }

    /// `matches`, where a path matches in any of the forms servers read it in: as written, and
    /// with runs of `/` merged (`//admin/x` is `/admin/x` to a server that merges slashes), so
    /// that a deny rule on a path cannot be dodged by doubling a slash; and a method in any
    /// case. An allow or ask rule must match every form (`matches`).
    fn matches_any_form(&self, request: &Request<'_>) -> bool {
        self.matches_path_by(request, true, |paths, path| {
            paths.is_match(path) || (path.contains("//") && paths.is_match(merge_slashes(path)))
        })
    }

    /// `any_case`: a method matches in any case (`delete` is `DELETE` to some servers), where
    /// a deny rule is matched.
    fn matches_path_by(
        &self,
        request: &Request<'_>,
        any_case: bool,
        path_matches: impl Fn(&GlobSet, &str) -> bool,
    ) -> bool {
        if !self.host_matches(request.host) || !self.port_matches(request.port) {
            return false;
        }
        match request.http {
            Some((method, path)) => {
                (self.methods.is_empty()
                    || self
                        .methods
                        .iter()
                        .any(|m| m == method || (any_case && m.eq_ignore_ascii_case(method))))
                    && self
                        .paths
                        .as_ref()
                        .is_none_or(|paths| path_matches(paths, path))
            }
            // A tunnel shows no method or path and carries no credential: only rules that need
            // neither allow it (the others apply inside intercepted TLS).
            None => !self.is_l7() && self.credential.is_none(),
        }
    }
}

fn compile_rule(rule: &NetRule, label: &str) -> Result<Rule, RulesError> {
    let err = |message: String| RulesError::Rule {
        rule: format!("{label} host={}", rule.host),
        message,
    };
    let host = if let Ok(ip) = rule.host.parse::<IpAddr>() {
        HostMatch::Ip(ip.to_canonical())
    } else if let Ok(net) = rule.host.parse::<IpNet>() {
        HostMatch::Net(net.trunc())
    } else if let Some(domain) = rule.host.strip_prefix("*.") {
        let glob = Glob::new(&format!("*.{}", domain.to_ascii_lowercase()))
            .map_err(|e| err(e.to_string()))?;
        HostMatch::Subdomains(glob.compile_matcher())
    } else {
        match Host::parse(&rule.host) {
            Ok(Host::Name(name)) => HostMatch::Exact(name),
            Ok(Host::Ip(ip)) => HostMatch::Ip(ip),
            Err(e) => return Err(err(e.to_string())),
        }
    };
    let paths = if rule.paths.is_empty() {
        None
    } else {
        let mut builder = GlobSetBuilder::new();
        for path in &rule.paths {
            builder.add(Glob::new(path).map_err(|e| err(e.to_string()))?);
        }
        Some(builder.build().map_err(|e| err(e.to_string()))?)
    };
    Ok(Rule {
        label: format!("{label} host={}", rule.host),
        credential: rule.credential.clone(),
        host,
        ports: rule.ports.clone(),
        methods: rule.methods.clone(),
        path_globs: paths.as_ref().map(|_| rule.paths.clone()),
        paths,
        dns: rule.dns,
    })
}

/// `path` with each run of `/` made one.
fn merge_slashes(path: &str) -> String {
    let mut merged = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && merged.ends_with('/')) {
            merged.push(c);
        }
    }
    merged
}

/// Addresses that lead into the host, its networks or a cloud's metadata service. An IPv6
/// address that carries an IPv4 one (mapped, compatible, translated, NAT64, 6to4, Teredo) is
/// judged by the IPv4 address it leads to as well.
pub(crate) fn is_internal(ip: IpAddr) -> bool {
    if let IpAddr::V6(v6) = ip
        && embedded_v4(v6)
            .into_iter()
            .any(|v4| is_internal(IpAddr::V4(v4)))
    {
        return true;
    }
    match ip {
        IpAddr::V4(v4) => {
            v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.octets()[0] == 0
                || (v4.octets()[0] == 100 && (64..128).contains(&v4.octets()[1])) // CGNAT
        }
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let first = segments[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local, includes fd00:ec2::254
                || (first & 0xffc0) == 0xfe80 // link-local
                || (first & 0xffc0) == 0xfec0 // site-local (deprecated, still routed by some)
                // Local-use NAT64 (RFC 8215): translates into whatever network the operator has.
                || segments[..3] == [0x64, 0xff9b, 1]
                // Discard-only (RFC 6666).
                || segments[..4] == [0x100, 0, 0, 0]
        }
    }
}

/// The IPv4 addresses an IPv6 address leads to, for the forms that carry one.
fn embedded_v4(v6: std::net::Ipv6Addr) -> Vec<std::net::Ipv4Addr> {
    use std::net::Ipv4Addr;
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let mut found = Vec::new();
    if s[..6] == [0, 0, 0, 0, 0, 0xffff] // IPv4-mapped ::ffff:a.b.c.d
        || s[..6] == [0, 0, 0, 0, 0xffff, 0] // IPv4-translated ::ffff:0:a.b.c.d (SIIT)
        || (s[..6] == [0, 0, 0, 0, 0, 0] && (s[6] != 0 || s[7] > 1)) // IPv4-compatible ::a.b.c.d
        || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
    // NAT64 well-known prefix 64:ff9b::/96
    {
        found.push(low);
    }
    if s[0] == 0x2002 {
        // 6to4: 2002:AABB:CCDD::/48
        found.push(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    if s[..2] == [0x2001, 0] {
        // Teredo: the server in bits 32-63, the client (inverted) in the last 32.
        found.push(Ipv4Addr::new(
            (s[2] >> 8) as u8,
            s[2] as u8,
            (s[3] >> 8) as u8,
            s[3] as u8,
        ));
        found.push(Ipv4Addr::from(!u32::from(low)));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(host: &str) -> NetRule {
        NetRule {
            host: host.into(),
            ports: vec![],
            methods: vec![],
            paths: vec![],
            credential: None,
            dns: NameLookup::Any,
        }
    }

    fn rules(allow: Vec<NetRule>, deny: Vec<NetRule>, default: NetworkDefault) -> Rules {
        Rules::compile(&Network {
            default,
            allow,
            deny,
            ask: vec![],
            extra_ca: None,
            gateway: false,
            inference: None,
        })
        .unwrap()
    }

    fn name(n: &str) -> Host {
        Host::parse(n).unwrap()
    }

    #[test]
    fn deny_wins_and_globs_cover_subdomains_only() {
        let r = rules(
            vec![rule("*.example.com"), rule("pypi.org")],
            vec![rule("bad.example.com")],
            NetworkDefault::Deny,
        );
        let decide = |h: &str| {
            r.decide(&Request {
                host: &name(h),
                port: 443,
                http: None,
            })
            .allowed
        };
        assert!(decide("a.example.com"));
        assert!(!decide("example.com"));
        assert!(!decide("bad.example.com"));
        assert!(decide("pypi.org"));
        assert!(!decide("evil.org"));
    }

    #[test]
    fn methods_and_paths_apply_to_http_and_block_tunnels() {
        let mut get_only = rule("api.x.org");
        get_only.methods = vec!["GET".into()];
        get_only.paths = vec!["/repos/**".into()];
        let r = rules(vec![get_only], vec![], NetworkDefault::Deny);
        let host = name("api.x.org");
        let http = |m, p| {
            r.decide(&Request {
                host: &host,
                port: 80,
                http: Some((m, p)),
            })
            .allowed
        };
        assert!(http("GET", "/repos/a/b"));
        assert!(!http("POST", "/repos/a/b"));
        assert!(!http("GET", "/users"));
        let missed = r.decide(&Request {
            host: &host,
            port: 80,
            http: Some(("POST", "/users")),
        });
        assert_eq!(
            missed.reason,
            "no rule allows this request: allow[0] host=api.x.org covers the host but allows only GET on /repos/** (this is POST /users); network.default is deny"
        );
        let tunnel = r.decide(&Request {
            host: &host,
            port: 443,
            http: None,
        });
        // A plain tunnel cannot show its method or path: such hosts are intercepted instead.
        assert!(!tunnel.allowed, "{tunnel:?}");
        assert!(r.intercepts(&host, 443));
        assert!(!r.intercepts(&name("other.org"), 443));
    }

    #[test]
    fn a_deny_rule_on_paths_opens_tunnels_up_and_catches_doubled_slashes() {
        let mut admin = rule("good.test");
        admin.paths = vec!["/admin/**".into()];
        let r = rules(vec![rule("good.test")], vec![admin], NetworkDefault::Deny);
        let host = name("good.test");
        let http = |p| {
            r.decide(&Request {
                host: &host,
                port: 80,
                http: Some(("GET", p)),
            })
            .allowed
        };
        assert!(http("/public/x"));
        assert!(!http("/admin/x"));
        // What a server that merges slashes reads as /admin/x.
        assert!(!http("//admin/x"));
        assert!(!http("/admin//x"));
        // Only a request shows its path: the tunnel is opened up, so each request is decided.
        assert!(r.intercepts(&host, 443));
        assert!(r.need_interception());
        // A deny rule that refuses the host outright needs no interception.
        let r = rules(vec![], vec![rule("good.test")], NetworkDefault::Allow);
        assert!(!r.intercepts(&host, 443));
        // An allow rule on paths covers a path only in every form a server may read.
        let mut public = rule("good.test");
        public.paths = vec!["/public/**".into()];
        let r = rules(vec![public], vec![], NetworkDefault::Deny);
        let allowed = |p| {
            r.decide(&Request {
                host: &host,
                port: 80,
                http: Some(("GET", p)),
            })
            .allowed
        };
        assert!(allowed("/public/a//b"));
        assert!(!allowed("//public/../admin"));
    }

    #[test]
    fn a_denied_address_is_denied_in_every_form_and_behind_every_name() {
        let r = rules(
            vec![rule("*.example.test")],
            vec![rule("198.51.100.7"), rule("203.0.113.0/24")],
            NetworkDefault::Allow,
        );
        let tunnel = |h: &str| {
            r.decide(&Request {
                host: &name(h),
                port: 80,
                http: None,
            })
        };
        for form in [
            "198.51.100.7",
            "[::ffff:198.51.100.7]",
            "[::ffff:c633:6407]",
            "[64:ff9b::c633:6407]",
            "[2002:c633:6407::1]",
            "[::ffff:203.0.113.9]",
        ] {
            let verdict = tunnel(form);
            assert!(!verdict.allowed, "{form}: {verdict:?}");
            assert!(verdict.rule.starts_with("deny["), "{form}: {verdict:?}");
        }
        assert!(tunnel("198.51.100.8").allowed);
        // A name decided as a name is allowed; once known to be at a denied address, not.
        let request = Request {
            host: &name("denied-ip.example.test"),
            port: 80,
            http: Some(("GET", "/")),
        };
        assert!(r.decide(&request).allowed);
        assert!(r.denies_addresses());
        assert_eq!(
            r.denied_at(&request, "198.51.100.7".parse().unwrap()),
            Some("deny[0] host=198.51.100.7")
        );
        assert_eq!(
            r.denied_at(&request, "::ffff:203.0.113.200".parse().unwrap()),
            Some("deny[1] host=203.0.113.0/24")
        );
        assert_eq!(r.denied_at(&request, "198.51.100.8".parse().unwrap()), None);
        // A deny rule on paths that names an address holds for those paths there.
        let mut admin = rule("198.51.100.7");
        admin.paths = vec!["/admin/**".into()];
        let on_paths = rules(vec![], vec![admin], NetworkDefault::Allow);
        let at = "198.51.100.7".parse().unwrap();
        let asked = name("denied-ip.example.test");
        let asking = |http| Request {
            host: &asked,
            port: 80,
            http,
        };
        assert!(
            on_paths
                .denied_at(&asking(Some(("GET", "//admin/x"))), at)
                .is_some()
        );
        assert_eq!(
            on_paths.denied_at(&asking(Some(("GET", "/public"))), at),
            None
        );
        assert_eq!(on_paths.denied_at(&asking(None), at), None);
        // Such a rule opens up a connection to that address, whatever name it was opened for;
        // a rule without methods or paths refuses it outright instead.
        assert!(on_paths.decides_requests_at_addresses());
        assert!(on_paths.decides_requests_at(443, at));
        assert!(on_paths.decides_requests_at(443, "::ffff:198.51.100.7".parse().unwrap()));
        assert!(!on_paths.decides_requests_at(443, "198.51.100.8".parse().unwrap()));
        assert!(!r.decides_requests_at_addresses());
        assert!(!r.decides_requests_at(443, at));
        // A deny rule's method matches in any case.
        let mut delete = rule("api.test");
        delete.methods = vec!["DELETE".into()];
        let r = rules(vec![rule("api.test")], vec![delete], NetworkDefault::Deny);
        let host = name("api.test");
        for method in ["DELETE", "delete", "Delete"] {
            let verdict = r.decide(&Request {
                host: &host,
                port: 80,
                http: Some((method, "/x")),
            });
            assert!(!verdict.allowed, "{method}");
        }
        // A deny rule by name names no address.
        let by_name = rules(vec![], vec![rule("evil.test")], NetworkDefault::Allow);
        assert!(!by_name.denies_addresses());
        assert_eq!(
            by_name.denied_at(&request, "198.51.100.7".parse().unwrap()),
            None
        );
    }

    #[test]
    fn internal_addresses_need_a_rule_that_names_them() {
        let r = rules(
            vec![rule("127.0.0.1"), rule("internal.corp")],
            vec![],
            NetworkDefault::Allow,
        );
        let public: IpAddr = "93.184.216.34".parse().unwrap();
        assert!(r.address_allowed(&name("example.com"), public, 443));
        assert!(!r.address_allowed(&name("example.com"), "10.0.0.5".parse().unwrap(), 443));
        assert!(!r.address_allowed(&name("x"), "169.254.169.254".parse().unwrap(), 80));
        assert!(!r.address_allowed(&name("x"), "::ffff:10.0.0.1".parse().unwrap(), 80));
        assert!(r.address_allowed(&name("x"), "127.0.0.1".parse().unwrap(), 80));
        assert!(r.address_allowed(&name("internal.corp"), "10.1.2.3".parse().unwrap(), 80));
    }

    #[test]
    fn names_resolve_when_a_rule_could_use_them() {
        let mut on_443 = rule("api.x.org");
        on_443.ports = vec![443];
        let mut deny_on_25 = rule("mail.x.org");
        deny_on_25.ports = vec![25];
        let r = rules(
            vec![on_443, rule("*.x.org"), rule("10.0.0.0/8")],
            vec![rule("bad.x.org"), deny_on_25],
            NetworkDefault::Deny,
        );
        assert!(r.decide_name(&name("api.x.org")).allowed);
        assert!(r.decide_name(&name("a.x.org")).allowed);
        // A deny on some ports still lets the name resolve for the others; on all ports, not.
        assert!(r.decide_name(&name("mail.x.org")).allowed);
        assert!(!r.decide_name(&name("bad.x.org")).allowed);
        assert!(!r.decide_name(&name("c2VjcmV0.attacker.test")).allowed);
        // Private answers only where a rule names the address or the exact name.
        assert!(r.address_allowed_any_port(&name("a.x.org"), "10.9.9.9".parse().unwrap()));
        assert!(!r.address_allowed_any_port(&name("a.x.org"), "192.168.1.1".parse().unwrap()));
        assert!(r.address_allowed_any_port(&name("a.x.org"), "93.184.216.34".parse().unwrap()));
    }

    #[test]
    fn ipv6_forms_that_carry_a_private_ipv4_are_private() {
        let r = rules(vec![], vec![], NetworkDefault::Allow);
        let blocked = |text: &str| !r.address_allowed(&name("x"), text.parse().unwrap(), 80);
        for internal in [
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "::ffff:0:169.254.169.254",
            "::127.0.0.1",
            "::10.1.2.3",
            "64:ff9b::10.0.0.1",
            "64:ff9b::169.254.169.254",
            "64:ff9b::7f00:1",
            "64:ff9b:1::8.8.8.8",
            "2002:a00:1::1",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::1",
            // Teredo with a client of 127.0.0.1 (inverted: 80ff:fffe).
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
            "2001:0:a00:1::1",
            "fec0::1",
            "100::1",
        ] {
            assert!(blocked(internal), "{internal} was taken for public");
        }
        for public in [
            "2606:4700::1111",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
            "::ffff:8.8.8.8",
        ] {
            assert!(!blocked(public), "{public} was taken for private");
        }
    }

    #[test]
    fn names_under_a_connected_only_rule_are_not_looked_up_for_queries() {
        let mut quiet = rule("*.quiet.test");
        quiet.dns = NameLookup::Connected;
        let r = rules(vec![quiet, rule("loud.test")], vec![], NetworkDefault::Deny);
        let verdict = r.decide_name(&name("c2VjcmV0.quiet.test"));
        assert!(verdict.allowed);
        assert_eq!(verdict.lookup, NameLookup::Connected);
        assert_eq!(r.decide_name(&name("loud.test")).lookup, NameLookup::Any);
    }

    #[test]
    fn deny_wins_over_ask_and_ask_over_allow() {
        let r = Rules::compile(&Network {
            default: NetworkDefault::Allow,
            allow: vec![rule("*.x.org")],
            deny: vec![rule("bad.x.org")],
            ask: vec![rule("*.x.org"), rule("10.1.2.3")],
            extra_ca: None,
            gateway: false,
            inference: None,
        })
        .unwrap();
        let decide = |h: &str| {
            r.decide(&Request {
                host: &name(h),
                port: 443,
                http: None,
            })
        };
        let bad = decide("bad.x.org");
        assert!(!bad.allowed && !bad.ask, "{bad:?}");
        let asked = decide("a.x.org");
        assert!(!asked.allowed && asked.ask, "{asked:?}");
        assert_eq!(asked.rule, "ask[0] host=*.x.org");
        assert!(decide("other.org").allowed);
        // The name resolves (so that the connection can be asked about), and a private address
        // an ask rule names is usable once approved.
        assert!(r.decide_name(&name("a.x.org")).allowed);
        assert!(r.address_allowed(&name("y"), "10.1.2.3".parse().unwrap(), 443));
    }

    #[test]
    fn an_ask_rule_on_methods_opens_up_tls_and_asks_inside_it() {
        let mut post = rule("api.x.org");
        post.methods = vec!["POST".into()];
        let r = Rules::compile(&Network {
            default: NetworkDefault::Deny,
            allow: vec![],
            deny: vec![],
            ask: vec![post],
            extra_ca: None,
            gateway: false,
            inference: None,
        })
        .unwrap();
        assert!(r.need_interception());
        assert!(r.intercepts(&name("api.x.org"), 443));
        assert!(!r.intercepts(&name("other.org"), 443));
        let inside = |method: &str| {
            r.decide(&Request {
                host: &name("api.x.org"),
                port: 443,
                http: Some((method, "/v1/x")),
            })
        };
        assert!(inside("POST").ask);
        let get = inside("GET");
        assert!(!get.allowed && !get.ask, "{get:?}");
    }
}
