//! `warden`: run commands in cells and control them from outside.
//!
//! Every subcommand turns its arguments into a typed request and calls the same core functions
//! (`warden_cell`, `warden_policy`); no confinement logic lives here.

mod cli;
mod client;
mod commands;
mod daemon;
mod render;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match commands::dispatch(args) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("warden: {err:#}");
            ExitCode::from(warden_protocol::exit::WARDEN_ERROR as u8)
        }
    }
}
