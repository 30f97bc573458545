//! The policy document as Rust types. Every struct refuses unknown fields, so a typo is an error
//! with a line and column rather than a silently ignored rule.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, de};

use crate::units::{ByteSize, Duration};

/// A whole policy. Sections that are left out take the values of the built-in `default` preset.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Schema version; only `1` exists.
    #[serde(deserialize_with = "version_one")]
    pub version: u32,
    /// A preset this document builds on: its lists add to the preset's, its other values replace
    /// the preset's (see `compose`). Gone from the policy once composed.
    #[serde(default, skip_serializing)]
    pub extends: Option<String>,
    /// Entries taken out of the preset's lists and maps, in the policy's own shape (with
    /// `extends` only).
    #[serde(default, skip_serializing)]
    pub remove: Option<serde_json::Value>,
    /// Isolation tier the cell runs under.
    #[serde(default)]
    pub tier: Tier,
    /// An imported image (`warden image import`) as the cell's root, instead of the host's
    /// directories. With one, `filesystem.read_only`, `filesystem.links` and
    /// `process.env.set` hold only what the document itself names (the presets' host
    /// directories and variables are not laid over the image); the image's environment comes
    /// first and the document's variables win over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default)]
    pub filesystem: Filesystem,
    #[serde(default)]
    pub process: Process,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub network: Network,
    #[serde(default)]
    pub credentials: Credentials,
    #[serde(default)]
    pub approvals: Approvals,
    /// Which commands the warden runs when asked to (exec through the daemon).
    #[serde(default)]
    pub commands: Commands,
    #[serde(default)]
    pub gpu: Gpu,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            version: 1,
            extends: None,
            remove: None,
            tier: Tier::default(),
            image: None,
            filesystem: Filesystem::default(),
            process: Process::default(),
            limits: Limits::default(),
            network: Network::default(),
            credentials: Credentials::default(),
            approvals: Approvals::default(),
            commands: Commands::default(),
            gpu: Gpu::default(),
        }
    }
}

fn version_one<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let version = u32::deserialize(deserializer)?;
    if version == 1 {
        Ok(version)
    } else {
        Err(de::Error::custom(format!(
            "unsupported policy version {version}: this warden understands version 1"
        )))
    }
}

/// The isolation mechanism behind a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Linux namespaces, seccomp, Landlock and cgroups.
    #[default]
    Process,
    /// gVisor (`runsc`).
    Gvisor,
    /// A microVM driven by the warden.
    Microvm,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Self::Process, Self::Gvisor, Self::Microvm];

    pub fn name(self) -> &'static str {
        match self {
            Self::Process => "process",
            Self::Gvisor => "gvisor",
            Self::Microvm => "microvm",
        }
    }

    /// The tier a policy's word names.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// What the cell sees of the host file system.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Filesystem {
    /// Host paths visible read-only at the same place inside the cell. Paths missing on the host
    /// are left out (so one policy serves hosts with and without `/lib64`).
    #[serde(deserialize_with = "absolute_paths")]
    pub read_only: Vec<PathBuf>,
    /// Host directories visible read-write at the same place inside the cell.
    #[serde(deserialize_with = "absolute_paths")]
    pub read_write: Vec<PathBuf>,
    /// Paths inside the cell that are masked even when a parent is visible.
    #[serde(deserialize_with = "absolute_paths")]
    pub hidden: Vec<PathBuf>,
    /// Size of the cell's private `/tmp`.
    pub tmp_size: ByteSize,
    pub workspace: Workspace,
    /// Symbolic links made in the cell's root, by path: another name for a place the cell
    /// sees (`/workspace: /home/user`). A link grants nothing: what it leads to is what the
    /// cell could reach anyway.
    #[serde(
        deserialize_with = "absolute_links",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub links: BTreeMap<PathBuf, PathBuf>,
}

impl Default for Filesystem {
    fn default() -> Self {
        let read_only = [
            "/usr",
            "/bin",
            "/sbin",
            "/lib",
            "/lib32",
            "/lib64",
            "/libx32",
            "/etc/alternatives",
            "/etc/ssl",
            "/etc/ca-certificates",
            "/etc/ld.so.cache",
            "/etc/ld.so.conf",
            "/etc/ld.so.conf.d",
            "/etc/localtime",
            "/etc/mime.types",
            "/etc/os-release",
            "/etc/debian_version",
            "/etc/profile",
            "/etc/bash.bashrc",
            "/etc/inputrc",
            "/etc/shells",
            "/etc/protocols",
            "/etc/services",
            "/etc/gai.conf",
            "/etc/python3",
            "/etc/python3.11",
            "/etc/perl",
        ];
        Self {
            read_only: read_only.iter().map(PathBuf::from).collect(),
            read_write: Vec::new(),
            hidden: Vec::new(),
            tmp_size: ByteSize(256 << 20),
            workspace: Workspace::default(),
            links: BTreeMap::new(),
        }
    }
}

/// How the host project directory (`--workspace DIR`) appears in the cell.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Workspace {
    /// Where the workspace appears inside the cell.
    #[serde(deserialize_with = "absolute_path")]
    pub mount: PathBuf,
    pub mode: WorkspaceMode,
    /// Paths, relative to the workspace, that the host later executes or trusts (`.git`, `.envrc`,
    /// shell rc files, editor and agent configuration). In `direct` mode they are read-only
    /// inside the cell; in `overlay` mode changes to them are applied only when named.
    pub protect: Vec<String>,
}

impl Default for Workspace {
    fn default() -> Self {
        let protect = [
            ".git",
            ".envrc",
            ".env",
            ".bashrc",
            ".bash_profile",
            ".profile",
            ".zshrc",
            ".zprofile",
            ".vscode",
            ".idea",
            ".devcontainer",
            ".claude",
            ".cursor",
            ".github",
            ".gitmodules",
            ".gitattributes",
            "Makefile",
        ];
        Self {
            mount: PathBuf::from("/workspace"),
            mode: WorkspaceMode::default(),
            protect: protect.iter().map(|p| (*p).to_owned()).collect(),
        }
    }
}

/// `overlay`: the cell writes a copy-on-write layer over the host directory, and changes reach
/// the host only through `warden apply`. `direct`: the cell writes the host directory itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceMode {
    #[default]
    Overlay,
    Direct,
}

/// Who the command runs as and what it starts with.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Process {
    /// User id inside the cell (never host root: see the docs on id mapping). When the policy
    /// names none: the image's user (`image:`), else [`DEFAULT_USER`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<u32>,
    /// Group id inside the cell; defaults to the user's (the image's, or the user id).
    pub group: Option<u32>,
    /// Host name of the cell; defaults to the cell's name.
    pub hostname: Option<String>,
    /// Working directory inside the cell. When the policy names none: the image's working
    /// directory (`image:`), else `/workspace`.
    #[serde(
        deserialize_with = "absolute_path_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub cwd: Option<PathBuf>,
    pub env: EnvPolicy,
}

/// The user a cell runs as when neither its policy nor its image names one.
pub const DEFAULT_USER: u32 = 1000;
/// Where a cell's commands start when neither its policy nor its image names a directory.
pub const DEFAULT_CWD: &str = "/workspace";

impl Process {
    /// The user id, where no image decides it.
    pub fn user(&self) -> u32 {
        self.user.unwrap_or(DEFAULT_USER)
    }

    /// The group id, where no image decides it.
    pub fn group(&self) -> u32 {
        self.group.unwrap_or(self.user())
    }

    /// The working directory, where no image decides it.
    pub fn cwd(&self) -> PathBuf {
        self.cwd
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CWD))
    }
}

/// The environment is cleared; only what is named here enters the cell.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvPolicy {
    /// Variables copied from the caller's environment when set there.
    pub pass: Vec<String>,
    /// Variables set to fixed values. A `~/` at the start of a value, or of one of its
    /// `:`-separated parts, is the home directory of whoever reads the policy.
    #[serde(deserialize_with = "env_values")]
    pub set: BTreeMap<String, String>,
}

impl Default for EnvPolicy {
    fn default() -> Self {
        let set = [
            (
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ),
            ("HOME", "/tmp"),
            ("LANG", "C.UTF-8"),
        ];
        Self {
            pass: vec!["TERM".to_owned(), "TZ".to_owned()],
            set: set
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }
}

/// Resource limits. `null` means unlimited.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub memory: Option<ByteSize>,
    pub pids: Option<u64>,
    /// CPU bandwidth in cores (`0.5` is half of one core).
    #[serde(deserialize_with = "cpus")]
    pub cpus: Option<f64>,
    /// Wall-clock time after which the whole cell is killed.
    pub wall: Option<Duration>,
    /// Total bytes of stdout and stderr the warden relays before it kills the cell.
    pub output: Option<ByteSize>,
    /// For cells kept by the daemon: time without a running or new exec after which `on_idle`
    /// happens.
    pub idle: Option<Duration>,
    /// What the daemon does to an idle cell (`pause` frees its CPU; the next exec resumes it).
    pub on_idle: LifecycleAction,
    /// What the daemon does when a cell it keeps reaches `wall` (`warden run` always kills).
    pub on_wall: LifecycleAction,
    /// Connections the cell may have open through its egress gateway at once; one more is
    /// refused (a 503 on the proxy port, a reset when redirected). Each costs the warden a
    /// thread or two, so this bounds what the cell can make the warden hold.
    #[serde(deserialize_with = "connections")]
    pub connections: u32,
    /// A gateway connection with no byte in either direction for this long is closed.
    pub connection_idle: Duration,
    /// How much the warden writes about the cell's network decisions (its egress record, and
    /// the journal entries copied from it); past it, decisions are counted, not recorded.
    pub records: ByteSize,
    /// What the cell may store in its copy-on-write workspace layer. As root the layer is a
    /// file system of exactly this size (writes past it fail with ENOSPC); rootless, no single
    /// file may grow past it (EFBIG) and the warden ends the cell when the layer does.
    #[serde(deserialize_with = "disk")]
    pub disk: Option<ByteSize>,
    /// Files each process of the cell may hold open (RLIMIT_NOFILE, soft and hard).
    #[serde(deserialize_with = "open_files")]
    pub open_files: u64,
}

/// The smallest disk limit: room for the file system's own structures and a little more.
pub const MIN_DISK: u64 = 32 << 20;
/// Most open files a policy may allow a process.
pub const MAX_OPEN_FILES: u64 = 1 << 20;

/// Most connections a policy may allow a cell at once.
pub const MAX_CONNECTIONS: u32 = 4096;

/// What happens to a cell at a lifecycle limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LifecycleAction {
    Pause,
    Kill,
}

impl LifecycleAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Kill => "kill",
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory: Some(ByteSize(1 << 30)),
            pids: Some(512),
            cpus: None,
            wall: None,
            output: Some(ByteSize(64 << 20)),
            idle: None,
            on_idle: LifecycleAction::Pause,
            on_wall: LifecycleAction::Kill,
            connections: 128,
            connection_idle: Duration(std::time::Duration::from_secs(300)),
            records: ByteSize(16 << 20),
            disk: Some(ByteSize(2 << 30)),
            open_files: 4096,
        }
    }
}

fn disk<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<ByteSize>, D::Error> {
    let value = Option::<ByteSize>::deserialize(deserializer)?;
    match value {
        Some(size) if size.0 < MIN_DISK => Err(de::Error::custom(format!(
            "disk must be at least {} (got {size}); write null for no limit",
            ByteSize(MIN_DISK)
        ))),
        other => Ok(other),
    }
}

fn open_files<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let value = u64::deserialize(deserializer)?;
    if (16..=MAX_OPEN_FILES).contains(&value) {
        Ok(value)
    } else {
        Err(de::Error::custom(format!(
            "open_files must be between 16 and {MAX_OPEN_FILES} (got {value})"
        )))
    }
}

fn connections<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let value = u32::deserialize(deserializer)?;
    if (1..=MAX_CONNECTIONS).contains(&value) {
        Ok(value)
    } else {
        Err(de::Error::custom(format!(
            "connections must be between 1 and {MAX_CONNECTIONS} (got {value})"
        )))
    }
}

fn cpus<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    let value = Option::<f64>::deserialize(deserializer)?;
    match value {
        Some(v) if !(v.is_finite() && v >= 0.01) => Err(de::Error::custom(format!(
            "cpus must be a number of cores of at least 0.01 (got {v})"
        ))),
        other => Ok(other),
    }
}

/// Network section: what the egress gateway lets out. Without rules and with `default: deny`
/// the cell has loopback only and no gateway at all.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Network {
    /// What happens to a connection no rule matches.
    pub default: NetworkDefault,
    /// Destinations let through. Deny rules win over allow rules.
    pub allow: Vec<NetRule>,
    pub deny: Vec<NetRule>,
    /// Destinations a person decides on (`warden approve`/`warden deny`) while the connection
    /// waits; deny rules win over them, they win over allow rules.
    pub ask: Vec<NetRule>,
    /// An extra CA (PEM file) trusted for upstream TLS, beside the host's roots.
    #[serde(deserialize_with = "optional_absolute_path")]
    pub extra_ca: Option<PathBuf>,
    /// Give the cell its egress gateway even while these rules let nothing out (everything is
    /// refused and recorded), so that a replaced policy can let something out later. A cell
    /// made without a gateway has none for life: the gateway's sockets, the redirect and the
    /// proxy variables are set up when the cell is made.
    pub gateway: bool,
    /// The model traffic of agents in the cell: routed to an upstream at a fixed name, with the
    /// key injected by the gateway, every exchange parsed and recorded, under a token budget.
    pub inference: Option<Inference>,
}

/// `network.inference`: where a cell's model API requests go. The cell's clients use
/// `http://NAME/...` (`OPENAI_BASE_URL=http://inference.warden/v1`, say) through the gateway,
/// which sends them to `upstream` (its path prefix before theirs) with the credential's secret
/// in its header, reads each exchange in its wire format (Chat Completions, Responses,
/// Anthropic Messages, streamed or not) and records model, tokens, latency and the text.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Inference {
    /// The API's root: `http://127.0.0.1:8000` or `http://host:port/prefix` (plain HTTP in
    /// this version: a local server, or a TLS proxy in front of a provider).
    pub upstream: String,
    /// The credential (from `credentials`) whose secret goes in the upstream's header.
    #[serde(default)]
    pub credential: Option<String>,
    /// The name the cell's clients use.
    #[serde(default = "default_inference_name")]
    pub name: String,
    /// Most tokens (input and output together) the cell's requests may use; the next request
    /// past them is refused with a 429.
    #[serde(default)]
    pub max_tokens: Option<u64>,
}

fn default_inference_name() -> String {
    "inference.warden".to_owned()
}

impl Network {
    /// Whether the cell gets an egress gateway at all.
    pub fn has_gateway(&self) -> bool {
        self.gateway
            || self.inference.is_some()
            || self.default == NetworkDefault::Allow
            || !self.allow.is_empty()
            || !self.ask.is_empty()
    }
}

/// One network rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetRule {
    /// A host name (`pypi.org`), a glob of subdomains (`*.githubusercontent.com`), an IP address
    /// or a CIDR block.
    pub host: String,
    /// Ports the rule covers; empty covers every port.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// HTTP methods (plain HTTP requests only in this version); empty covers all.
    #[serde(default)]
    pub methods: Vec<String>,
    /// URL path globs such as `/simple/**`; empty covers all. On HTTPS, method and path rules
    /// make the gateway intercept TLS with the cell's own CA.
    #[serde(default)]
    pub paths: Vec<String>,
    /// A credential (from `credentials`) the gateway adds to requests this rule allows.
    #[serde(default)]
    pub credential: Option<String>,
    /// Which names this rule lets the cell's own DNS queries resolve (see [`NameLookup`]).
    #[serde(default)]
    pub dns: NameLookup,
}

/// How the gateway's DNS answers the cell for names a rule covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NameLookup {
    /// Any name the rule covers is looked up on the host when the cell asks. Under a wildcard,
    /// the labels the cell chose reach that domain's name servers.
    #[default]
    Any,
    /// Only names the gateway already looked up for a connection this rule allowed are
    /// answered (from what that lookup returned); a query alone never leaves the host.
    Connected,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkDefault {
    #[default]
    Deny,
    Allow,
}

/// Named credentials the gateway injects into requests to the hosts bound to them.
pub type Credentials = BTreeMap<String, Credential>;

/// A secret of the caller that the cell never sees: it gets a placeholder, and the gateway puts
/// the secret in `header` only on requests that a rule naming this credential allows.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Credential {
    /// Environment variable of the caller holding the secret (the cell gets the placeholder
    /// under the same name).
    pub from_env: Option<String>,
    /// File of the caller holding the secret.
    #[serde(default, deserialize_with = "optional_absolute_path")]
    pub from_file: Option<PathBuf>,
    /// Header that carries it.
    #[serde(default = "default_credential_header")]
    pub header: String,
    /// How the header value is built; `{}` is replaced by the secret.
    #[serde(default = "default_credential_format")]
    pub format: String,
    /// Also put the secret in place of its placeholder in the bodies of requests that a rule
    /// binding this credential allows (the two are equally long, so the framing holds).
    #[serde(default)]
    pub in_body: bool,
}

fn default_credential_header() -> String {
    "Authorization".to_owned()
}

fn default_credential_format() -> String {
    "Bearer {}".to_owned()
}

/// Approval behaviour for `ask` decisions.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Approvals {
    pub timeout: Duration,
    pub on_timeout: ApprovalOutcome,
    /// `ask`: an apply of workspace changes through the daemon waits for a person's answer.
    pub apply: ApplyApproval,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApplyApproval {
    #[default]
    Allow,
    Ask,
}

impl Default for Approvals {
    fn default() -> Self {
        Self {
            timeout: Duration(std::time::Duration::from_secs(300)),
            on_timeout: ApprovalOutcome::Deny,
            apply: ApplyApproval::Allow,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalOutcome {
    #[default]
    Deny,
    Allow,
}

/// Rules on the commands a client asks the warden to start in a cell (exec). Patterns are
/// globs over the command line (the arguments joined by spaces): `git push*`, `rm -rf *`,
/// `*/curl *`. Deny wins over ask, ask over allow; `default` decides the rest. They govern
/// what the warden is asked to run, not what a running program starts by itself.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Commands {
    pub default: CommandDefault,
    pub allow: Vec<String>,
    pub deny: Vec<String>,
    pub ask: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommandDefault {
    #[default]
    Allow,
    Deny,
    Ask,
}

/// What the command rules say about one command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandVerdict {
    Allow,
    /// Refused, by this rule (`deny: PATTERN` or `default: deny`).
    Deny(String),
    /// Held for a person, by this rule.
    Ask(String),
}

/// The command rules compiled into matchers.
#[derive(Debug, Clone)]
pub struct CommandRules {
    allow: globset::GlobSet,
    deny: globset::GlobSet,
    ask: globset::GlobSet,
    rules: Commands,
}

impl CommandRules {
    pub fn compile(rules: &Commands) -> Result<Self, String> {
        let set = |patterns: &[String]| {
            let mut builder = globset::GlobSetBuilder::new();
            for pattern in patterns {
                let glob = globset::GlobBuilder::new(pattern)
                    .literal_separator(false)
                    .build()
                    .map_err(|e| format!("pattern `{pattern}`: {e}"))?;
                builder.add(glob);
            }
            builder.build().map_err(|e| e.to_string())
        };
        Ok(Self {
            allow: set(&rules.allow)?,
            deny: set(&rules.deny)?,
            ask: set(&rules.ask)?,
            rules: rules.clone(),
        })
    }

    pub fn decide(&self, argv: &[String]) -> CommandVerdict {
        let line = argv.join(" ");
        let first = |set: &globset::GlobSet, list: &[String]| {
            set.matches(&line).first().map(|&i| list[i].clone())
        };
        if let Some(rule) = first(&self.deny, &self.rules.deny) {
            return CommandVerdict::Deny(format!("deny: {rule}"));
        }
        if let Some(rule) = first(&self.ask, &self.rules.ask) {
            return CommandVerdict::Ask(format!("ask: {rule}"));
        }
        if self.allow.is_match(&line) {
            return CommandVerdict::Allow;
        }
        match self.rules.default {
            CommandDefault::Allow => CommandVerdict::Allow,
            CommandDefault::Deny => CommandVerdict::Deny("default: deny".to_owned()),
            CommandDefault::Ask => CommandVerdict::Ask("default: ask".to_owned()),
        }
    }
}

/// GPU access. Only `none` exists in this version.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Gpu {
    pub devices: GpuDevices,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuDevices {
    #[default]
    None,
}

fn optional_absolute_path<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<PathBuf>, D::Error> {
    let path = Option::<PathBuf>::deserialize(deserializer)?;
    if let Some(path) = &path {
        check_absolute(path).map_err(de::Error::custom)?;
    }
    Ok(path)
}

fn absolute_path<'de, D: Deserializer<'de>>(deserializer: D) -> Result<PathBuf, D::Error> {
    let path = PathBuf::deserialize(deserializer)?;
    check_absolute(&path).map_err(de::Error::custom)?;
    Ok(path)
}

fn absolute_path_opt<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<PathBuf>, D::Error> {
    absolute_path(deserializer).map(Some)
}

/// Absolute paths; `~/...` is under the home directory of whoever reads the policy.
fn absolute_paths<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<PathBuf>, D::Error> {
    let paths = Vec::<PathBuf>::deserialize(deserializer)?;
    let mut out = Vec::with_capacity(paths.len());
    for path in paths {
        let path = expand_home(&path.to_string_lossy()).map_err(de::Error::custom)?;
        let path = PathBuf::from(path);
        check_absolute(&path).map_err(de::Error::custom)?;
        out.push(path);
    }
    Ok(out)
}

fn absolute_links<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<PathBuf, PathBuf>, D::Error> {
    let links = BTreeMap::<PathBuf, PathBuf>::deserialize(deserializer)?;
    for (path, target) in &links {
        check_absolute(path).map_err(de::Error::custom)?;
        check_absolute(target).map_err(de::Error::custom)?;
        if path.parent().is_none() {
            return Err(de::Error::custom("a link cannot replace `/`"));
        }
    }
    Ok(links)
}

fn env_values<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    let values = BTreeMap::<String, String>::deserialize(deserializer)?;
    values
        .into_iter()
        .map(|(key, value)| {
            let parts: Result<Vec<String>, String> = value.split(':').map(expand_home).collect();
            Ok((key, parts.map_err(de::Error::custom)?.join(":")))
        })
        .collect()
}

/// `~/rest` as `$HOME/rest`; anything else as it is.
fn expand_home(text: &str) -> Result<String, String> {
    let Some(rest) = text.strip_prefix("~/") else {
        return Ok(text.to_owned());
    };
    match std::env::var("HOME") {
        Ok(home) if home.starts_with('/') => Ok(format!("{}/{rest}", home.trim_end_matches('/'))),
        _ => Err(format!(
            "`{text}` names the home directory, but HOME is not set to an absolute path"
        )),
    }
}

fn check_absolute(path: &std::path::Path) -> Result<(), String> {
    use std::path::Component;
    if !path.is_absolute() {
        return Err(format!(
            "path `{}` must be absolute (start with /)",
            path.display()
        ));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(format!("path `{}` must not contain `..`", path.display()));
    }
    Ok(())
}

#[cfg(test)]
mod command_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn argv(line: &str) -> Vec<String> {
        line.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn deny_wins_then_ask_then_allow_then_the_default() {
        let rules = CommandRules::compile(&Commands {
            default: CommandDefault::Deny,
            allow: vec!["git *".to_owned(), "ls*".to_owned()],
            deny: vec!["git push --force*".to_owned()],
            ask: vec!["git push*".to_owned()],
        })
        .unwrap();
        assert_eq!(rules.decide(&argv("ls -la /tmp")), CommandVerdict::Allow);
        assert_eq!(rules.decide(&argv("git status")), CommandVerdict::Allow);
        assert_eq!(
            rules.decide(&argv("git push origin")),
            CommandVerdict::Ask("ask: git push*".to_owned())
        );
        assert_eq!(
            rules.decide(&argv("git push --force origin")),
            CommandVerdict::Deny("deny: git push --force*".to_owned())
        );
        assert_eq!(
            rules.decide(&argv("/usr/bin/rm -rf /")),
            CommandVerdict::Deny("default: deny".to_owned())
        );
        assert!(
            CommandRules::compile(&Commands {
                ask: vec!["[unclosed".to_owned()],
                ..Commands::default()
            })
            .is_err()
        );
    }
}
