//! Commands that run or relay a process through the daemon: `warden run` with a daemon, `warden exec`,
//! the terminal's raw mode, and the announcements of questions on the waiting terminal.

use crate::cli::ExecArgs;
use anyhow::{Context, Result, bail};
use base64::Engine as _;
use hyper::Method;
use serde_json::{Value, json};
use std::io::{Read as _, Write as _};
use warden_cell::Store;
use warden_client::Client;

use super::*;

/// `warden run` through the daemon: a cell made for the command, the command exec'd into it
/// with stdin, signals and output relayed, the same exit statuses as an in-process run, and the
/// cell ended afterwards (its workspace changes kept for review unless `--rm`).
pub fn run_through(
    client: &Client,
    args: &crate::cli::RunArgs,
    policy: &warden_policy::Policy,
    env: &[(String, String)],
    from: Option<String>,
) -> Result<i32> {
    use warden_protocol::exit;
    let argv: Vec<String> = args
        .command
        .iter()
        .map(|a| {
            a.to_str().map(str::to_owned).with_context(|| {
                format!(
                    "argument {a:?} is not UTF-8, which the daemon's API cannot carry; stop the daemon to run it in-process"
                )
            })
        })
        .collect::<Result<_>>()?;
    let workspace = workspace_dir(args.workspace.as_deref())?;
    let rt = current_thread()?;
    // The policy as this command made it (file or preset, `~`, flags): the daemon gets it whole.
    let body = warden_protocol::CreateCell {
        name: args.name.clone(),
        policy: Some(warden_policy::to_yaml(policy)),
        workspace,
        from,
        labels: [("made-by".to_owned(), "warden run".to_owned())].into(),
        secrets: callers_secrets(policy)?,
        ..Default::default()
    };
    let cell: warden_protocol::CellInfo =
        rt.block_on(client.call(Method::POST, "/v1/cells", Some(&body)))?;
    let name = cell.name;
    let spec = warden_protocol::ExecSpec {
        argv,
        env: env.iter().cloned().collect(),
        background: true,
        timeout_ms: policy.limits.wall.map(|w| w.0.as_millis() as u64),
        output_limit: policy.limits.output.map(|o| o.0),
        ..Default::default()
    };
    let outcome = rt.block_on(relay_process(client, &name, &spec, false));
    // The cell ends with its command; what it changed waits for review unless --rm.
    let end = if args.rm {
        rt.block_on(client.json(Method::DELETE, &format!("/v1/cells/{name}"), None))
    } else {
        rt.block_on(client.json(Method::POST, &format!("/v1/cells/{name}/kill"), None))
    };
    if let Err(err) = end {
        // A cell that its own limits ended already needs no kill.
        let ended = err
            .api()
            .is_some_and(|api| api.status == hyper::StatusCode::CONFLICT);
        if !ended {
            return Err(err.into());
        }
    }
    let store = Store::open(Store::default_root())?;
    let changed = !args.rm
        && std::fs::read_dir(store.layer(&name).upper())
            .is_ok_and(|mut entries| entries.next().is_some());
    if !args.rm && !changed {
        // Nothing to review: the daemon forgets the cell, as an in-process run leaves nothing.
        let _ = rt.block_on(client.json(Method::DELETE, &format!("/v1/cells/{name}"), None));
    }
    if changed {
        eprintln!(
            "warden: cell {name} changed its workspace; the host directory is untouched. Review with \
             `warden diff {name}`, then `warden apply {name}` or `warden rm {name}`."
        );
    }
    let exit = match outcome {
        Ok(exit) => exit,
        Err(err) => return refused(&err).ok_or(err),
    };
    use warden_protocol::ExitReason;
    // The same words as an in-process run.
    let limits = &policy.limits;
    let limit = match exit.reason {
        ExitReason::Timeout => Some(("wall-clock", limits.wall.map(|w| w.to_string()))),
        ExitReason::MemoryLimit => Some(("memory", limits.memory.map(|m| m.to_string()))),
        ExitReason::DiskLimit => Some(("disk", limits.disk.map(|d| d.to_string()))),
        ExitReason::OutputLimit => Some(("output", limits.output.map(|o| o.to_string()))),
        _ => None,
    };
    if let Some((what, limit)) = limit {
        let limit = limit.unwrap_or_default();
        eprintln!("warden: cell {name}: {what} limit {limit} exceeded: killed");
        return Ok(exit.status());
    }
    Ok(match exit.reason {
        ExitReason::Exited | ExitReason::Signaled => exit.status(),
        // The same words as a run without a daemon.
        ExitReason::Failed => {
            match (&exit.message, exit.code) {
                (Some(message), Some(exit::NOT_FOUND)) => eprintln!(
                    "warden: {message} (in cell {name}; is it under a read-only path of the policy?)"
                ),
                (Some(message), _) => eprintln!("warden: {message}"),
                (None, _) => {}
            }
            exit.status()
        }
        ExitReason::Killed
        | ExitReason::CellEnded
        | ExitReason::Timeout
        | ExitReason::MemoryLimit
        | ExitReason::DiskLimit
        | ExitReason::OutputLimit => {
            eprintln!("warden: cell {name} was killed by `warden kill`");
            exit::KILLED
        }
    })
}

/// Runs `work` while announcing on stderr each question the cell's `ask` rules raise meanwhile
/// (about this command or about a connection it makes), with its id and how to answer, and each
/// answer. The daemon subscribes before `work` starts, so no question is missed. `tty`: the
/// terminal is raw, lines end in CR LF.
async fn announcing<T>(
    client: &Client,
    cell: &str,
    tty: bool,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let path = format!("/v1/events?cell={}", query(cell));
    let stream = client.open_events(Method::GET, &path, None).await;
    let announce = async {
        if let Ok(stream) = stream {
            let _ = stream
                .each(|event, data| {
                    if event != "entry" {
                        return;
                    }
                    if let Some(line) = serde_json::from_str::<Value>(data)
                        .ok()
                        .and_then(|entry| announcement(cell, &entry))
                    {
                        let end = if tty { "\r\n" } else { "\n" };
                        let _ = write!(std::io::stderr(), "{line}{end}");
                    }
                })
                .await;
        }
        // Without the stream (an older daemon, one that stopped) the work goes on unannounced.
        std::future::pending::<()>().await
    };
    tokio::select! {
        done = work => done,
        () = announce => unreachable!("the announcer never ends by itself"),
    }
}

/// The line that tells a person at the terminal about a question or its answer.
fn announcement(cell: &str, entry: &Value) -> Option<String> {
    use crate::render::safe;
    let data = &entry["data"];
    let text = |key: &str| safe(data[key].as_str().unwrap_or_default());
    match entry["kind"].as_str()? {
        "approval.ask" => {
            let id = entry["seq"].as_u64()?;
            Some(format!(
                "warden: cell {cell} asks for {} (rule {}): answer within {}s with `warden approve {cell} {id}` \
                 (--scope cell or always to keep the answer) or `warden deny {cell} {id}`",
                text("request"),
                text("rule"),
                data["timeout_s"].as_u64().unwrap_or(0),
            ))
        }
        "approval.answer" => Some(format!(
            "warden: {} {} for cell {cell} (by {}, scope {})",
            if data["decision"] == "approve" {
                "approved"
            } else {
                "denied"
            },
            text("request"),
            text("by"),
            text("scope"),
        )),
        "approval.timeout" => Some(format!(
            "warden: nobody answered about {} for cell {cell} in time: {}",
            text("request"),
            if data["outcome"] == "allow" {
                "allowed"
            } else {
                "denied"
            },
        )),
        _ => None,
    }
}

/// A command its cell's rules, or a person, refused: said, with its own exit status.
fn refused(err: &anyhow::Error) -> Option<i32> {
    let api = api_error(err)?;
    (api.status == hyper::StatusCode::FORBIDDEN).then(|| {
        eprintln!("warden: refused: {}", api.message);
        warden_protocol::exit::REFUSED
    })
}

/// Starts the process, pumps stdin to it, forwards signals, writes its output; returns its
/// exit information. Questions the cell's `ask` rules raise meanwhile are announced on stderr.
async fn relay_process(
    client: &Client,
    cell: &str,
    spec: &warden_protocol::ExecSpec,
    tty: bool,
) -> Result<warden_protocol::ExitInfo> {
    announcing(client, cell, tty, relay(client, cell, spec, tty)).await
}

async fn relay(
    client: &Client,
    cell: &str,
    spec: &warden_protocol::ExecSpec,
    tty: bool,
) -> Result<warden_protocol::ExitInfo> {
    use tokio::signal::unix::{SignalKind, signal};
    let started: warden_protocol::Started = client
        .call(Method::POST, &format!("/v1/cells/{cell}/exec"), Some(spec))
        .await?;
    let id = started.id;
    // Even a process that has ended already (a quick one, or one that could not start) is read
    // through its output: what it wrote is kept, and the stream ends with its exit.
    // stdin, from a thread of its own (reads block).
    let pump_client = client.clone();
    let stdin_path = format!("/v1/cells/{cell}/processes/{id}/stdin");
    std::thread::spawn(move || {
        let Ok(rt) = current_thread() else {
            return;
        };
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = stdin.read(&mut buf).unwrap_or(0);
            let body = if n == 0 {
                json!({ "close": true })
            } else {
                json!({ "data_base64": base64::engine::general_purpose::STANDARD.encode(&buf[..n]) })
            };
            if rt
                .block_on(pump_client.json(Method::POST, &stdin_path, Some(&body)))
                .is_err()
                || n == 0
            {
                return;
            }
        }
    });
    let listen = |kind| signal(kind).context("handling signals");
    let mut interrupt = listen(SignalKind::interrupt())?;
    let mut terminate = listen(SignalKind::terminate())?;
    let mut hangup = listen(SignalKind::hangup())?;
    let mut quit = listen(SignalKind::quit())?;
    let mut winch = listen(SignalKind::window_change())?;
    let resize_path = format!("/v1/cells/{cell}/processes/{id}/resize");
    // A resize between the size's first reading and the listener above went unheard: the
    // terminal is looked at again now.
    let resize = || async {
        if let (true, Some((rows, cols))) = (tty, terminal_size()) {
            let size = warden_protocol::TtySize { rows, cols };
            let _ = client
                .call::<_, Value>(Method::POST, &resize_path, Some(&size))
                .await;
        }
    };
    if tty && spec.tty.map(|t| (t.rows, t.cols)) != terminal_size() {
        resize().await;
    }
    let output_path = format!("/v1/cells/{cell}/processes/{id}/output");
    let mut exit: Option<warden_protocol::ExitInfo> = None;
    let mut output = Box::pin(
        client.events(Method::GET, &output_path, None, |event, data| {
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                return;
            };
            let bytes = || chunk_bytes(&value);
            match event {
                "stdout" => {
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&bytes());
                    let _ = out.flush();
                }
                "stderr" => {
                    let _ = std::io::stderr().write_all(&bytes());
                }
                "exit" => exit = serde_json::from_value(value.clone()).ok(),
                _ => {}
            }
        }),
    );
    let signal_path = format!("/v1/cells/{cell}/processes/{id}/signal");
    loop {
        // Signals that would end this client go to the process instead.
        let number = tokio::select! {
            done = &mut output => {
                done?;
                break;
            }
            _ = interrupt.recv() => libc::SIGINT,
            _ = terminate.recv() => libc::SIGTERM,
            _ = hangup.recv() => libc::SIGHUP,
            _ = quit.recv() => libc::SIGQUIT,
            _ = winch.recv() => {
                resize().await;
                continue;
            }
        };
        let signal = warden_protocol::SignalBody {
            signal: warden_protocol::Signal::Number(number),
        };
        let _ = client
            .call::<_, Value>(Method::POST, &signal_path, Some(&signal))
            .await;
    }
    drop(output);
    exit.context("the process's output ended without its exit (did the daemon stop?)")
}

pub fn exec(args: ExecArgs) -> Result<i32> {
    let client = client()?;
    let timeout_ms = match &args.timeout {
        Some(text) => Some(
            humantime::parse_duration(text)
                .with_context(|| format!("--timeout {text}: write it as 30s, 5m, 1h"))?
                .as_millis() as u64,
        ),
        None => None,
    };
    if args.interactive || args.tty {
        return exec_interactive(&client, &args, timeout_ms);
    }
    let body = serde_json::to_value(warden_protocol::ExecSpec {
        argv: args.command.clone(),
        env: pairs(&args.env, "env")?,
        cwd: args.cwd.clone(),
        timeout_ms,
        ..Default::default()
    })?;
    let path = format!("/v1/cells/{}/exec", args.name);
    let mut code = warden_protocol::exit::WARDEN_ERROR;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let rt = current_thread()?;
    let run = client.events(Method::POST, &path, Some(&body), |event, data| {
        let Ok(value) = serde_json::from_str::<Value>(data) else {
            return;
        };
        let bytes = || chunk_bytes(&value);
        match event {
            "stdout" => {
                let _ = stdout.write_all(&bytes());
                let _ = stdout.flush();
            }
            "stderr" => {
                let _ = stderr.write_all(&bytes());
            }
            "exit" => {
                code = match serde_json::from_value::<warden_protocol::ExitInfo>(value) {
                    Ok(exit) => process_exit(&exit),
                    Err(err) => {
                        eprintln!("warden: an exit this warden does not understand: {err}");
                        warden_protocol::exit::WARDEN_ERROR
                    }
                }
            }
            _ => {}
        }
    });
    let run = async { run.await.map_err(anyhow::Error::from) };
    match rt.block_on(announcing(&client, &args.name, false, run)) {
        Ok(()) => Ok(code),
        Err(err) => refused(&err).ok_or(err),
    }
}

/// The exit status of an exec'd process, from its `exit` event (said on stderr where it was
/// not the process's own doing).
fn process_exit(exit: &warden_protocol::ExitInfo) -> i32 {
    use warden_protocol::ExitReason;
    match (&exit.message, exit.reason) {
        (_, ExitReason::Exited | ExitReason::Signaled) => {}
        (Some(message), _) => eprintln!("warden: {message}"),
        (None, ExitReason::Timeout) => {
            eprintln!("warden: the process ran past --timeout and was killed")
        }
        (None, ExitReason::CellEnded) => {
            eprintln!("warden: the cell ended before the process did")
        }
        (None, _) => {}
    }
    match exit.reason {
        // Not the process's own status: the cell ended under it.
        ExitReason::CellEnded | ExitReason::Killed => warden_protocol::exit::WARDEN_ERROR,
        _ => exit.status(),
    }
}

/// Puts a terminal in raw mode until dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> Result<Self> {
        let stdin = std::io::stdin();
        let saved = rustix::termios::tcgetattr(&stdin).context("reading the terminal's mode")?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw)
            .context("putting the terminal in raw mode")?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}

fn terminal_size() -> Option<(u16, u16)> {
    let size = rustix::termios::tcgetwinsize(std::io::stdout()).ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then_some((size.ws_row, size.ws_col))
}

/// `warden exec -i` / `-t`: stdin passed as it comes, on a terminal with `-t`.
fn exec_interactive(client: &Client, args: &ExecArgs, timeout_ms: Option<u64>) -> Result<i32> {
    use std::io::IsTerminal as _;
    let mut spec = warden_protocol::ExecSpec {
        argv: args.command.clone(),
        env: pairs(&args.env, "env")?,
        cwd: args.cwd.clone(),
        timeout_ms,
        background: true,
        ..Default::default()
    };
    let _raw = if args.tty {
        if !std::io::stdin().is_terminal() {
            bail!("-t needs a terminal on stdin (use -i to pass a pipe or a file)");
        }
        let (rows, cols) = terminal_size().unwrap_or((24, 80));
        spec.tty = Some(warden_protocol::TtySize { rows, cols });
        Some(RawMode::enter()?)
    } else {
        None
    };
    let exit = current_thread()?.block_on(relay_process(client, &args.name, &spec, args.tty));
    drop(_raw);
    let exit = match exit {
        Ok(exit) => exit,
        Err(err) => return refused(&err).ok_or(err),
    };
    Ok(process_exit(&exit))
}
