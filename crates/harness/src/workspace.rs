//! Diff, apply, snapshot, reset and policy replacement of daemon cells: the process tier's own
//! library calls (on blocking threads), their errors classified by what they are.

use serde_json::json;
use std::sync::Arc;
use warden_cell::tier::{ChangesError, SnapshotError};
use warden_workspace::WorkspaceError as LayerError;

use crate::{
    ApplyRequest, CellFailure, Harness, HarnessError, PolicySource, Snapshot, WorkspaceError,
};

/// A workspace error, classified by what it is (never by its words).
fn changes_error(err: ChangesError) -> HarnessError {
    let failure = match &err {
        ChangesError::NoLayer(_) => WorkspaceError::NoWorkspace,
        ChangesError::Running(_) => WorkspaceError::Conflict,
        ChangesError::Workspace(e) => match e {
            LayerError::UnknownPath(_) => WorkspaceError::Invalid,
            LayerError::Conflict { .. }
            | LayerError::Refused { .. }
            | LayerError::Changed { .. }
            | LayerError::ChangedInCell { .. }
            | LayerError::TooLarge { .. }
            | LayerError::Unread { .. } => WorkspaceError::Conflict,
            _ => WorkspaceError::Failed,
        },
        ChangesError::Registry(warden_cell::RegistryError::NotFound(_)) => {
            return CellFailure::NoCell(err.to_string()).into();
        }
        ChangesError::Layer { .. } | ChangesError::Cgroup(_) | ChangesError::Registry(_) => {
            WorkspaceError::Failed
        }
    };
    failure(err.to_string()).into()
}

fn snapshot_error(err: SnapshotError) -> HarnessError {
    let err = match err {
        SnapshotError::Changes(inner) => return changes_error(inner),
        other => other,
    };
    // Out of room for the copy it makes: said so, with what to do.
    if let SnapshotError::Copy { path, source } = &err
        && matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
    {
        return WorkspaceError::Full(format!(
            "{err}: no room is left to write {}. If it is in the cell's own disk (its layer's `fs`, bounded by limits.disk), remove snapshots of the cell it no longer needs (`warden rm CELL@SNAPSHOT`) or give it a larger limits.disk; else free space on the host",
            path.display()
        ))
        .into();
    }
    let failure = match &err {
        SnapshotError::Changes(_) => WorkspaceError::Failed,
        SnapshotError::Name(_) | SnapshotError::Foreign { .. } | SnapshotError::Earlier { .. } => {
            WorkspaceError::Invalid
        }
        SnapshotError::NotFound(_) => WorkspaceError::Missing,
        SnapshotError::Exists(_)
        | SnapshotError::InUse { .. }
        | SnapshotError::LayerGone(_)
        | SnapshotError::TooDeep { .. } => WorkspaceError::Conflict,
        SnapshotError::Copy { .. }
        | SnapshotError::Record { .. }
        | SnapshotError::Remount { .. } => WorkspaceError::Failed,
    };
    failure(err.to_string()).into()
}

impl Harness {
    /// The backend of the tier cell `name` was made in (its entry says which).
    pub(crate) fn backend_of(
        &self,
        name: &str,
    ) -> Result<std::sync::Arc<dyn warden_cell::Backend>, HarnessError> {
        let tier = self
            .entry(name)?
            .tier
            .as_deref()
            .and_then(warden_policy::Tier::from_name)
            .unwrap_or_default();
        self.backend(tier)
    }

    /// Runs blocking work on cell `name`'s workspace, through its tier (walks, copies, a reset
    /// helper's fork), off the runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        name: &str,
        work: impl FnOnce(&dyn warden_cell::Backend, &str) -> Result<T, HarnessError> + Send + 'static,
    ) -> Result<T, HarnessError> {
        let backend = self.backend_of(name)?;
        let cell = name.to_owned();
        tokio::task::spawn_blocking(move || work(&*backend, &cell))
            .await
            .map_err(|e| {
                HarnessError::from(WorkspaceError::Failed(format!(
                    "a workspace task failed: {e}"
                )))
            })?
    }

    /// Saves the cell's workspace as `CELL@SNAP`.
    pub async fn snapshot(
        &self,
        name: &str,
        as_name: Option<&str>,
    ) -> Result<Snapshot, HarnessError> {
        // In the file before the snapshot is taken; on disk with its end, which is waited for
        // (a snapshot changes nothing outside the warden, so nothing waits on the disk first).
        let begun = self.snapshot_begins(name, as_name).await?;
        let made = self.snapshot_made(name, as_name).await;
        let done = match made {
            Ok(snapshot) => self
                .record(
                    Some(name),
                    "workspace.snapshot.done",
                    json!({ "id": snapshot.id, "size": snapshot.size }),
                )
                .await
                .map(|_| snapshot),
            Err(err) => Err(err),
        };
        begun.wait(self).await?;
        done
    }

    /// A snapshot, with `taken` called as soon as it is taken (the cell running again, its
    /// copy made), before its end is journaled: for a caller whose next step only needs the
    /// copy made (an agent's next tool call). Its entries take no fdatasync of their own: they
    /// go to the disk with the next entry that is waited for (the next tool call's start), or
    /// within a few milliseconds; what is built on the snapshot later (a rewind, a fork) is
    /// journaled with a wait, which takes them along.
    pub async fn snapshot_then(
        self: &Arc<Self>,
        name: &str,
        as_name: Option<&str>,
        taken: impl FnOnce(&Snapshot) + Send,
    ) -> Result<Snapshot, HarnessError> {
        self.check_snapshot(name, as_name)?;
        self.record_soon(Some(name), "workspace.snapshot", json!({ "as": as_name }))
            .await?;
        let snapshot = self.snapshot_made(name, as_name).await?;
        taken(&snapshot);
        self.record_soon(
            Some(name),
            "workspace.snapshot.done",
            json!({ "id": snapshot.id, "size": snapshot.size }),
        )
        .await?;
        Ok(snapshot)
    }

    /// The snapshot's first entry, in the file before it is taken.
    async fn snapshot_begins(
        &self,
        name: &str,
        as_name: Option<&str>,
    ) -> Result<crate::record::Durable, HarnessError> {
        self.check_snapshot(name, as_name)?;
        self.record_ahead(Some(name), "workspace.snapshot", json!({ "as": as_name }))
            .await
    }

    /// The cell exists, and the snapshot's name (if any) is one.
    fn check_snapshot(&self, name: &str, as_name: Option<&str>) -> Result<(), HarnessError> {
        self.entry(name)?;
        if let Some(snap) = as_name {
            warden_cell::check_name(snap).map_err(|e| {
                HarnessError::from(WorkspaceError::Invalid(format!("snapshot name: {e}")))
            })?;
        }
        Ok(())
    }

    /// The tier's snapshot, on a blocking thread.
    async fn snapshot_made(
        &self,
        name: &str,
        as_name: Option<&str>,
    ) -> Result<Snapshot, HarnessError> {
        let snap = as_name.map(str::to_owned);
        // The cell's file slots, as an apply and a reset hold them: a snapshot taken beside an
        // upload held its temporary file (`.NAME.warden-N`), which a reset to it then left in
        // the workspace for good.
        let _files = self.hold_file_slots(name).await?;
        let info = self
            .blocking(name, move |tier, cell| {
                tier.snapshot(cell, snap.as_deref()).map_err(snapshot_error)
            })
            .await?;
        Ok(Snapshot {
            id: info.id,
            size: info.size,
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
        let diff = self.diff_of(name).await;
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
        // Read as the diff's own records, never made a JSON document whole: that took ~1.6 KiB
        // of the daemon's memory a change (a cell's 60,000 empty files, 94 MiB at its delete),
        // where the first 1,000 are all that is journaled.
        let changes = &diff.changes;
        let listed: Vec<serde_json::Value> = changes
            .iter()
            .take(1000)
            .map(|c| {
                json!({
                    "path": c.path,
                    "kind": c.kind,
                    "entry": c.entry,
                    "size": c.size,
                    "blake3": c.hash,
                })
            })
            .collect();
        let count = changes.len();
        drop(diff);
        let _ = self
            .record(
                Some(name),
                "workspace.changes",
                json!({ "when": when, "count": count, "changes": listed }),
            )
            .await;
    }

    /// What the cell changed in its workspace (the `warden diff --json` document).
    pub async fn diff(&self, name: &str) -> Result<serde_json::Value, HarnessError> {
        let diff = self.changes(name).await?;
        serde_json::to_value(&diff).map_err(|e| {
            HarnessError::from(WorkspaceError::Failed(format!("writing the diff: {e}")))
        })
    }

    /// What the cell changed in its workspace, as the diff's own records: what the API writes
    /// out, with no JSON document of every change made in between (~1.6 KiB a change).
    pub async fn changes(&self, name: &str) -> Result<warden_workspace::Diff, HarnessError> {
        let entry = self.entry(name)?;
        if entry.workspace.is_none() {
            return Err(HarnessError::from(WorkspaceError::NoWorkspace(format!(
                "cell `{name}` has no workspace"
            ))));
        }
        self.diff_of(name).await
    }

    /// The diff of a cell's layer as the API shows it.
    async fn diff_of(&self, name: &str) -> Result<warden_workspace::Diff, HarnessError> {
        self.blocking(name, |tier, cell| {
            tier.diff(cell).map(|(diff, _)| diff).map_err(changes_error)
        })
        .await
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
            return Err(HarnessError::from(WorkspaceError::NoWorkspace(format!(
                "cell `{name}` has no workspace"
            ))));
        };
        for path in &request.paths {
            if path.starts_with('-') || path.contains('\0') {
                return Err(HarnessError::from(WorkspaceError::Invalid(format!(
                    "path `{path}` is not a workspace path"
                ))));
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
                digest = Some(self.diff_of(name).await?.digest);
            }
            let shown = digest.as_deref().map_or("", |d| &d[..d.len().min(16)]);
            let flags = self.what_flags_add(name, request, digest.clone()).await?;
            let question = format!("apply {what} of {name} to {host} (changes {shown}){flags}");
            // A standing grant covers exactly these changes, written this way: another apply,
            // or this one with `force` or `include_sensitive`, asks again.
            let grant = format!(
                "apply {question} [force: {}, include sensitive: {}]",
                request.force, request.include_sensitive
            );
            self.ask_person(
                name,
                question,
                grant,
                "approvals.apply: ask".to_owned(),
                &approvals,
            )
            .await?;
        }
        let options = warden_workspace::ApplyOptions {
            paths: request.paths.clone(),
            dry_run: request.dry_run,
            force: request.force,
            include_sensitive: request.include_sensitive,
            digest,
            ..warden_workspace::ApplyOptions::default()
        };
        // Every file slot of the cell (see `files::FILE_SLOTS`), held through the copy: an
        // upload of the files API writes its file under a temporary name and renames it, and an
        // apply beside it copied the half-written temporary file to the host (where it stayed, and
        // every later apply conflicted with it) or failed with a 500.
        let _files = self.hold_file_slots(name).await?;
        let report = self
            .blocking(name, move |tier, cell| {
                tier.apply(cell, options).map_err(changes_error)
            })
            .await?;
        let report = serde_json::to_value(&report).map_err(|e| {
            HarnessError::from(WorkspaceError::Failed(format!(
                "writing the apply report: {e}"
            )))
        })?;
        self.record(Some(name), "workspace.applied", report.clone())
            .await?;
        Ok(report)
    }

    /// What `force` and `include_sensitive` add to an apply, in words for the person asked
    /// (nothing without them): the sensitive changes written only because of the flag, and the
    /// host entries changed since the cell started that `force` writes over. Each is learned
    /// from a dry run of the same apply, so the question says what the apply will do.
    async fn what_flags_add(
        &self,
        name: &str,
        request: &ApplyRequest,
        digest: Option<String>,
    ) -> Result<String, HarnessError> {
        let (force, include_sensitive) = (request.force, request.include_sensitive);
        if !force && !include_sensitive {
            return Ok(String::new());
        }
        let paths = request.paths.clone();
        let (sensitive, overwritten) = self
            .blocking(name, move |tier, cell| {
                let dry_run = |include_sensitive: bool, force: bool| {
                    tier.apply(
                        cell,
                        warden_workspace::ApplyOptions {
                            paths: paths.clone(),
                            dry_run: true,
                            force,
                            include_sensitive,
                            digest: digest.clone(),
                            ..warden_workspace::ApplyOptions::default()
                        },
                    )
                };
                let mut sensitive = Vec::new();
                if include_sensitive {
                    let without = dry_run(false, true).map_err(changes_error)?.applied;
                    sensitive = dry_run(true, true)
                        .map_err(changes_error)?
                        .applied
                        .into_iter()
                        .filter(|path| !without.contains(path))
                        .collect();
                }
                let mut overwritten = None;
                if force {
                    match dry_run(include_sensitive, false) {
                        Ok(_) => {}
                        Err(ChangesError::Workspace(LayerError::Conflict { paths, .. })) => {
                            overwritten = Some(paths);
                        }
                        Err(err) => return Err(changes_error(err)),
                    }
                }
                Ok((sensitive, overwritten))
            })
            .await?;
        let mut added = String::new();
        if include_sensitive {
            if sensitive.is_empty() {
                added.push_str(", including sensitive changes (none among these)");
            } else {
                const SHOWN: usize = 20;
                let mut listed = sensitive
                    .iter()
                    .take(SHOWN)
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(", ");
                if sensitive.len() > SHOWN {
                    listed.push_str(&format!(" and {} more", sensitive.len() - SHOWN));
                }
                added.push_str(&format!(
                    ", including sensitive changes it leaves out without --include-sensitive: {listed}"
                ));
            }
        }
        if force {
            match overwritten {
                Some(paths) => added.push_str(&format!(
                    ", with --force: overwriting what the host changed since the cell started at {paths}"
                )),
                None => added.push_str(
                    ", with --force: overwriting anything the host changes since the cell started (nothing yet)",
                ),
            }
        }
        Ok(added)
    }

    /// Snapshots of this cell.
    pub fn snapshots(&self, name: &str) -> Result<Vec<Snapshot>, HarnessError> {
        let entry = self.entry(name)?;
        let prefix = format!("{name}@");
        Ok(warden_cell::snapshot::listed(&self.store)
            .into_iter()
            .filter(|s| s.id.starts_with(&prefix))
            // An earlier cell's of this name are not this cell's (see `check_own_snapshot`).
            .filter(|s| !taken_before(s, &entry))
            .map(|s| Snapshot {
                id: s.id,
                size: s.size,
            })
            .collect())
    }

    /// Removes snapshot `CELL@SNAP`, of a cell that runs or of one removed since, with the
    /// memory image of a checkpoint of that name: its name goes at once, its layer when nothing
    /// stacks it any more (a later snapshot, the cell itself); refused while another cell was
    /// forked from it. Journaled before it is done.
    pub async fn remove_snapshot(&self, id: &str) -> Result<(), HarnessError> {
        let Some((cell, _)) = id.split_once('@') else {
            return Err(WorkspaceError::Invalid(format!(
                "`{id}` is not a snapshot: they are named CELL@SNAPSHOT (`warden snapshots CELL` lists a cell's)"
            ))
            .into());
        };
        // Known before anything is journaled: a name that is none is refused as such.
        let store = self.store.clone();
        let named = id.to_owned();
        tokio::task::spawn_blocking(move || warden_cell::snapshot::get(&store, &named))
            .await
            .map_err(|e| WorkspaceError::Failed(format!("looking up the snapshot: {e}")))?
            .map_err(snapshot_error)?;
        let live = self.entry(cell).is_ok();
        self.record(
            live.then_some(cell),
            "workspace.snapshot.remove",
            json!({ "id": id, "cell": cell }),
        )
        .await?;
        let store = self.store.clone();
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || {
            warden_cell::snapshot::remove(&store, &id).map_err(snapshot_error)?;
            let image = store.root().join("checkpoints").join(&id);
            if image.is_dir() {
                std::fs::remove_dir_all(&image).map_err(|e| {
                    HarnessError::from(WorkspaceError::Failed(format!(
                        "removing the checkpoint's memory image {}: {e}",
                        image.display()
                    )))
                })?;
            }
            Ok(())
        })
        .await
        .map_err(|e| WorkspaceError::Failed(format!("removing the snapshot: {e}")))?
    }

    /// Returns the cell's workspace to a snapshot of it (`SNAP` or `CELL@SNAP`), or to its start.
    pub async fn reset(&self, name: &str, to: Option<&str>) -> Result<(), HarnessError> {
        let entry = self.entry(name)?;
        let to = to.map(|t| {
            if t.contains('@') {
                t.to_owned()
            } else {
                format!("{name}@{t}")
            }
        });
        if let Some(id) = &to {
            self.check_own_snapshot(&entry, id).await?;
        }
        // The cell's file slots, as an apply holds them: an upload beside a reset wrote into
        // the overlay the reset replaced, and its rename failed with a 404 `no-such-file`.
        let _files = self.hold_file_slots(name).await?;
        self.record(Some(name), "workspace.reset", json!({ "to": to }))
            .await?;
        // A running cell's reset forks a helper that joins the cell; `fork` is the C library's,
        // so the allocator is usable in the child whatever the daemon's other threads held.
        self.blocking(name, move |tier, cell| {
            tier.reset(cell, to.as_deref()).map_err(snapshot_error)
        })
        .await
    }

    /// A reset goes back to a snapshot of this cell only. Snapshots outlive their cell (a
    /// fork may start from one later), and their records name the cell by its name alone: a
    /// new cell that took a deleted one's name was reset to the deleted one's snapshot, whose
    /// layers (the earlier cell's files, on another workspace) it then held, and an apply
    /// would have written them into its own workspace. One taken before this cell was made is
    /// an earlier cell's: refused, with the way to start from it (a fork).
    async fn check_own_snapshot(
        &self,
        entry: &crate::CellEntry,
        id: &str,
    ) -> Result<(), HarnessError> {
        let store = self.store.clone();
        let named = id.to_owned();
        let info = tokio::task::spawn_blocking(move || warden_cell::snapshot::get(&store, &named))
            .await
            .map_err(|e| WorkspaceError::Failed(format!("looking up the snapshot: {e}")))?;
        // One that is not there, or of another cell by name, is refused by the tier as before.
        let Ok(info) = info else { return Ok(()) };
        if info.cell == entry.name && taken_before(&info, entry) {
            return Err(WorkspaceError::Invalid(format!(
                "snapshot `{id}` was taken of an earlier cell named `{}`, which is gone; this cell was made after it, and a reset takes a snapshot of this cell only. Start a new cell from it instead (`from`: `{id}`)",
                entry.name
            ))
            .into());
        }
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
        let entry = self.entry(name)?;
        self.live(name)?;
        let policy = warden_policy::from_yaml("policy", yaml)
            .map_err(|e| HarnessError::from(WorkspaceError::Invalid(e.to_string())))?;
        let current = entry.policy_in_force().ok_or_else(|| {
            HarnessError::from(WorkspaceError::Failed(format!(
                "the policy cell `{name}` was made with no longer parses"
            )))
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
            return Err(WorkspaceError::Conflict(message).into());
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
            std::fs::write(&file, yaml).map_err(|e| {
                HarnessError::from(WorkspaceError::Failed(format!(
                    "writing {}: {e}",
                    file.display()
                )))
            })?;
            let cell = self.live(name)?;
            crate::on_own_thread(move || cell.set_network_rules(&file))
                .await?
                .map_err(|e| HarnessError::from(WorkspaceError::Conflict(e.to_string())))?
        } else {
            0
        };
        self.update_entry(name, |entry| {
            entry.replaced = Some(yaml.to_owned());
            true
        })?;
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

/// Whether snapshot `info` was taken before the cell of `entry` was made: of an earlier cell
/// of its name.
fn taken_before(info: &warden_cell::SnapshotInfo, entry: &crate::CellEntry) -> bool {
    let taken_ms = info
        .created
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    taken_ms < entry.created_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_out_of_room_is_disk_full_with_what_to_do() {
        let full = snapshot_error(SnapshotError::Copy {
            path: "/state/layers/c/fs/upper.new".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        });
        assert_eq!(full.kind, crate::ErrorKind::Conflict);
        assert_eq!(full.reason, "disk-full");
        assert!(full.message.contains("limits.disk") && full.message.contains("warden rm"));
        // Any other failure to copy stays the warden's own.
        let other = snapshot_error(SnapshotError::Copy {
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(libc::EIO),
        });
        assert_eq!(other.reason, "workspace-failed");
    }
}
