//! `warden agent`: sessions of the warden's own agent loop, through the daemon (or, for `run`
//! without one, with the daemon's core in this process).

use std::collections::BTreeMap;
use std::io::Write as _;

use anyhow::{Context, Result, bail};
use hyper::Method;
use serde_json::Value;
use warden_protocol::{
    AgentAction, AgentInfo, AgentState, Budgets, ForkAgent, StartAgent, ToolMode,
};

use super::*;
use crate::cli::{AgentCommand, AgentRunArgs};

pub fn agent(command: AgentCommand) -> Result<i32> {
    match command {
        AgentCommand::Run(args) => run(*args),
        AgentCommand::Ls { json } => {
            let list: Vec<AgentInfo> = call(Method::GET, "/v1/agents", None::<&()>)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<12} {:<8} {:>5} {:>9} {:>9}  {:<28} CELL",
                    "ID", "STATE", "TURNS", "IN", "OUT", "MODEL"
                );
                for a in list {
                    println!(
                        "{:<12} {:<8} {:>5} {:>9} {:>9}  {:<28} {}",
                        a.id,
                        a.state.name(),
                        a.turn,
                        a.usage.input,
                        a.usage.output,
                        a.model,
                        a.cell
                    );
                }
            }
            Ok(0)
        }
        AgentCommand::Show {
            id,
            transcript,
            json,
        } => {
            let info: AgentInfo = call(Method::GET, &format!("/v1/agents/{id}"), None::<&()>)?;
            let conversation: Option<warden_protocol::Transcript> = match transcript {
                true => Some(call(
                    Method::GET,
                    &format!("/v1/agents/{id}/transcript"),
                    None::<&()>,
                )?),
                false => None,
            };
            if json {
                let mut value = serde_json::to_value(&info)?;
                if let Some(t) = &conversation {
                    value["transcript"] = serde_json::to_value(t)?;
                }
                println!("{}", serde_json::to_string_pretty(&value)?);
                return Ok(0);
            }
            print_info(&info);
            if let Some(t) = conversation {
                println!();
                for item in &t.items {
                    print_item(item);
                }
            }
            Ok(0)
        }
        AgentCommand::Pause { id } => act(&id, AgentAction::Pause),
        AgentCommand::Resume { id } => act(&id, AgentAction::Resume),
        AgentCommand::Step { id } => act(&id, AgentAction::Step),
        AgentCommand::Stop { id } => act(&id, AgentAction::Stop),
        AgentCommand::Say { id, text } => {
            let info: AgentInfo = call(
                Method::POST,
                &format!("/v1/agents/{id}/say"),
                Some(&warden_protocol::Say { text }),
            )?;
            println!("said to {} (delivered at turn {})", info.id, info.turn + 1);
            Ok(0)
        }
        AgentCommand::Rewind { id, turn } => {
            let info: AgentInfo = call(
                Method::POST,
                &format!("/v1/agents/{id}/rewind"),
                Some(&warden_protocol::Rewind { turn }),
            )?;
            println!(
                "{} is at the end of turn {turn}, paused; `warden agent resume {}` or `step` goes on",
                info.id, info.id
            );
            Ok(0)
        }
        AgentCommand::Fork {
            id,
            turn,
            say,
            model,
            base_url,
            paused,
        } => {
            let api_key = model.as_deref().and_then(callers_key);
            let body = ForkAgent {
                turn,
                say,
                model,
                base_url,
                api_key,
                paused,
            };
            let info: AgentInfo =
                call(Method::POST, &format!("/v1/agents/{id}/fork"), Some(&body))?;
            println!(
                "{} (cell {}), forked from {id} at turn {turn}",
                info.id, info.cell
            );
            Ok(0)
        }
        AgentCommand::Wait { id, json } => {
            let info: AgentInfo = call(Method::GET, &format!("/v1/agents/{id}/wait"), None::<&()>)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                print_info(&info);
            }
            Ok(exit_status(&info))
        }
    }
}

fn call<B: serde::Serialize, T: serde::de::DeserializeOwned>(
    method: Method,
    path: &str,
    body: Option<&B>,
) -> Result<T> {
    let client = client()?;
    Ok(current_thread()?.block_on(client.call(method, path, body))?)
}

fn act(id: &str, action: AgentAction) -> Result<i32> {
    let info: AgentInfo = call(
        Method::POST,
        &format!("/v1/agents/{id}/{}", action.name()),
        None::<&()>,
    )?;
    println!("{} is {}", info.id, info.state.name());
    Ok(0)
}

/// The key of a model's provider, from this caller's environment.
fn callers_key(model: &str) -> Option<String> {
    let format = warden_model::Format::from_provider(model.split(':').next()?)?;
    std::env::var(format.key_variable())
        .ok()
        .filter(|k| !k.is_empty())
}

/// `model:` and `base_url:` of `$XDG_CONFIG_HOME/warden/agent.yaml` (or `~/.config/...`).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    model: Option<String>,
    base_url: Option<String>,
}

fn config() -> Result<Config> {
    let dir = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    let Some(path) = dir.map(|d| d.join("warden").join("agent.yaml")) else {
        return Ok(Config::default());
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_saphyr::from_str(&text).with_context(|| format!("reading {}", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The request `warden agent run` makes of its arguments, the environment and the config file.
fn request(args: &AgentRunArgs) -> Result<StartAgent> {
    let file = config()?;
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let Some(model) = args
        .model
        .clone()
        .or_else(|| env("WARDEN_MODEL"))
        .or(file.model)
    else {
        bail!(
            "no model: pass --model PROVIDER:MODEL (e.g. openai:gpt-5.1, anthropic:claude-sonnet-4-5), set WARDEN_MODEL, or write `model:` in ~/.config/warden/agent.yaml; providers: {}",
            warden_model::Format::PROVIDERS
        );
    };
    let base_url = args
        .base_url
        .clone()
        .or_else(|| env("WARDEN_BASE_URL"))
        .or(file.base_url);
    let mut tools = BTreeMap::new();
    for pair in &args.tools {
        let Some((name, mode)) = pair.split_once('=') else {
            bail!("--tool {pair}: write it as NAME=MODE (auto, ask or deny)");
        };
        let mode = match mode {
            "auto" => ToolMode::Auto,
            "ask" => ToolMode::Ask,
            "deny" => ToolMode::Deny,
            other => bail!("--tool {pair}: no mode `{other}`; the modes are auto, ask, deny"),
        };
        tools.insert(name.to_owned(), mode);
    }
    let wall_s = match &args.wall {
        Some(text) => Some(
            humantime::parse_duration(text)
                .with_context(|| format!("--wall {text}: write it like 90s, 10m, 1h"))?
                .as_secs()
                .max(1),
        ),
        None => None,
    };
    let (policy, preset) = match &args.cell {
        Some(_) => (None, None),
        None => (
            Some(warden_policy::to_yaml(&crate::policy::effective(
                &args.policy,
            )?)),
            None,
        ),
    };
    Ok(StartAgent {
        task: args.task.clone(),
        api_key: callers_key(&model),
        model,
        base_url,
        cell: args.cell.clone(),
        policy,
        preset,
        workspace: workspace_dir(args.workspace.as_deref())?,
        instructions: args.instructions.clone(),
        budgets: Budgets {
            steps: args.steps,
            input_tokens: args.max_input_tokens,
            output_tokens: args.max_output_tokens,
            wall_s,
            tool_output_bytes: args.tool_output,
        },
        tools,
        paused: args.paused,
    })
}

fn run(args: AgentRunArgs) -> Result<i32> {
    let mut request = request(&args)?;
    let Some(client) = client_if_running() else {
        if args.detach {
            bail!("--detach needs a daemon to run the session: start `warden serve`");
        }
        return run_here(request, args.json);
    };
    let rt = current_thread()?;
    // Started paused, so that the stream is open before its first entry; then let go.
    let paused = std::mem::replace(&mut request.paused, true);
    let info: AgentInfo = rt.block_on(client.call(Method::POST, "/v1/agents", Some(&request)))?;
    if args.detach {
        if !paused {
            rt.block_on(client.call::<(), AgentInfo>(
                Method::POST,
                &format!("/v1/agents/{}/resume", info.id),
                None,
            ))?;
        }
        println!("{}", info.id);
        return Ok(0);
    }
    eprintln!(
        "warden: session {} in cell {} ({}); Ctrl-C stops following, not the session (`warden agent stop {}` ends it)",
        info.id, info.cell, info.model, info.id
    );
    let id = info.id.clone();
    rt.block_on(async {
        let stream = client
            .open_events(
                Method::GET,
                &format!("/v1/events?cell={}", query(&info.cell)),
                None,
            )
            .await?;
        if !paused {
            client
                .call::<(), AgentInfo>(Method::POST, &format!("/v1/agents/{id}/resume"), None)
                .await?;
        }
        let ended = tokio::sync::Notify::new();
        let follow = stream.each(|_, data| {
            if let Ok(entry) = serde_json::from_str::<Value>(data)
                && show(&entry, &id)
            {
                ended.notify_one();
            }
        });
        // The stream may lag behind a busy journal: the session's own state says when it ended.
        let polled = async {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                let path = format!("/v1/agents/{id}");
                match client.call::<(), AgentInfo>(Method::GET, &path, None).await {
                    Ok(now) if now.state.is_over() => return Ok(()),
                    Ok(_) => {}
                    Err(err) => return Err(anyhow::Error::from(err)),
                }
            }
        };
        tokio::select! {
            followed = follow => followed.map(drop).map_err(anyhow::Error::from),
            () = ended.notified() => Ok(()),
            polled = polled => polled,
        }
    })?;
    let info: AgentInfo = rt.block_on(client.call::<(), _>(
        Method::GET,
        &format!("/v1/agents/{}/wait", info.id),
        None,
    ))?;
    finish(&info, args.json)
}

/// `warden agent run` with no daemon: the daemon's core in this process, for this session's
/// life. Its cell's workspace is kept, for `warden diff` and `apply`; its processes end with
/// the session (nothing is left to control them): when the model is done, and when the run is
/// interrupted (SIGINT, SIGTERM, SIGHUP), which stops the session first.
fn run_here(request: StartAgent, json: bool) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let config = serve::daemon_harness(Default::default(), 0, Vec::new())?;
    rt.block_on(async move {
        let harness = warden_harness::Harness::open(config).await?;
        let agents = warden_agent::Agents::open(std::sync::Arc::clone(&harness), None);
        let mut entries = harness.subscribe();
        let by = format!(
            "warden agent run (uid {}, pid {})",
            rustix::process::getuid().as_raw(),
            std::process::id()
        );
        let started = agents.start(request, &by).await;
        let info = match started {
            Ok(info) => info,
            Err(err) => {
                harness.shutdown().await;
                bail!("{}", err.message);
            }
        };
        eprintln!(
            "warden: session {} in cell {} ({}), without a daemon",
            info.id, info.cell, info.model
        );
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupts = [
            SignalKind::interrupt(),
            SignalKind::terminate(),
            SignalKind::hangup(),
        ]
        .map(|kind| signal(kind).ok());
        let interrupted = async {
            let [a, b, c] = &mut interrupts;
            tokio::select! {
                () = next_signal(a) => {}
                () = next_signal(b) => {}
                () = next_signal(c) => {}
            }
        };
        let followed = async {
            loop {
                match entries.recv().await {
                    Ok(entry) => {
                        if entry["cell"] == info.cell.as_str() && show(&entry, &info.id) {
                            break;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => break,
                }
            }
        };
        tokio::select! {
            () = followed => {}
            () = interrupted => {
                eprintln!("warden: interrupted: stopping session {}", info.id);
                let _ = agents.control(&info.id, AgentAction::Stop, &by).await;
            }
        }
        let info = agents
            .settled(&info.id)
            .await
            .map_err(|e| anyhow::anyhow!(e.message))?;
        // The session is over: its cell's processes go, its workspace stays for review.
        let _ = harness
            .control(&info.cell, warden_protocol::ControlAction::Kill, &by)
            .await;
        harness.shutdown().await;
        finish(&info, json)
    })
}

/// The next delivery of a signal being waited for (never, where it could not be).
async fn next_signal(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

fn finish(info: &AgentInfo, json: bool) -> Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(info)?);
        return Ok(exit_status(info));
    }
    // The model's last words, and why the session ended, are the model's (or its API's) text:
    // made safe for a terminal, line by line.
    if let Some(summary) = &info.summary {
        println!("{}", crate::render::safe_lines(summary));
    }
    eprintln!(
        "warden: {} {} after {} turns ({} tokens in, {} out): {}",
        info.id,
        info.state.name(),
        info.turn,
        info.usage.input,
        info.usage.output,
        crate::render::safe_lines(info.ended.as_deref().unwrap_or(""))
    );
    eprintln!(
        "warden: review the changes with `warden diff {0}`, write them back with `warden apply {0}`",
        info.cell
    );
    Ok(exit_status(info))
}

/// 0 when the model finished, 1 when the session was stopped or failed.
fn exit_status(info: &AgentInfo) -> i32 {
    match info.state {
        AgentState::Done | AgentState::Running | AgentState::Paused => 0,
        AgentState::Stopped | AgentState::Failed => 1,
    }
}

fn one_line(text: &str, max: usize) -> String {
    let line: String = text
        .split('\n')
        .next()
        .unwrap_or("")
        .chars()
        .take(max)
        .collect();
    crate::render::safe(&line).into_owned()
}

/// Prints what a journal entry of the session says; `true` at its end.
fn show(entry: &Value, id: &str) -> bool {
    let kind = entry["kind"].as_str().unwrap_or("");
    let fields = &entry["data"];
    let mine = fields["id"].as_str() == Some(id);
    let out = &mut std::io::stderr();
    match kind {
        "agent.model" if mine => {
            let turn = fields["turn"].as_u64().unwrap_or(0);
            if let Some(error) = fields["error"].as_str() {
                let _ = writeln!(out, "[turn {turn}] model error: {}", one_line(error, 200));
                return false;
            }
            let text = fields["text"].as_str().unwrap_or("");
            if !text.is_empty() {
                let _ = writeln!(out, "[turn {turn}] {}", one_line(text, 200));
            }
            for call in fields["calls"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    out,
                    "[turn {turn}] -> {} {}",
                    one_line(call["name"].as_str().unwrap_or("?"), 80),
                    one_line(call["arguments"].as_str().unwrap_or(""), 160)
                );
            }
        }
        "agent.tool" if mine => {
            let mark = if fields["error"] == true { "!" } else { "=" };
            let _ = writeln!(
                out,
                "         {mark} {} {} ({} ms)",
                one_line(fields["name"].as_str().unwrap_or("?"), 80),
                one_line(fields["output"].as_str().unwrap_or(""), 160),
                fields["ms"]
            );
        }
        "agent.say" | "agent.control" | "agent.rewind" | "agent.paused" if mine => {
            let by = fields["by"].as_str().unwrap_or("?");
            // This command's own resume (the session starts paused until the stream is open)
            // is no news to the one who ran it.
            if kind == "agent.control" && by.contains(&format!("(pid {})", std::process::id())) {
                return false;
            }
            let line = match kind {
                "agent.say" => format!(
                    "[operator] {} (from {by})",
                    fields["text"].as_str().unwrap_or("")
                ),
                "agent.control" => format!(
                    "{} (by {by})",
                    match fields["action"].as_str().unwrap_or("?") {
                        "pause" => "paused",
                        "resume" => "resumed",
                        "step" => "stepping one turn",
                        "stop" => "stopped",
                        other => other,
                    }
                ),
                "agent.rewind" => format!("rewound to turn {} (by {by})", fields["turn"]),
                _ => format!("paused after turn {} ({by})", fields["after_turn"]),
            };
            let _ = writeln!(out, "warden: {}", one_line(&line, 200));
        }
        "approval.ask" => {
            let _ = writeln!(
                out,
                "warden: waiting for approval of {} (`warden approve {} {}` or `warden deny`)",
                one_line(fields["request"].as_str().unwrap_or(""), 160),
                entry["cell"].as_str().unwrap_or(""),
                entry["seq"]
            );
        }
        "agent.end" if mine => return true,
        _ => {}
    }
    false
}

fn print_info(info: &AgentInfo) {
    println!("session   {}", info.id);
    println!("cell      {}", info.cell);
    println!(
        "state     {}{}",
        info.state.name(),
        info.ended
            .as_deref()
            .map(|e| format!(" ({e})"))
            .unwrap_or_default()
    );
    println!("model     {} at {}", info.model, info.base_url);
    println!("turns     {}", info.turn);
    println!(
        "tokens    {} in, {} out",
        info.usage.input, info.usage.output
    );
    if let Some(from) = &info.forked_from {
        println!("forked    from {from}");
    }
    for t in &info.turns {
        println!(
            "  turn {:>3}  snapshot {}",
            t.turn,
            t.snapshot.as_deref().unwrap_or("(none)")
        );
    }
    if let Some(summary) = &info.summary {
        println!("summary   {}", one_line(summary, 200));
    }
}

fn print_item(item: &warden_model::Item) {
    use warden_model::Item;
    match item {
        Item::User { text } => println!("user: {}", crate::render::safe_lines(text)),
        Item::Assistant { text, calls } => {
            if !text.is_empty() {
                println!("model: {}", crate::render::safe_lines(text));
            }
            for c in calls {
                println!(
                    "model -> {} {}",
                    one_line(&c.name, 80),
                    one_line(&c.arguments, 300)
                );
            }
        }
        Item::Result { output, error, .. } => {
            println!(
                "{} {}",
                if *error { "tool !" } else { "tool =" },
                one_line(output, 300)
            );
        }
    }
}

/// `warden replay SESSION --rerun`: the session's tool calls again, and where they diverge.
pub fn rerun(id: &str, json: bool) -> Result<i32> {
    let report: warden_protocol::Rerun = call(
        Method::POST,
        &format!("/v1/agents/{id}/rerun"),
        Some(&serde_json::json!({})),
    )?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for c in &report.calls {
            println!(
                "turn {:>3}  {:<4} {} {}",
                c.turn,
                if c.same { "same" } else { "DIFF" },
                c.name,
                one_line(&c.arguments, 100)
            );
            if !c.same {
                println!("           then: {}", one_line(&c.recorded, 160));
                println!("           now:  {}", one_line(&c.now, 160));
            }
        }
        println!(
            "{} of {} calls diverged; they ran in cell {}",
            report.diverged,
            report.calls.len(),
            report.cell
        );
    }
    Ok(i32::from(report.diverged > 0))
}
