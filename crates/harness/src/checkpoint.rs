//! Memory snapshots: a checkpoint saves a cell's processes (their memory, where each was) and
//! its workspace at one moment, and the cell ends there; a cell made with `restore` of it goes on
//! from that moment, under another name or the same. Only tiers that can save a sandbox's memory
//! have them (the gVisor tier); the others refuse with the tier that has them.
//!
//! A checkpoint is a directory `STATE/checkpoints/CELL@NAME/`: the tier's memory image, and
//! `cell.json` (what the cell was made from: its policy, environment, labels). Its workspace is
//! the snapshot of the same id.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::json;
use warden_protocol::{Checkpoint, CreateCell};

use crate::{
    CellFailure, CreateError, Harness, HarnessError, PolicySource, WorkspaceError, now_ms,
};

/// What a checkpoint keeps of the cell it was made of.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Saved {
    policy: PolicySource,
    env: std::collections::BTreeMap<String, String>,
    labels: std::collections::BTreeMap<String, String>,
    made_ms: u64,
}

/// The file in the daemon's folder of a cell that says it ended at a checkpoint (its id).
pub(crate) const CHECKPOINTED: &str = "checkpointed";

impl Harness {
    fn checkpoint_dir(&self, id: &str) -> PathBuf {
        self.store.root().join("checkpoints").join(id)
    }

    /// Saves the memory and the workspace of cell `name` as `NAME@AS`; the cell ends there.
    pub async fn checkpoint(
        &self,
        name: &str,
        as_name: Option<&str>,
        by: &str,
    ) -> Result<Checkpoint, HarnessError> {
        let entry = self.entry(name)?;
        let policy = entry.policy_in_force().ok_or_else(|| {
            HarnessError::from(WorkspaceError::Failed(format!(
                "cell `{name}` has no policy on record"
            )))
        })?;
        if policy.network.has_gateway() {
            return Err(HarnessError::from(WorkspaceError::Conflict(format!(
                "cell `{name}` lets traffic out through the gateway; its sockets live on its namespace's network stack, which cannot be saved: only a cell with no network (no `network.allow`, `ask` or `inference`) can be checkpointed"
            ))));
        }
        if entry.workspace.is_none() {
            return Err(HarnessError::from(WorkspaceError::NoWorkspace(format!(
                "cell `{name}` has no workspace: a checkpoint keeps the cell's workspace beside its memory; make the cell with a workspace (`workspace` in the API, `-w DIR` on the command line)"
            ))));
        }
        let (cell, status) = self.live_with_status(name)?;
        if status == warden_cell::Status::Paused {
            return Err(HarnessError::from(CellFailure::Paused(format!(
                "cell `{name}` is paused; resume it first"
            ))));
        }
        let snap = match as_name {
            Some(snap) => {
                warden_cell::check_name(snap).map_err(|e| {
                    HarnessError::from(WorkspaceError::Invalid(format!("checkpoint name: {e}")))
                })?;
                snap.to_owned()
            }
            None => format!("ckpt-{}", now_ms()),
        };
        let id = format!("{name}@{snap}");
        let image = self.checkpoint_dir(&id);
        if image.exists() || warden_cell::snapshot::get(&self.store, &id).is_ok() {
            return Err(HarnessError::from(WorkspaceError::Conflict(format!(
                "`{id}` exists; pick another name or remove it (`warden rm {id}`)"
            ))));
        }
        // No upload under way meanwhile: its temporary file would be in the snapshot.
        let _files = self.hold_file_slots(name).await?;
        self.record(
            Some(name),
            "cell.checkpoint",
            json!({ "as": snap, "by": by }),
        )
        .await?;
        let tier = self.backend(policy.tier)?;
        let cell_name = name.to_owned();
        let (image_dir, snap_name) = (image.clone(), snap.clone());
        let _ = std::fs::write(
            self.daemon_dir.join("cells").join(name).join(CHECKPOINTED),
            &id,
        );
        let saved = tokio::task::spawn_blocking(move || {
            let mut workspace_bytes = 0;
            let mut while_held = || {
                tier.snapshot(&cell_name, Some(&snap_name))
                    .map(|info| workspace_bytes = info.size.unwrap_or(0))
                    .map_err(|e| format!("snapshotting the workspace: {e}"))
            };
            tier.checkpoint(&cell_name, &image_dir, &mut while_held)
                .map(|()| workspace_bytes)
        })
        .await
        .map_err(|e| HarnessError::from(WorkspaceError::Failed(format!("checkpointing: {e}"))))?;
        let workspace_bytes = match saved {
            Ok(bytes) => bytes,
            Err(err) => {
                let _ = std::fs::remove_file(
                    self.daemon_dir.join("cells").join(name).join(CHECKPOINTED),
                );
                let _ = warden_cell::snapshot::remove(&self.store, &id);
                let failure = match err {
                    warden_cell::CellError::Unsupported(_)
                    | warden_cell::CellError::Refused(_)
                    | warden_cell::CellError::Ended(_) => WorkspaceError::Conflict,
                    _ => WorkspaceError::Failed,
                };
                self.record(
                    Some(name),
                    "cell.checkpoint.fail",
                    json!({ "error": err.to_string() }),
                )
                .await?;
                return Err(failure(err.to_string()).into());
            }
        };
        let saved = Saved {
            policy: entry.policy.clone(),
            env: entry.env.clone(),
            labels: entry.labels.clone(),
            made_ms: now_ms(),
        };
        let written = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(image.join("cell.json"), bytes));
        if let Err(e) = written {
            return Err(HarnessError::from(WorkspaceError::Failed(format!(
                "writing {}: {e}",
                image.join("cell.json").display()
            ))));
        }
        let memory_bytes = dir_size(&image);
        self.record(
            Some(name),
            "cell.checkpoint.done",
            json!({ "id": id, "memory_bytes": memory_bytes, "workspace_bytes": workspace_bytes }),
        )
        .await?;
        // The cell ended at its checkpoint: once its tier has let go of it, it is so recorded
        // (bounded: a tier that holds on is left to the cell's watch).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !matches!(cell.status(), Ok(warden_cell::Status::Ended))
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let reason = format!("checkpointed as {id}");
        if matches!(cell.status(), Ok(warden_cell::Status::Ended))
            && self.update_entry(name, |entry| {
                let unended = entry.ended.is_none();
                if unended {
                    entry.ended = Some(reason.clone());
                }
                unended
            })?
        {
            self.record(Some(name), "cell.end", json!({ "reason": reason }))
                .await?;
        }
        Ok(Checkpoint {
            id,
            memory_bytes,
            workspace_bytes,
        })
    }

    /// A request to restore a checkpoint, made into the request for the cell it was (its
    /// policy, environment and labels; its workspace the snapshot of the same id), and where
    /// its memory image is.
    pub(crate) fn restoring(
        &self,
        mut request: CreateCell,
    ) -> Result<(CreateCell, Option<PathBuf>), HarnessError> {
        let Some(id) = request.restore.clone() else {
            return Ok((request, None));
        };
        if request.policy.is_some()
            || request.preset.is_some()
            || request.workspace.is_some()
            || request.from.is_some()
        {
            return Err(HarnessError::from(CreateError::Invalid("`restore` brings back the checkpointed cell as it was: give no `policy`, `preset`, `workspace` or `from` with it".into())));
        }
        if !id.contains('@') || id.contains('/') {
            return Err(HarnessError::from(CreateError::Invalid(format!(
                "`restore`: `{id}` is not a checkpoint (they are named CELL@NAME)"
            ))));
        }
        let image = self.checkpoint_dir(&id);
        let saved: Saved = std::fs::read(image.join("cell.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| {
                HarnessError::from(CreateError::NoSource(format!(
                    "no checkpoint `{id}` (`warden snapshots` lists them)"
                )))
            })?;
        match saved.policy {
            PolicySource::Preset(preset) => request.preset = Some(preset),
            PolicySource::Yaml(yaml) => request.policy = Some(yaml),
        }
        let mut env = saved.env;
        env.extend(std::mem::take(&mut request.env));
        request.env = env;
        let mut labels = saved.labels;
        labels.extend(std::mem::take(&mut request.labels));
        request.labels = labels;
        request.from = Some(id);
        Ok((request, Some(image)))
    }
}

/// Bytes of the files in `dir` (not below).
fn dir_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
