//! Command-line grammar.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The command line. `warden run ...`, the command whose start is a cell's cold start, is
/// read by a parser of its own arguments alone: building the parser of every subcommand took
/// about 0.4 ms of each cold start on the development VM. Whatever that parser does not accept
/// as it stands (help, a mistake) goes to the whole parser, so that every message and status is
/// the whole parser's.
pub fn parse() -> Cli {
    parse_from(std::env::args_os())
}

pub fn parse_from(argv: impl IntoIterator<Item = std::ffi::OsString>) -> Cli {
    let argv: Vec<std::ffi::OsString> = argv.into_iter().collect();
    if let Some(args) = parse_run(&argv) {
        return Cli {
            command: Command::Run(args),
        };
    }
    match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and the version are answers (0). Any other command line warden cannot read
            // is its own failure, 125 as the README's table says: clap's 2 would read as the
            // status of a command that ran.
            let _ = e.print();
            std::process::exit(if e.use_stderr() { 125 } else { 0 })
        }
    }
}

/// `warden run ...` read by `RunArgs`'s own parser; `None` for anything else, and for what
/// that parser does not take.
fn parse_run(argv: &[std::ffi::OsString]) -> Option<RunArgs> {
    use clap::{Args as _, FromArgMatches as _};
    if argv.get(1).is_none_or(|word| word != "run") {
        return None;
    }
    // "run" stands where a parser expects its program's name.
    let parser = RunArgs::augment_args(clap::Command::new("run"));
    let matches = parser.try_get_matches_from(&argv[1..]).ok()?;
    RunArgs::from_arg_matches(&matches).ok()
}

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
        /// The digest `warden diff` printed: apply only if the changes are still exactly the
        /// ones reviewed (else nothing is written).
        #[arg(long, value_name = "DIGEST")]
        digest: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a stopped cell's workspace layer (its unapplied changes are lost), or a snapshot
    /// (`CELL@SNAP`).
    Rm {
        name: String,
        /// Also a cell the daemon keeps that still runs: it is killed first, and its unapplied
        /// workspace changes are dropped.
        #[arg(long)]
        force: bool,
    },
    /// Save the current state of a cell's workspace as an immutable snapshot `CELL@SNAP`.
    Snapshot {
        name: String,
        /// Snapshot name (default: s1, s2, ...).
        #[arg(long = "as", value_name = "SNAP")]
        as_name: Option<String>,
    },
    /// Save a gVisor cell's processes (their memory, where each was) with its workspace, as
    /// `CELL@NAME`; the cell ends there. Needs the daemon.
    Checkpoint {
        name: String,
        /// Checkpoint name (default: ckpt-TIME).
        #[arg(long = "as", value_name = "NAME")]
        as_name: Option<String>,
    },
    /// Bring a checkpoint `CELL@NAME` back as a running cell: its processes go on where they
    /// were, its workspace as it was. Needs the daemon.
    Restore {
        /// The checkpoint, `CELL@NAME`.
        checkpoint: String,
        /// The new cell's name (default: a new one).
        #[arg(long)]
        name: Option<String>,
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
    /// List the questions `ask` rules are waiting on: of one cell, or with no NAME of every cell.
    Approvals {
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Let a held connection through (ID from `warden approvals NAME` or the cell's terminal).
    Approve {
        name: String,
        id: u64,
        /// With the daemon: `cell` also approves the same request from this cell from now on,
        /// `always` from every cell.
        #[arg(long, default_value = "once", value_parser = ["once", "cell", "always"])]
        scope: String,
    },
    /// Refuse a held connection: the cell gets a 403 that says so.
    Deny { name: String, id: u64 },
    /// Check or explain a policy.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Print a completion script for a shell: `warden completions bash > /etc/bash_completion.d/warden`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff): `warden man > /usr/local/share/man/man1/warden.1`.
    Man,
    /// Report which isolation features this host offers, and how to fix what is missing.
    Doctor {
        #[arg(long)]
        json: bool,
    },
    /// Run the daemon: the HTTP API on a unix socket (and, with --listen, on loopback TCP with a
    /// token), the journal, and the cells made through it.
    Serve {
        /// Also listen on this loopback address, e.g. 127.0.0.1:8787 (requests need the token).
        #[arg(long, value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// Read the TCP token from this file instead of making one.
        #[arg(long, value_name = "FILE", requires = "listen")]
        token_file: Option<PathBuf>,
        /// Also serve the E2B-compatible API on this loopback address, e.g. 127.0.0.1:3000: the
        /// `e2b` SDK works against it with E2B_API_URL and E2B_SANDBOX_URL set to
        /// http://ADDR and E2B_API_KEY to the key written to e2b.key in the runtime directory.
        #[arg(long, value_name = "ADDR")]
        e2b: Option<std::net::SocketAddr>,
        /// Close the journal's active segment for a new one at this size.
        #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        journal_segment_mib: u64,
        /// Keep this many closed journal segments and remove older ones (default: keep all;
        /// `warden audit verify` then proves the chain from the oldest one kept).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        journal_keep_segments: Option<u64>,
        /// Keep this many cell keepers started ahead, so that a cell made does not wait for one
        /// to start (0: start each when its cell is made).
        #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=64))]
        keepers_ahead: u64,
        /// Keep N cells of this policy made ahead (a preset's name, `e2b:TEMPLATE` for the E2B
        /// API's sandboxes, or a policy file), so that a create asking for it with no name,
        /// workspace, source or environment of its own takes one ready (repeat for more
        /// policies; `warden ps` shows them and their memory).
        #[arg(long, value_name = "POLICY=N")]
        pool: Vec<String>,
        /// Serve the API on this many threads (default: one fewer than the CPUs the daemon may
        /// use, at least one; the cells' processes and the journal's thread use the rest).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
        api_threads: Option<u64>,
    },
    /// Print the link that opens the daemon's dashboard in a browser, logged in (the daemon
    /// serves it on its TCP listener: `warden serve --listen 127.0.0.1:8787`; the token is in
    /// the link's fragment, which the browser never sends anywhere).
    Dashboard,
    /// Serve the warden's tools to an MCP client over stdin and stdout (Claude Code, Cursor,
    /// Codex: configure the command `warden mcp`). Through the daemon when one runs, else with
    /// the daemon's core in this process (its cells outlive it; a daemon started later takes
    /// them back). The daemon also serves MCP over HTTP at /mcp.
    Mcp,
    /// Run an agent: the warden runs the model's loop itself, its tools in a cell, and can
    /// pause, step, steer, rewind and fork it from outside.
    Agent {
        #[command(subcommand)]
        command: AgentCommand,
    },
    /// Make a long-lived cell through the daemon; run commands in it with `warden exec`.
    Create(CreateArgs),
    /// Run a command in a cell made with `warden create`, streaming its output.
    Exec(ExecArgs),
    /// Copy a file or directory between the host and a daemon cell: `warden cp FILE CELL:PATH`
    /// or `warden cp CELL:PATH DEST` (PATH is relative to the cell's workspace).
    Cp { source: String, dest: String },
    /// Print the output of the processes exec'd into a daemon cell (-f: follow running ones).
    Logs {
        name: String,
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only this process (ids from `GET /v1/cells/NAME/processes`).
        #[arg(long)]
        process: Option<u64>,
    },
    /// Images as a cell's root (`image: NAME` in a policy): import an OCI image layout or a
    /// `docker save` archive, list them, remove them.
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// Check or export the journal.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Print a cell's timeline from the journal (an agent session's: its cell's, with the
    /// model's turns and tool calls beside the effects).
    Replay {
        name: String,
        #[arg(long)]
        json: bool,
        /// For an agent session: carry out its recorded tool calls again, in order, in a new
        /// cell from its first snapshot, and show where the results diverge (through the
        /// daemon).
        #[arg(long)]
        rerun: bool,
    },
    /// Keep a cell for the daemon (started by `warden serve`, not by hand): its request, a
    /// serialized cell spec, comes as JSON on stdin.
    #[command(hide = true)]
    Keep,
    /// Fork cell keepers for the daemon (started by `warden serve`, not by hand): each request
    /// comes on stdin, a socket, with the keeper's stdio.
    #[command(hide = true)]
    Keepers,
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// Cell name (default: generated).
    pub name: Option<String>,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Host directory that appears at /workspace.
    #[arg(long, short = 'w')]
    pub workspace: Option<PathBuf>,
    /// Environment variable for every process of the cell (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    /// Label (repeatable).
    #[arg(long = "label", short = 'l', value_name = "K=V")]
    pub labels: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Start a session on a task and follow it until it ends (through the daemon when one
    /// runs: there it outlives this command; Ctrl-C only stops following).
    Run(Box<AgentRunArgs>),
    /// List the daemon's sessions.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Show a session: state, turns and their snapshots, usage; with --transcript the
    /// conversation.
    Show {
        id: String,
        #[arg(long)]
        transcript: bool,
        #[arg(long)]
        json: bool,
    },
    /// Hold the loop before its next model or tool call and freeze its cell.
    Pause { id: String },
    /// Let it run on (a stopped or failed session tries again).
    Resume { id: String },
    /// Run one model turn and its tool calls, then pause.
    Step { id: String },
    /// End the session (a model call or command under way is cut).
    Stop { id: String },
    /// Give the agent an instruction, delivered at its next turn as the operator's.
    Say { id: String, text: String },
    /// Reset the workspace and the conversation to the end of a turn (0: the start); the
    /// session is left paused there.
    Rewind {
        id: String,
        #[arg(long = "to", value_name = "TURN")]
        turn: u32,
    },
    /// Start a new session in a new cell from the end of a turn (the original is kept), to
    /// try another instruction or model.
    Fork {
        id: String,
        #[arg(long = "at", value_name = "TURN")]
        turn: u32,
        /// An instruction for the fork's next turn.
        #[arg(long)]
        say: Option<String>,
        /// Another PROVIDER:MODEL.
        #[arg(long)]
        model: Option<String>,
        #[arg(long, value_name = "URL")]
        base_url: Option<String>,
        /// Start it paused.
        #[arg(long)]
        paused: bool,
    },
    /// Wait until the session is paused or has ended; print it.
    Wait {
        id: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct AgentRunArgs {
    /// What the agent is to do.
    pub task: String,
    /// PROVIDER:MODEL, PROVIDER one of openai (Chat Completions), openai-responses (Responses
    /// API), anthropic (Messages). Default: $WARDEN_MODEL, or `model:` in the config file.
    #[arg(long)]
    pub model: Option<String>,
    /// The API root as the provider's SDKs take it (e.g. http://127.0.0.1:8000/v1). Default:
    /// $WARDEN_BASE_URL, `base_url:` in the config file, or the provider's own.
    #[arg(long, value_name = "URL")]
    pub base_url: Option<String>,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Host directory that appears as the cell's workspace (copy-on-write: review with
    /// `warden diff`, write back with `warden apply`).
    #[arg(long, short = 'w')]
    pub workspace: Option<PathBuf>,
    /// Run in this existing cell of the daemon instead of a new one.
    #[arg(long, conflicts_with_all = ["workspace"])]
    pub cell: Option<String>,
    /// Most model turns (default 50).
    #[arg(long, value_name = "N")]
    pub steps: Option<u32>,
    /// Most input tokens over the session.
    #[arg(long, value_name = "N")]
    pub max_input_tokens: Option<u64>,
    /// Most output tokens over the session.
    #[arg(long, value_name = "N")]
    pub max_output_tokens: Option<u64>,
    /// Most wall-clock time (e.g. 10m).
    #[arg(long, value_name = "DURATION")]
    pub wall: Option<String>,
    /// Most bytes of one tool result the model gets (default 16384; the rest is cut, with a
    /// note to the model).
    #[arg(long, value_name = "BYTES")]
    pub tool_output: Option<u64>,
    /// A tool's approval mode: auto, ask (each call waits for `warden approve`), deny
    /// (repeatable; e.g. --tool exec=ask).
    #[arg(long = "tool", value_name = "NAME=MODE")]
    pub tools: Vec<String>,
    /// Words added to the warden's standing instructions to the model.
    #[arg(long)]
    pub instructions: Option<String>,
    /// Start paused (step it with `warden agent step`).
    #[arg(long)]
    pub paused: bool,
    /// Print the session's id and return at once (through a daemon only).
    #[arg(long, short = 'd')]
    pub detach: bool,
    /// Print the session at the end as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    pub name: String,
    /// Extra environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    /// Working directory inside the cell.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Kill the process after this long (e.g. 30s, 5m).
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Pass this command's stdin to the process as it comes.
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// Run the process on a terminal of the cell (this terminal in raw mode, resized with it).
    #[arg(long, short = 't')]
    pub tty: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Import an image from an OCI image layout (a directory, or a tar of one: `docker save`
    /// since Docker 25, `skopeo copy ... oci-archive:FILE`) or a classic `docker save` archive.
    /// Every blob is checked against its digest; each layer is unpacked once.
    Import {
        /// The layout directory or archive (tar, or tar.gz).
        file: PathBuf,
        /// The name cells use (`image: NAME`); default: the archive's own tag.
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Fetch an image from a registry (Docker Hub, ghcr.io, a registry of one's own) and import
    /// it: the manifest for linux on this machine's architecture (or --platform), its
    /// configuration and layers, each checked against its digest, then unpacked as an import
    /// is. The registry is reached from the host, not from a cell; a login comes from
    /// WARDEN_REGISTRY_USER and WARDEN_REGISTRY_PASSWORD (anonymous without them).
    Pull {
        /// [REGISTRY/]REPOSITORY[:TAG][@DIGEST], like python:3.12-slim or
        /// ghcr.io/org/tools:1 (Docker Hub when no registry is named).
        reference: String,
        /// The name cells use (`image: NAME`); default: the reference as given.
        #[arg(long)]
        name: Option<String>,
        /// OS/ARCH[/VARIANT] to take from a multi-platform image (default: linux and this
        /// machine's architecture).
        #[arg(long)]
        platform: Option<String>,
        /// A registry (HOST[:PORT]) to speak plain HTTP to, for one of your own without TLS
        /// (repeatable).
        #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
        insecure: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// List the imported images.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove an image (and the layers no other image uses).
    Rm { name: String },
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Prove the journal's hash chain and checkpoint signatures; name the first bad entry.
    Verify {
        /// Journal directory (default: `journal` in the state directory).
        #[arg(long)]
        journal: Option<PathBuf>,
        /// Public key (hex) to check checkpoints with, instead of the one beside the journal.
        #[arg(long)]
        key: Option<String>,
    },
    /// Write journal entries to stdout.
    Export {
        #[arg(long, value_enum, default_value = "jsonl")]
        format: ExportFormat,
        /// Only entries about this cell.
        #[arg(long)]
        cell: Option<String>,
        /// Only entries at or after this time (RFC 3339, or an age such as 1h).
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        journal: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    Jsonl,
    Ocsf,
}

/// The policy of a new cell: a file or a preset, and the common knobs on top of it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PolicyArgs {
    /// Policy file (YAML).
    #[arg(long = "policy", conflicts_with = "preset", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Built-in policy preset (`warden policy presets` lists them).
    #[arg(long)]
    pub preset: Option<String>,
    /// Isolation tier: `process` (namespaces, seccomp, Landlock) or `gvisor` (a gVisor
    /// sandbox); `warden doctor` says which this host can run.
    #[arg(long, value_name = "TIER")]
    pub tier: Option<String>,
    /// Memory limit (e.g. 512MiB, 2GiB; `none`: unlimited).
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// CPU limit in cores (e.g. 0.5; `none`: unlimited).
    #[arg(long, value_name = "CORES")]
    pub cpus: Option<String>,
    /// Most processes and threads (`none`: unlimited).
    #[arg(long, value_name = "N")]
    pub pids: Option<String>,
    /// Wall-clock limit of the cell (e.g. 30s, 10m; `none`: unlimited).
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Disk limit of the workspace (e.g. 4GiB; `none`: unlimited).
    #[arg(long, value_name = "SIZE")]
    pub disk: Option<String>,
    /// Let the cell reach HOST (a name, `*.domain`, an IP or a CIDR block), on PORT or on any
    /// port (repeatable).
    #[arg(long, value_name = "HOST[:PORT]")]
    pub allow: Vec<String>,
    /// Show a host path to the cell read-only, at the same place (repeatable).
    #[arg(long = "ro", value_name = "PATH")]
    pub read_only: Vec<PathBuf>,
    /// Show a host directory to the cell read-write, at the same place (repeatable).
    #[arg(long = "rw", value_name = "PATH")]
    pub read_write: Vec<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub policy: PolicyArgs,
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
    /// Print the policy in force, every section written out, as YAML (what `extends`, the
    /// preset and the flags make of it).
    Show {
        #[command(flatten)]
        policy: Box<PolicyArgs>,
    },
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

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<std::ffi::OsString> {
        line.split(' ').map(Into::into).collect()
    }

    /// `warden run`'s own parser takes exactly what the whole parser takes, and reads it the
    /// same; what it does not take goes to the whole parser (its help and errors).
    #[test]
    fn the_run_parser_reads_what_the_whole_parser_reads() {
        let taken = [
            "warden run -- true",
            "warden run --rm -e A=b --env C=d -w /tmp --name n1 -- sh -c x",
            "warden run --preset default --rw /tmp --ro /usr -- echo -- --rm",
            "warden run --policy p.yaml --allow example.com:443 --allow b.org -- x",
            "warden run --tier gvisor --memory 64M --cpus 1 --pids 9 --timeout 5s --disk 1G -- x",
            "warden run --policy p.yaml --preset default -- x",
            "warden run -e=A=b -- x",
            "warden run --rm --rm -- x",
        ];
        for line in taken {
            let argv = words(line);
            let whole = Cli::try_parse_from(&argv);
            let own = parse_run(&argv);
            match (whole, own) {
                (Ok(whole), Some(own)) => assert_eq!(
                    format!("{whole:?}"),
                    format!(
                        "{:?}",
                        Cli {
                            command: Command::Run(own)
                        }
                    ),
                    "{line}"
                ),
                (Err(_), None) => {}
                (whole, own) => panic!("{line}: the whole parser: {whole:?}; run's: {own:?}"),
            }
        }
        let refused = [
            "warden run",
            "warden run true",
            "warden run -h",
            "warden run --help",
            "warden run --version",
            "warden run --bogus -- x",
            "warden run --name -- x",
            "warden run -e -- x",
            "warden ps",
            "warden runx -- x",
            "warden",
        ];
        for line in refused {
            let argv = words(line);
            assert!(parse_run(&argv).is_none(), "{line}: run's parser took it");
        }
        assert!(
            Cli::try_parse_from(words("warden run --help")).is_err(),
            "help is the whole parser's"
        );
        // Every line the whole parser takes as a run goes through `parse_from` the same way.
        let cli = parse_from(words("warden run --rm -- true"));
        assert!(matches!(
            cli.command,
            Command::Run(RunArgs { rm: true, .. })
        ));
    }
}
