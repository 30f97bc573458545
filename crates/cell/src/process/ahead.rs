//! Keepers started ahead of the cells they will keep. A keeper started ahead waits for its
//! request on its line, a socket that is its stdin, and answers `ready` on the same line once
//! its cell takes execs. A keeper is no cell: it holds nothing of any policy until its request
//! comes, so one started ahead serves any cell. Where keepers are started ahead (a daemon), the
//! keepers' fork server (`forks`) forks them; elsewhere each is the `warden` binary started
//! anew (about 2.5 ms). A cell whose caller hands it secrets gets a keeper of its own, started
//! then as `warden keep` (the secrets travel in its environment only). A keeper whose line
//! closes with no request ends quietly: that is how the ones left idle go when their daemon
//! does.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::AsFd as _;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::forks::{ForkedKeeper, Forks};
use crate::tier::ProcessConfig;

/// A keeper process and the line its request goes down and its `ready` comes up.
#[derive(Debug)]
pub(crate) struct Keeper {
    pub(crate) child: KeeperProcess,
    pub(crate) line: UnixStream,
}

/// A keeper: started as `warden keep`, or forked by the keepers' fork server; the daemon's
/// child either way.
#[derive(Debug)]
pub(crate) enum KeeperProcess {
    Started(Child),
    Forked(ForkedKeeper),
}

impl KeeperProcess {
    pub(crate) fn pid(&self) -> i32 {
        match self {
            Self::Started(child) => child.id() as i32,
            Self::Forked(forked) => forked.pid(),
        }
    }

    /// Its exit status, reaping it, once it ended.
    pub(crate) fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self {
            Self::Started(child) => child.try_wait(),
            Self::Forked(forked) => forked.try_wait(),
        }
    }

    pub(crate) fn kill(&mut self) -> std::io::Result<()> {
        match self {
            Self::Started(child) => child.kill(),
            Self::Forked(forked) => forked.kill(),
        }
    }

    pub(crate) fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            Self::Started(child) => child.wait(),
            Self::Forked(forked) => forked.wait(),
        }
    }
}

/// Starts a keeper (`warden keep`) that waits for its request on its line; `log`: where its
/// stdout and stderr go (none: nowhere until its request names a log); `secrets`: variables of
/// its environment that its gateway's credentials read.
pub(crate) fn spawn(
    config: &ProcessConfig,
    secrets: &[(String, String)],
    log: Option<File>,
) -> std::io::Result<Keeper> {
    let (line, theirs) = UnixStream::pair()?;
    let (out, err) = match log {
        Some(log) => {
            let copy = log.try_clone()?;
            (Stdio::from(log), Stdio::from(copy))
        }
        None => (Stdio::null(), Stdio::null()),
    };
    let mut command = Command::new(&config.warden_exe);
    command.arg("keep");
    // The caller's secrets reach the keeper's gateway as the variables its credentials read:
    // in its environment, never on a command line or in a file.
    for (var, value) in secrets {
        command.env(var, value);
    }
    let child = command
        .envs(config.keeper_env.iter().map(|(k, v)| (k, v)))
        .env("WARDEN_RUNTIME_DIR", &config.runtime)
        .env("WARDEN_STATE_DIR", &config.state)
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .stdout(out)
        .stderr(err)
        // Its own process group: signals meant for the caller's terminal are not its.
        .process_group(0)
        .spawn()?;
    Ok(Keeper {
        child: KeeperProcess::Started(child),
        line,
    })
}

impl Keeper {
    /// Sends the request (the line is then closed for writing: the keeper reads to its end).
    pub(crate) fn send(&mut self, request: &[u8]) {
        // A keeper that died at once says why in its log, not through this write.
        let _ = self.line.write_all(request);
        let _ = self.line.shutdown(std::net::Shutdown::Write);
    }

    /// Waits until the keeper says its cell is ready. `Err(Some(status))`: it ended first;
    /// `Err(None)`: `deadline` passed (it is still there).
    pub(crate) fn wait_ready(&mut self, deadline: Instant) -> Result<(), Option<ExitStatus>> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut said = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(None);
            }
            let timeout = PollTimeout::try_from(left.as_millis().min(1000) as i32)
                .unwrap_or(PollTimeout::NONE);
            let mut fds = [PollFd::new(self.line.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) | Err(nix::Error::EINTR) => continue,
                Ok(_) => {}
                Err(_) => return Err(self.ended_within(Duration::from_secs(1))),
            }
            let mut buf = [0u8; 16];
            match self.line.read(&mut buf) {
                Ok(0) | Err(_) => return Err(self.ended_within(Duration::from_secs(5))),
                Ok(n) => {
                    said.extend_from_slice(&buf[..n]);
                    if said.starts_with(b"ready\n") {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The keeper's exit status, once it ended within `wait`; killed (and reaped) after it.
    fn ended_within(&mut self, wait: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + wait;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                return self.child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// A keeper forked by `forks`; `log`: where its stdout and stderr go (none: nowhere until its
/// request names a log).
fn fork(forks: &Forks, log: Option<&File>) -> std::io::Result<Keeper> {
    let (line, theirs) = UnixStream::pair()?;
    let (out, err) = match log {
        Some(log) => (log.try_clone()?.into(), log.try_clone()?.into()),
        None => (
            File::options().write(true).open("/dev/null")?.into(),
            File::options().write(true).open("/dev/null")?.into(),
        ),
    };
    let forked = forks.fork(theirs.into(), out, err)?;
    Ok(Keeper {
        child: KeeperProcess::Forked(forked),
        line,
    })
}

/// Keepers started ahead, up to a number, and started again as they are taken; and, where
/// keepers are started ahead (a daemon's), the fork server that starts them.
#[derive(Debug)]
pub(crate) struct Ahead {
    config: ProcessConfig,
    idle: Mutex<Vec<Keeper>>,
    refilling: AtomicBool,
    forks: Option<Arc<Forks>>,
}

impl Ahead {
    pub(crate) fn new(config: ProcessConfig) -> Arc<Self> {
        let ahead = Arc::new(Self {
            idle: Mutex::new(Vec::new()),
            refilling: AtomicBool::new(false),
            forks: (config.keepers_ahead > 0).then(|| Forks::shared(&config)),
            config,
        });
        ahead.refill();
        ahead
    }

    /// A keeper started ahead, if one is there; another is started in its place, off the
    /// caller's path.
    pub(crate) fn take(self: &Arc<Self>) -> Option<Keeper> {
        let mut keeper = self.idle.lock().ok()?.pop();
        // One that ended while idle (killed from outside) is of no use.
        while let Some(k) = keeper.as_mut() {
            if matches!(k.child.try_wait(), Ok(None)) {
                break;
            }
            keeper = self.idle.lock().ok()?.pop();
        }
        self.refill();
        keeper
    }

    /// Starts a keeper: forked by the fork server where keepers are started ahead (a server that
    /// cannot be started or fails is left, and the keeper started as `warden keep`), else as
    /// `warden keep`. `log` and `secrets` as for [`spawn`]. A keeper given secrets is started
    /// as `warden keep`, with them in its environment: they never pass through the server,
    /// whose memory every keeper it forks later would copy.
    pub(crate) fn start(
        &self,
        secrets: &[(String, String)],
        log: Option<File>,
    ) -> std::io::Result<Keeper> {
        if let (Some(forks), true) = (&self.forks, secrets.is_empty()) {
            match fork(forks, log.as_ref()) {
                Ok(keeper) => return Ok(keeper),
                Err(err) => eprintln!(
                    "warden: note: the keepers' fork server failed ({err}); this keeper is started as `warden keep`"
                ),
            }
        }
        spawn(&self.config, secrets, log)
    }

    /// Keepers started idle now.
    pub(crate) fn idle(&self) -> usize {
        self.idle.lock().map_or(0, |idle| idle.len())
    }

    /// Starts keepers on a thread of its own until as many wait as the configuration asks.
    fn refill(self: &Arc<Self>) {
        if self.config.keepers_ahead == 0 || self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let ahead = Arc::clone(self);
        let started = std::thread::Builder::new()
            .name("keepers-ahead".to_owned())
            .spawn(move || {
                while ahead.idle() < ahead.config.keepers_ahead {
                    match ahead.start(&[], None) {
                        Ok(keeper) => match ahead.idle.lock() {
                            Ok(mut idle) => idle.push(keeper),
                            Err(_) => break,
                        },
                        // A keeper that cannot be started now is started when a cell asks.
                        Err(_) => break,
                    }
                }
                ahead.refilling.store(false, Ordering::Release);
            });
        if started.is_err() {
            self.refilling.store(false, Ordering::Release);
        }
    }
}

impl Drop for Ahead {
    /// The keepers still idle are ours and keep nothing: they are ended and reaped.
    fn drop(&mut self) {
        if let Ok(idle) = self.idle.get_mut() {
            for mut keeper in idle.drain(..) {
                drop(keeper.line);
                let _ = keeper.child.kill();
                let _ = keeper.child.wait();
            }
        }
    }
}
