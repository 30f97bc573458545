//! One command in a cell made for it and deleted once it ends (`POST /v1/run`): a create and a
//! foreground exec as one call, with no round trip between them, the create's journal round
//! overlapping the command's start, and the cell's delete before the answer ends.

use std::sync::Arc;

use super::*;

/// A run under way: its process (its output and exit as any exec's), and the cell's delete,
/// which follows the process's end whether or not anyone still reads it.
#[derive(Debug)]
pub struct RunningOnce {
    pub cell: String,
    pub process: Arc<Process>,
    /// The delete's outcome once the command has ended (an `Err` says why the cell is left).
    pub deleted: tokio::sync::oneshot::Receiver<Result<(), String>>,
}

impl Harness {
    /// Makes the cell `request.cell` asks for (from a pool where it qualifies, as a create),
    /// runs `request.exec` in it in the foreground, and deletes the cell once the command has
    /// ended (by `by`). Nothing of the command is told before the create's and the start's
    /// journal entries are on disk: a pooled cell's entries go to the disk in a round that
    /// overlaps the command's start, and the start's own round follows them. A command that
    /// cannot start deletes the cell before the error is answered.
    pub async fn run_once(
        self: &Arc<Self>,
        request: RunOnce,
        by: &str,
    ) -> Result<RunningOnce, HarnessError> {
        let RunOnce { cell, exec } = request;
        if exec.background {
            return Err(ExecError::Invalid(
                "a run streams its command to its end and then deletes its cell: `background` is for a process in a cell that stays (create the cell, then exec)".to_owned(),
            )
            .into());
        }
        let (info, written) = self.create_with(cell, true).await?;
        let name = info.name;
        let (tx, deleted) = tokio::sync::oneshot::channel();
        let then = Then {
            by: by.to_owned(),
            deleted: tx,
        };
        let started = self.exec_then(&name, exec, Some(then)).await;
        // Written before the start's entry: durable by the start's round at the latest.
        let durable = match written {
            Some(written) => written.wait(self).await.map(drop),
            None => Ok(()),
        };
        // The process's watch deletes the cell once the process has ended (the start, where
        // the program could not start).
        let process = match started.and_then(|process| durable.map(|()| process)) {
            Ok(process) => process,
            Err(err) => {
                // The delete ends whatever started.
                let _ = self.delete(&name, by).await;
                return Err(err);
            }
        };
        Ok(RunningOnce {
            cell: name,
            process,
            deleted,
        })
    }
}

/// What follows a run's process's end: the delete of its cell (by `by`), whose outcome goes
/// to the run's answer.
#[derive(Debug)]
pub(crate) struct Then {
    by: String,
    deleted: tokio::sync::oneshot::Sender<Result<(), String>>,
}

impl Then {
    pub(crate) async fn delete(self, harness: &Arc<Harness>, cell: &str) {
        let outcome = harness
            .delete(cell, &self.by)
            .await
            .map_err(|err| format!("deleting cell `{cell}` after its command: {err}"));
        let _ = self.deleted.send(outcome);
    }
}
