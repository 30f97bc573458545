//! Processes exec'd into cells, as the harness sees them: their output, kept (within a bound)
//! so that a client can reconnect and read it from any point, and how they ended.

use crate::{ExitInfo, ExitReason, ProcessInfo, Stream};
use std::collections::VecDeque;
use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use warden_cell::Session;

/// Output kept per process for readers that connect late; older chunks are dropped first.
/// Each chunk also counts `CHUNK_COST` against it, so that a process that writes a byte at a
/// time cannot make the daemon hold ~60 bytes of bookkeeping for each byte kept.
const KEPT_OUTPUT: usize = 4 * 1024 * 1024;
/// What a kept chunk costs beyond its bytes: its place in the queue, its allocation's header.
const CHUNK_COST: usize = 64;
/// Output read while no reader asked for it gathers into one chunk up to this size.
const GATHERED: usize = 64 * 1024;
/// Ended processes whose output is kept per cell (the oldest are forgotten first).
pub(crate) const KEPT_ENDED: usize = 16;
/// Output copied into the journal's exec entry, per stream.
pub(crate) const JOURNALED_OUTPUT: usize = 64 * 1024;

/// A reader's place in a process's output: the index of its next chunk, and that chunk's
/// byte offset where the reader knows it, so that output dropped before it got there is told
/// as the bytes this reader missed (not all that was ever dropped, which readers that add up
/// their `Dropped` items counted again at each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    index: u64,
    offset: Option<u64>,
}

impl Cursor {
    /// From the first chunk of the output.
    pub fn start() -> Self {
        Self {
            index: 0,
            offset: Some(0),
        }
    }

    /// From chunk `index` (a reader that comes back with the `next` it was told).
    pub fn at(index: u64) -> Self {
        match index {
            0 => Self::start(),
            _ => Self {
                index,
                offset: None,
            },
        }
    }

    /// Past all output: a reader of the ending alone.
    pub fn end() -> Self {
        Self {
            index: u64::MAX,
            offset: None,
        }
    }

    /// The index of the next chunk.
    pub fn index(&self) -> u64 {
        self.index
    }
}

/// What a reader gets next.
#[derive(Debug, Clone)]
pub enum Item {
    Output(Stream, Arc<[u8]>),
    /// Output that was dropped before this reader got to it (bytes; all that was dropped
    /// for a reader that started at a later chunk, whose offset it did not know).
    Dropped(u64),
    Exit(ExitInfo),
}

#[derive(Debug, Default)]
struct Log {
    chunks: VecDeque<(Stream, Arc<[u8]>)>,
    /// Output read since the last chunk was made, gathered until a reader asks for it (or it
    /// reaches `GATHERED`, or the stream changes): the chunk after `chunks`.
    tail: Option<(Stream, Vec<u8>)>,
    /// Index of `chunks[0]` in the process's whole output.
    first: u64,
    /// Bytes of `chunks` and `tail`, and `CHUNK_COST` for each chunk.
    kept_bytes: usize,
    dropped_bytes: u64,
    counts: [u64; 2],
    captured: [Vec<u8>; 2],
    exit: Option<ExitInfo>,
}

impl Log {
    /// Makes the gathered output a chunk of its own.
    fn seal(&mut self) {
        if let Some((stream, data)) = self.tail.take() {
            self.kept_bytes += CHUNK_COST;
            self.chunks.push_back((stream, Arc::from(data)));
        }
    }

    /// Drops the oldest chunks until what is kept is within `KEPT_OUTPUT`.
    fn trim(&mut self) {
        while self.kept_bytes > KEPT_OUTPUT {
            let Some((_, old)) = self.chunks.pop_front() else {
                break;
            };
            self.kept_bytes -= old.len() + CHUNK_COST;
            self.dropped_bytes += old.len() as u64;
            self.first += 1;
        }
    }

    /// The next item at `cursor` if there is one now, gathered output included.
    fn take(&mut self, cursor: &mut Cursor) -> Option<Item> {
        if cursor.index < self.first {
            return Some(self.skip_dropped(cursor));
        }
        let at = (cursor.index - self.first) as usize;
        if at == self.chunks.len() && self.tail.is_some() {
            self.seal();
            self.trim();
            // Trimming never drops the newest chunk unless it alone is over the bound.
            if cursor.index < self.first {
                return Some(self.skip_dropped(cursor));
            }
        }
        let at = (cursor.index - self.first) as usize;
        let (stream, data) = self.chunks.get(at)?;
        let start = cursor.offset.unwrap_or_else(|| {
            self.dropped_bytes
                + self
                    .chunks
                    .range(..at)
                    .map(|(_, c)| c.len() as u64)
                    .sum::<u64>()
        });
        *cursor = Cursor {
            index: cursor.index + 1,
            offset: Some(start + data.len() as u64),
        };
        Some(Item::Output(*stream, Arc::clone(data)))
    }

    /// Moves a cursor that fell behind to the first kept chunk: the bytes it missed.
    fn skip_dropped(&self, cursor: &mut Cursor) -> Item {
        let missed = self.dropped_bytes - cursor.offset.unwrap_or(0).min(self.dropped_bytes);
        *cursor = Cursor {
            index: self.first,
            offset: Some(self.dropped_bytes),
        };
        Item::Dropped(missed)
    }
}

/// Where a process's input goes.
#[derive(Debug)]
pub(crate) enum Input {
    Pipe(tokio::net::unix::pipe::Sender),
    /// The master of its terminal.
    Tty(Arc<OwnedFd>),
}

/// Where its output comes from.
#[derive(Debug)]
pub(crate) enum Outputs {
    Pipes([OwnedFd; 2]),
    Tty(Arc<OwnedFd>),
}

impl Outputs {
    /// Copies output into the process's log, to the end of every pipe (or of the terminal);
    /// `stop` ends a terminal reader that a left-behind process of the cell keeps open. The
    /// pipes are read by the returned future itself, so that the task that awaits it is the
    /// one woken when they close; a terminal by a blocking thread, whose end it awaits.
    pub(crate) fn read(
        self,
        process: &Arc<Process>,
        stop: &Arc<AtomicBool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let process = Arc::clone(process);
        let stop = Arc::clone(stop);
        async move {
            match self {
                Self::Pipes([stdout, stderr]) => {
                    tokio::join!(
                        copy_pipe(Stream::Stdout, stdout, &process),
                        copy_pipe(Stream::Stderr, stderr, &process)
                    );
                }
                Self::Tty(master) => {
                    let _ = tokio::task::spawn_blocking(move || {
                        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
                        let mut buf = vec![0u8; 64 * 1024];
                        while !stop.load(Ordering::Relaxed) {
                            let mut fds = [PollFd::new(master.as_fd(), PollFlags::POLLIN)];
                            match poll(&mut fds, PollTimeout::from(200u16)) {
                                Ok(0) | Err(nix::Error::EINTR) => continue,
                                Ok(_) => {}
                                Err(_) => break,
                            }
                            match nix::unistd::read(master.as_fd(), &mut buf) {
                                Ok(0) => break,
                                Ok(n) => process.push(Stream::Stdout, &buf[..n]),
                                Err(nix::Error::EINTR | nix::Error::EAGAIN) => continue,
                                // EIO: every holder of the terminal's slave side is gone.
                                Err(_) => break,
                            }
                        }
                    })
                    .await;
                }
            }
        }
    }
}

/// Copies one output pipe into the process's log until its end.
async fn copy_pipe(stream: Stream, fd: OwnedFd, process: &Process) {
    use tokio::io::AsyncReadExt as _;
    // Made non-blocking with one call (the end is ours alone: the process's end is another
    // open file, which stays blocking), not the checked conversion's three.
    if nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .is_err()
    {
        return;
    }
    let Ok(mut pipe) = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(fd) else {
        return;
    };
    // Read into its spare room: nothing to zero first.
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        match pipe.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => process.push(stream, &buf),
        }
    }
}

/// One exec'd process.
#[derive(Debug)]
pub struct Process {
    pub id: u64,
    pub cell: String,
    pub argv: Vec<String>,
    pub started_ms: u64,
    pub background: bool,
    pub pid: i32,
    log: Mutex<Log>,
    version: watch::Sender<u64>,
    /// The connection to the cell's keeper, while the process runs (dropped at its end, so an
    /// ended process holds no descriptor of the daemon's nor a thread of the keeper's).
    session: Mutex<Option<Arc<dyn Session>>>,
    pub(crate) stdin: tokio::sync::Mutex<Option<Input>>,
    terminal: Mutex<Option<Arc<OwnedFd>>>,
    output_limit: Option<u64>,
    over_limit: AtomicBool,
    /// A run's process: its cell is deleted once it ends, before its end is told.
    then: Mutex<Option<crate::once::Then>>,
    /// A run's process: its line to the cell, kept past its end until the run has answered.
    kept_line: Mutex<KeptLine>,
}

/// A run's line to its cell past the process's end: the cell's init, the last of the cell,
/// goes (and the cell's teardown begins) when the line hangs up, so the line is let go of
/// once the run's answer is out ([`LineHold`]).
#[derive(Debug, Default)]
struct KeptLine {
    /// Kept past the end (a run's process).
    wanted: bool,
    /// Let go of already: no line is kept from then on.
    let_go: bool,
    line: Option<Arc<dyn Session>>,
}

/// Holds a run's line to its cell past the process's end; dropped once the run has answered
/// (or its caller went away), which lets the cell's init go. See `KeptLine`.
#[derive(Debug)]
pub struct LineHold(Arc<Process>);

impl Drop for LineHold {
    fn drop(&mut self) {
        let line = self.0.kept_line.lock().ok().and_then(|mut kept| {
            kept.let_go = true;
            kept.line.take()
        });
        drop(line);
    }
}

impl Process {
    pub(crate) fn new(
        id: u64,
        cell: String,
        argv: Vec<String>,
        background: bool,
        pid: i32,
        session: Arc<dyn Session>,
        stdin: Option<Input>,
    ) -> Self {
        let terminal = match &stdin {
            Some(Input::Tty(master)) => Some(Arc::clone(master)),
            _ => None,
        };
        Self {
            id,
            cell,
            argv,
            started_ms: crate::now_ms(),
            background,
            pid,
            log: Mutex::new(Log::default()),
            version: watch::channel(0).0,
            session: Mutex::new(Some(session)),
            stdin: tokio::sync::Mutex::new(stdin),
            terminal: Mutex::new(terminal),
            output_limit: None,
            over_limit: AtomicBool::new(false),
            then: Mutex::new(None),
            kept_line: Mutex::new(KeptLine::default()),
        }
    }

    pub(crate) fn with_output_limit(mut self, limit: Option<u64>) -> Self {
        self.output_limit = limit;
        self
    }

    pub(crate) fn with_then(self, then: Option<crate::once::Then>) -> Self {
        if let Ok(mut kept) = self.kept_line.lock() {
            kept.wanted = then.is_some();
        }
        if let Ok(mut slot) = self.then.lock() {
            *slot = then;
        }
        self
    }

    /// The hold on a run's line to its cell past the process's end (see `KeptLine`).
    pub(crate) fn hold_line(self: &Arc<Self>) -> LineHold {
        LineHold(Arc::clone(self))
    }

    /// What follows the process's end, taken once by its watch when it ends.
    pub(crate) fn take_then(&self) -> Option<crate::once::Then> {
        self.then.lock().ok().and_then(|mut then| then.take())
    }

    pub(crate) fn output_limit(&self) -> Option<u64> {
        self.output_limit
    }

    /// Whether the process was killed for writing more than its output limit.
    pub(crate) fn over_output_limit(&self) -> bool {
        self.over_limit.load(Ordering::Relaxed)
    }

    /// Resizes the process's terminal; an error for a process without one.
    pub fn resize(&self, size: crate::TtySize) -> std::io::Result<()> {
        let terminal = self.terminal.lock().ok().and_then(|t| t.clone());
        match terminal {
            Some(master) => warden_cell::resize_terminal(master.as_fd(), size),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the process has no terminal (start it with `tty`)",
            )),
        }
    }

    pub fn info(&self) -> ProcessInfo {
        let exit = self.log.lock().ok().and_then(|l| l.exit.clone());
        ProcessInfo {
            id: self.id,
            cell: self.cell.clone(),
            argv: self.argv.clone(),
            pid: self.pid,
            started_ms: self.started_ms,
            background: self.background,
            running: exit.is_none(),
            exit,
        }
    }

    pub fn exit(&self) -> Option<ExitInfo> {
        self.log.lock().ok().and_then(|l| l.exit.clone())
    }

    pub(crate) fn push(&self, stream: Stream, data: &[u8]) {
        if let Ok(mut log) = self.log.lock() {
            let slot = stream as usize;
            log.counts[slot] += data.len() as u64;
            if let Some(limit) = self.output_limit
                && log.counts[0] + log.counts[1] > limit
                && !self.over_limit.swap(true, Ordering::Relaxed)
                && let Some(session) = self.session()
            {
                std::thread::spawn(move || session.signal(libc::SIGKILL));
            }
            let room = JOURNALED_OUTPUT.saturating_sub(log.captured[slot].len());
            let take = room.min(data.len());
            log.captured[slot].extend_from_slice(&data[..take]);
            // Small reads are gathered into the output no reader took yet, where it is of the
            // same stream; a large one is a chunk of its own at once (copied once).
            match &mut log.tail {
                Some((same, tail)) if *same == stream && tail.len() + data.len() <= GATHERED => {
                    tail.extend_from_slice(data);
                }
                _ if data.len() >= GATHERED / 4 => {
                    log.seal();
                    log.kept_bytes += CHUNK_COST;
                    log.chunks.push_back((stream, Arc::from(data)));
                }
                _ => {
                    log.seal();
                    log.tail = Some((stream, data.to_vec()));
                }
            }
            log.kept_bytes += data.len();
            log.trim();
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// Byte counts and the journaled head of each stream.
    pub(crate) fn totals(&self) -> ([u64; 2], [Vec<u8>; 2]) {
        self.log
            .lock()
            .map(|l| (l.counts, l.captured.clone()))
            .unwrap_or_default()
    }

    /// The keeper connection, while the process runs.
    pub(crate) fn session(&self) -> Option<Arc<dyn Session>> {
        self.session.lock().ok().and_then(|s| s.clone())
    }

    pub(crate) fn finish(&self, exit: ExitInfo) {
        if let Ok(mut log) = self.log.lock() {
            log.seal();
            log.trim();
            log.exit = Some(exit);
        }
        // What only a running process needs goes now (a run's line, once the run has
        // answered).
        let line = self
            .session
            .lock()
            .ok()
            .and_then(|mut session| session.take());
        let line = match self.kept_line.lock() {
            Ok(mut kept) if kept.wanted && !kept.let_go => {
                kept.line = line;
                None
            }
            _ => line,
        };
        drop(line);
        if let Ok(mut terminal) = self.terminal.lock() {
            *terminal = None;
        }
        if let Ok(mut stdin) = self.stdin.try_lock() {
            *stdin = None;
        }
        self.version.send_modify(|v| *v += 1);
    }

    /// The next item after `cursor` if there is one now (`None`: caught up with a running
    /// process).
    pub fn try_next(&self, cursor: &mut Cursor) -> Option<Item> {
        let mut log = self.log.lock().ok()?;
        if let Some(item) = log.take(cursor) {
            return Some(item);
        }
        log.exit.clone().map(Item::Exit)
    }

    /// The next item after `cursor`, waiting for it; advances the cursor.
    pub async fn next(&self, cursor: &mut Cursor) -> Item {
        loop {
            let mut changed = self.version.subscribe();
            if let Ok(mut log) = self.log.lock() {
                if let Some(item) = log.take(cursor) {
                    return item;
                }
                if let Some(exit) = &log.exit {
                    return Item::Exit(exit.clone());
                }
            }
            if changed.changed().await.is_err() {
                // The process object is going away; report what is known.
                return Item::Exit(self.exit().unwrap_or(ExitInfo {
                    reason: ExitReason::CellEnded,
                    code: None,
                    signal: None,
                    message: None,
                    duration_ms: 0,
                    usage: None,
                    stdout_bytes: 0,
                    stderr_bytes: 0,
                    journal_seq: None,
                }));
            }
        }
    }

    /// Sends a signal to the process's group (through the cell's keeper).
    pub async fn signal(self: &Arc<Self>, signal: i32) {
        if let Some(session) = self.session() {
            let _ = tokio::task::spawn_blocking(move || session.signal(signal)).await;
        }
    }

    /// Writes to the process's stdin; `close` ends it (on a terminal: sends end-of-file, ^D).
    pub async fn write_stdin(&self, data: &[u8], close: bool) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = self.stdin.lock().await;
        match stdin.as_mut() {
            None => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the process's stdin is closed",
            )),
            Some(Input::Pipe(pipe)) => {
                let written = pipe.write_all(data).await;
                if close || written.is_err() {
                    *stdin = None;
                }
                written
            }
            Some(Input::Tty(master)) => {
                let master = Arc::clone(master);
                let mut bytes = data.to_vec();
                if close {
                    bytes.push(0x04);
                }
                tokio::task::spawn_blocking(move || {
                    let mut rest = bytes.as_slice();
                    while !rest.is_empty() {
                        match nix::unistd::write(master.as_fd(), rest) {
                            Ok(n) => rest = &rest[n..],
                            Err(nix::Error::EINTR | nix::Error::EAGAIN) => continue,
                            Err(e) => return Err(std::io::Error::from_raw_os_error(e as i32)),
                        }
                    }
                    Ok(())
                })
                .await
                .map_err(std::io::Error::other)?
            }
        }
    }
}

/// Kills a foreground process whose reader went away before it ended.
#[derive(Debug)]
pub struct KillOnDrop(pub Arc<Process>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.exit().is_none()
            && let Some(session) = self.0.session()
        {
            std::thread::spawn(move || session.signal(libc::SIGKILL));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed step is a failed test

    use super::*;
    use std::os::fd::{AsRawFd, RawFd};
    use warden_cell::{CellError, tier::ExecEvent};

    /// A line to a cell whose hang-up (its drop) is seen.
    #[derive(Debug)]
    struct Line(Arc<AtomicBool>, OwnedFd);

    impl AsRawFd for Line {
        fn as_raw_fd(&self) -> RawFd {
            self.1.as_raw_fd()
        }
    }

    impl Session for Line {
        fn try_next_event(&self) -> Result<Option<(ExecEvent, Vec<OwnedFd>)>, CellError> {
            Ok(None)
        }
        fn signal(&self, _: i32) -> Result<(), CellError> {
            Ok(())
        }
    }

    impl Drop for Line {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn process(run: bool) -> (Arc<Process>, Arc<AtomicBool>) {
        let hung_up = Arc::new(AtomicBool::new(false));
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let line = Arc::new(Line(Arc::clone(&hung_up), fd));
        let process = Process::new(1, "c".into(), vec!["true".into()], false, 2, line, None);
        process.kept_line.lock().unwrap().wanted = run;
        (Arc::new(process), hung_up)
    }

    fn end(process: &Process) {
        process.finish(ExitInfo {
            reason: ExitReason::Exited,
            code: Some(0),
            signal: None,
            message: None,
            duration_ms: 1,
            usage: None,
            stdout_bytes: 0,
            stderr_bytes: 0,
            journal_seq: None,
        });
    }

    #[test]
    fn a_runs_line_outlives_its_process_until_the_run_lets_go_and_no_other_does() {
        // A run's: held past the end, let go of with the hold.
        let (run, hung_up) = process(true);
        let hold = run.hold_line();
        end(&run);
        assert!(run.exit().is_some());
        assert!(
            !hung_up.load(Ordering::SeqCst),
            "let go of before the run answered"
        );
        drop(hold);
        assert!(hung_up.load(Ordering::SeqCst), "kept after the run let go");
        // A run whose hold went first (its caller went away): let go of at the end.
        let (run, hung_up) = process(true);
        drop(run.hold_line());
        end(&run);
        assert!(hung_up.load(Ordering::SeqCst), "kept with nobody to let go");
        // Any other process: let go of at its end.
        let (other, hung_up) = process(false);
        end(&other);
        assert!(
            hung_up.load(Ordering::SeqCst),
            "an exec's line kept past its end"
        );
    }
}
