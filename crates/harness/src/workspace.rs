//! Snapshot, reset and policy replacement of daemon cells.
//!
//! Snapshot and reset are carried out by a short-lived `warden` process, exactly as the CLI does
//! them: a reset of a running cell forks a helper that joins the cell's namespaces, which must
//! not happen from the daemon's many threads.

use serde::Serialize;
use serde_json::json;

use crate::{ErrorKind, Harness, HarnessError, PolicySource};

/// Which workspace changes to apply, and how.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    /// Paths (a directory selects what is below it); none: every change.
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub dry_run: bool,
    /// Overwrite host files edited since the cell started.
    #[serde(default)]
    pub force: bool,
    /// Apply sensitive changes (hooks, rc files, new executables, outward symlinks) too.
    #[serde(default)]
    pub include_sensitive: bool,
    /// The digest of the diff that was reviewed (`GET .../diff` gives it): the apply writes
    /// those changes exactly, or nothing. Without it, an apply held for a person is bound to
    /// the diff as it was when the question was asked.
    #[serde(default)]
    pub digest: Option<String>,
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub id: String,
    pub size: u64,
}

impl Harness {
    async fn warden_command(&self, args: &[&str]) -> Result<String, HarnessError> {
        let output = tokio::process::Command::new(&self.config.warden_exe)
            .args(args)
            .env("WARDEN_RUNTIME_DIR", &self.config.runtime)
            .env("WARDEN_STATE_DIR", &self.config.state)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .map_err(|e| HarnessError::internal(format!("running warden {}: {e}", args[0])))?;
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned());
        }
        let message = String::from_utf8_lossy(&output.stderr)
            .trim()
            .trim_start_matches("warden: ")
            .to_owned();
        let kind = if message.contains("no snapshot") || message.contains("not found") {
            ErrorKind::NotFound
        } else {
            ErrorKind::Conflict
        };
        Err(HarnessError::new(kind, message))
    }

    /// Saves the cell's workspace as `CELL@SNAP`.
    pub async fn snapshot(
        &self,
        name: &str,
        as_name: Option<&str>,
    ) -> Result<Snapshot, HarnessError> {
        self.entry(name)?;
        if let Some(snap) = as_name {
            warden_cell::linux::plan::check_name(snap)
                .map_err(|e| HarnessError::bad(format!("snapshot name: {e}")))?;
        }
        self.record(Some(name), "workspace.snapshot", json!({ "as": as_name }))
            .await?;
        let mut args = vec!["snapshot", name];
        if let Some(snap) = as_name {
            args.extend(["--as", snap]);
        }
        let out = self.warden_command(&args).await?;
        // "CELL@SNAP (N bytes)"
        let (id, rest) = out.split_once(' ').unwrap_or((out.as_str(), ""));
        let size = rest
            .trim_start_matches('(')
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        self.record(
            Some(name),
            "workspace.snapshot.done",
            json!({ "id": id, "size": size }),
        )
        .await?;
        Ok(Snapshot {
            id: id.to_owned(),
            size,
        })
    }

    /// Journals what the cell changed in its workspace (paths, kinds, sizes and hashes; not the
    /// contents), from the warden's own diff of the copy-on-write layer.
    pub(crate) async fn journal_changes(&self, name: &str, when: &str) {
        let Ok(Some(entry)) = self.state.get(name) else {
            return;
        };
        if entry.workspace.is_none() {
            return;
        }
        let diff = self
            .warden_command(&["diff", name, "--json"])
            .await
            .and_then(|out| {
                serde_json::from_str::<serde_json::Value>(&out)
                    .map_err(|e| HarnessError::internal(format!("reading the diff: {e}")))
            });
        let diff = match diff {
            Ok(diff) => diff,
            Err(err) => {
                let _ = self
                    .record(
                        Some(name),
                        "workspace.changes",
                        json!({ "when": when, "error": err.message }),
                    )
                    .await;
                return;
            }
        };
        let Some(changes) = diff["changes"].as_array() else {
            return;
        };
        let listed: Vec<serde_json::Value> = changes
            .iter()
            .take(1000)
            .map(|c| {
                json!({
                    "path": c["path"],
                    "kind": c["kind"],
                    "entry": c["entry"],
                    "size": c["size"],
                    "blake3": c["hash"],
                })
            })
            .collect();
        let _ = self
            .record(
                Some(name),
                "workspace.changes",
                json!({ "when": when, "count": changes.len(), "changes": listed }),
            )
            .await;
    }

    /// What the cell changed in its workspace (the `warden diff --json` document).
    pub async fn diff(&self, name: &str) -> Result<serde_json::Value, HarnessError> {
        let entry = self.entry(name)?;
        if entry.workspace.is_none() {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("cell `{name}` has no workspace"),
            ));
        }
        let out = self.warden_command(&["diff", name, "--json"]).await?;
        serde_json::from_str(&out)
            .map_err(|e| HarnessError::internal(format!("reading the diff: {e}")))
    }

    /// Writes chosen changes of the cell's workspace into its host directory (all of them when
    /// `request.paths` is empty); with `approvals.apply: ask`, only once a person agreed.
    pub async fn apply(
        &self,
        name: &str,
        request: &ApplyRequest,
        by: &str,
    ) -> Result<serde_json::Value, HarnessError> {
        let entry = self.entry(name)?;
        let Some(host) = entry.workspace.clone() else {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("cell `{name}` has no workspace"),
            ));
        };
        for path in &request.paths {
            if path.starts_with('-') || path.contains('\0') {
                return Err(HarnessError::bad(format!(
                    "path `{path}` is not a workspace path"
                )));
            }
        }
        let approvals = match &entry.policy {
            PolicySource::Preset(p) => warden_policy::preset(p).ok(),
            PolicySource::Yaml(y) => warden_policy::from_yaml("policy", y).ok(),
        }
        .map(|p| p.approvals)
        .unwrap_or_default();
        let what = if request.paths.is_empty() {
            "every change".to_owned()
        } else {
            request.paths.join(", ")
        };
        self.record(
            Some(name),
            "workspace.apply",
            json!({ "paths": request.paths, "dry_run": request.dry_run, "force": request.force,
                    "include_sensitive": request.include_sensitive, "host": host, "by": by }),
        )
        .await?;
        let mut digest = request.digest.clone();
        if !request.dry_run && approvals.apply == warden_policy::ApplyApproval::Ask {
            // The person answers about the changes as they are now: the apply that follows
            // writes those, or nothing.
            if digest.is_none() {
                digest = self.diff(name).await?["digest"].as_str().map(str::to_owned);
            }
            let shown = digest.as_deref().map_or("", |d| &d[..d.len().min(16)]);
            let question = format!("apply {what} of {name} to {host} (changes {shown})");
            // A standing grant covers exactly these changes: another apply asks again.
            let grant = format!("apply {question}");
            self.ask_person(
                name,
                question,
                grant,
                "approvals.apply: ask".to_owned(),
                &approvals,
            )
            .await?;
        }
        let mut args = vec!["apply", name, "--json"];
        if let Some(digest) = &digest {
            args.extend(["--digest", digest.as_str()]);
        }
        for (flag, on) in [
            ("--dry-run", request.dry_run),
            ("--force", request.force),
            ("--include-sensitive", request.include_sensitive),
        ] {
            if on {
                args.push(flag);
            }
        }
        if !request.paths.is_empty() {
            args.push("--");
            args.extend(request.paths.iter().map(String::as_str));
        }
        let out = self.warden_command(&args).await?;
        let report: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| HarnessError::internal(format!("reading the apply report: {e}")))?;
        self.record(Some(name), "workspace.applied", report.clone())
            .await?;
        Ok(report)
    }

    /// Snapshots of this cell.
    pub fn snapshots(&self, name: &str) -> Result<Vec<Snapshot>, HarnessError> {
        self.entry(name)?;
        let prefix = format!("{name}@");
        Ok(warden_cell::snapshot::list(&self.store)
            .into_iter()
            .filter(|s| s.id.starts_with(&prefix))
            .map(|s| Snapshot {
                id: s.id,
                size: s.size,
            })
            .collect())
    }

    /// Returns the cell's workspace to a snapshot of it (`SNAP` or `CELL@SNAP`), or to its start.
    pub async fn reset(&self, name: &str, to: Option<&str>) -> Result<(), HarnessError> {
        self.entry(name)?;
        let to = to.map(|t| {
            if t.contains('@') {
                t.to_owned()
            } else {
                format!("{name}@{t}")
            }
        });
        self.record(Some(name), "workspace.reset", json!({ "to": to }))
            .await?;
        let mut args = vec!["reset", name];
        if let Some(to) = &to {
            args.extend(["--to", to.as_str()]);
        }
        self.warden_command(&args).await?;
        Ok(())
    }

    /// The cell's policy as it was made, and the latest document whose `network` and
    /// `commands` replaced those of the running cell (if any).
    pub fn policy(&self, name: &str) -> Result<(PolicySource, Option<String>), HarnessError> {
        let entry = self.entry(name)?;
        Ok((entry.policy, entry.replaced))
    }

    /// Replaces the `network` and `commands` of a running cell with those of `yaml` (a whole
    /// policy document): the gateway closes open connections the new rules forbid, and the
    /// next exec is decided by the new command rules. The other sections are fixed when a cell
    /// is made: the document may leave them out or repeat them, and one that changes them is
    /// refused with nothing changed. Returns how many connections were closed.
    pub async fn replace_policy(&self, name: &str, yaml: &str) -> Result<u64, HarnessError> {
        let mut entry = self.entry(name)?;
        self.live(name)?;
        let policy = warden_policy::from_yaml("policy", yaml)
            .map_err(|e| HarnessError::bad(e.to_string()))?;
        let current = entry.policy_in_force().ok_or_else(|| {
            HarnessError::internal(format!(
                "the policy cell `{name}` was made with no longer parses"
            ))
        })?;
        let fixed: Vec<String> = warden_policy::sections(yaml)
            .into_iter()
            .filter(|section| match section.as_str() {
                "tier" => policy.tier != current.tier,
                "filesystem" => policy.filesystem != current.filesystem,
                "process" => policy.process != current.process,
                "limits" => policy.limits != current.limits,
                "credentials" => policy.credentials != current.credentials,
                "approvals" => policy.approvals != current.approvals,
                "gpu" => policy.gpu != current.gpu,
                _ => false,
            })
            .map(|section| format!("`{section}`"))
            .collect();
        if !fixed.is_empty() {
            let message = format!(
                "cell `{name}`: a running cell's `network` and `commands` can be replaced, but this policy also changes {}, which are fixed when a cell is made; leave them out (or as they are), or make a new cell with this policy",
                fixed.join(", ")
            );
            // Nothing changes, but the attempt is on record.
            self.record(
                Some(name),
                "policy.refused",
                json!({ "yaml": yaml, "reason": message }),
            )
            .await?;
            return Err(HarnessError::new(ErrorKind::Conflict, message));
        }
        let network_changes = policy.network != current.network;
        self.record(Some(name), "policy.replace", json!({ "yaml": yaml }))
            .await?;
        let closed = if network_changes {
            let file = self
                .daemon_dir
                .join("cells")
                .join(name)
                .join("policy-update.yaml");
            std::fs::write(&file, yaml)
                .map_err(|e| HarnessError::internal(format!("writing {}: {e}", file.display())))?;
            let registry = self.registry.clone();
            let owned = name.to_owned();
            crate::on_own_thread("cell-policy", move || {
                warden_cell::control::set_network_policy(&registry, &owned, &file)
            })
            .await?
            .map_err(|e| HarnessError::new(ErrorKind::Conflict, e.to_string()))?
        } else {
            0
        };
        entry.replaced = Some(yaml.to_owned());
        self.state.put(&entry)?;
        if let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.replace_rules(policy.network, policy.commands);
        }
        self.record(
            Some(name),
            "policy.replaced",
            json!({ "closed_connections": closed, "network_changed": network_changes }),
        )
        .await?;
        Ok(closed)
    }
}
