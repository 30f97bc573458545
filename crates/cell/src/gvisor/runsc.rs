//! The `runsc` binary and the flags every call of it shares.
//!
//! The warden drives runsc as a program, as its own OCI tooling does: `run` for a cell's life
//! (in the foreground and attached, so that the sandbox goes when the keeper does), `exec`
//! for each process, `kill` and `delete` to clean up, `checkpoint`/`restore` for memory
//! snapshots. runsc hands the stdio it is given to the sandbox, and changes the owner of what
//! they are (a terminal, a file) to the sandbox's user: it is only ever given pipes and
//! terminals the warden made for the purpose, never a descriptor of anybody else's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where runsc is looked for when `WARDEN_RUNSC` does not name it.
const SEARCHED: [&str; 3] = ["/usr/bin/runsc", "/usr/sbin/runsc", "/usr/local/bin/runsc"];

/// runsc, with the state directory the warden gives it.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub binary: PathBuf,
    /// runsc's own state (`--root`): under Warden's state directory.
    pub root: PathBuf,
    /// The sandbox's network: its own loopback only (`none`: gVisor's network stack, the
    /// stricter, and the one runsc can checkpoint), or the sockets of the namespace the warden
    /// made, where the gateway listens (`host`).
    pub network: Network,
}

/// See [`Runsc::network`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    None,
    Host,
}

impl Runsc {
    /// The runsc this host has (`WARDEN_RUNSC`, else the usual places, else `PATH`).
    pub fn find(state: &Path) -> Option<Self> {
        let binary = std::env::var_os("WARDEN_RUNSC")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                SEARCHED
                    .iter()
                    .map(PathBuf::from)
                    .find(|p| p.is_file())
                    .or_else(|| on_path("runsc"))
            })?;
        binary.is_file().then(|| Self {
            binary,
            root: state.join("gvisor").join("runsc"),
            network: Network::None,
        })
    }

    /// A command of runsc with the flags every call shares: the ptrace platform (the one that
    /// works in a VM without nested virtualization), the cell's network (see `network`), no
    /// cgroups of runsc's own (the warden places the sandbox in the cell's), no host sockets.
    pub fn command(&self, verb: &str) -> Command {
        let mut command = Command::new(&self.binary);
        command
            .arg("--root")
            .arg(&self.root)
            .args(["--platform=ptrace", "--ignore-cgroups", "--host-uds=none"])
            .arg(match self.network {
                Network::None => "--network=none",
                Network::Host => "--network=host",
            });
        // runsc's own debug logs, for a sandbox that misbehaves (a directory; see the README).
        if let Some(dir) = std::env::var_os("WARDEN_RUNSC_DEBUG").filter(|d| !d.is_empty()) {
            let mut log = std::ffi::OsString::from("--debug-log=");
            log.push(dir);
            log.push("/");
            command.arg("--debug").arg(log);
        }
        command.arg(verb);
        command
    }

    /// Whether runsc keeps state of a container `id` (one that ended with runsc killed, before
    /// it could clean up after it): then `delete --force` is needed before the name is used
    /// again. (runsc names its state files `ID_sandbox:ID.state`; looking costs a directory
    /// read, where asking runsc costs a start of it.)
    pub fn has_state(&self, id: &str) -> bool {
        let prefix = format!("{id}_sandbox:");
        std::fs::read_dir(&self.root).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        })
    }

    /// The status runsc's own record of container `id` gives (`created`, `running`, `paused`,
    /// `stopped`): its state file (`ID_sandbox:ID.state`, see `has_state`), a JSON document
    /// whose `status` runsc writes as the container changes. A read of a small file, where
    /// `runsc state` is a start of runsc (20-25 ms of CPU on this host, beside the sandbox it
    /// waits for). `None` where there is no such file or it does not read as one of this
    /// container's (being written, or a runsc that keeps its state otherwise): runsc is asked
    /// then.
    pub fn recorded_status(&self, id: &str) -> Option<String> {
        let text = std::fs::read(self.root.join(format!("{id}_sandbox:{id}.state"))).ok()?;
        let record: serde_json::Value = serde_json::from_slice(&text).ok()?;
        if record.get("id")?.as_str()? != id {
            return None;
        }
        Some(record.get("status")?.as_str()?.to_owned())
    }

    /// runsc's own word on its version (`runsc --version`'s first line).
    pub fn version(&self) -> Option<String> {
        let out = Command::new(&self.binary).arg("--version").output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines().next().map(|l| l.trim().to_owned())
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path: OsString = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_root(root: &Path) -> Runsc {
        Runsc {
            binary: PathBuf::from("/nonexistent/runsc"),
            root: root.to_path_buf(),
            network: Network::None,
        }
    }

    #[test]
    fn the_status_is_read_from_runscs_state_file_and_nothing_else_is_taken_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let runsc = in_root(dir.path());
        let write = |id: &str, text: &str| {
            std::fs::write(dir.path().join(format!("{id}_sandbox:{id}.state")), text).unwrap();
        };
        // As runsc writes it (its fields abridged).
        write(
            "a",
            r#"{"id":"a","spec":{"ociVersion":"1.0.0"},"status":"running","goferPid":7}"#,
        );
        write("b", r#"{"id":"b","status":"created"}"#);
        // Cut short while it is written, another container's, one with no status.
        write("c", r#"{"id":"c","status":"runn"#);
        write("d", r#"{"id":"other","status":"running"}"#);
        write("e", r#"{"id":"e","state":"running"}"#);
        assert_eq!(runsc.recorded_status("a").as_deref(), Some("running"));
        assert_eq!(runsc.recorded_status("b").as_deref(), Some("created"));
        for id in ["c", "d", "e", "none"] {
            assert_eq!(runsc.recorded_status(id), None, "{id}");
        }
    }
}
