//! A gVisor cell that runs one command with the caller's stdio (`warden run` without a
//! daemon): a keeper started for it, in the caller's process group and with the caller's stdio,
//! runs the command as the sandbox's first process and relays its output (counting it against
//! the policy's limit), keeps the wall-clock limit and passes the caller's signals on; how the
//! cell ended comes back in its report.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::process::Command;

use crate::process::backend::{KeeperRequest, ProcessBackend};
use crate::process::outcome::Ending;
use crate::process::store::Store;
use crate::tier::{Attached, CellSpec, StartError};

pub fn run(
    keepers: &ProcessBackend,
    mut spec: CellSpec,
    argv: Vec<std::ffi::OsString>,
    discard_changes: bool,
    before_start: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Attached, StartError> {
    let config = keepers.config();
    let name = spec.name.clone();
    // The start is journaled before anything of the cell exists: its command cannot run first.
    before_start().map_err(StartError::Host)?;
    let report = config
        .runtime
        .join(format!(".run-{name}-{}.json", std::process::id()));
    spec.report = Some(report.clone());
    let request = serde_json::to_vec(&KeeperRequest {
        spec,
        open_files: config.keeper_open_files,
        argv,
        discard_changes,
        log_to: None,
    })
    .map_err(|e| StartError::Host(format!("writing the keeper's request: {e}")))?;
    // The request in a file of this user's alone (the command's stdin is the caller's).
    let request_file = config
        .runtime
        .join(format!(".keep-{name}-{}.json", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&request_file)
        .and_then(|mut file| file.write_all(&request));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&request_file);
        return Err(StartError::Host(format!(
            "writing the keeper's request {}: {e}",
            request_file.display()
        )));
    }
    let mut command = Command::new(&config.warden_exe);
    command
        .arg("keep")
        .envs(config.keeper_env.iter().map(|(k, v)| (k, v)))
        .env("WARDEN_RUNTIME_DIR", &config.runtime)
        .env("WARDEN_STATE_DIR", &config.state)
        .env(crate::process::backend::KEEP_REQUEST, &request_file);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = std::fs::remove_file(&request_file);
            return Err(StartError::Host(format!(
                "starting the keeper {}: {e}",
                config.warden_exe.display()
            )));
        }
    };
    let status = child
        .wait()
        .map_err(|e| StartError::Host(format!("waiting for the keeper: {e}")))?;
    let ended = std::fs::read(&report)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok());
    let _ = std::fs::remove_file(&report);
    let _ = std::fs::remove_file(&request_file);
    let Some(ended) = ended else {
        // The keeper said why on the caller's stderr.
        return Err(StartError::Refused(format!(
            "the cell's keeper ended ({status}) before the cell did"
        )));
    };
    let ending = Ending::from_report(&ended)
        .ok_or_else(|| StartError::Host(format!("the keeper's report is not one: {ended}")))?;
    let store = Store::open(config.state.clone()).map_err(|e| StartError::Host(e.to_string()))?;
    Ok(Attached {
        kept_changes: store.layer(&name).exists(),
        name,
        ending,
        notices: Vec::new(),
    })
}
