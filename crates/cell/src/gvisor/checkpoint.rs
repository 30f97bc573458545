//! Memory snapshots of gVisor cells: `runsc checkpoint` saves the sandbox's whole state (every
//! process where it was, its memory, its open files) into an image, and the cell ends there; a
//! cell made with `restore` comes back from the image (`runsc restore`, in the foreground like
//! `run`), its workspace from the snapshot taken at the same moment.
//!
//! A cell's network must be the sandbox's own for this: runsc cannot save sockets of the host's
//! stack, which is what a cell with a gateway uses.

use std::path::Path;
use std::process::Stdio;

use super::runsc::Runsc;
use crate::tier::CellError;

/// runsc's words when it cannot save a cell that uses the host's network stack.
const HOSTINET: &str = "hostinet";

/// The file in a cell's runtime folder that says an exec was ever started in it (the host side
/// makes it before its first `runsc exec`).
pub const EXECS_MARKER: &str = "execs";

/// Runs a runsc command to its end with pipes of its own; its stderr's last line on failure.
fn quietly(command: &mut std::process::Command) -> Result<(), String> {
    let out = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("starting runsc: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(said
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("runsc failed without saying why")
        .trim()
        .to_owned())
}

/// Ends the processes of the cell that hold a descriptor of the host (the pipes and terminals
/// of the warden's execs: runsc cannot save them), through the cell's own init, as the cell's
/// user. Processes that run on their own, their stdio inside the cell, are saved.
fn release(runsc: &Runsc, name: &str, user: (u32, u32)) -> Result<(), CellError> {
    quietly(
        runsc
            .command("exec")
            .arg("--user")
            .arg(format!("{}:{}", user.0, user.1))
            .arg(name)
            .args([super::compat::INIT_IN_CELL, "release"]),
    )
    .map_err(|e| CellError::Refused(format!("ending the execs of cell `{name}`: {e}")))
}

/// Ends the warden's execs in the cell (see `release`; not needed, and not paid for, while
/// `execs` does not exist: no exec was ever started in it), holds the sandbox still (`runsc
/// pause`: gVisor stops its tasks, the sandbox still answers runsc), calls `while_held`, then
/// saves the image into `image` or, when that or `while_held` fails, lets the cell go on.
pub fn save(
    runsc: &Runsc,
    name: &str,
    user: (u32, u32),
    (image, execs): (&Path, &Path),
    while_held: &mut dyn FnMut() -> Result<(), String>,
) -> Result<(), CellError> {
    std::fs::create_dir_all(image)
        .map_err(|e| CellError::Host(format!("creating {}: {e}", image.display())))?;
    let released = execs.exists();
    if released {
        release(runsc, name, user)?;
    }
    quietly(runsc.command("pause").arg(name))
        .map_err(|e| CellError::Refused(format!("holding cell `{name}` still: {e}")))?;
    let saved = while_held().and_then(|()| {
        quietly(
            runsc
                .command("checkpoint")
                .arg("--image-path")
                .arg(image)
                .arg(name),
        )
    });
    match saved {
        Ok(()) => Ok(()),
        Err(message) => {
            let _ = quietly(runsc.command("resume").arg(name));
            let _ = std::fs::remove_dir_all(image);
            if !released {
                // Should anything but an exec have left a descriptor of the host in the cell,
                // the next checkpoint looks for it.
                let _ = std::fs::File::create(execs);
            }
            Err(if message.contains(HOSTINET) {
                CellError::Unsupported(format!(
                    "cell `{name}` lets traffic out through the gateway, on its namespace's network stack, whose sockets runsc cannot save; only a gVisor cell with no network (no `network.allow`, `ask` or `inference`) can be checkpointed"
                ))
            } else {
                CellError::Host(format!("saving cell `{name}`: {message}"))
            })
        }
    }
}
