//! Command-line grammar.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "warden",
    version,
    about = "Run commands and agents in cells that cannot touch the host; control them from outside."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command in a fresh cell; exits with the command's status.
    Run(RunArgs),
    /// List running cells (and, with --all, stopped cells with kept workspace changes).
    Ps {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Include stopped cells whose workspace changes are kept.
        #[arg(long, short = 'a')]
        all: bool,
    },
    /// Show what a cell changed in its copy-on-write workspace.
    Diff {
        name: String,
        /// Print JSON.
        #[arg(long, conflicts_with = "stat")]
        json: bool,
        /// Only list the changed paths with a summary.
        #[arg(long)]
        stat: bool,
    },
    /// Write chosen workspace changes of a cell into the host directory.
    Apply {
        name: String,
        /// Paths to apply (a directory selects what is below it); none applies everything.
        paths: Vec<String>,
        /// Say what would be applied, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Overwrite host files edited since the cell started.
        #[arg(long)]
        force: bool,
        /// Apply sensitive changes (hooks, rc files, new executables, outward symlinks) too.
        #[arg(long)]
        include_sensitive: bool,
    },
    /// Remove a stopped cell's workspace layer (its unapplied changes are lost), or a snapshot
    /// (`CELL@SNAP`).
    Rm { name: String },
    /// Save the current state of a cell's workspace as an immutable snapshot `CELL@SNAP`.
    Snapshot {
        name: String,
        /// Snapshot name (default: s1, s2, ...).
        #[arg(long = "as", value_name = "SNAP")]
        as_name: Option<String>,
    },
    /// List snapshots with their size.
    Snapshots {
        #[arg(long)]
        json: bool,
    },
    /// Return a cell's workspace to a snapshot of it, or to its start.
    Reset {
        name: String,
        /// Snapshot to return to (`CELL@SNAP` or `SNAP`); default: the start.
        #[arg(long)]
        to: Option<String>,
    },
    /// Run a new cell starting from a snapshot (or from a cell's current state).
    Fork {
        /// `CELL@SNAP`, or a cell name (snapshotted first).
        source: String,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Freeze every process of a cell.
    Pause { name: String },
    /// Thaw a paused cell.
    Resume { name: String },
    /// End every process of a cell.
    Kill { name: String },
    /// Show the egress gateway's decisions for a cell (running or stopped).
    Net {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// List the questions a cell's `ask` rules are waiting on.
    Approvals {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Let a held connection through (ID from `warden approvals NAME` or the cell's terminal).
    Approve { name: String, id: u64 },
    /// Refuse a held connection: the cell gets a 403 that says so.
    Deny { name: String, id: u64 },
    /// Check or explain a policy.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Report which isolation features this host offers, and how to fix what is missing.
    Doctor {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Policy file (YAML).
    #[arg(long, conflicts_with = "preset")]
    pub policy: Option<PathBuf>,
    /// Built-in policy preset (`warden policy presets` lists them).
    #[arg(long)]
    pub preset: Option<String>,
    /// Host directory that appears at /workspace.
    #[arg(long, short = 'w')]
    pub workspace: Option<PathBuf>,
    /// Cell name, for `warden ps`, `pause`, `resume` and `kill`.
    #[arg(long)]
    pub name: Option<String>,
    /// Remove the cell when it ends: its workspace changes and its egress record.
    #[arg(long)]
    pub rm: bool,
    /// Extra environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Parse and validate a policy file.
    Check { file: PathBuf },
    /// Say in plain words what a policy allows.
    Explain {
        /// Policy file; without it, explain --preset (default: `default`).
        file: Option<PathBuf>,
        #[arg(long, conflicts_with = "file")]
        preset: Option<String>,
    },
    /// List the built-in presets.
    Presets,
    /// Replace the network rules of a running cell (open connections they forbid are closed).
    Set { name: String, file: PathBuf },
}
