//! The journal's writer. Entries are sealed into the chain by the thread that appends them;
//! one syncer thread writes what was sealed and makes it durable with fdatasync, many entries
//! at a time (group commit), before their acknowledgements. An entry appended while nothing
//! else waits is written and synced by its own thread instead (no hand-off to the syncer and
//! back); one round runs at a time, whoever runs it. An entry submitted ahead is also written
//! by its own thread, so it is in the file when the call returns.
//!
//! Several processes may append to one journal (a daemon, and `warden run` without one): an
//! appender holds an exclusive lock on `journal.lock` from the moment it seals an entry until
//! the entry is written, and on taking the lock it reads what others wrote meanwhile (the
//! tail, or the new active segment after another's rotation) to chain on from there. A process
//! that dies holding the lock loses it with its descriptors; a line it tore is cut by the next.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek as _, SeekFrom, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustix::fs::{FlockOperation, flock};
use serde_json::{Value, json};

use crate::entry::CHECKPOINT;
use crate::entry::{Entry, GENESIS, redact};
use crate::error::JournalError;
use crate::keys::SigningKeys;
use crate::ring::{RING_FILE, Ring};
use crate::segments::{JOURNAL_FILE, segment_name, segments, shape, shape_at};

/// A checkpoint after this many entries ...
const CHECKPOINT_EVERY: u64 = 1024;
/// ... or when entries have waited this long for one.
const CHECKPOINT_AFTER: Duration = Duration::from_secs(5);
/// How long the syncer stays awake for an appender's round to end, when entries wait behind it.
const SPIN_FOR: Duration = Duration::from_millis(2);
/// The longest an entry submitted `soon` waits for an entry that is waited for to take it to
/// the disk, before the syncer takes it there alone.
const SOON_WITHIN: Duration = Duration::from_millis(10);
/// The lock that appending processes take in turn, in the journal directory.
pub const LOCK_FILE: &str = "journal.lock";
/// How the journal keeps its segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segments {
    /// The active segment is closed for a new one once it is this large.
    pub bytes: u64,
    /// Closed segments kept (at least one, so that the chain left starts in a segment named
    /// after its first entry); the oldest beyond this are removed. `None`: all are kept.
    pub keep: Option<usize>,
    /// The size of the ring (`journal.ring`, see the `ring` module) that entries are made
    /// durable in: so much of the active segment may be on disk only there. 0: no ring, every
    /// round syncs the segment. A ring that exists keeps the size it was made with.
    pub ring: u64,
}

impl Default for Segments {
    fn default() -> Self {
        Self {
            bytes: 64 * 1024 * 1024,
            keep: None,
            ring: 1024 * 1024,
        }
    }
}

/// How soon an entry submitted ahead must reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Urgency {
    /// Something waits on it: synced at once (with whatever else waits).
    Waited,
    /// Nothing waits on it: no fdatasync of its own (see `Journal::submit_ahead`).
    Soon,
    /// Something waits on it, and the caller leads its round itself (`Journal::lead`) once the
    /// work that may overlap the fdatasync is under way: the syncer is not woken for it.
    Led,
}

/// Proof that an entry is on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub seq: u64,
    pub hash: String,
}

type Ack = Box<dyn FnOnce(Result<Receipt, JournalError>) + Send>;

struct Pending {
    cell: Option<String>,
    kind: String,
    data: Value,
    /// Called once the entry is in the file, before the fdatasync that makes it durable.
    written: Option<Ack>,
    ack: Ack,
    /// How soon it must reach the disk (`Waited` for an entry submitted not ahead).
    urgency: Urgency,
}

/// An open journal. Appends from any thread; dropping it writes a last checkpoint.
pub struct Journal {
    /// The writer: made at the open, or, for a journal opened deferred, at its first use (how
    /// that went, for every later use).
    opened: OnceLock<Result<Opened, JournalError>>,
    segments: Segments,
    /// The syncer thread, once started (at the open, or, for a journal opened deferred, by
    /// the first entry that needs it).
    syncer: Mutex<Option<JoinHandle<()>>>,
    redactions: Arc<RwLock<Vec<String>>>,
    dir: PathBuf,
}

/// What opening the journal's files made.
struct Opened {
    shared: Arc<Shared>,
    public_key: String,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("dir", &self.dir).finish()
    }
}

impl Journal {
    /// Opens (or starts) the journal in `dir`. A torn last line, left by a crash in the middle
    /// of a write that was never acknowledged, is cut off and the cut is recorded.
    pub fn open(dir: &Path) -> Result<Self, JournalError> {
        Self::open_with(dir, Segments::default())
    }

    /// Opens the journal, closing the active segment for a new one whenever it has grown past
    /// `segments.bytes`, and keeping `segments.keep` closed ones.
    pub fn open_with(dir: &Path, segments: Segments) -> Result<Self, JournalError> {
        let journal = Self::open_deferred(dir, segments)?;
        journal.shared()?;
        journal.start_syncer()?;
        Ok(journal)
    }

    /// Like `open_with`, but the journal's files are opened (its key read, its tail checked)
    /// at its first use, and the syncer thread starts only when an entry needs it (one that
    /// finds a round under way, or is submitted to be synced later); until then every entry is
    /// written and synced by the thread that appends it, and the process has no thread of the
    /// journal's. For a process that must stay single-threaded for a while and whose first
    /// entry can wait beside other work (`warden run` without a daemon clones its cell from
    /// itself, and journals its start while the cell is made: the open goes with that). A
    /// journal whose files cannot be opened fails each entry with the reason. Checkpoints then
    /// wait for the close, or for the syncer.
    pub fn open_deferred(dir: &Path, segments: Segments) -> Result<Self, JournalError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(JournalError::io("creating the journal directory", dir))?;
        Ok(Self {
            opened: OnceLock::new(),
            segments,
            syncer: Mutex::new(None),
            redactions: Arc::new(RwLock::new(Vec::new())),
            dir: dir.to_path_buf(),
        })
    }

    /// The writer (see `opened`).
    fn shared(&self) -> Result<&Arc<Shared>, JournalError> {
        self.opened().map(|opened| &opened.shared)
    }

    /// What opening the journal's files made, opening them at the first call.
    fn opened(&self) -> Result<&Opened, JournalError> {
        self.opened
            .get_or_init(|| self.open_files())
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Opens the journal's files: its key, its append lock, its active segment, whose tail is
    /// checked (a torn last line, never acknowledged, is cut off and the cut journaled).
    fn open_files(&self) -> Result<Opened, JournalError> {
        let (dir, segments) = (self.dir.as_path(), self.segments);
        let keys = SigningKeys::load_or_create(dir)?;
        let mut lock = AppendLock::open(dir)?;
        lock.hold()?;
        let path = dir.join(JOURNAL_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&path)
            .map_err(JournalError::io("opening the journal", &path))?;
        let tail = read_tail(&mut file, &path)?;
        // An empty active segment continues the chain where the last closed one ends.
        let mut last = match tail.last {
            Some(entry) => Some(entry),
            None => last_closed_entry(dir)?,
        };
        // Entries that a crash took from the segment's end come back from the ring.
        let mut restored = 0;
        let ring = match segments.ring {
            0 => None,
            bytes => {
                let ring_path = dir.join(RING_FILE);
                let (ring, header, made) = Ring::open(dir, bytes)
                    .map_err(JournalError::io("opening the journal's ring", &ring_path))?;
                if !made {
                    let (count, newest) =
                        restore_from_ring(&ring, &mut file, &path, last.as_ref())?;
                    if count > 0 {
                        restored = count;
                        last = newest;
                    }
                }
                Some((Arc::new(ring), header, made))
            }
        };
        let (next_seq, prev) = match &last {
            Some(entry) => (entry.seq + 1, entry.hash.clone()),
            None => (1, GENESIS.to_owned()),
        };
        let (inode, size) = shape(&file).map_err(JournalError::io("opening the journal", &path))?;
        let segment_first = match size {
            0 => next_seq,
            _ => first_seq(&path)?.unwrap_or(next_seq),
        };
        // How much of the segment is known to be on disk: all of it after a restore (synced
        // with it), or for a ring made now (its writes would otherwise stand for bytes that
        // it never held), else what the ring's header says of this segment.
        let durable = match &ring {
            None => size,
            Some((ring, _, made)) if *made => {
                file.sync_data()
                    .map_err(JournalError::io("opening the journal", &path))?;
                let _ = ring.note_durable(segment_first, size);
                size
            }
            Some(_) if restored > 0 => size,
            Some((_, header, _)) if header.segment == segment_first => header.durable.min(size),
            Some(_) => 0,
        };
        lock.release();
        let public_key = keys.public_hex();
        let state = WriterState {
            lock,
            inode,
            file: Arc::new(file),
            path: path.clone(),
            dir: dir.to_path_buf(),
            size,
            segment_first,
            rotate_bytes: segments.bytes.max(1),
            keep_segments: segments.keep,
            keys,
            written: Receipt {
                seq: next_seq - 1,
                hash: prev.clone(),
            },
            next_seq,
            prev,
            since_checkpoint: 0,
            oldest_unsigned: None,
            redactions: Arc::clone(&self.redactions),
            stopped: None,
            closing: false,
            unsynced: Vec::new(),
            urgent: 0,
            soon_since: None,
            unwritten: Vec::new(),
            syncing: false,
            ring: ring.map(|(ring, ..)| ring),
            durable,
            sync_segment: false,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            work: Condvar::new(),
        });
        if tail.cut_bytes > 0 || restored > 0 {
            // Before any entry of this process's, in a round of its own.
            let mut state = shared
                .state
                .lock()
                .map_err(|_| JournalError::Stopped("the writer failed".to_owned()))?;
            let reason = match (tail.cut_bytes > 0, restored > 0) {
                (true, true) => {
                    "a torn last line was cut, and the entries from it on came back from the ring"
                }
                (false, true) => {
                    "entries that a crash took from the segment came back from the ring"
                }
                _ => "a torn last line, never acknowledged, was removed",
            };
            let receipt = state.append(
                None,
                "journal.recovered".to_owned(),
                json!({ "cut_bytes": tail.cut_bytes, "restored": restored, "reason": reason }),
                false,
            )?;
            let (tx, rx) = mpsc::sync_channel(1);
            let ack: Ack = Box::new(move |result| {
                let _ = tx.send(result);
            });
            state.wait_for_disk(receipt, ack, false);
            shared.sync_round(state);
            rx.recv()
                .unwrap_or_else(|_| Err(JournalError::Stopped("the writer is gone".to_owned())))?;
        }
        Ok(Opened { shared, public_key })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts the syncer thread unless it runs.
    fn start_syncer(&self) -> Result<(), JournalError> {
        let mut syncer = self
            .syncer
            .lock()
            .map_err(|_| JournalError::Stopped("the writer failed".to_owned()))?;
        if syncer.is_none() {
            let shared = Arc::clone(self.shared()?);
            *syncer = Some(
                std::thread::Builder::new()
                    .name("journal".to_owned())
                    .spawn(move || shared.sync_loop())
                    .map_err(JournalError::io("starting the journal writer", &self.dir))?,
            );
        }
        Ok(())
    }

    /// Wakes the syncer, starting it first where it does not run yet.
    fn wake(&self) {
        // A thread that cannot start leaves the entries to the next round or the close.
        let _ = self.start_syncer();
        if let Ok(shared) = self.shared() {
            shared.work.notify_one();
        }
    }

    /// The hex public key that verifies this journal's checkpoints (empty for a journal
    /// opened deferred whose files cannot be opened: its entries fail with the reason).
    pub fn public_key(&self) -> &str {
        self.opened().map_or("", |opened| &opened.public_key)
    }

    /// The newest entry in the journal's file as this writer knows it: the newest it wrote
    /// there (sealed entries that wait for their write are not), or the one another process
    /// had written when this one last caught up with it. None for a journal opened deferred
    /// that is not open yet, or could not be. A check of the file that begins after this was
    /// read must find the chain at this entry or beyond it (`Report::behind`).
    pub fn written_head(&self) -> Option<Receipt> {
        let opened = self.opened.get()?.as_ref().ok()?;
        let state = opened.shared.state.lock().ok()?;
        Some(state.written.clone())
    }

    /// Adds strings that must never be written: each is replaced by `[redacted]`.
    pub fn add_redactions(&self, secrets: impl IntoIterator<Item = String>) {
        if let Ok(mut list) = self.redactions.write() {
            for secret in secrets {
                if !secret.is_empty() && !list.contains(&secret) {
                    list.push(secret);
                }
            }
        }
    }

    /// Queues an entry; `ack` is called once it is on disk (or could not be written).
    pub fn submit(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
        ack: impl FnOnce(Result<Receipt, JournalError>) + Send + 'static,
    ) {
        self.queue(Pending {
            cell: cell.map(str::to_owned),
            kind: kind.to_owned(),
            data,
            written: None,
            ack: Box::new(ack),
            urgency: Urgency::Waited,
        });
    }

    /// Like `submit`, and `written` is called first, before this returns, once the entry is in
    /// the file (where a crash of this process cannot take it) but not yet through the
    /// fdatasync that makes it survive a power cut: work that must follow the entry can overlap
    /// that wait, while what acknowledges it waits for `ack`. With `Urgency::Soon` (an entry
    /// that nothing waits on: a record of what the warden saw, not of an effect to come) it
    /// takes no fdatasync of its own: it goes to the disk with the next entry that is waited
    /// for, or at the latest `SOON_WITHIN` later, and `ack` is called then.
    pub fn submit_ahead(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
        urgency: Urgency,
        written: impl FnOnce(Result<Receipt, JournalError>) + Send + 'static,
        ack: impl FnOnce(Result<Receipt, JournalError>) + Send + 'static,
    ) {
        self.queue(Pending {
            cell: cell.map(str::to_owned),
            kind: kind.to_owned(),
            data,
            written: Some(Box::new(written)),
            ack: Box::new(ack),
            urgency,
        });
    }

    /// Takes entries submitted `Urgency::Led` to the disk: when no round of the group commit
    /// is under way, the calling thread runs one itself (and their acknowledgements are called
    /// before this returns); else the syncer takes them in its next round. Nothing is done
    /// when no entry that is waited for is left (a round took them already).
    pub fn lead(&self) {
        let Ok(shared) = self.shared() else {
            return;
        };
        let Ok(state) = shared.state.lock() else {
            return;
        };
        if state.urgent == 0 {
            return;
        }
        if state.syncing {
            drop(state);
            self.wake();
        } else {
            shared.sync_round(state);
        }
    }

    /// Like `submit`, but when no round of the group commit is under way, the calling thread
    /// runs one itself (writing and syncing all that waits, this entry included), and `ack` is
    /// called before this returns: the hand-off to the syncer thread and back, each a wake-up
    /// of a sleeping thread, are saved, for the price of the caller waiting on the fdatasync.
    /// While a round is under way the entry waits for the syncer's next one, as with `submit`.
    pub fn submit_leading(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
        ack: impl FnOnce(Result<Receipt, JournalError>) + Send + 'static,
    ) {
        let ack: Ack = Box::new(ack);
        let shared = match self.shared() {
            Ok(shared) => shared,
            Err(err) => return ack(Err(err)),
        };
        let mut state = match shared.state.lock() {
            Ok(state) => state,
            Err(_) => return ack(Err(JournalError::Stopped("the writer failed".to_owned()))),
        };
        // Alone: nothing else waits and no round is under way. Otherwise the syncer is (or is
        // about to be) at work, and a round of its own would only come between.
        let alone = !state.syncing && state.urgent == 0;
        match state.append(cell.map(str::to_owned), kind.to_owned(), data, false) {
            Ok(receipt) => state.wait_for_disk(receipt, ack, false),
            Err(err) => {
                drop(state);
                return ack(Err(err));
            }
        }
        if alone {
            shared.sync_round(state);
        } else {
            drop(state);
            self.wake();
        }
    }

    /// Entries about one cell, sealed in order into one round of the group commit (and, with
    /// `sign`, a signed checkpoint after them, so that a close soon after needs no write of its
    /// own); `ack` gets their receipts once all are on disk. Like `submit_leading`, the caller
    /// runs the round itself when none is under way.
    pub fn submit_batch(
        &self,
        cell: Option<&str>,
        entries: Vec<(String, Value)>,
        sign: bool,
        ack: impl FnOnce(Result<Vec<Receipt>, JournalError>) + Send + 'static,
    ) {
        let shared = match self.shared() {
            Ok(shared) => shared,
            Err(err) => return ack(Err(err)),
        };
        let mut state = match shared.state.lock() {
            Ok(state) => state,
            Err(_) => return ack(Err(JournalError::Stopped("the writer failed".to_owned()))),
        };
        let alone = !state.syncing && state.urgent == 0;
        let receipts = match state.append_all(cell, entries, false) {
            Ok(receipts) => receipts,
            Err(err) => {
                // Those sealed already go on with the next round, unacknowledged here.
                drop(state);
                self.wake();
                return ack(Err(err));
            }
        };
        if sign && state.since_checkpoint > 0 {
            state.push_checkpoint();
        }
        let Some(last) = receipts.last().cloned() else {
            drop(state);
            return ack(Ok(Vec::new()));
        };
        state.wait_for_disk(
            last,
            Box::new(move |result: Result<Receipt, JournalError>| {
                ack(result.map(|_| receipts));
            }),
            false,
        );
        if alone {
            shared.sync_round(state);
        } else {
            drop(state);
            self.wake();
        }
    }

    /// Entries about one cell, sealed in order and written to the file in one write before
    /// this returns (a crash of the warden cannot lose them), and synced by the syncer: `ack`
    /// gets their receipts once all are on disk. For effects that may start while the disk
    /// catches up, like `submit_ahead`, but one round of the group commit for all (entries
    /// submitted one by one can straddle a round that began between them, and wait for two).
    /// With `Urgency::Soon` the batch starts no round of its own: it goes to the disk with the
    /// next entry that is waited for (an effect's, submitted right after it), or within
    /// `SOON_WITHIN`. An error: none was written (those sealed before it go with the next
    /// round, unacknowledged).
    pub fn submit_batch_ahead(
        &self,
        cell: Option<&str>,
        entries: Vec<(String, Value)>,
        urgency: Urgency,
        ack: impl FnOnce(Result<Vec<Receipt>, JournalError>) + Send + 'static,
    ) -> Result<Vec<Receipt>, JournalError> {
        let mut state = self
            .shared()?
            .state
            .lock()
            .map_err(|_| JournalError::Stopped("the writer failed".to_owned()))?;
        let receipts = match state.append_all(cell, entries, true) {
            Ok(receipts) => receipts,
            Err(err) => {
                drop(state);
                self.wake();
                return Err(err);
            }
        };
        let Some(last) = receipts.last().cloned() else {
            drop(state);
            ack(Ok(Vec::new()));
            return Ok(Vec::new());
        };
        let all = receipts.clone();
        state.wait_for_disk(
            last,
            Box::new(move |result: Result<Receipt, JournalError>| {
                ack(result.map(|_| all));
            }),
            urgency == Urgency::Soon,
        );
        drop(state);
        // One submitted `Led` wakes nobody: its caller leads its round (`lead`).
        if urgency != Urgency::Led {
            self.wake();
        }
        Ok(receipts)
    }

    /// Seals the entry here, in the caller's thread (and writes it, when it is submitted
    /// ahead), and leaves its acknowledgement to the syncer.
    fn queue(&self, pending: Pending) {
        let Pending {
            cell,
            kind,
            data,
            written,
            ack,
            urgency,
        } = pending;
        let soon = urgency == Urgency::Soon;
        let shared = match self.shared() {
            Ok(shared) => shared,
            Err(err) => {
                if let Some(written) = written {
                    written(Err(err.clone()));
                }
                return ack(Err(err));
            }
        };
        let appended = match shared.state.lock() {
            Ok(mut state) => match state.append(cell, kind, data, written.is_some()) {
                Ok(receipt) => {
                    // The syncer is woken for an entry that is waited for, and for the first
                    // of those that are not (so that it knows how long it may sleep); one
                    // submitted `Led` wakes nobody: its caller leads its round.
                    let first_soon = soon && state.unsynced.is_empty();
                    state.wait_for_disk(receipt.clone(), ack, soon);
                    Ok((receipt, urgency == Urgency::Waited || first_soon))
                }
                Err(err) => Err((err, ack)),
            },
            Err(_) => Err((JournalError::Stopped("the writer failed".to_owned()), ack)),
        };
        match appended {
            Ok((receipt, wake)) => {
                if wake {
                    self.wake();
                }
                if let Some(written) = written {
                    written(Ok(receipt));
                }
            }
            Err((err, ack)) => {
                if let Some(written) = written {
                    written(Err(err.clone()));
                }
                ack(Err(err));
            }
        }
    }

    /// Appends an entry and returns once it is on disk.
    pub fn append(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Receipt, JournalError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit_leading(cell, kind, data, move |result| {
            let _ = tx.send(result);
        });
        rx.recv()
            .unwrap_or_else(|_| Err(JournalError::Stopped("the writer is gone".to_owned())))
    }

    /// Writes a last checkpoint and waits for the writer.
    pub fn close(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        // A journal opened deferred and never used has nothing to close.
        let Some(Ok(opened)) = self.opened.get() else {
            return;
        };
        let shared = Arc::clone(&opened.shared);
        let syncer = self.syncer.lock().ok().and_then(|mut s| s.take());
        let Some(syncer) = syncer else {
            // No syncer ever ran: every round was an appender's, and none is under way. The
            // last checkpoint is this thread's.
            if let Ok(mut state) = shared.state.lock()
                && !state.closing
            {
                state.closing = true;
                state.checkpoint_and_sync();
            }
            return;
        };
        if let Ok(mut state) = shared.state.lock() {
            state.closing = true;
        }
        shared.work.notify_one();
        let _ = syncer.join();
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// The last entry of the newest closed segment (closed segments end whole and synced).
fn last_closed_entry(dir: &Path) -> Result<Option<Entry>, JournalError> {
    let all = segments(dir).map_err(JournalError::io("listing the journal", dir))?;
    let Some(newest) = all.iter().rev().find(|p| !p.ends_with(JOURNAL_FILE)) else {
        return Ok(None);
    };
    let mut file = File::open(newest).map_err(JournalError::io("reading the journal", newest))?;
    Ok(read_tail(&mut file, newest)?.last)
}

/// The sequence number of the first entry in a segment.
fn first_seq(path: &Path) -> Result<Option<u64>, JournalError> {
    use std::io::BufRead as _;
    let file = File::open(path).map_err(JournalError::io("reading the journal", path))?;
    let mut line = Vec::new();
    io::BufReader::new(file)
        .read_until(b'\n', &mut line)
        .map_err(JournalError::io("reading the journal", path))?;
    Ok(check_line(line.strip_suffix(b"\n").unwrap_or(&line))
        .ok()
        .map(|e| e.seq))
}

/// Appends to the active segment `file` the entries that the ring holds past the segment's end
/// and that continue the chain from `last` (entries a crash took from the segment after the
/// ring had them), and syncs it: how many, and the newest. A copy of older bytes, or a torn
/// one, does not continue the chain, and ends what is taken.
fn restore_from_ring(
    ring: &Ring,
    file: &mut File,
    path: &Path,
    last: Option<&Entry>,
) -> Result<(u64, Option<Entry>), JournalError> {
    let io = |what| JournalError::io(what, path);
    let (_, end) = shape(file).map_err(io("reading the journal"))?;
    let (seq, hash) = last.map_or((0, GENESIS), |e| (e.seq, e.hash.as_str()));
    let found = ring_continuation(ring, end, seq, hash).map_err(JournalError::io(
        "reading the journal's ring",
        &path.with_file_name(crate::ring::RING_FILE),
    ))?;
    if found.count > 0 {
        file.write_all(&found.bytes)
            .and_then(|()| file.sync_data())
            .map_err(io("restoring the journal from its ring"))?;
    }
    Ok((found.count, found.newest))
}

/// Entries the ring holds past a segment's end that continue the chain there.
pub(crate) struct Continuation {
    /// Their lines, each with its newline, as the ring has them.
    pub bytes: Vec<u8>,
    pub count: u64,
    pub newest: Option<Entry>,
}

/// The entries that the ring holds from offset `end` of the active segment on and that
/// continue the chain from entry `seq` whose hash is `hash` (the entry that ends the segment
/// there; 0 and `GENESIS`: the chain's start). A copy of older bytes, or a torn one, does not
/// continue the chain, and ends what is taken. Shared by the open's restore after a crash, the
/// appender's after a cut from outside, and `verify`, which says what the segment lacks.
pub(crate) fn ring_continuation(
    ring: &Ring,
    end: u64,
    seq: u64,
    hash: &str,
) -> io::Result<Continuation> {
    let (mut seq, mut prev) = (seq + 1, hash.to_owned());
    let (mut found, mut newest, mut count) = (Vec::new(), None, 0u64);
    let (mut read, mut pending) = (0u64, Vec::new());
    // A first read the size of an entry or two: where nothing was lost, the bytes there are
    // an older copy, and the first line tells.
    let mut chunk = 8 * 1024;
    'reading: while read < ring.bytes() {
        let bytes = ring.read(end + read, chunk.min(ring.bytes() - read))?;
        read += bytes.len() as u64;
        pending.extend_from_slice(&bytes);
        let mut start = 0;
        loop {
            // Told apart from its first bytes, before its end is read: what does not begin as
            // the next entry's line does (zeros of a ring never written there, say, which hold
            // no line end at all).
            let head = format!("{{\"seq\":{seq},");
            let rest = &pending[start..];
            if !head
                .as_bytes()
                .starts_with(&rest[..rest.len().min(head.len())])
            {
                break 'reading;
            }
            let Some(newline) = rest.iter().position(|b| *b == b'\n') else {
                break;
            };
            let line = &pending[start..start + newline];
            match check_line(line) {
                Ok(entry) if entry.prev == prev => {
                    found.extend_from_slice(line);
                    found.push(b'\n');
                    seq += 1;
                    prev = entry.hash.clone();
                    newest = Some(entry);
                    count += 1;
                }
                _ => break 'reading,
            }
            start += newline + 1;
        }
        pending.drain(..start);
        chunk = 64 * 1024;
    }
    Ok(Continuation {
        bytes: found,
        count,
        newest,
    })
}

struct Tail {
    last: Option<Entry>,
    cut_bytes: u64,
}

/// Finds the last complete line, cutting off a torn one, and checks that it verifies.
fn read_tail(file: &mut File, path: &Path) -> Result<Tail, JournalError> {
    let io = |what| JournalError::io(what, path);
    let len = file
        .seek(SeekFrom::End(0))
        .map_err(io("reading the journal"))?;
    if len == 0 {
        return Ok(Tail {
            last: None,
            cut_bytes: 0,
        });
    }
    // The last complete line (`last_line_within`: read backwards in blocks, most entries in the
    // first one); what follows it is a torn write.
    let last = last_line_within(file, len).map_err(io("reading the journal"))?;
    let Some((line, end)) = last else {
        // Not one complete line: the whole file is a torn first write.
        file.set_len(0).map_err(io("cutting a torn last line"))?;
        file.sync_all().map_err(io("cutting a torn last line"))?;
        return Ok(Tail {
            last: None,
            cut_bytes: len,
        });
    };
    let entry = check_line(&line).map_err(|reason| JournalError::Corrupt {
        path: path.to_path_buf(),
        reason,
    })?;
    let cut = len - end;
    if cut > 0 {
        file.set_len(end).map_err(io("cutting a torn last line"))?;
        file.sync_all().map_err(io("cutting a torn last line"))?;
    }
    Ok(Tail {
        last: Some(entry),
        cut_bytes: cut,
    })
}

/// The last complete line within the first `end` bytes of `file` (without its newline), and
/// where it ends (past its newline); none where those bytes hold no newline. Read backwards in
/// blocks until the last two newlines (or the start) are in view: most entries fit the first
/// block (a larger first read costs every open its copy and its fresh heap pages), and each
/// further read takes four times as much. The file is not changed.
fn last_line_within(file: &File, end: u64) -> io::Result<Option<(Vec<u8>, u64)>> {
    use std::os::unix::fs::FileExt as _;
    let mut block = 8 * 1024u64;
    loop {
        let start = end.saturating_sub(block);
        let mut buf = vec![0u8; (end - start) as usize];
        file.read_exact_at(&mut buf, start)?;
        let Some(newline) = buf.iter().rposition(|b| *b == b'\n') else {
            if start == 0 {
                return Ok(None);
            }
            block *= 4;
            continue;
        };
        let line_end = start + newline as u64 + 1;
        match buf[..newline].iter().rposition(|b| *b == b'\n') {
            Some(before) => return Ok(Some((buf[before + 1..newline].to_vec(), line_end))),
            None if start == 0 => return Ok(Some((buf[..newline].to_vec(), line_end))),
            None => block *= 4,
        }
    }
}

/// Parses one line and checks that it is canonical and that its hash is right.
pub(crate) fn check_line(line: &[u8]) -> Result<Entry, String> {
    let entry: Entry =
        serde_json::from_slice(line).map_err(|e| format!("not a journal entry: {e}"))?;
    if entry.hash != entry.compute_hash() {
        return Err("its hash does not match its content".to_owned());
    }
    if entry.to_line() != line {
        return Err("it is not in canonical form (bytes were changed)".to_owned());
    }
    Ok(entry)
}

/// What appenders and the syncer share.
struct Shared {
    state: Mutex<WriterState>,
    /// Wakes the syncer: entries wait for the disk, or the journal closes.
    work: Condvar,
}

struct WriterState {
    /// Held from the sealing of an entry until it is written (see the module's text).
    lock: AppendLock,
    /// The active segment's inode as this process opened it: another number at the path
    /// means another process closed it.
    inode: u64,
    /// The active segment (shared with the syncer, which syncs it outside the lock).
    file: Arc<File>,
    path: PathBuf,
    dir: PathBuf,
    /// The active segment's size, its first entry, and the size that closes it.
    size: u64,
    segment_first: u64,
    rotate_bytes: u64,
    keep_segments: Option<usize>,
    keys: SigningKeys,
    next_seq: u64,
    prev: String,
    /// The newest entry in the file as far as this process knows: the newest it wrote, or
    /// that another process had written when this one caught up.
    written: Receipt,
    since_checkpoint: u64,
    oldest_unsigned: Option<Instant>,
    redactions: Arc<RwLock<Vec<String>>>,
    stopped: Option<String>,
    closing: bool,
    /// Sealed entries that wait for the next fdatasync, with their acknowledgements.
    unsynced: Vec<(Receipt, Ack)>,
    /// How many of them are waited for (the others were submitted `soon`) ...
    urgent: usize,
    /// ... and since when the oldest of those submitted `soon` waits.
    soon_since: Option<Instant>,
    /// Their lines not yet written, in chain order.
    unwritten: Vec<u8>,
    /// A round of the group commit is between its write and its acknowledgements.
    syncing: bool,
    /// Where rounds make entries durable (see the `ring` module); `None`: in the segment.
    ring: Option<Arc<Ring>>,
    /// How much of the active segment is known to be on disk (the ring may write over the
    /// copies of these bytes).
    durable: u64,
    /// What the next round takes to the disk is not all in the ring: it syncs the segment.
    sync_segment: bool,
}

impl Shared {
    /// The syncer: makes written entries durable, many per fdatasync, then acknowledges them;
    /// signs a checkpoint when entries waited too long for one, and a last one at close.
    fn sync_loop(&self) {
        loop {
            let Ok(mut state) = self.state.lock() else {
                return;
            };
            let mut spinning: Option<Instant> = None;
            loop {
                let soon_left = state
                    .soon_since
                    .map(|since| SOON_WITHIN.saturating_sub(since.elapsed()));
                let due = state.urgent > 0
                    || soon_left.is_some_and(|left| left.is_zero())
                    || (state.closing && !state.unsynced.is_empty());
                if due && !state.syncing {
                    break;
                }
                if state.behind() && !state.closing && state.stopped.is_none() {
                    // Beside the rounds, which go on meanwhile.
                    let (file, size, inode) = (Arc::clone(&state.file), state.size, state.inode);
                    drop(state);
                    let result = file.sync_data();
                    state = match self.state.lock() {
                        Ok(state) => state,
                        Err(_) => return,
                    };
                    match result {
                        Ok(()) => state.segment_on_disk(size, inode),
                        Err(err) => {
                            state.stop(&err);
                        }
                    }
                    continue;
                }
                if state.closing && !state.syncing {
                    // Sign whatever the last checkpoint does not cover.
                    state.checkpoint_and_sync();
                    return;
                }
                let wait = match state.oldest_unsigned {
                    Some(since) => CHECKPOINT_AFTER.saturating_sub(since.elapsed()),
                    None => Duration::from_secs(3600),
                };
                if wait.is_zero() && !state.syncing {
                    state.checkpoint_and_sync();
                    continue;
                }
                let wait = soon_left.map_or(wait, |left| wait.min(left));
                if state.syncing
                    && state.urgent > 0
                    && spinning.get_or_insert_with(Instant::now).elapsed() < SPIN_FOR
                {
                    // Entries wait behind an appender's round, which usually ends within one
                    // fdatasync: the syncer stays awake for it (yielding the core) rather than
                    // pay a wake-up between the two rounds; a slow disk ends the spinning.
                    drop(state);
                    std::thread::yield_now();
                    state = match self.state.lock() {
                        Ok(state) => state,
                        Err(_) => return,
                    };
                    continue;
                }
                state = match self
                    .work
                    .wait_timeout(state, wait.max(Duration::from_micros(100)))
                {
                    Ok((state, _)) => state,
                    Err(_) => return,
                };
            }
            self.sync_round(state);
        }
    }

    /// One round of the group commit, by the syncer or by an appender that found it idle:
    /// writes what waits (under the lock, so that the file keeps the chain's order), makes it
    /// durable with one fdatasync outside the lock, and acknowledges it. Entries sealed
    /// meanwhile wait for the next round, which nobody starts before this one is done.
    fn sync_round(&self, mut state: std::sync::MutexGuard<'_, WriterState>) {
        if let Err(err) = state.write_unwritten() {
            let batch = std::mem::take(&mut state.unsynced);
            state.urgent = 0;
            state.soon_since = None;
            drop(state);
            for (_, ack) in batch {
                ack(Err(err.clone()));
            }
            return;
        }
        state.syncing = true;
        let batch = std::mem::take(&mut state.unsynced);
        state.urgent = 0;
        state.soon_since = None;
        // The ring, which has a copy of all that was written, unless a write could not go
        // there too (or there is none): then the segment itself.
        let ring = match state.sync_segment {
            true => None,
            false => state.ring.clone(),
        };
        let (file, size, inode) = (Arc::clone(&state.file), state.size, state.inode);
        state.sync_segment = false;
        drop(state);
        let result = match &ring {
            Some(ring) => ring.sync(),
            None => file.sync_data(),
        };
        let stopped = result.as_ref().err().map(|err| {
            self.state
                .lock()
                .map_or_else(|_| "the writer failed".to_owned(), |mut s| s.stop(err))
        });
        for (receipt, ack) in batch {
            ack(match &stopped {
                None => Ok(receipt),
                Some(reason) => Err(JournalError::Stopped(reason.clone())),
            });
        }
        // The round ends after its acknowledgements: entries sealed meanwhile are left to the
        // syncer, which is not kept waiting on a wake-up between rounds.
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        state.syncing = false;
        if result.is_ok() && ring.is_none() {
            state.segment_on_disk(size, inode);
        }
        if state.size >= state.rotate_bytes && state.stopped.is_none() {
            state.rotate();
        }
        // A segment far ahead of the disk is synced by the syncer, before an appender has to.
        let more = !state.unsynced.is_empty() || state.closing || state.behind();
        drop(state);
        if more {
            self.work.notify_one();
        }
    }
}

impl WriterState {
    /// The active segment (whose inode is `inode`) is on disk up to `size`.
    fn segment_on_disk(&mut self, size: u64, inode: u64) {
        if inode == self.inode && size > self.durable {
            self.durable = size;
            if let Some(ring) = &self.ring {
                // Advice for the next writer to open the journal; true once it is on disk.
                let _ = ring.note_durable(self.segment_first, size);
            }
        }
    }

    /// Half the ring or more holds bytes of the segment that are not on disk yet.
    fn behind(&self) -> bool {
        self.ring
            .as_ref()
            .is_some_and(|ring| self.size.saturating_sub(self.durable) > ring.bytes() / 2)
    }

    /// What the ring's header says is on disk of the active segment (nothing, where it speaks
    /// of another).
    fn durable_by_ring(&self) -> u64 {
        self.ring
            .as_ref()
            .and_then(|ring| ring.header().ok().flatten())
            .filter(|header| header.segment == self.segment_first)
            .map_or(0, |header| header.durable.min(self.size))
    }

    /// Leaves a sealed entry's acknowledgement for the fdatasync that takes it to the disk.
    fn wait_for_disk(&mut self, receipt: Receipt, ack: Ack, soon: bool) {
        if soon {
            self.soon_since.get_or_insert_with(Instant::now);
        } else {
            self.urgent += 1;
        }
        self.unsynced.push((receipt, ack));
    }

    /// Seals `entries` in order (`append` each); `write_now`: the last one writes them all to
    /// the file before returning. An error stops at that entry (those sealed before it stay).
    fn append_all(
        &mut self,
        cell: Option<&str>,
        entries: Vec<(String, Value)>,
        write_now: bool,
    ) -> Result<Vec<Receipt>, JournalError> {
        let count = entries.len();
        entries
            .into_iter()
            .enumerate()
            .map(|(i, (kind, data))| {
                self.append(
                    cell.map(str::to_owned),
                    kind,
                    data,
                    write_now && i + 1 == count,
                )
            })
            .collect()
    }

    /// Seals one entry (and a checkpoint when one is due); `write_now` writes it (and all
    /// sealed before it) to the file before returning.
    fn append(
        &mut self,
        cell: Option<String>,
        kind: String,
        mut data: Value,
        write_now: bool,
    ) -> Result<Receipt, JournalError> {
        if let Some(reason) = &self.stopped {
            return Err(JournalError::Stopped(reason.clone()));
        }
        if self.closing {
            return Err(JournalError::Stopped("closed".to_owned()));
        }
        if let Ok(secrets) = self.redactions.read() {
            redact(&mut data, &secrets);
        }
        self.hold()?;
        let entry = self.seal(cell, kind, data);
        self.unwritten.extend_from_slice(&entry.to_line());
        self.unwritten.push(b'\n');
        self.since_checkpoint += 1;
        self.oldest_unsigned.get_or_insert_with(Instant::now);
        if self.since_checkpoint >= CHECKPOINT_EVERY {
            self.push_checkpoint();
        }
        if write_now {
            self.write_unwritten()?;
        }
        Ok(Receipt {
            seq: entry.seq,
            hash: entry.hash,
        })
    }

    fn seal(&mut self, cell: Option<String>, kind: String, data: Value) -> Entry {
        let time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let entry = Entry::seal(
            self.next_seq,
            time_ms,
            cell,
            kind,
            data,
            std::mem::take(&mut self.prev),
        );
        self.next_seq += 1;
        self.prev = entry.hash.clone();
        entry
    }

    /// Seals a signed checkpoint of the chain so far.
    fn push_checkpoint(&mut self) {
        let head_seq = self.next_seq - 1;
        let signature = self.keys.sign(head_seq, &self.prev);
        let data = json!({
            "head_seq": head_seq,
            "head": self.prev,
            "key": self.keys.public_hex(),
            "signature": signature,
        });
        let entry = self.seal(None, CHECKPOINT.to_owned(), data);
        self.unwritten.extend_from_slice(&entry.to_line());
        self.unwritten.push(b'\n');
        self.since_checkpoint = 0;
        self.oldest_unsigned = None;
    }

    /// Writes and syncs a checkpoint if entries are not covered by one.
    fn checkpoint_and_sync(&mut self) {
        if self.since_checkpoint == 0 || self.stopped.is_some() {
            self.oldest_unsigned = None;
            return;
        }
        if self.hold().is_err() {
            return;
        }
        self.push_checkpoint();
        if self.write_unwritten().is_ok() {
            let size = self.size;
            match self.file.sync_data() {
                Ok(()) => self.segment_on_disk(size, self.inode),
                Err(err) => {
                    self.stop(&err);
                }
            }
        }
    }

    fn write_unwritten(&mut self) -> Result<(), JournalError> {
        self.write_out(true)
    }

    /// Writes what was sealed; `release`: and lets other processes append after it.
    fn write_out(&mut self, release: bool) -> Result<(), JournalError> {
        if let Some(reason) = &self.stopped {
            self.lock.release();
            return Err(JournalError::Stopped(reason.clone()));
        }
        let (at, len) = (self.size, self.unwritten.len() as u64);
        // The ring takes a copy (of a write no larger than itself), over copies of bytes that
        // are on disk in the segment: those the copy replaces are synced there first.
        let ring = self
            .ring
            .clone()
            .filter(|ring| len > 0 && len <= ring.bytes());
        if let Some(ring) = &ring
            && at + len > self.durable + ring.bytes()
        {
            match self.file.sync_data() {
                Ok(()) => self.segment_on_disk(at, self.inode),
                Err(err) => {
                    self.lock.release();
                    return Err(JournalError::Stopped(self.stop(&err)));
                }
            }
        }
        let written = (&*self.file).write_all(&self.unwritten);
        let copied = match &ring {
            Some(ring) => written.is_ok() && ring.mirror(at, &self.unwritten).is_ok(),
            None => self.ring.is_none() || len == 0,
        };
        if !copied {
            // Not all of it in the ring: the round that takes it to the disk syncs the segment.
            self.sync_segment = true;
        }
        self.size += len;
        if len > 0 {
            self.written.seq = self.next_seq - 1;
            self.written.hash.clone_from(&self.prev);
        }
        self.unwritten.clear();
        if release {
            self.lock.release();
        }
        written.map_err(|err| JournalError::Stopped(self.stop(&err)))
    }

    /// Takes the append lock (when this process does not hold it yet) and catches up with
    /// what other processes appended meanwhile.
    fn hold(&mut self) -> Result<(), JournalError> {
        if self.lock.hold()?
            && let Err(err) = self.catch_up()
        {
            self.lock.release();
            return Err(err);
        }
        Ok(())
    }

    /// Reads where the chain stands now: the active segment's tail, or the new active segment
    /// when another process closed the one this process had open. What others appended is
    /// chained on from; a file that lost entries this process wrote (cut or rewritten from
    /// outside) is not: those entries come back from the ring where it holds them as written,
    /// and otherwise the entry is refused (`JournalError::Cut`), so that no sequence number
    /// is given twice and no checkpoint signs a chain without them.
    fn catch_up(&mut self) -> Result<(), JournalError> {
        let io = |what| JournalError::io(what, &self.path);
        let same = shape_at(&self.path)
            .ok()
            .filter(|&(inode, _)| inode == self.inode);
        let Some((_, len)) = same else {
            let mut file = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .mode(0o600)
                .open(&self.path)
                .map_err(io("opening the journal"))?;
            let tail = read_tail(&mut file, &self.path)?;
            let last = match tail.last {
                Some(entry) => Some(entry),
                None => last_closed_entry(&self.dir)?,
            };
            // Another process closes the segment only once it chained on from this
            // process's entries: a chain that now ends before them was cut from outside.
            if let Some(found) = self.behind_head(last.as_ref()) {
                return Err(self.cut(format!("{found} (a new active segment)")));
            }
            let (inode, size) = shape(&file).map_err(io("opening the journal"))?;
            self.chain_on(last.as_ref());
            self.segment_first = match size {
                0 => self.next_seq,
                _ => first_seq(&self.path)?.unwrap_or(self.next_seq),
            };
            self.size = size;
            self.inode = inode;
            self.file = Arc::new(file);
            self.durable = self.durable_by_ring();
            return Ok(());
        };
        // The file at the path is this one: its length is the one looked at there (a second
        // look through the descriptor asked the same inode again, at every entry).
        if len == self.size {
            return Ok(());
        }
        let mut reader = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(io("reading the journal"))?;
        // Others only append: the file is at least as long as this process left it, and its
        // line that ends there is this process's last entry.
        if let Some(found) = self.lost_own(&reader, len)? {
            return self.restore_own(&reader, len, found);
        }
        let tail = read_tail(&mut reader, &self.path)?;
        let last = match tail.last {
            Some(entry) => Some(entry),
            None => last_closed_entry(&self.dir)?,
        };
        if let Some(found) = self.behind_head(last.as_ref()) {
            return Err(self.cut(found));
        }
        self.size = shape(&reader).map_err(io("reading the journal"))?.1;
        self.chain_on(last.as_ref());
        self.durable = self.durable.max(self.durable_by_ring());
        Ok(())
    }

    /// What is wrong with `last`, the entry the chain now ends at, where it is behind the
    /// newest entry this process sealed (an earlier one, or another with its number).
    fn behind_head(&self, last: Option<&Entry>) -> Option<String> {
        let head = self.next_seq - 1;
        match last {
            None if head > 0 => Some("it holds no entry".to_owned()),
            Some(entry) if entry.seq < head => Some(format!("it ends at entry {}", entry.seq)),
            Some(entry) if entry.seq == head && entry.hash != self.prev => Some(format!(
                "it ends at entry {head}, but not the one this process wrote (another hash)"
            )),
            _ => None,
        }
    }

    /// Whether the active segment (`reader`, `len` bytes long now) lost entries this process
    /// wrote to it: shorter than this process left it, or its line that ends there is not
    /// this process's last entry. What it holds now, in words, if so.
    fn lost_own(&self, reader: &File, len: u64) -> Result<Option<String>, JournalError> {
        if self.size == 0 {
            // Nothing of this process's in this segment (its entries end the closed one).
            return Ok(None);
        }
        let io = JournalError::io("reading the journal", &self.path);
        if len > self.size {
            let ours = last_line_within(reader, self.size).map_err(io)?;
            let head = self.next_seq - 1;
            if let Some((line, end)) = ours
                && end == self.size
                && check_line(&line).is_ok_and(|e| e.seq == head && e.hash == self.prev)
            {
                return Ok(None);
            }
            return Ok(Some(format!(
                "the line that ended at byte {} is no longer entry {head}, and {}",
                self.size,
                self.describe_end(reader, len)?
            )));
        }
        Ok(Some(format!(
            "{} bytes where this process left {}, and {}",
            len,
            self.size,
            self.describe_end(reader, len)?
        )))
    }

    /// Where the active segment's first `len` bytes end, in words.
    fn describe_end(&self, reader: &File, len: u64) -> Result<String, JournalError> {
        let last = last_line_within(reader, len)
            .map_err(JournalError::io("reading the journal", &self.path))?;
        Ok(match last {
            None if len == 0 => "it is empty".to_owned(),
            None => format!("it holds no complete line ({len} bytes)"),
            Some((line, end)) => {
                let entry = match check_line(&line) {
                    Ok(entry) => format!("it ends at entry {}", entry.seq),
                    Err(reason) => format!("its last line is not a sound entry ({reason})"),
                };
                match len - end {
                    0 => entry,
                    partial => format!("{entry}, then {partial} bytes of a partial line"),
                }
            }
        })
    }

    /// Brings back from the ring the entries this process wrote that the active segment lost
    /// (see `lost_own`), where the ring holds all of them, as they were written, from the
    /// end of the segment's last complete line on (a partial line after it is cut, as at an
    /// open after a crash), and journals `journal.recovered`; else refuses (`JournalError::Cut`)
    /// and changes nothing.
    fn restore_own(&mut self, reader: &File, len: u64, found: String) -> Result<(), JournalError> {
        let io = |what| JournalError::io(what, &self.path);
        let Some(ring) = self.ring.clone() else {
            return Err(self.cut(found));
        };
        // The entry the segment's complete lines end with (the one before the segment, where
        // it holds none).
        let (end, seq, hash) = match last_line_within(reader, len)
            .map_err(io("reading the journal"))?
        {
            Some((line, end)) => match check_line(&line) {
                Ok(entry) => (end, entry.seq, entry.hash),
                Err(_) => return Err(self.cut(found)),
            },
            None if self.segment_first <= 1 => (0, 0, GENESIS.to_owned()),
            None => match last_closed_entry(&self.dir)? {
                Some(entry) if entry.seq + 1 == self.segment_first => (0, entry.seq, entry.hash),
                _ => return Err(self.cut(found)),
            },
        };
        let back = ring_continuation(&ring, end, seq, &hash).map_err(JournalError::io(
            "reading the journal's ring",
            &self.path.with_file_name(crate::ring::RING_FILE),
        ))?;
        let whole = back
            .newest
            .as_ref()
            .is_some_and(|e| e.seq + 1 == self.next_seq && e.hash == self.prev)
            && end + back.bytes.len() as u64 == self.size;
        if !whole {
            return Err(self.cut(found));
        }
        // Cut back to the complete lines, the entries appended (the descriptor appends), and
        // the segment synced: the ring's copies of them stay true.
        let restored = (if end < len {
            reader.set_len(end)
        } else {
            Ok(())
        })
        .and_then(|()| (&*self.file).write_all(&back.bytes))
        .and_then(|()| self.file.sync_data());
        if let Err(err) = restored {
            return Err(JournalError::Stopped(self.stop(&err)));
        }
        self.durable = self.size;
        if let Some(ring) = &self.ring {
            let _ = ring.note_durable(self.segment_first, self.size);
        }
        let entry = self.seal(
            None,
            "journal.recovered".to_owned(),
            json!({
                "cut_bytes": len - end,
                "restored": back.count,
                "reason": "entries this process had written were cut from the segment from outside while it was open, and came back from the ring",
                "found": found,
            }),
        );
        self.unwritten.extend_from_slice(&entry.to_line());
        self.unwritten.push(b'\n');
        self.since_checkpoint += 1;
        self.oldest_unsigned.get_or_insert_with(Instant::now);
        // Written now, the lock kept: the entry this hold is for follows it.
        self.write_out(false)
    }

    /// The error for a segment that lost entries this process wrote.
    fn cut(&self, found: String) -> JournalError {
        JournalError::Cut {
            path: self.path.clone(),
            found,
            written: self.next_seq - 1,
        }
    }

    fn chain_on(&mut self, last: Option<&Entry>) {
        let (next_seq, prev) = match last {
            Some(entry) => (entry.seq + 1, entry.hash.clone()),
            None => (1, GENESIS.to_owned()),
        };
        self.next_seq = next_seq;
        self.written.seq = next_seq - 1;
        self.written.hash.clone_from(&prev);
        self.prev = prev;
    }

    /// Closes the active segment (signed and on disk, renamed `journal-<first seq>.jsonl`) and
    /// starts an empty one; the chain runs on across the two.
    fn rotate(&mut self) {
        if self.hold().is_err() {
            return;
        }
        if self.size < self.rotate_bytes {
            // Another process closed it meanwhile.
            self.lock.release();
            return;
        }
        if self.since_checkpoint > 0 {
            self.push_checkpoint();
        }
        // Written, and the lock still this process's until the new segment is there.
        if self.write_out(false).is_err() {
            return;
        }
        let closed = self.dir.join(segment_name(self.segment_first));
        let reopened = self
            .file
            .sync_data()
            .and_then(|()| fs::rename(&self.path, &closed))
            .and_then(|()| {
                OpenOptions::new()
                    .read(true)
                    .append(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&self.path)
            })
            .and_then(|file| {
                File::open(&self.dir)?.sync_all()?;
                Ok(file)
            });
        match reopened {
            Ok(file) => {
                self.inode = shape(&file).map_or(0, |(inode, _)| inode);
                self.file = Arc::new(file);
                self.size = 0;
                self.segment_first = self.next_seq;
                self.durable = 0;
                if let Some(ring) = &self.ring {
                    let _ = ring.note_durable(self.segment_first, 0);
                }
                self.drop_old_segments();
            }
            Err(err) => {
                self.stop(&err);
            }
        }
        if self.unwritten.is_empty() {
            self.lock.release();
        }
    }

    /// Removes the oldest closed segments beyond the number to keep, and journals which. The
    /// chain that is left still verifies, from its first entry on (`verify` says where).
    fn drop_old_segments(&mut self) {
        let Some(keep) = self.keep_segments else {
            return;
        };
        let Ok(all) = segments(&self.dir) else {
            return;
        };
        let closed: Vec<_> = all.iter().filter(|p| !p.ends_with(JOURNAL_FILE)).collect();
        let removed: Vec<String> = closed
            .iter()
            .take(closed.len().saturating_sub(keep.max(1)))
            .filter(|old| fs::remove_file(old).is_ok())
            .filter_map(|old| old.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        if removed.is_empty() {
            return;
        }
        let entry = self.seal(
            None,
            "journal.pruned".to_owned(),
            json!({ "removed": removed, "keep": keep.max(1) }),
        );
        self.unwritten.extend_from_slice(&entry.to_line());
        self.unwritten.push(b'\n');
        self.since_checkpoint += 1;
        self.oldest_unsigned.get_or_insert_with(Instant::now);
        // On disk with the next round, or the next checkpoint at the latest.
        let _ = self.write_unwritten();
    }

    /// After a failed write or sync nothing more is accepted: what follows could not be
    /// chained to what the disk holds.
    fn stop(&mut self, err: &io::Error) -> String {
        let reason = format!("writing {}: {err}", self.path.display());
        self.stopped.get_or_insert(reason).clone()
    }
}

/// The lock on `journal.lock`, taken and given back as entries are sealed and written.
struct AppendLock {
    file: File,
    held: bool,
}

impl AppendLock {
    fn open(dir: &Path) -> Result<Self, JournalError> {
        let path = dir.join(LOCK_FILE);
        let file = crate::segments::open_own(&path)
            .map_err(JournalError::io("opening the journal's lock", &path))?;
        Ok(Self { file, held: false })
    }

    /// Takes the lock, waiting for another process to give it back; whether it was free here
    /// (so what others wrote must be read).
    fn hold(&mut self) -> Result<bool, JournalError> {
        if self.held {
            return Ok(false);
        }
        flock(&self.file, FlockOperation::LockExclusive).map_err(|errno| JournalError::Io {
            what: "taking the journal's lock",
            path: PathBuf::from(LOCK_FILE),
            source: Arc::new(io::Error::from(errno)),
        })?;
        self.held = true;
        Ok(true)
    }

    fn release(&mut self) {
        // Not given back (it cannot fail on a descriptor that holds it): it goes with the
        // descriptor at the latest.
        if self.held && flock(&self.file, FlockOperation::Unlock).is_ok() {
            self.held = false;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::verify;

    #[test]
    fn entries_chain_across_reopen_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let first = journal.append(Some("a"), "t.one", json!({"n": 1})).unwrap();
        let second = journal.append(None, "t.two", json!({"n": 2})).unwrap();
        assert_eq!((first.seq, second.seq), (1, 2));
        drop(journal);
        // A crash in the middle of a write: half a line with no newline.
        let path = dir.path().join(JOURNAL_FILE);
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"{\"seq\":99,\"time_ms\":1,\"ce").unwrap();
        drop(file);
        let journal = Journal::open(dir.path()).unwrap();
        let third = journal.append(Some("a"), "t.three", json!({})).unwrap();
        drop(journal);
        let report = verify(dir.path(), None).unwrap();
        // two entries, a checkpoint, the recovery note, the third, and a closing checkpoint
        assert_eq!(report.entries, 6, "{report:?}");
        assert!(third.seq > second.seq + 1);
        assert_eq!(report.checkpoints, 2);
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("journal.recovered"));
        assert!(!text.contains("\"seq\":99"));
    }

    /// A journal with a ring of `ring` bytes, every round led by the appending thread (no
    /// syncer thread: one left behind by `mem::forget` would write on).
    fn with_ring(dir: &Path, ring: u64) -> Journal {
        let segments = Segments {
            ring,
            ..Default::default()
        };
        Journal::open_deferred(dir, segments).unwrap()
    }

    /// What the ring's header says is on disk of the active segment (a ring that is there is
    /// opened as it is).
    fn durable_by_header(dir: &Path) -> u64 {
        let (_, header, made) = Ring::open(dir, 1).unwrap();
        assert!(!made, "no ring was there");
        header.durable
    }

    /// The segment at `path` cut back to `len` bytes, as a crash can leave it.
    fn cut_to(path: &Path, len: u64) {
        OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// The entries of the active segment.
    fn entries_in(dir: &Path) -> Vec<Entry> {
        fs::read_to_string(dir.join(JOURNAL_FILE))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn acknowledged_entries_a_crash_took_from_the_segment_come_back_from_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 64 * 1024);
        for n in 0..2 {
            journal
                .append(Some("a"), "t.kept", json!({ "n": n }))
                .unwrap();
        }
        let path = dir.path().join(JOURNAL_FILE);
        let kept = fs::metadata(&path).unwrap().len();
        let mut acknowledged = Vec::new();
        for n in 0..3 {
            acknowledged.push(
                journal
                    .append(Some("a"), "t.lost", json!({ "n": n }))
                    .unwrap(),
            );
        }
        // A crash (nothing closes the journal) that took the segment's last entries: it was
        // synced when the ring was made, and the entries since went to the disk in the ring.
        assert!(durable_by_header(dir.path()) <= kept);
        std::mem::forget(journal);
        cut_to(&path, kept);
        let journal = with_ring(dir.path(), 64 * 1024);
        let next = journal.append(None, "t.after", json!({})).unwrap();
        journal.close();
        let entries = entries_in(dir.path());
        for receipt in &acknowledged {
            let back = entries.iter().find(|e| e.seq == receipt.seq).unwrap();
            assert_eq!((back.kind.as_str(), &back.hash), ("t.lost", &receipt.hash));
        }
        let recovered = entries
            .iter()
            .find(|e| e.kind == "journal.recovered")
            .unwrap();
        assert_eq!(recovered.data["restored"], 3, "{recovered:?}");
        assert_eq!(recovered.data["cut_bytes"], 0, "{recovered:?}");
        assert!(next.seq > acknowledged[2].seq);
        verify(dir.path(), None).unwrap();

        // Opened again with nothing lost, the ring's older copies bring nothing back.
        let journal = with_ring(dir.path(), 64 * 1024);
        journal.append(None, "t.again", json!({})).unwrap();
        journal.close();
        let again = entries_in(dir.path());
        assert_eq!(
            again
                .iter()
                .filter(|e| e.kind == "journal.recovered")
                .count(),
            1
        );
        verify(dir.path(), None).unwrap();
    }

    #[test]
    fn a_copy_in_the_ring_that_does_not_continue_the_chain_ends_the_restore() {
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 64 * 1024);
        journal.append(None, "t.kept", json!({})).unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let kept = fs::metadata(&path).unwrap().len();
        for n in 0..3 {
            journal.append(None, "t.lost", json!({ "n": n })).unwrap();
        }
        std::mem::forget(journal);
        let lost = fs::read(&path).unwrap();
        cut_to(&path, kept);
        // The second lost entry's copy altered in the ring (its `n` now 7: its hash no longer
        // matches): the first comes back, and nothing after the altered one.
        let second = lost[kept as usize..]
            .split(|b| *b == b'\n')
            .nth(1)
            .unwrap()
            .to_vec();
        let at = kept as usize
            + lost[kept as usize..]
                .iter()
                .position(|b| *b == b'\n')
                .unwrap()
            + 1;
        let altered = String::from_utf8(second)
            .unwrap()
            .replace("\"n\":1", "\"n\":7");
        let ring = OpenOptions::new()
            .write(true)
            .open(dir.path().join(RING_FILE))
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&ring, altered.as_bytes(), 4096 + at as u64)
            .unwrap();
        let journal = with_ring(dir.path(), 64 * 1024);
        journal.append(None, "t.after", json!({})).unwrap();
        journal.close();
        let entries = entries_in(dir.path());
        let kinds: Vec<&str> = entries.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds.iter().filter(|k| **k == "t.lost").count(),
            1,
            "{kinds:?}"
        );
        assert!(!fs::read_to_string(&path).unwrap().contains("\"n\":7"));
        verify(dir.path(), None).unwrap();
    }

    #[test]
    fn the_ring_never_writes_over_what_the_segment_has_not_on_disk() {
        // A ring of 4 KiB holds about a dozen entries: a hundred go round it several times.
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 4096);
        let mut acknowledged = Vec::new();
        for n in 0..100 {
            acknowledged.push(
                journal
                    .append(
                        Some("c"),
                        "t.entry",
                        json!({ "n": n, "pad": "x".repeat(150) }),
                    )
                    .unwrap(),
            );
        }
        // The segment on disk may be as short as the header says it is sure of: everything
        // after that must be in the ring.
        let path = dir.path().join(JOURNAL_FILE);
        let durable = durable_by_header(dir.path());
        let size = fs::metadata(&path).unwrap().len();
        assert!(
            durable < size && size - durable <= 4096,
            "{durable} of {size} on disk"
        );
        std::mem::forget(journal);
        cut_to(&path, durable);
        // (A journal opened deferred opens its files, and restores, at its first entry.)
        let journal = with_ring(dir.path(), 4096);
        journal.append(None, "t.after", json!({})).unwrap();
        journal.close();
        let entries = entries_in(dir.path());
        for receipt in &acknowledged {
            assert!(
                entries
                    .iter()
                    .any(|e| e.seq == receipt.seq && e.hash == receipt.hash),
                "entry {} was lost",
                receipt.seq
            );
        }
        let recovered = entries
            .iter()
            .find(|e| e.kind == "journal.recovered")
            .unwrap();
        assert!(recovered.data["restored"].as_u64().unwrap() > 0);
        verify(dir.path(), None).unwrap();
    }

    /// The active segment at `path` without its last `lines` lines, as someone may cut it
    /// from outside; its bytes before.
    fn cut_lines(path: &Path, lines: usize) -> Vec<u8> {
        let before = fs::read(path).unwrap();
        let mut end = before.len();
        for _ in 0..lines {
            end = before[..end - 1]
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(0, |i| i + 1);
        }
        cut_to(path, end as u64);
        before
    }

    /// Entries this writer wrote and acknowledged, cut from its open segment from outside: the
    /// next entry does not take their numbers; the ring, which holds them as written, puts
    /// them back first, and the restore is journaled.
    #[test]
    fn entries_cut_from_the_open_segment_from_outside_come_back_from_the_ring_before_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 64 * 1024);
        let acknowledged: Vec<Receipt> = (0..10)
            .map(|n| {
                journal
                    .append(Some("a"), "t.entry", json!({ "n": n }))
                    .unwrap()
            })
            .collect();
        let path = dir.path().join(JOURNAL_FILE);
        let whole = cut_lines(&path, 3);
        let next = journal.append(None, "t.after", json!({})).unwrap();
        assert!(
            next.seq > acknowledged[9].seq,
            "entry {} was given again",
            next.seq
        );
        // The segment is whole again, byte for byte, before what follows.
        let now = fs::read(&path).unwrap();
        assert_eq!(&now[..whole.len()], &whole[..]);
        let entries = entries_in(dir.path());
        let recovered = entries
            .iter()
            .find(|e| e.kind == "journal.recovered")
            .unwrap();
        assert_eq!(recovered.seq, acknowledged[9].seq + 1);
        assert_eq!(recovered.data["restored"], 3, "{recovered:?}");
        assert!(
            recovered.data["found"]
                .as_str()
                .unwrap()
                .contains("it ends at entry 7"),
            "{recovered:?}"
        );
        assert_eq!(next.seq, recovered.seq + 1);
        // The last entry changed and its newline taken off: cut as a partial line, and put
        // back as it was written.
        let text = fs::read_to_string(&path).unwrap();
        let changed = text
            .strip_suffix('\n')
            .unwrap()
            .replace("t.after", "t.other");
        fs::write(&path, &changed).unwrap();
        let later = journal.append(None, "t.later", json!({})).unwrap();
        assert_eq!(later.seq, next.seq + 2, "after a second journal.recovered");
        let entries = entries_in(dir.path());
        assert!(
            entries
                .iter()
                .any(|e| e.seq == next.seq && e.hash == next.hash)
        );
        let second = entries
            .iter()
            .rfind(|e| e.kind == "journal.recovered")
            .unwrap();
        assert_eq!(second.data["restored"], 1, "{second:?}");
        assert!(second.data["cut_bytes"].as_u64().unwrap() > 0, "{second:?}");
        journal.close();
        verify(dir.path(), None).unwrap();
    }

    /// Cut from outside where no ring holds what was cut: the entry is refused with what was
    /// found and what to do, nothing is signed over the cut (not even at the close), and once
    /// the file is whole again entries go on where they were.
    #[test]
    fn entries_cut_from_the_open_segment_that_no_ring_holds_stop_appends_and_signatures() {
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 0);
        for n in 0..10 {
            journal.append(None, "t.entry", json!({ "n": n })).unwrap();
        }
        let path = dir.path().join(JOURNAL_FILE);
        let whole = cut_lines(&path, 3);
        let cut = fs::read(&path).unwrap();
        for _ in 0..2 {
            let err = journal.append(None, "t.after", json!({})).unwrap_err();
            assert!(
                matches!(err, JournalError::Cut { written: 10, .. }),
                "{err}"
            );
            let text = err.to_string();
            for needle in [
                "it ends at entry 7",
                "up to entry 10",
                "journal.jsonl",
                "warden audit verify",
            ] {
                assert!(text.contains(needle), "{needle}: {text}");
            }
        }
        // A checkpoint (as the syncer signs them) finds the same, and signs nothing.
        journal
            .shared()
            .unwrap()
            .state
            .lock()
            .unwrap()
            .checkpoint_and_sync();
        assert_eq!(fs::read(&path).unwrap(), cut);
        // Grown past its length since the cut, by an entry chained on from the cut (another
        // process's, say): still refused.
        let eight: Entry =
            serde_json::from_slice(whole[cut.len()..].split(|b| *b == b'\n').next().unwrap())
                .unwrap();
        let pad = "x".repeat(whole.len());
        let other = Entry::seal(
            8,
            1,
            None,
            "t.other".to_owned(),
            json!({ "pad": pad }),
            eight.prev,
        );
        let mut forked = cut.clone();
        forked.extend_from_slice(&other.to_line());
        forked.push(b'\n');
        assert!(forked.len() > whole.len());
        fs::write(&path, &forked).unwrap();
        let err = journal.append(None, "t.after", json!({})).unwrap_err();
        assert!(matches!(err, JournalError::Cut { .. }), "{err}");
        // A cut copy put in its place (another file at the path): still refused.
        let copy = dir.path().join("cut-copy");
        fs::write(&copy, &cut).unwrap();
        fs::rename(&copy, &path).unwrap();
        let err = journal.append(None, "t.after", json!({})).unwrap_err();
        assert!(err.to_string().contains("it ends at entry 7"), "{err}");
        // Restored from a backup: on from entry 11.
        fs::write(&path, &whole).unwrap();
        let next = journal.append(None, "t.after", json!({})).unwrap();
        assert_eq!(next.seq, 11);
        journal.close();
        let report = verify(dir.path(), None).unwrap();
        assert_eq!(report.last_seq, 12, "{report:?} (a closing checkpoint)");
    }

    /// The head a running writer has written, against the chain as `verify` reads it.
    #[test]
    fn the_writers_head_tells_a_file_that_lost_its_entries() {
        let dir = tempfile::tempdir().unwrap();
        let journal = with_ring(dir.path(), 0);
        for n in 0..5 {
            journal.append(None, "t.entry", json!({ "n": n })).unwrap();
        }
        let head = journal.written_head().unwrap();
        assert_eq!(head.seq, 5);
        fs::write(dir.path().join(crate::PUBLIC_FILE), journal.public_key()).unwrap();
        assert_eq!(verify(dir.path(), None).unwrap().behind(&head), None);
        cut_lines(&dir.path().join(JOURNAL_FILE), 2);
        let report = verify(dir.path(), None).unwrap();
        let why = report.behind(&head).unwrap();
        assert!(
            why.contains("end at entry 3") && why.contains("up to entry 5"),
            "{why}"
        );
        std::mem::forget(journal);
    }

    #[test]
    fn a_last_entry_longer_than_the_first_read_is_found_when_the_journal_opens_again() {
        for pad in [5_000, 40_000, 300_000] {
            let dir = tempfile::tempdir().unwrap();
            let journal = Journal::open(dir.path()).unwrap();
            journal.append(None, "t.short", json!({})).unwrap();
            let long = journal
                .append(None, "t.long", json!({ "pad": "x".repeat(pad) }))
                .unwrap();
            // Ended without its closing checkpoint (a killed process): the long entry is last,
            // and a torn write after it.
            std::mem::forget(journal);
            let path = dir.path().join(JOURNAL_FILE);
            let mut file = OpenOptions::new().append(true).open(&path).unwrap();
            file.write_all(b"{\"seq\":").unwrap();
            drop(file);
            let journal = Journal::open(dir.path()).unwrap();
            let next = journal.append(None, "t.next", json!({})).unwrap();
            drop(journal);
            // The recovery note follows the long entry, then the next one.
            assert_eq!(next.seq, long.seq + 2, "pad {pad}");
            let report = verify(dir.path(), None).unwrap();
            // The two, the recovery note, the next one and the closing checkpoint.
            assert_eq!(report.entries, 5, "pad {pad}: {report:?}");
        }
    }

    #[test]
    fn a_deferred_journal_opens_its_files_at_its_first_entry_and_fails_each_entry_with_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        // A last line that does not verify (its hash is not its content's).
        let bad = "{\"seq\":1,\"time_ms\":1,\"cell\":null,\"kind\":\"t\",\"data\":{},\"prev\":\"0\",\"hash\":\"0\"}\n";
        fs::write(&path, bad).unwrap();
        let journal = Journal::open_deferred(dir.path(), Segments::default()).unwrap();
        // Nothing read or made yet: not even the signing key.
        assert!(!dir.path().join(crate::keys::KEY_FILE).exists());
        for _ in 0..2 {
            let err = journal.append(None, "t.after", json!({})).unwrap_err();
            assert!(matches!(err, JournalError::Corrupt { .. }), "{err}");
            assert!(err.to_string().contains("warden audit verify"), "{err}");
        }
        let (tx, rx) = mpsc::channel();
        journal.submit_ahead(
            None,
            "t.ahead",
            json!({}),
            Urgency::Waited,
            {
                let tx = tx.clone();
                move |r| tx.send(r.is_err()).unwrap()
            },
            move |r| tx.send(r.is_err()).unwrap(),
        );
        assert_eq!((rx.recv().unwrap(), rx.recv().unwrap()), (true, true));
        assert_eq!(journal.public_key(), "");
        drop(journal);
        // Left as it was.
        assert_eq!(fs::read_to_string(&path).unwrap(), bad);
        // A good one, opened deferred and never used, is not touched either; used, it chains on.
        let good = tempfile::tempdir().unwrap();
        drop(Journal::open_deferred(good.path(), Segments::default()).unwrap());
        assert!(!good.path().join(JOURNAL_FILE).exists());
        let journal = Journal::open_deferred(good.path(), Segments::default()).unwrap();
        assert_eq!(journal.append(None, "t.one", json!({})).unwrap().seq, 1);
        assert_eq!(journal.public_key().len(), 64);
        drop(journal);
        let journal = Journal::open_deferred(good.path(), Segments::default()).unwrap();
        let two = journal.append(None, "t.two", json!({})).unwrap();
        drop(journal);
        assert!(two.seq > 1);
        verify(good.path(), None).unwrap();
    }

    #[test]
    fn an_entry_alone_is_synced_by_its_own_thread_and_others_by_the_syncer() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap());
        let me = std::thread::current().id();
        let (tx, rx) = mpsc::channel();
        let acked = tx.clone();
        journal.submit_leading(None, "t.alone", json!({}), move |r| {
            acked
                .send((r.unwrap().seq, std::thread::current().id()))
                .unwrap();
        });
        // Acknowledged before the call returned, on this thread.
        let (seq, by) = rx.try_recv().expect("acknowledged before returning");
        assert_eq!((seq, by), (1, me));
        // While a round is under way (marked so here by hand), a leading entry is left to the
        // syncer thread.
        {
            let mut state = journal.shared().unwrap().state.lock().unwrap();
            state.syncing = true;
        }
        let acked = tx.clone();
        journal.submit_leading(None, "t.queued", json!({}), move |r| {
            acked
                .send((r.unwrap().seq, std::thread::current().id()))
                .unwrap();
        });
        assert!(
            rx.try_recv().is_err(),
            "not synced by the caller while a round runs"
        );
        journal.shared().unwrap().state.lock().unwrap().syncing = false;
        journal.shared().unwrap().work.notify_one();
        let (seq, by) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(seq, 2);
        assert_ne!(by, me, "the syncer acknowledged it");
        drop(journal);
        let report = verify(dir.path(), None).unwrap();
        assert_eq!(
            report.entries, 3,
            "two entries and the closing checkpoint: {report:?}"
        );
    }

    #[test]
    fn concurrent_appends_are_all_acknowledged_in_one_chain() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let journal = Arc::clone(&journal);
                std::thread::spawn(move || {
                    (0..200)
                        .map(|i| {
                            journal
                                .append(None, "t", json!({"t": t, "i": i}))
                                .unwrap()
                                .seq
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seqs: Vec<u64> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), 1600);
        drop(journal);
        let report = verify(dir.path(), None).unwrap();
        assert!(
            report.entries > 1600 && report.checkpoints >= 1,
            "{report:?}"
        );
    }

    /// A journal opened deferred starts no thread while every entry finds no round under way
    /// (its appender writes and syncs it), starts its syncer for the first that needs one, and
    /// signs its last checkpoint at the close either way.
    #[test]
    fn a_deferred_journal_has_no_thread_until_an_entry_needs_one() {
        let dir = tempfile::tempdir().unwrap();
        {
            let journal = Journal::open_deferred(dir.path(), Segments::default()).unwrap();
            journal.append(None, "a", json!({})).unwrap();
            let (tx, rx) = mpsc::channel();
            journal.submit_batch(
                Some("c"),
                vec![("b".to_owned(), json!({})), ("c".to_owned(), json!({}))],
                false,
                move |r| {
                    let _ = tx.send(r);
                },
            );
            assert_eq!(rx.recv().unwrap().unwrap().len(), 2);
            assert!(journal.syncer.lock().unwrap().is_none(), "no thread yet");
        }
        let report = verify(dir.path(), None).unwrap();
        assert_eq!((report.entries, report.unsigned_tail), (4, 0), "{report:?}");
        let journal = Journal::open_deferred(dir.path(), Segments::default()).unwrap();
        let (tx, rx) = mpsc::channel();
        journal.submit(None, "later", json!({}), move |r| {
            let _ = tx.send(r);
        });
        assert!(
            rx.recv().unwrap().is_ok(),
            "the syncer it started acknowledged it"
        );
        assert!(journal.syncer.lock().unwrap().is_some());
        drop(journal);
        assert_eq!(verify(dir.path(), None).unwrap().unsigned_tail, 0);
    }

    /// Two writers on one directory (as a daemon and a `warden run` beside it): each takes
    /// the lock in turn and chains on from the other's entries, through rotations.
    #[test]
    fn two_writers_on_one_journal_make_one_chain_through_rotations() {
        let dir = tempfile::tempdir().unwrap();
        let small = Segments {
            bytes: 16 * 1024,
            keep: None,
            ..Default::default()
        };
        let a = Arc::new(Journal::open_with(dir.path(), small).unwrap());
        let b = Arc::new(Journal::open(dir.path()).unwrap());
        let writers: Vec<_> = [Arc::clone(&a), Arc::clone(&b), a, b]
            .into_iter()
            .enumerate()
            .map(|(w, journal)| {
                std::thread::spawn(move || {
                    for i in 0..300 {
                        let data = json!({"w": w, "i": i});
                        if i % 3 == 0 {
                            journal.append(Some("c"), "t", data).unwrap();
                        } else {
                            let (tx, rx) = mpsc::channel();
                            journal.submit(Some("c"), "t", data, move |r| {
                                let _ = tx.send(r);
                            });
                            rx.recv().unwrap().unwrap();
                        }
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        let report = verify(dir.path(), None).unwrap();
        assert!(report.segments > 2, "the small writer rotated: {report:?}");
        let mut seen = std::collections::HashSet::new();
        for path in crate::segments::segments(dir.path()).unwrap() {
            for line in fs::read_to_string(&path).unwrap().lines() {
                let entry: Entry = serde_json::from_str(line).unwrap();
                if entry.kind == "t" {
                    assert!(seen.insert((entry.data["w"].clone(), entry.data["i"].clone())));
                }
            }
        }
        assert_eq!(
            seen.len(),
            1200,
            "every acknowledged entry is in the one chain"
        );
    }

    /// A writer that opened the journal before another wrote and rotated it chains on from
    /// the other's last entry, not from what it read at its own open.
    #[test]
    fn a_writer_catches_up_with_entries_and_a_rotation_made_by_another() {
        let dir = tempfile::tempdir().unwrap();
        let late = Journal::open(dir.path()).unwrap();
        {
            let other = Journal::open_with(
                dir.path(),
                Segments {
                    bytes: 1,
                    keep: None,
                    ..Default::default()
                },
            )
            .unwrap();
            for i in 0..5 {
                other.append(None, "other", json!({ "i": i })).unwrap();
            }
        }
        let receipt = late.append(None, "late", json!({})).unwrap();
        drop(late);
        let report = verify(dir.path(), None).unwrap();
        assert_eq!(
            report.last_seq,
            receipt.seq + 1,
            "{report:?} (a last checkpoint follows)"
        );
        assert!(report.segments >= 5, "{report:?}");
    }

    #[test]
    fn an_entry_submitted_soon_rides_with_the_next_waited_entry_or_goes_alone_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap());
        let file = dir.path().join(JOURNAL_FILE);
        let (tx, rx) = mpsc::channel();
        let soon = |kind: &'static str| {
            let (written, durable) = (tx.clone(), tx.clone());
            let seen = file.clone();
            journal.submit_ahead(
                None,
                kind,
                json!({}),
                Urgency::Soon,
                move |r| {
                    let text = fs::read_to_string(&seen).unwrap();
                    assert!(text.contains(kind), "not in the file when written: {text}");
                    let _ = written.send((kind, "written", r.unwrap().seq));
                },
                move |r| {
                    let _ = durable.send((kind, "durable", r.unwrap().seq));
                },
            );
        };
        soon("t.seen");
        assert_eq!(rx.recv().unwrap().1, "written");
        // No fdatasync of its own: nothing is acknowledged before an entry that is waited for
        // comes (the syncer would take it alone only after SOON_WITHIN).
        assert!(
            rx.recv_timeout(SOON_WITHIN / 3).is_err(),
            "an entry submitted soon was synced at once"
        );
        // On the disk no later than the next entry that is waited for: acknowledged by the
        // time that one's append returns.
        let waited = journal.append(None, "t.effect", json!({})).unwrap();
        let (kind, what, seq) = rx
            .try_recv()
            .expect("the entry submitted soon was not on disk with the next waited one");
        assert_eq!((kind, what), ("t.seen", "durable"));
        assert!(seq < waited.seq);
        // Alone, it still reaches the disk in time.
        soon("t.alone");
        assert_eq!(rx.recv().unwrap().1, "written");
        let (kind, what, _) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((kind, what), ("t.alone", "durable"));
    }

    #[test]
    fn an_entry_submitted_led_waits_for_its_lead_which_syncs_it_in_the_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        // Opened deferred: no syncer runs until something wakes one (a wake-up starts it). With
        // one started at the open, a syncer that had not reached its wait yet (a loaded host
        // schedules it late) took the led entry itself, and the test failed for it.
        let journal = Journal::open_deferred(dir.path(), Segments::default()).unwrap();
        let (tx, rx) = mpsc::channel();
        let led = |kind: &'static str| {
            let (written, durable) = (tx.clone(), tx.clone());
            journal.submit_ahead(
                None,
                kind,
                json!({}),
                Urgency::Led,
                move |r| {
                    let _ = written.send((kind, "written", std::thread::current().id(), r.is_ok()));
                },
                move |r| {
                    let _ = durable.send((kind, "durable", std::thread::current().id(), r.is_ok()));
                },
            );
        };
        let here = std::thread::current().id();
        // Alone, the first entry is synced by this thread: still no syncer.
        journal.append(None, "t.first", json!({})).unwrap();
        led("t.start");
        assert_eq!(rx.recv().unwrap(), ("t.start", "written", here, true));
        // Nobody was woken for it: it waits for its lead (a wake-up would have started the
        // syncer, which takes whatever waits at once).
        let early = rx.recv_timeout(Duration::from_millis(300));
        assert!(
            early.is_err(),
            "an entry submitted led was synced before its lead: {early:?}"
        );
        // The lead syncs it in this thread, before it returns.
        journal.lead();
        assert_eq!(rx.try_recv(), Ok(("t.start", "durable", here, true)));
        // A lead that finds nothing waiting does nothing.
        journal.lead();
        assert!(rx.try_recv().is_err());
        // A round started by another entry that is waited for takes a led one with it.
        led("t.other");
        assert_eq!(rx.recv().unwrap().1, "written");
        let waited = journal.append(None, "t.effect", json!({})).unwrap();
        let (kind, what, _, ok) = rx
            .try_recv()
            .expect("a led entry was not on disk with the next round");
        assert_eq!((kind, what, ok), ("t.other", "durable", true));
        journal.lead();
        assert!(rx.try_recv().is_err(), "{waited:?}");
        let report = crate::verify(dir.path(), None).unwrap();
        assert!(report.entries >= 4, "{report:?}");
    }

    /// A cell's create and start submitted as one batch ahead: their receipts, and where the
    /// acknowledgement of both comes.
    fn create_and_start(
        journal: &Journal,
        urgency: Urgency,
    ) -> (
        Vec<Receipt>,
        mpsc::Receiver<Result<Vec<Receipt>, JournalError>>,
    ) {
        let (tx, rx) = mpsc::channel();
        let entries = vec![
            ("cell.create".to_owned(), json!({ "n": 1 })),
            ("cell.start".to_owned(), json!({ "n": 2 })),
        ];
        let written = journal
            .submit_batch_ahead(Some("c"), entries, urgency, move |receipts| {
                let _ = tx.send(receipts);
            })
            .unwrap();
        (written, rx)
    }

    #[test]
    fn a_batch_submitted_soon_waits_for_the_next_waited_entry_and_goes_to_the_disk_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let file = dir.path().join(JOURNAL_FILE);
        let (written, rx) = create_and_start(&journal, Urgency::Soon);
        let text = fs::read_to_string(&file).unwrap();
        assert!(
            text.contains("\"cell.create\"") && text.contains("\"cell.start\""),
            "not in the file when submitted: {text}"
        );
        // No fdatasync of its own ...
        assert!(
            rx.recv_timeout(SOON_WITHIN / 3).is_err(),
            "a batch submitted soon was synced at once"
        );
        // ... but on the disk by the time the next waited entry's append returns.
        let waited = journal.append(Some("c"), "exec.start", json!({})).unwrap();
        let durable = rx
            .try_recv()
            .expect("the batch submitted soon was not on disk with the next waited entry")
            .unwrap();
        assert_eq!(durable, written);
        assert_eq!(waited.seq, written[1].seq + 1);
        journal.close();
    }

    #[test]
    fn a_batch_submitted_led_waits_for_its_lead_which_syncs_it_in_the_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        // Opened deferred, as for a led entry (see above): no syncer runs until woken.
        let journal = Journal::open_deferred(dir.path(), Segments::default()).unwrap();
        journal.append(None, "t.first", json!({})).unwrap();
        let (written, rx) = create_and_start(&journal, Urgency::Led);
        let text = fs::read_to_string(dir.path().join(JOURNAL_FILE)).unwrap();
        assert!(text.contains("\"cell.start\""), "not in the file: {text}");
        let early = rx.recv_timeout(Duration::from_millis(300));
        assert!(
            early.is_err(),
            "a batch submitted led was synced before its lead: {early:?}"
        );
        journal.lead();
        assert_eq!(rx.try_recv().unwrap().unwrap(), written);
        journal.close();
    }

    #[test]
    fn an_entry_submitted_ahead_is_in_the_file_before_its_acknowledgement() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(Journal::open(dir.path()).unwrap());
        let file = dir.path().join(JOURNAL_FILE);
        let (tx, rx) = mpsc::channel();
        let (written_tx, ack_tx) = (tx.clone(), tx);
        let seen = file.clone();
        journal.submit_ahead(
            Some("c"),
            "exec.start",
            json!({ "n": 1 }),
            Urgency::Waited,
            move |receipt| {
                let text = fs::read_to_string(&seen).unwrap();
                let _ = written_tx.send(("written", receipt.unwrap().seq, text));
            },
            move |receipt| {
                let _ = ack_tx.send(("durable", receipt.unwrap().seq, String::new()));
            },
        );
        let (first, seq, text) = rx.recv().unwrap();
        assert_eq!(first, "written");
        assert!(text.contains("\"exec.start\""), "{text}");
        let (second, durable_seq, _) = rx.recv().unwrap();
        assert_eq!((second, durable_seq), ("durable", seq));
    }

    #[test]
    fn a_batch_submitted_ahead_is_in_the_file_when_it_returns_and_acknowledged_whole() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let file = dir.path().join(JOURNAL_FILE);
        let (written, rx) = create_and_start(&journal, Urgency::Waited);
        // Both in the file, in order, before the disk is waited for.
        let text = fs::read_to_string(&file).unwrap();
        let (create, start) = (
            text.find("\"cell.create\"").expect("create written"),
            text.find("\"cell.start\"").expect("start written"),
        );
        assert!(create < start, "{text}");
        assert_eq!(written.len(), 2);
        assert_eq!(written[1].seq, written[0].seq + 1);
        let durable = rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(durable, written);
        // Nothing is acknowledged for an empty batch but that it is empty.
        let (tx, rx) = mpsc::channel();
        let none = journal
            .submit_batch_ahead(Some("c"), Vec::new(), Urgency::Waited, move |r| {
                let _ = tx.send(r);
            })
            .unwrap();
        assert!(none.is_empty() && rx.recv().unwrap().unwrap().is_empty());
        journal.close();
        let report = crate::verify(dir.path(), None).unwrap();
        assert!(report.last_seq >= written[1].seq);
    }

    #[test]
    fn segments_rotate_and_the_chain_runs_through_them() {
        let dir = tempfile::tempdir().unwrap();
        let small = Segments {
            bytes: 2_000,
            keep: None,
            ..Default::default()
        };
        let journal = Journal::open_with(dir.path(), small).unwrap();
        for i in 0..60 {
            journal
                .append(
                    Some("c"),
                    "exec.exit",
                    json!({ "i": i, "pad": "x".repeat(40) }),
                )
                .unwrap();
        }
        journal.close();
        let files = segments(dir.path()).unwrap();
        assert!(files.len() > 3, "{files:?}");
        for closed in &files[..files.len() - 1] {
            let text = fs::read_to_string(closed).unwrap();
            assert!(text.len() < 4_000, "{closed:?} was not rotated in time");
            let last: Entry = serde_json::from_str(text.lines().last().unwrap()).unwrap();
            assert_eq!(last.kind, CHECKPOINT, "{closed:?} ends signed");
        }
        let report = crate::verify(dir.path(), None).unwrap();
        assert_eq!((report.first_seq, report.segments), (1, files.len()));
        let last_seq = report.last_seq;

        // An active segment lost between the rename and the new file: the chain goes on from
        // the last closed segment. (Here it is removed with entries in it: the ring, which
        // would bring those back, goes too.)
        fs::remove_file(dir.path().join(JOURNAL_FILE)).unwrap();
        fs::remove_file(dir.path().join(RING_FILE)).unwrap();
        let last_closed = crate::verify(dir.path(), None).unwrap().last_seq;
        let journal = Journal::open_with(dir.path(), small).unwrap();
        let next = journal.append(None, "t.after", json!({})).unwrap();
        assert_eq!(next.seq, last_closed + 1);
        journal.close();
        assert!(crate::verify(dir.path(), None).is_ok());
        assert!(last_seq >= last_closed);

        // The oldest segment archived: the rest verifies, from where it starts.
        let files = segments(dir.path()).unwrap();
        fs::rename(&files[0], dir.path().join("archived")).unwrap();
        let report = crate::verify(dir.path(), None).unwrap();
        assert!(report.first_seq > 1, "{report:?}");
        // A segment missing in the middle, or the head of a segment cut, is caught and named.
        let middle = files[2].clone();
        let kept = fs::read(&middle).unwrap();
        fs::remove_file(&middle).unwrap();
        let err = crate::verify(dir.path(), None).unwrap_err();
        assert!(err.to_string().contains("were removed"), "{err}");
        let text = String::from_utf8(kept).unwrap();
        let without_first: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
        fs::write(&middle, without_first).unwrap();
        let err = crate::verify(dir.path(), None).unwrap_err();
        let name = middle.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            err.to_string().contains(&format!("({name} line 1)")),
            "{err}"
        );
    }

    #[test]
    fn only_the_newest_closed_segments_are_kept_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let keep_two = Segments {
            bytes: 2_000,
            keep: Some(2),
            ..Default::default()
        };
        let journal = Journal::open_with(dir.path(), keep_two).unwrap();
        for i in 0..80 {
            journal
                .append(None, "t", json!({ "i": i, "pad": "x".repeat(40) }))
                .unwrap();
        }
        let last = journal.append(None, "t.last", json!({})).unwrap();
        journal.close();
        let files = segments(dir.path()).unwrap();
        assert_eq!(files.len(), 3, "two closed and the active one: {files:?}");
        let report = crate::verify(dir.path(), None).unwrap();
        assert!(report.first_seq > 1, "{report:?}");
        assert!(report.last_seq > last.seq, "{report:?}");
        // Each removal is in the journal, naming what went.
        let mut text = Vec::new();
        crate::export(dir.path(), crate::Format::Jsonl, None, None, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        let pruned: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("\"journal.pruned\""))
            .collect();
        assert!(!pruned.is_empty(), "{text}");
        assert!(pruned[pruned.len() - 1].contains("journal-0"), "{pruned:?}");
    }

    #[test]
    fn a_tampered_last_entry_stops_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        journal.append(None, "t", json!({"v": "abc"})).unwrap();
        journal.close();
        let path = dir.path().join(JOURNAL_FILE);
        let text = fs::read_to_string(&path).unwrap();
        // The last line is the closing checkpoint; change its head.
        let changed = text.replacen("\"head_seq\":1", "\"head_seq\":7", 1);
        assert_ne!(changed, text);
        fs::write(&path, changed).unwrap();
        let err = Journal::open(dir.path()).unwrap_err();
        assert!(matches!(err, JournalError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("warden audit verify"));
    }
}
