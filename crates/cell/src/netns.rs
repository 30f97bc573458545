//! A cell's network namespace, made on a thread of its own (a network namespace is a thread's:
//! the rest of the process stays in the host's), with loopback only, and, where the policy lets
//! anything out, the gateway's sockets bound in it and the rest of its traffic redirected to
//! them, exactly as a rootless process cell's init does it for itself. Made so by the gVisor tier's
//! keeper (runsc joins it: `--network=host` with the namespace's path in the bundle, so the
//! sandbox's sockets are this namespace's: every egress rule, credential and record holds
//! unchanged), and by a root warden for a process cell, ahead of the cell's clone
//! (`process::run::NetworkAhead`), where a cell with a gateway has its redirection made after
//! the clone, beside the init's setup (`start_unredirected`, `gateway::redirect_in`).

use std::io;
use std::os::fd::OwnedFd;

/// A cell's network namespace (the gVisor keeper holds it for the cell's life).
#[derive(Debug)]
pub struct Namespace {
    /// The namespace itself (`/proc/self/fd/N` of it is what runsc is given).
    pub fd: OwnedFd,
    /// The gateway's sockets in it, where the policy asked for a gateway.
    pub sockets: Option<crate::gateway::Sockets>,
}

impl Namespace {
    /// Makes the namespace on a thread of its own (a network namespace is a thread's: the
    /// rest of the keeper, the gateway's outgoing connections among it, stays in the host's),
    /// brings up its loopback, and opens the gateway's sockets when `gateway`.
    pub fn make(gateway: bool) -> io::Result<Self> {
        Self::start(gateway)?.finish()
    }

    /// `make` begun: the namespace is made on its thread while the caller goes on; `finish`
    /// waits for it.
    pub fn start(gateway: bool) -> io::Result<Making> {
        Self::spawn(Gateway::Known {
            gateway,
            redirect: true,
        })
    }

    /// `start`, with the gateway's sockets opened but its redirection left to the caller
    /// (`gateway::redirect_in`), who can start it later, beside other work: the thread is then
    /// done sooner.
    pub fn start_unredirected(gateway: bool) -> io::Result<Making> {
        Self::spawn(Gateway::Known {
            gateway,
            redirect: false,
        })
    }

    /// Starts making a namespace before the policy of the cell it is for is known (a root
    /// `warden run`, at its start: `start_early`), the gateway's sockets left to be asked for
    /// with `Making::decide`.
    fn start_undecided() -> io::Result<Making> {
        let (tell, told) = std::sync::mpsc::channel();
        let mut making = Self::spawn(Gateway::Later(told))?;
        making.decide = Some(tell);
        Ok(making)
    }

    fn spawn(gateway: Gateway) -> io::Result<Making> {
        std::thread::Builder::new()
            .name("cell-netns".to_owned())
            .spawn(move || -> io::Result<Self> {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                    io::Error::other(format!("creating the network namespace: {e}"))
                })?;
                crate::process::sys::loopback_up()?;
                let fd = crate::process::sys::network_namespace_of_this_thread()?;
                let (gateway, redirect) = match gateway {
                    Gateway::Known { gateway, redirect } => (gateway, redirect),
                    // Never told (the caller let go of it): none.
                    Gateway::Later(told) => (told.recv().unwrap_or(false), false),
                };
                let sockets = match (gateway, redirect) {
                    (true, true) => Some(crate::gateway::Sockets::open()?),
                    (true, false) => Some(crate::gateway::Sockets::open_unredirected()?),
                    (false, _) => None,
                };
                Ok(Self { fd, sockets })
            })
            .map(|thread| Making {
                thread: Some(thread),
                decide: None,
            })
    }
}

/// Whether the gateway's sockets are opened in a namespace being made: known at its start, or
/// told once the cell's policy is known (unredirected, as `start_unredirected`).
enum Gateway {
    Known { gateway: bool, redirect: bool },
    Later(std::sync::mpsc::Receiver<bool>),
}

/// A network namespace being made (`Namespace::start`). Dropped unfinished, its thread is
/// told that no gateway is wanted and joined: a process tier's clone is made with no other
/// thread.
#[derive(Debug)]
pub struct Making {
    thread: Option<std::thread::JoinHandle<io::Result<Namespace>>>,
    /// Where the namespace was started before its cell's policy was known: tells its thread
    /// whether to open the gateway's sockets.
    decide: Option<std::sync::mpsc::Sender<bool>>,
}

impl Making {
    /// Tells a namespace started early (`start_early`) whether to open the gateway's sockets
    /// (unredirected); one that is never told opens none.
    pub fn decide(&mut self, gateway: bool) {
        if let Some(tell) = self.decide.take() {
            let _ = tell.send(gateway);
        }
    }

    /// The namespace, once its thread has made it (and is gone).
    pub fn finish(mut self) -> io::Result<Namespace> {
        self.join()
    }

    fn join(&mut self) -> io::Result<Namespace> {
        drop(self.decide.take());
        self.thread
            .take()
            .ok_or_else(|| io::Error::other("the network namespace was taken already"))?
            .join()
            .map_err(|_| io::Error::other("the thread making the network namespace failed"))?
    }
}

impl Drop for Making {
    fn drop(&mut self) {
        if self.thread.is_some() {
            drop(self.join());
        }
    }
}

/// A namespace started by `start_early`, until the run takes it (`take_early`).
static EARLY: std::sync::Mutex<Option<Making>> = std::sync::Mutex::new(None);

/// Starts making a network namespace for the cell of a root `warden run`, at the run's start,
/// before its policy is read (a process cell of every policy takes one, as root; a cell of
/// another tier, or a run that goes through a daemon, lets go of it): its making, 0.55-0.7 ms
/// of the kernel's on the other core, is then under way while the run reads its policy, checks
/// its paths and opens its journal, where it began once the run had come that far, and the run
/// waited for it before its clone (0.25-0.3 ms, traced). The thread is started with the
/// signals a run forwards to its cell blocked (a thread takes its maker's mask), as the run's
/// own threads are, and the caller's mask is left as it was: a run through a daemon handles
/// them itself.
pub fn start_early() {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let Ok(mut early) = EARLY.lock() else {
        return;
    };
    if early.is_some() {
        return;
    }
    let Ok(mask) = crate::process::run::forwarded_signals()
        .thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK)
    else {
        return;
    };
    let started = Namespace::start_undecided();
    let _ = mask.thread_set_mask();
    if let Ok(making) = started {
        crate::process::sys::keep_only_other_thread_off_this_cpu();
        *early = Some(making);
    }
}

/// The namespace `start_early` began, if any (taken once).
pub(crate) fn take_early() -> Option<Making> {
    EARLY.lock().ok()?.take()
}

/// Lets go of a namespace `start_early` began that no process cell of this run takes (a cell
/// of another tier, a run through a daemon): its thread is told and joined, so that the
/// process is left with the threads it had (the gVisor tier forks its keeper only from a
/// process of one thread).
pub fn let_go_of_early() {
    if let Some(making) = take_early() {
        drop(making);
        // Joined, the thread may be listed a moment longer (see `thread_count_once_joined`).
        let _ = crate::process::sys::thread_count_once_joined();
    }
}
