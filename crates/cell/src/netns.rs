//! A cell's network namespace, made on a thread of its own (a network namespace is a thread's:
//! the rest of the process stays in the host's), with loopback only, and, where the policy lets
//! anything out, the gateway's sockets bound in it and the rest of its traffic redirected to
//! them, exactly as the process tier's cell does it for itself. Made so by the gVisor tier's
//! keeper (runsc joins it: `--network=host` with the namespace's path in the bundle, so the
//! sandbox's sockets are this namespace's: every egress rule, credential and record holds
//! unchanged), and by a root `warden run` for a process cell without a gateway, ahead of the
//! cell's clone (`process::run::NetworkAhead`).

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
        std::thread::Builder::new()
            .name("cell-netns".to_owned())
            .spawn(move || -> io::Result<Self> {
                // The CPU's features, which the standard library asks the CPU about once per
                // process (a dozen `cpuid`s, each a trap to the hypervisor in a VM: 30 us
                // here), asked here, beside the caller, before its first need of them
                // (hashing the journal, searching bytes).
                #[cfg(target_arch = "x86_64")]
                let _ = std::arch::is_x86_feature_detected!("avx2");
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                    io::Error::other(format!("creating the network namespace: {e}"))
                })?;
                crate::process::sys::loopback_up()?;
                let fd = crate::process::sys::network_namespace_of_this_thread()?;
                let sockets = match gateway {
                    true => Some(crate::gateway::Sockets::open()?),
                    false => None,
                };
                Ok(Self { fd, sockets })
            })
            .map(Making)
    }
}

/// A network namespace being made (`Namespace::start`).
#[derive(Debug)]
pub struct Making(std::thread::JoinHandle<io::Result<Namespace>>);

impl Making {
    /// The namespace, once its thread has made it.
    pub fn finish(self) -> io::Result<Namespace> {
        self.0
            .join()
            .map_err(|_| io::Error::other("the thread making the network namespace failed"))?
    }
}
