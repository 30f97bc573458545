//! What the harness journals: entries on disk before they are acknowledged (one, or several
//! of a cell in one group commit), announced to the events stream once written, and read
//! back for a client that reconnects.

use super::*;

/// Entries of a reconnecting client's backlog read ahead of its stream.
const ENTRIES_AHEAD: usize = 8;

impl Harness {
    /// Journal entries after `after` (their sequence number), of `cell` only when given, as the
    /// events stream shows them: what a client that reconnects missed. Only the segments that
    /// can hold them are read.
    pub async fn entries_after(
        &self,
        after: u64,
        cell: Option<String>,
    ) -> Result<Vec<Value>, HarnessError> {
        let mut entries = self.stream_entries_after(after, cell);
        let mut out = Vec::new();
        while let Some(entry) = entries.recv().await {
            out.push(entry?);
        }
        Ok(out)
    }

    /// The entries of [`Self::entries_after`] as they are read, a line at a time, a few ahead
    /// of the receiver: a client that asks from far back (`after=0` of a journal of gigabytes)
    /// has the daemon hold a few entries, not every one it missed (read whole, a long journal
    /// would have taken the daemon's memory). The reading stops once the receiver is gone; an
    /// error ends the stream.
    pub fn stream_entries_after(
        &self,
        after: u64,
        cell: Option<String>,
    ) -> tokio::sync::mpsc::Receiver<Result<Value, HarnessError>> {
        use std::io::BufRead as _;
        let dir = self.journal.dir().to_path_buf();
        let (tx, rx) = tokio::sync::mpsc::channel(ENTRIES_AHEAD);
        tokio::task::spawn_blocking(move || {
            let unreadable = |what: String| HarnessError::from(HistoryError::Unreadable(what));
            let segments = match warden_journal::segments(&dir) {
                Ok(segments) => segments,
                Err(e) => {
                    let _ = tx.blocking_send(Err(unreadable(format!("listing the journal: {e}"))));
                    return;
                }
            };
            // Closed segments are named by their first entry: skip those wholly at or before
            // `after`.
            let mut start = 0;
            for (i, path) in segments.iter().enumerate() {
                if warden_journal::segment_first_seq(path)
                    .is_some_and(|first| first <= after.saturating_add(1))
                {
                    start = i;
                }
            }
            for path in &segments[start..] {
                let file = match std::fs::File::open(path) {
                    Ok(file) => std::io::BufReader::new(file),
                    Err(e) => {
                        let _ = tx.blocking_send(Err(unreadable(format!(
                            "reading {}: {e}",
                            path.display()
                        ))));
                        return;
                    }
                };
                for line in file.split(b'\n') {
                    let line = match line {
                        Ok(line) => line,
                        Err(e) => {
                            let _ = tx.blocking_send(Err(unreadable(format!(
                                "reading {}: {e}",
                                path.display()
                            ))));
                            return;
                        }
                    };
                    let Ok(entry) = serde_json::from_slice::<warden_journal::Entry>(&line) else {
                        continue;
                    };
                    if entry.seq <= after
                        || cell
                            .as_deref()
                            .is_some_and(|c| entry.cell.as_deref() != Some(c))
                    {
                        continue;
                    }
                    let event = json!({
                        "seq": entry.seq,
                        "cell": entry.cell,
                        "kind": entry.kind,
                        "data": entry.data,
                    });
                    if tx.blocking_send(Ok(event)).is_err() {
                        return;
                    }
                }
            }
        });
        rx
    }

    /// Appends to the journal and waits until it is on disk. Every entry goes to the events
    /// stream once it is on disk (whether or not anyone listens as it is made: a client that
    /// subscribes, then reads what it missed from the journal, must find each entry in one of
    /// the two).
    pub async fn record(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Receipt, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let event = Some(data.clone());
        self.journal
            .submit_leading(cell, kind, data, move |result| {
                let _ = tx.send(result);
            });
        let receipt = journaled(rx.await)?;
        self.announce(&receipt, cell, kind, event);
        Ok(receipt)
    }

    /// Appends an entry and answers once it is written to the journal's file, not waiting for
    /// the disk: for a record of what the warden saw (an agent's model exchange, say) that no
    /// effect waits on. It takes no fdatasync of its own: the next entry that is waited for
    /// (the journal syncs its file as a whole) makes it durable too, or the journal's syncer
    /// within a few milliseconds; it goes to the events stream once it is on disk.
    pub async fn record_soon(
        self: &Arc<Self>,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Receipt, HarnessError> {
        let durable = self
            .record_written(cell, kind, data, warden_journal::Urgency::Soon)
            .await?;
        let receipt = durable.receipt.clone();
        let harness = Arc::clone(self);
        tokio::spawn(async move {
            let _ = durable.wait(&harness).await;
        });
        Ok(receipt)
    }

    /// Appends entries about one cell in one group commit, and a signed checkpoint after them
    /// with `sign` (so that closing the journal then needs no write of its own), and waits
    /// until all are on disk.
    pub(crate) async fn record_all(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let events = self.submit_all(cell, entries, sign, move |result| {
            let _ = tx.send(result);
        });
        let receipts = rx.await.unwrap_or_else(|_| Err(writer_gone()));
        self.announce_all(cell, receipts, events)
    }

    /// Like `record_all`, blocking the calling thread until the entries are on disk: for a
    /// caller that cannot await (a tier's `before_start`). A round no other thread has under
    /// way is run by this thread, so an ephemeral harness's blocks no longer than its write.
    pub(crate) fn record_all_blocking(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let events = self.submit_all(cell, entries, sign, move |result| {
            let _ = tx.send(result);
        });
        let receipts = rx.recv().unwrap_or_else(|_| Err(writer_gone()));
        self.announce_all(cell, receipts, events)
    }

    /// Submits entries as one batch; returns them again, for the events stream.
    pub(crate) fn submit_all(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
        ack: impl FnOnce(Result<Vec<Receipt>, warden_journal::JournalError>) + Send + 'static,
    ) -> Vec<(String, Value)> {
        let entries: Vec<(String, Value)> = entries
            .into_iter()
            .map(|(kind, data)| (kind.to_owned(), data))
            .collect();
        self.journal
            .submit_batch(Some(cell), entries.clone(), sign, ack);
        entries
    }

    pub(crate) fn announce_all(
        &self,
        cell: &str,
        receipts: Result<Vec<Receipt>, warden_journal::JournalError>,
        events: Vec<(String, Value)>,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let receipts =
            receipts.map_err(|err| HarnessError::from(CellFailure::Journal(err.to_string())))?;
        for (receipt, (kind, data)) in receipts.iter().zip(events) {
            self.announce(receipt, Some(cell), &kind, Some(data));
        }
        Ok(receipts)
    }

    /// Appends entries of one kind about one cell (one group commit) and waits until all are
    /// on disk.
    pub(crate) async fn record_many(
        &self,
        cell: &str,
        kind: &str,
        entries: Vec<Value>,
    ) -> Result<(), HarnessError> {
        let mut waiting = Vec::with_capacity(entries.len());
        for data in entries {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let event = Some(data.clone());
            self.journal.submit(Some(cell), kind, data, move |result| {
                let _ = tx.send(result);
            });
            waiting.push((rx, event));
        }
        for (rx, event) in waiting {
            let receipt = journaled(rx.await)?;
            self.announce(&receipt, Some(cell), kind, event);
        }
        Ok(())
    }

    /// Appends to the journal and waits until the entry is in the file (a crash of the warden
    /// cannot lose it); the returned `Durable` resolves once it is on disk. For an effect that
    /// may start while the disk catches up, but must not be acknowledged before.
    pub(crate) async fn record_ahead(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Durable, HarnessError> {
        self.record_written(cell, kind, data, warden_journal::Urgency::Waited)
            .await
    }

    /// `record_ahead` for entries about one cell: all in the journal's file when this returns,
    /// and on disk in one round of the group commit when the returned `DurableAll` resolves.
    /// `Urgency::Soon`: they start no round of their own, but go with the next entry that is
    /// waited for (one the caller submits next, so that one round takes both).
    pub(crate) fn record_all_ahead(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        urgency: warden_journal::Urgency,
    ) -> Result<DurableAll, HarnessError> {
        let events: Vec<(String, Value)> = entries
            .into_iter()
            .map(|(kind, data)| (kind.to_owned(), data))
            .collect();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.journal
            .submit_batch_ahead(Some(cell), events.clone(), urgency, move |result| {
                let _ = tx.send(result);
            })
            .map_err(|err| HarnessError::from(CellFailure::Journal(err.to_string())))?;
        Ok(DurableAll {
            cell: cell.to_owned(),
            led: urgency == warden_journal::Urgency::Led,
            synced: rx,
            events,
        })
    }

    /// `record_ahead`, or, `Urgency::Soon`, for an entry no effect waits on: it then takes no
    /// fdatasync of its own, but rides with the next entry that is waited for (or goes to the
    /// disk within a few milliseconds). `Urgency::Led`, for an effect the caller starts at
    /// once: the fdatasync waits for `Durable::lead`, called once the effect's start is under
    /// way, which runs it on the caller's thread where no round is under way (the two overlap
    /// without a wake-up of the journal's syncer thread and back); `Durable::wait` leads where
    /// nothing did.
    pub(crate) async fn record_written(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
        urgency: warden_journal::Urgency,
    ) -> Result<Durable, HarnessError> {
        self.submit_written(cell, kind, data, urgency)
            .written()
            .await
    }

    /// `record_written`'s entry, given its place in the journal here and now (entries are
    /// written in the order they are submitted), for a caller that decides it under a lock;
    /// `Submitted::written` waits until it is in the journal's file.
    pub(crate) fn submit_written(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
        urgency: warden_journal::Urgency,
    ) -> Submitted {
        let (written_tx, written_rx) = tokio::sync::oneshot::channel();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let event = Some(data.clone());
        let written = move |result| {
            let _ = written_tx.send(result);
        };
        let synced = move |result| {
            let _ = tx.send(result);
        };
        self.journal
            .submit_ahead(cell, kind, data, urgency, written, synced);
        Submitted {
            written: written_rx,
            synced: rx,
            led: urgency == warden_journal::Urgency::Led,
            event: event.map(|data| (cell.map(str::to_owned), kind.to_owned(), data)),
        }
    }

    /// Sends a journaled entry to the events stream.
    pub(crate) fn announce(
        &self,
        receipt: &Receipt,
        cell: Option<&str>,
        kind: &str,
        data: Option<Value>,
    ) {
        if !kind.starts_with("pool.") {
            self.pools_wait_for_quiet_since_now();
        }
        if let Some(data) = data
            && self.events.receiver_count() > 0
        {
            let _ = self.events.send(Arc::new(json!({
                "seq": receipt.seq,
                "cell": cell,
                "kind": kind,
                "data": data,
            })));
        }
    }
}

/// An entry submitted to the journal (`Harness::submit_written`), not yet known to be in its
/// file.
pub(crate) struct Submitted {
    written: tokio::sync::oneshot::Receiver<Result<Receipt, warden_journal::JournalError>>,
    synced: tokio::sync::oneshot::Receiver<Result<Receipt, warden_journal::JournalError>>,
    led: bool,
    event: Option<(Option<String>, String, Value)>,
}

impl Submitted {
    /// Once the entry is in the journal's file: its `Durable`.
    pub(crate) async fn written(self) -> Result<Durable, HarnessError> {
        let receipt = journaled(self.written.await)?;
        Ok(Durable {
            receipt,
            led: self.led,
            synced: self.synced,
            event: self.event,
        })
    }
}

/// Entries in the journal's file that are still on their way to the disk.
pub(crate) struct DurableAll {
    cell: String,
    /// Submitted `Urgency::Led`: its round waits for a lead (`Journal::lead`).
    led: bool,
    synced: tokio::sync::oneshot::Receiver<Result<Vec<Receipt>, warden_journal::JournalError>>,
    events: Vec<(String, Value)>,
}

impl DurableAll {
    /// Takes led entries to the disk: in this thread, blocking it for the fdatasync, where no
    /// round is under way, else in the syncer's next round.
    pub(crate) fn lead(&mut self, harness: &Harness) {
        if std::mem::take(&mut self.led) {
            harness.journal.lead();
        }
    }

    /// Waits until the entries are on disk (leading their round where nothing did).
    pub(crate) async fn wait(mut self, harness: &Harness) -> Result<Vec<Receipt>, HarnessError> {
        self.lead(harness);
        let receipts = self.synced.await.unwrap_or_else(|_| Err(writer_gone()));
        harness.announce_all(&self.cell, receipts, self.events)
    }
}

/// An entry in the journal's file that is still on its way to the disk.
pub(crate) struct Durable {
    pub(crate) receipt: Receipt,
    /// Submitted `Urgency::Led`: its round waits for `lead`.
    led: bool,
    synced: tokio::sync::oneshot::Receiver<Result<Receipt, warden_journal::JournalError>>,
    event: Option<(Option<String>, String, Value)>,
}

impl Durable {
    /// Takes a led entry to the disk: in this thread, blocking it for the fdatasync, where no
    /// round is under way, else in the syncer's next round.
    pub(crate) fn lead(&mut self, harness: &Harness) {
        if std::mem::take(&mut self.led) {
            harness.journal.lead();
        }
    }

    /// Waits until the entry is on disk.
    pub(crate) async fn wait(mut self, harness: &Harness) -> Result<Receipt, HarnessError> {
        self.lead(harness);
        let receipt = journaled(self.synced.await)?;
        if let Some((cell, kind, data)) = self.event {
            harness.announce(&receipt, cell.as_deref(), &kind, Some(data));
        }
        Ok(receipt)
    }
}

pub(crate) fn journaled(
    answer: Result<
        Result<Receipt, warden_journal::JournalError>,
        tokio::sync::oneshot::error::RecvError,
    >,
) -> Result<Receipt, HarnessError> {
    answer
        .unwrap_or_else(|_| Err(writer_gone()))
        .map_err(|err| HarnessError::from(CellFailure::Journal(err.to_string())))
}

pub(crate) fn writer_gone() -> warden_journal::JournalError {
    warden_journal::JournalError::Stopped("its writer is gone".to_owned())
}
