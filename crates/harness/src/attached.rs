//! One command in a new cell, run to its end with the caller's own stdio: `warden run` without
//! a daemon. The same checks, command rules and journal entries as a cell and an exec of the
//! daemon (`cell.create`, `exec.start` before anything runs, `exec.exit`, the egress record's
//! decisions, `cell.end`, then `cell.delete` or the changes kept for review); only the cell is
//! run by the tier in this process, with no keeper to start.

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde_json::json;
use warden_cell::tier::{Attached, Ending};
use warden_cell::{CellSpec, StartError};

use crate::{
    CreateCell, CreateError, ExecError, ExitInfo, ExitReason, Harness, HarnessError, Prepared,
};

/// The command, as `warden run` was given it.
#[derive(Debug, Clone)]
pub struct AttachedRun {
    /// Any bytes (a command line need not be UTF-8); its rules and the journal see it as text.
    pub argv: Vec<OsString>,
    /// Added to the cell's environment.
    pub env: Vec<(String, String)>,
    /// The workspace layer and the egress record go with the cell (`--rm`).
    pub discard_changes: bool,
    /// Who asked, for the journal.
    pub by: String,
    /// The caller has had the tier check this request (`Backend::check`) already, as `warden
    /// run` does before it opens the journal: the host's paths are not walked twice.
    pub checked: bool,
    /// The policy the request's `policy` text holds, parsed already by the caller (`warden
    /// run` parses it to pick the tier and check it): it is not parsed again.
    pub parsed: Option<warden_policy::Policy>,
}

/// How it ended.
#[derive(Debug, Clone)]
pub struct AttachedEnd {
    /// What the tier says (the ending, with its limit; notices; whether changes were kept).
    pub attached: Attached,
    /// The same as an exec of the daemon's reports it.
    pub exit: ExitInfo,
}

impl Harness {
    /// Runs `run` in a new cell made from `request`, to its end. Blocks the calling thread
    /// while the cell runs (the tier may clone the cell from it): call it on a current-thread
    /// runtime of its own, as `warden run` does, never on a daemon's.
    pub async fn run_attached(
        self: &Arc<Self>,
        request: CreateCell,
        run: AttachedRun,
    ) -> Result<AttachedEnd, HarnessError> {
        if run.argv.first().is_none_or(|p| p.is_empty()) {
            return Err(HarnessError::from(ExecError::Invalid(
                "a command needs at least the program".into(),
            )));
        }
        crate::exec::check_env(run.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        let argv: Vec<String> = run
            .argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let Prepared {
            name,
            parsed,
            from,
            entry,
        } = self.prepare(&request, run.parsed.clone()).await?;
        if !run.checked {
            self.backend(parsed.tier)?
                .check(
                    &parsed,
                    request.workspace.as_deref().map(std::path::Path::new),
                )
                .map_err(|e| HarnessError::from(CreateError::Refused(e.to_string())))?;
        }
        self.state.put(&entry)?;
        self.state.set_record_offset(&name, None)?;
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.insert(name.clone(), Arc::new(tokio::sync::Mutex::new(0)));
        }
        self.adopt_with(&entry, parsed.clone());
        let result = self
            .run_adopted(&name, parsed, from, &entry, &request, &run, &argv)
            .await;
        self.forget_attached(&name);
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_adopted(
        self: &Arc<Self>,
        name: &str,
        policy: warden_policy::Policy,
        from: Option<String>,
        entry: &crate::CellEntry,
        request: &CreateCell,
        run: &AttachedRun,
        argv: &[String],
    ) -> Result<AttachedEnd, HarnessError> {
        let created = crate::create_entry(entry, request, &from);
        let (verdict, _) = self.command_verdict(name, argv)?;
        if let Some((denied, refused)) = self.refusal(argv, &verdict) {
            self.record_all(
                name,
                vec![
                    ("cell.create", created),
                    ("exec.denied", denied),
                    ("cell.end", json!({ "reason": "its command was refused" })),
                    ("cell.delete", json!({ "by": run.by })),
                ],
                true,
            )
            .await?;
            return Err(refused);
        }
        let id = self.next_process.fetch_add(1, Ordering::Relaxed);
        let wall = policy.limits.wall.map(|w| w.0.as_millis() as u64);
        // Only a gateway writes an egress record.
        let recorded = policy.network.has_gateway();
        let start_entries = vec![
            ("cell.create", created),
            (
                "exec.start",
                json!({
                    "process": id,
                    "argv": argv,
                    "cwd": null,
                    // Names only: values may be secrets.
                    "env": run.env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
                    "background": false,
                    "timeout_ms": wall,
                }),
            ),
        ];
        let spec = CellSpec {
            name: name.to_owned(),
            policy,
            workspace: if from.is_some() {
                None
            } else {
                request.workspace.as_ref().map(Into::into)
            },
            from,
            env: request
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain(run.env.iter().cloned())
                .collect(),
            report: None,
            log: None,
            restore: None,
            secrets: Vec::new(),
        };
        let begun = Instant::now();
        // The start is on disk before the command may run, written while the cell assembles
        // its root (the tier calls back between the two): its cost hides behind the cell's.
        let mut start_entries = Some(start_entries);
        let mut started: Option<Result<Vec<warden_journal::Receipt>, HarnessError>> = None;
        let mut before_start = || {
            let entries = start_entries.take().unwrap_or_default();
            let journaled = self.record_all_blocking(name, entries, false);
            let answer = journaled
                .as_ref()
                .map(|_| ())
                .map_err(|e| e.message.clone());
            started = Some(journaled);
            answer
        };
        // The layer is discarded here, after the record's decisions are in the journal. The
        // tier clones the cell from this very thread, which therefore blocks here for the
        // cell's life: the runtime's other work waits (there is none on the CLI's runtime), and
        // the process has no other thread when the clone is made.
        let outcome = self.backend(spec.policy.tier)?.run_attached(
            spec,
            run.argv.clone(),
            false,
            &mut before_start,
        );
        let duration_ms = begun.elapsed().as_millis() as u64;
        // A start that failed before it was journaled is journaled now, with its failure.
        let started = match (started, start_entries) {
            (Some(started), _) => started?,
            (None, Some(entries)) => self.record_all(name, entries, false).await?,
            (None, None) => Vec::new(),
        };
        let start_seq = started.last().map_or(0, |r| r.seq);
        while recorded && self.copy_decisions(name).await {}
        let attached = match outcome {
            Ok(attached) => attached,
            Err(err) => {
                let message = match &err {
                    StartError::Refused(m) | StartError::TimedOut(m) | StartError::Host(m) => {
                        m.clone()
                    }
                };
                self.record(
                    Some(name),
                    "exec.exit",
                    json!({ "process": id, "start_seq": start_seq, "reason": "failed", "message": message }),
                )
                .await?;
                // Nothing to discard: what the tier made it removed, and what was there before
                // (a kept layer of an earlier cell of this name) is not this cell's.
                self.record(Some(name), "cell.fail", json!({ "error": message }))
                    .await?;
                return Err(match err {
                    StartError::Refused(_) => CreateError::Refused(message),
                    _ => CreateError::Unavailable(message),
                }
                .into());
            }
        };
        let (reason, code, signal, message) = exit_of(&attached.ending);
        let exit_entry = json!({
            "process": id,
            "start_seq": start_seq,
            "reason": reason.name(),
            "code": code,
            "signal": signal,
            "message": message,
            "duration_ms": duration_ms,
            // The command's stdio was the caller's own: the warden relayed it without keeping
            // a copy.
            "usage": null,
            "stdout_bytes": null,
            "stderr_bytes": null,
        });
        let end_entry = json!({ "reason": ending_reason(&attached.ending) });
        let kept = attached.kept_changes && !run.discard_changes;
        // The end in one group commit, signed: this harness's journal closes right after. The
        // tier releases the cell's name meanwhile (its runtime folder goes); the layer is
        // touched only once that is done.
        let exit = if kept {
            let receipts = self
                .record_all(
                    name,
                    vec![("exec.exit", exit_entry), ("cell.end", end_entry)],
                    false,
                )
                .await?;
            attached.release.wait();
            self.journal_changes(name, "ended, changes kept for review")
                .await;
            receipts
        } else {
            if attached.kept_changes {
                attached.release.wait();
            }
            self.discard(name, run.discard_changes);
            self.record_all(
                name,
                vec![
                    ("exec.exit", exit_entry),
                    ("cell.end", end_entry),
                    ("cell.delete", json!({ "by": run.by })),
                ],
                true,
            )
            .await?
        };
        let exit_seq = exit.first().map(|r| r.seq);
        Ok(AttachedEnd {
            exit: ExitInfo {
                reason,
                code,
                signal,
                message,
                duration_ms,
                usage: None,
                stdout_bytes: 0,
                stderr_bytes: 0,
                journal_seq: exit_seq,
            },
            attached: Attached {
                name: name.to_owned(),
                // What `--rm` discarded is not kept, whatever the tier left for this to remove.
                kept_changes: kept,
                ..attached
            },
        })
    }

    /// Removes the cell's layer, and with `record` its egress record.
    fn discard(&self, name: &str, record: bool) {
        // Most runs leave no layer (no workspace, or one that went with the cell): nothing to
        // look up then, on the way to the end's record.
        if self.store.layer(name).exists()
            && let Ok(tier) = self.backend_of(name)
        {
            let _ = tier.remove_layer(name);
        }
        if record {
            let _ = std::fs::remove_file(self.store.net_log_path(name));
        }
    }

    /// Forgets a cell run to its end here.
    fn forget_attached(&self, name: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(name);
        }
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.remove(name);
        }
        let _ = self.state.remove(name);
    }
}

/// An ending, as an exec's exit reports it.
fn exit_of(ending: &Ending) -> (ExitReason, Option<i32>, Option<i32>, Option<String>) {
    const KILL: Option<i32> = Some(libc::SIGKILL);
    match ending {
        Ending::Exited(code) => (ExitReason::Exited, Some(*code), None, None),
        Ending::Signaled(signal) => (ExitReason::Signaled, None, Some(*signal), None),
        Ending::MemoryLimit { .. } => (
            ExitReason::MemoryLimit,
            None,
            KILL,
            Some(ending_reason(ending)),
        ),
        Ending::WallLimit { .. } => (ExitReason::Timeout, None, KILL, Some(ending_reason(ending))),
        Ending::OutputLimit { .. } => (
            ExitReason::OutputLimit,
            None,
            KILL,
            Some(ending_reason(ending)),
        ),
        Ending::DiskLimit { .. } => (
            ExitReason::DiskLimit,
            None,
            KILL,
            Some(ending_reason(ending)),
        ),
        Ending::Killed => (ExitReason::Killed, None, KILL, None),
        Ending::CommandNotFound(message) => {
            (ExitReason::Failed, Some(127), None, Some(message.clone()))
        }
        Ending::CannotExecute(message) => {
            (ExitReason::Failed, Some(126), None, Some(message.clone()))
        }
    }
}

fn ending_reason(ending: &Ending) -> String {
    let size = |bytes: u64| warden_policy::ByteSize(bytes).to_string();
    match ending {
        Ending::Exited(_) | Ending::Signaled(_) => "its command ended".to_owned(),
        Ending::MemoryLimit { limit } => format!("memory limit {} exceeded", size(*limit)),
        Ending::WallLimit { limit } => format!(
            "wall-clock limit {} exceeded",
            warden_policy::Duration(*limit)
        ),
        Ending::OutputLimit { limit } => format!("output limit {} exceeded", size(*limit)),
        Ending::DiskLimit { limit } => format!("disk limit {} exceeded", size(*limit)),
        Ending::Killed => "killed".to_owned(),
        Ending::CommandNotFound(_) | Ending::CannotExecute(_) => {
            "its command could not start".to_owned()
        }
    }
}
