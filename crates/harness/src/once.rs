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
    /// The run's line to its cell, held past the command's end: dropped once the run has
    /// answered, it lets the cell's teardown begin (a cell that ends with its command waits
    /// for it), so that the teardown does not take the CPUs from the answer.
    pub line: crate::LineHold,
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
        let (info, handing) = self.create_with(cell, true).await?;
        let name = info.name;
        // (One with a workspace is killed, as any: its changes are listed after.)
        let ends_itself = info.workspace.is_none()
            && self
                .cell(&name)
                .is_some_and(|cell| cell.ends_with_last_process());
        let (tx, deleted) = tokio::sync::oneshot::channel();
        let then = Then {
            by: by.to_owned(),
            deleted: tx,
            ends_itself,
        };
        // The line is held at once: a way out below lets go of it.
        let started = self
            .exec_then(&name, exec, Some(then))
            .await
            .map(|process| {
                let line = process.hold_line();
                (process, line)
            });
        // Written before the start's entry, and durable with it (one round).
        let durable = match handing {
            Some(handing) => handing.wait(self).await,
            None => Ok(()),
        };
        // The process's watch deletes the cell once the process has ended (the start, where
        // the program could not start).
        let (process, line) = match started.and_then(|started| durable.map(|()| started)) {
            Ok(started) => started,
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
            line,
        })
    }
}

/// What follows a run's process's end: the delete of its cell (by `by`), whose outcome goes
/// to the run's answer.
#[derive(Debug)]
pub(crate) struct Then {
    by: String,
    deleted: tokio::sync::oneshot::Sender<Result<(), String>>,
    /// The cell's tier ends it with the run's process (`ExecRequest::last`): its end starts as
    /// the process's does, not after a kill that follows the news of it.
    pub(crate) ends_itself: bool,
}

impl Then {
    /// Deletes the cell; `ended`: the run's process ran and ended (so a cell that
    /// `ends_itself` is ending already).
    pub(crate) async fn delete(self, harness: &Arc<Harness>, cell: &str, ended: bool) {
        let ending = (ended && self.ends_itself).then_some("its run's command ended");
        let outcome = harness
            .delete_with(cell, &self.by, ending)
            .await
            .map_err(|err| format!("deleting cell `{cell}` after its command: {err}"));
        let _ = self.deleted.send(outcome);
    }
}

/// A run's cell from a pool, being handed out: its create's entries in the journal's file,
/// durable with the command's start.
pub(crate) struct Handing {
    written: crate::record::DurableAll,
}

impl Handing {
    pub(crate) fn new(written: crate::record::DurableAll) -> Self {
        Self { written }
    }

    /// Waits until the entries are on disk.
    async fn wait(self, harness: &Harness) -> Result<(), HarnessError> {
        self.written.wait(harness).await.map(drop)
    }
}
