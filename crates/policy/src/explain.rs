//! `warden policy explain`: what a policy allows, in plain words.

use std::fmt::Write as _;

use crate::model::{Policy, WorkspaceMode};

/// Renders the policy as sentences a reviewer can check without knowing the schema.
pub fn explain(policy: &Policy) -> String {
    let mut out = String::new();
    let fs = &policy.filesystem;
    let ws = &fs.workspace;
    let _ = writeln!(out, "Isolation tier: {}.", policy.tier.name());
    let _ = writeln!(out, "\nFiles");
    match ws.mode {
        WorkspaceMode::Overlay => {
            let _ = writeln!(
                out,
                "  - The workspace (--workspace DIR) appears at {} as a copy-on-write layer \
                 (mode: overlay): the cell may change anything in it, DIR on the host stays \
                 unchanged, and changes reach it only through `warden apply` after review with \
                 `warden diff`. Without --workspace it is an empty scratch directory.",
                ws.mount.display()
            );
            if !ws.protect.is_empty() {
                let _ = writeln!(
                    out,
                    "  - Changes to these, which the host runs or trusts later, are applied only \
                     when named: {}; so are new executables and symlinks leading outside.",
                    ws.protect.join(", ")
                );
            }
        }
        WorkspaceMode::Direct => {
            let _ = writeln!(
                out,
                "  - The workspace (--workspace DIR) appears read-write at {} and writes go \
                 straight to the host directory (mode: direct); without --workspace it is an \
                 empty scratch directory.",
                ws.mount.display()
            );
            if !ws.protect.is_empty() {
                let _ = writeln!(
                    out,
                    "  - Inside the workspace these stay read-only when they exist, because the \
                     host runs or trusts them later: {}.",
                    ws.protect.join(", ")
                );
            }
        }
    }
    let in_memory = match policy.limits.memory {
        Some(memory) if memory.0 < fs.tmp_size.0 => memory,
        _ => fs.tmp_size,
    };
    let _ = writeln!(
        out,
        "  - /tmp is private to the cell, in memory, at most {in_memory} (/dev/shm at most 64 MiB); what is stored there counts towards the memory limit."
    );
    let _ = writeln!(
        out,
        "  - Read-only from the host (when present there): {}.",
        join_paths(&fs.read_only)
    );
    if fs.read_write.is_empty() {
        let _ = writeln!(out, "  - No other host directory is writable.");
    } else {
        let _ = writeln!(
            out,
            "  - Read-write from the host: {}.",
            join_paths(&fs.read_write)
        );
    }
    if !fs.hidden.is_empty() {
        let _ = writeln!(out, "  - Always hidden: {}.", join_paths(&fs.hidden));
    }
    let _ = writeln!(
        out,
        "  - Nothing else of the host is visible: /etc holds only the files listed above plus \
         generated passwd, group, hosts, hostname, nsswitch.conf and resolv.conf; /dev holds \
         null, zero, full, random, urandom, tty, pts and shm; /proc shows only the cell's \
         processes, with sensitive entries masked; there is no /sys."
    );

    let proc = &policy.process;
    let _ = writeln!(out, "\nProcess");
    let image = policy.image.is_some();
    let who = match (proc.user, image) {
        (None, true) => format!(
            "the image's user (uid {} gid {} where it names none)",
            proc.user(),
            proc.group()
        ),
        _ => format!("uid {} gid {}", proc.user(), proc.group()),
    };
    let _ = writeln!(
        out,
        "  - Runs as {who} inside the cell, which maps to an unprivileged host id; no \
         capabilities, no_new_privs, its own session, pid, ipc, uts and cgroup namespaces."
    );
    match (&proc.cwd, image) {
        (None, true) => {
            let _ = writeln!(
                out,
                "  - Starts in the image's working directory ({} where it names none).",
                proc.cwd().display()
            );
        }
        _ => {
            let _ = writeln!(out, "  - Starts in {}.", proc.cwd().display());
        }
    }
    let mut env: Vec<String> = proc
        .env
        .set
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    env.extend(
        proc.env
            .pass
            .iter()
            .map(|k| format!("{k} (from the caller, if set)")),
    );
    let _ = writeln!(
        out,
        "  - Environment: only {}; everything else of the caller is dropped.",
        env.join(", ")
    );
    let _ = writeln!(
        out,
        "  - System calls that reach beyond the cell are refused (mount, ptrace, bpf, io_uring, \
         keyrings, kernel modules, clock setting, new user namespaces, setns, terminal injection, \
         vsock, packet and non-route netlink sockets)."
    );

    let limits = &policy.limits;
    let _ = writeln!(out, "\nLimits");
    let unlimited = || "unlimited".to_owned();
    let _ = writeln!(
        out,
        "  - Memory: {}.",
        limits.memory.map_or_else(unlimited, |m| m.to_string())
    );
    let _ = writeln!(
        out,
        "  - Processes and threads: {}.",
        limits.pids.map_or_else(unlimited, |p| p.to_string())
    );
    let _ = writeln!(
        out,
        "  - CPU: {}.",
        limits.cpus.map_or_else(unlimited, |c| format!("{c} cores"))
    );
    let _ = writeln!(
        out,
        "  - Wall clock: {}.",
        limits.wall.map_or_else(unlimited, |w| w.to_string())
    );
    if let Some(idle) = limits.idle {
        let _ = writeln!(
            out,
            "  - Idle (daemon cells): after {idle} without an exec, the daemon will {} it.",
            limits.on_idle.name()
        );
    }
    if limits.wall.is_some() && limits.on_wall == crate::LifecycleAction::Pause {
        let _ = writeln!(
            out,
            "  - At the wall-clock limit the daemon pauses a cell it keeps (`warden run` kills)."
        );
    }
    let _ = writeln!(
        out,
        "  - Output relayed: {}.",
        limits.output.map_or_else(unlimited, |o| o.to_string())
    );
    let _ = writeln!(
        out,
        "  - Workspace disk: {} (what the cell writes to its copy-on-write layer).",
        limits.disk.map_or_else(unlimited, |d| d.to_string())
    );
    let _ = writeln!(out, "  - Open files: {} per process.", limits.open_files);

    let _ = writeln!(out, "\nNetwork");
    let net = &policy.network;
    if !net.has_gateway() {
        let _ = writeln!(
            out,
            "  - None: the cell has only its own loopback interface; nothing on the host or beyond \
             is reachable (and no gateway that a replaced policy could open later: write \
             `network: {{gateway: true}}` for one)."
        );
    } else {
        let _ = writeln!(
            out,
            "  - Only through the warden's egress gateway (HTTP proxy on the cell's 127.0.0.1:3128); \
             every connection is decided and recorded (`warden net NAME`)."
        );
        for rule in &net.deny {
            let _ = writeln!(out, "  - Refused: {}.", describe_rule(rule));
        }
        for rule in &net.ask {
            let _ = writeln!(
                out,
                "  - Held for a person's answer (`warden approve`/`warden deny`, {} at most, then \
                 {}): {}.",
                policy.approvals.timeout,
                match policy.approvals.on_timeout {
                    crate::model::ApprovalOutcome::Allow => "allowed",
                    crate::model::ApprovalOutcome::Deny => "refused",
                },
                describe_rule(rule)
            );
        }
        for rule in &net.allow {
            let _ = writeln!(out, "  - Allowed: {}.", describe_rule(rule));
        }
        let _ = writeln!(
            out,
            "  - Anything else: {}. Private, loopback, link-local and metadata addresses are \
             refused unless a rule names them.",
            match net.default {
                crate::model::NetworkDefault::Allow => "allowed",
                crate::model::NetworkDefault::Deny => "refused with a 403 that names the reason",
            }
        );
    }
    if policy.credentials.is_empty() {
        let _ = writeln!(out, "\nCredentials: none.");
    } else {
        let _ = writeln!(
            out,
            "\nCredentials (the cell sees placeholders; the gateway adds the secrets)"
        );
        for (name, credential) in &policy.credentials {
            let source = match (&credential.from_env, &credential.from_file) {
                (Some(var), _) => format!("the caller's ${var}"),
                (None, Some(path)) => path.display().to_string(),
                (None, None) => "nowhere".to_owned(),
            };
            let hosts: Vec<&str> = policy
                .network
                .allow
                .iter()
                .filter(|r| r.credential.as_deref() == Some(name.as_str()))
                .map(|r| r.host.as_str())
                .collect();
            let _ = writeln!(
                out,
                "  - {name}: from {source}, sent as {} only to {}.",
                credential.header,
                if hosts.is_empty() {
                    "no host".to_owned()
                } else {
                    hosts.join(", ")
                }
            );
        }
    }
    let commands = &policy.commands;
    if commands.deny.is_empty()
        && commands.ask.is_empty()
        && commands.default == crate::model::CommandDefault::Allow
    {
        let _ = writeln!(out, "\nCommands (exec through the daemon): any.");
    } else {
        let _ = writeln!(out, "\nCommands (exec through the daemon)");
        for rule in &commands.deny {
            let _ = writeln!(out, "  - Refused: `{rule}`.");
        }
        for rule in &commands.ask {
            let _ = writeln!(out, "  - Held for a person's answer: `{rule}`.");
        }
        for rule in &commands.allow {
            let _ = writeln!(out, "  - Allowed: `{rule}`.");
        }
        let _ = writeln!(
            out,
            "  - Anything else: {}.",
            match commands.default {
                crate::model::CommandDefault::Allow => "allowed",
                crate::model::CommandDefault::Deny => "refused",
                crate::model::CommandDefault::Ask => "held for a person's answer",
            }
        );
    }
    let _ = writeln!(out, "GPU: no devices.");
    out
}

fn describe_rule(rule: &crate::model::NetRule) -> String {
    let mut text = rule.host.clone();
    if !rule.ports.is_empty() {
        let ports: Vec<String> = rule.ports.iter().map(u16::to_string).collect();
        text.push_str(&format!(" on port {}", ports.join(", ")));
    }
    if !rule.methods.is_empty() {
        text.push_str(&format!(", methods {}", rule.methods.join(", ")));
    }
    if !rule.paths.is_empty() {
        text.push_str(&format!(", paths {}", rule.paths.join(", ")));
    }
    if let Some(credential) = &rule.credential {
        text.push_str(&format!(", with credential {credential}"));
    }
    text
}

fn join_paths(paths: &[std::path::PathBuf]) -> String {
    if paths.is_empty() {
        return "nothing".to_owned();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
