//! The policy a command names: a file or a preset, with the command line's knobs (`--memory`,
//! `--allow`, `--tier`, ...) on top, checked again as a whole. Shared by the commands that run
//! in this process and those that go through a daemon.

use anyhow::{Context as _, Result};
use warden_policy::Policy;

pub fn load(file: Option<&std::path::Path>, preset: Option<&str>) -> Result<Policy> {
    Ok(match (file, preset) {
        (Some(file), _) => warden_policy::from_file(file)?,
        (None, Some(name)) => warden_policy::preset(name)?,
        (None, None) => warden_policy::preset("default")?,
    })
}

/// Whether the command line sets anything of the policy beside its file or preset.
fn has_knobs(args: &crate::cli::PolicyArgs) -> bool {
    args.memory.is_some()
        || args.tier.is_some()
        || args.disk.is_some()
        || args.cpus.is_some()
        || args.pids.is_some()
        || args.timeout.is_some()
        || !args.allow.is_empty()
        || !args.read_only.is_empty()
        || !args.read_write.is_empty()
}

/// The preset the policy is, as it is, where the command line names no file and no knob: a
/// cell's request (and its journal entry) then names the preset, as a daemon's create of a
/// preset does, rather than carrying its text.
pub fn preset_as_is(args: &crate::cli::PolicyArgs) -> Option<String> {
    (args.file.is_none() && !has_knobs(args))
        .then(|| args.preset.clone().unwrap_or_else(|| "default".to_owned()))
}

/// The policy a new cell gets: the file or preset, with the command line's knobs on top, checked
/// again as a whole.
pub fn effective(args: &crate::cli::PolicyArgs) -> Result<Policy> {
    use warden_policy::{ByteSize, Duration as PolicyDuration};
    let mut policy = load(args.file.as_deref(), args.preset.as_deref())?;
    if !has_knobs(args) {
        return Ok(policy);
    }
    let none = |text: &str| matches!(text.trim(), "none" | "unlimited");
    if let Some(text) = &args.tier {
        policy.tier = warden_policy::Tier::from_name(text.trim()).with_context(|| {
            format!("--tier {text}: write `process`, `gvisor` or `microvm` (`warden doctor` says which this host runs)")
        })?;
    }
    if let Some(text) = &args.memory {
        policy.limits.memory = if none(text) {
            None
        } else {
            Some(ByteSize::parse(text).map_err(|e| anyhow::anyhow!("--memory: {e}"))?)
        };
    }
    if let Some(text) = &args.disk {
        policy.limits.disk = if none(text) {
            None
        } else {
            Some(ByteSize::parse(text).map_err(|e| anyhow::anyhow!("--disk: {e}"))?)
        };
    }
    if let Some(text) = &args.cpus {
        policy.limits.cpus = if none(text) {
            None
        } else {
            Some(text.trim().parse().with_context(|| {
                format!("--cpus {text}: write a number of cores, like 0.5 or 2")
            })?)
        };
    }
    if let Some(text) = &args.pids {
        policy.limits.pids = if none(text) {
            None
        } else {
            Some(
                text.trim()
                    .parse()
                    .with_context(|| format!("--pids {text}: write a whole number, like 256"))?,
            )
        };
    }
    if let Some(text) = &args.timeout {
        policy.limits.wall = if none(text) {
            None
        } else {
            Some(PolicyDuration::parse(text).map_err(|e| anyhow::anyhow!("--timeout: {e}"))?)
        };
    }
    for target in &args.allow {
        // HOST, HOST:PORT, [IPv6]:PORT, or an IPv6 address or CIDR block alone.
        let (host, port) = match target.rsplit_once(':') {
            Some((host, port))
                if !host.is_empty()
                    && (!host.contains(':') || host.starts_with('['))
                    && port.bytes().all(|b| b.is_ascii_digit()) =>
            {
                let port: u16 = port
                    .parse()
                    .ok()
                    .filter(|p| *p > 0)
                    .with_context(|| format!("--allow {target}: {port} is not a port"))?;
                (
                    host.trim_start_matches('[').trim_end_matches(']'),
                    Some(port),
                )
            }
            _ => (target.as_str(), None),
        };
        policy.network.allow.push(warden_policy::NetRule {
            host: host.to_owned(),
            ports: port.into_iter().collect(),
            methods: Vec::new(),
            paths: Vec::new(),
            credential: None,
            dns: Default::default(),
        });
    }
    let absolute = |flag: &str, path: &std::path::Path| -> Result<std::path::PathBuf> {
        std::fs::canonicalize(path)
            .with_context(|| format!("{flag} {}: no such path on this host", path.display()))
    };
    for path in &args.read_only {
        policy.filesystem.read_only.push(absolute("--ro", path)?);
    }
    for path in &args.read_write {
        policy.filesystem.read_write.push(absolute("--rw", path)?);
    }
    // Every check of a written policy applies to what the flags made.
    Ok(warden_policy::from_yaml(
        "the policy with the command line's flags",
        &warden_policy::to_yaml(&policy),
    )?)
}
