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
const KEPT_OUTPUT: usize = 4 * 1024 * 1024;
/// Ended processes whose output is kept per cell (the oldest are forgotten first).
pub(crate) const KEPT_ENDED: usize = 16;
/// Output copied into the journal's exec entry, per stream.
pub(crate) const JOURNALED_OUTPUT: usize = 64 * 1024;

/// What a reader gets next.
#[derive(Debug, Clone)]
pub enum Item {
    Output(Stream, Arc<[u8]>),
    /// Output that was dropped before this reader got to it (bytes).
    Dropped(u64),
    Exit(ExitInfo),
}

#[derive(Debug, Default)]
struct Log {
    chunks: VecDeque<(Stream, Arc<[u8]>)>,
    /// Index of `chunks[0]` in the process's whole output.
    first: u64,
    kept_bytes: usize,
    dropped_bytes: u64,
    counts: [u64; 2],
    captured: [Vec<u8>; 2],
    exit: Option<ExitInfo>,
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
        }
    }

    pub(crate) fn with_output_limit(mut self, limit: Option<u64>) -> Self {
        self.output_limit = limit;
        self
    }

    pub(crate) fn with_then(self, then: Option<crate::once::Then>) -> Self {
        if let Ok(mut slot) = self.then.lock() {
            *slot = then;
        }
        self
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
            log.kept_bytes += data.len();
            log.chunks.push_back((stream, Arc::from(data)));
            while log.kept_bytes > KEPT_OUTPUT && log.chunks.len() > 1 {
                if let Some((_, old)) = log.chunks.pop_front() {
                    log.kept_bytes -= old.len();
                    log.dropped_bytes += old.len() as u64;
                    log.first += 1;
                }
            }
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
            log.exit = Some(exit);
        }
        // What only a running process needs goes now.
        if let Ok(mut session) = self.session.lock() {
            *session = None;
        }
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
    pub fn try_next(&self, cursor: &mut u64) -> Option<Item> {
        let log = self.log.lock().ok()?;
        if *cursor < log.first {
            *cursor = log.first;
            return Some(Item::Dropped(log.dropped_bytes));
        }
        let at = (*cursor - log.first) as usize;
        if let Some((stream, data)) = log.chunks.get(at) {
            *cursor += 1;
            return Some(Item::Output(*stream, Arc::clone(data)));
        }
        log.exit.clone().map(Item::Exit)
    }

    /// The next item after `cursor` (a chunk index), waiting for it; advances the cursor.
    pub async fn next(&self, cursor: &mut u64) -> Item {
        loop {
            let mut changed = self.version.subscribe();
            if let Ok(log) = self.log.lock() {
                if *cursor < log.first {
                    let lost: u64 = log.dropped_bytes;
                    *cursor = log.first;
                    return Item::Dropped(lost);
                }
                let at = (*cursor - log.first) as usize;
                if let Some((stream, data)) = log.chunks.get(at) {
                    *cursor += 1;
                    return Item::Output(*stream, Arc::clone(data));
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
