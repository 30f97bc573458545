//! `warden audit` and `warden replay`: the journal read back.

use crate::cli::{AuditCommand, ExportFormat};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use warden_journal::{Entry, Format};

use super::*;

pub fn audit(command: AuditCommand) -> Result<i32> {
    match command {
        AuditCommand::Verify { journal, key } => {
            let dir = journal_dir(journal);
            match warden_journal::verify(&dir, key.as_deref()) {
                Ok(report) => {
                    println!(
                        "ok: {} entries (last {}) in {} segment(s), {} signed checkpoints, {} entries after the last one; key {}",
                        report.entries,
                        report.last_seq,
                        report.segments,
                        report.checkpoints,
                        report.unsigned_tail,
                        report.key
                    );
                    if report.first_seq > 1 {
                        println!(
                            "note: the chain is proven from entry {}: the segments before it are not in {}",
                            report.first_seq,
                            dir.display()
                        );
                    }
                    if report.torn_bytes > 0 {
                        println!(
                            "note: a torn last line of {} bytes (a write cut by a crash, never acknowledged) follows; the daemon removes it when it next starts",
                            report.torn_bytes
                        );
                    }
                    Ok(0)
                }
                Err(
                    err @ (warden_journal::VerifyError::Bad { .. }
                    | warden_journal::VerifyError::Missing { .. }),
                ) => {
                    println!("FAILED: {err}");
                    Ok(1)
                }
                Err(err) => Err(err.into()),
            }
        }
        AuditCommand::Export {
            format,
            cell,
            since,
            journal,
        } => {
            let since_ms = match since {
                Some(text) => Some(parse_since(&text)?),
                None => None,
            };
            let dir = journal_dir(journal);
            let format = match format {
                ExportFormat::Jsonl => Format::Jsonl,
                ExportFormat::Ocsf => Format::Ocsf,
            };
            let mut out = std::io::stdout().lock();
            warden_journal::export(&dir, format, cell.as_deref(), since_ms, &mut out)
                .with_context(|| format!("reading the journal in {}", dir.display()))?;
            Ok(0)
        }
    }
}

fn parse_since(text: &str) -> Result<u64> {
    if let Ok(time) = humantime::parse_rfc3339_weak(text) {
        return Ok(time
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64));
    }
    let age = humantime::parse_duration(text).with_context(|| {
        format!("--since {text}: give a time (2026-01-02T03:04:05Z) or an age (90m, 2h)")
    })?;
    Ok(warden_harness::now_ms().saturating_sub(age.as_millis() as u64))
}

pub fn replay(name: &str, json_out: bool) -> Result<i32> {
    let dir = journal_dir(None);
    let mut text = Vec::new();
    warden_journal::export(&dir, Format::Jsonl, Some(name), None, &mut text)
        .with_context(|| format!("reading the journal in {}", dir.display()))?;
    let entries: Vec<Entry> = String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if entries.is_empty() {
        bail!("the journal has nothing about cell `{name}`");
    }
    if json_out {
        for entry in &entries {
            println!("{}", serde_json::to_string(entry)?);
        }
        return Ok(0);
    }
    for entry in &entries {
        println!(
            "{}  #{:<6} {:<14} {}",
            entry.time_text(),
            entry.seq,
            crate::render::safe(&entry.kind),
            crate::render::safe(&summary(entry))
        );
    }
    Ok(0)
}

/// One line about an entry, for people.
fn summary(entry: &Entry) -> String {
    let d = &entry.data;
    let argv = || {
        d["argv"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    };
    match entry.kind.as_str() {
        "exec.start" => format!("process {}: {}", d["process"], argv()),
        "exec.exit" => {
            let how = match (d["code"].as_i64(), d["signal"].as_i64()) {
                (Some(code), _) => format!("code {code}"),
                (None, Some(signal)) => format!("signal {signal}"),
                _ => String::new(),
            };
            // A run without a daemon passes its output to the caller without counting it.
            let output = match (d["stdout_bytes"].as_u64(), d["stderr_bytes"].as_u64()) {
                (Some(out), Some(err)) => format!(", {out} bytes out, {err} bytes err"),
                _ => ", output to the caller's terminal".to_owned(),
            };
            format!(
                "process {} {} {how} after {} ms{output}",
                d["process"],
                d["reason"].as_str().unwrap_or_default(),
                d["duration_ms"].as_u64().unwrap_or(0),
            )
        }
        "policy.replaced" => format!(
            "network and command rules replaced, {} open connection(s) closed",
            d["closed_connections"].as_u64().unwrap_or(0)
        ),
        "policy.refused" => d["reason"].as_str().unwrap_or_default().to_owned(),
        "agent.model" => match d["error"].as_str() {
            Some(error) if d["abandoned"] == true => format!("turn {}: {error}", d["turn"]),
            Some(error) => format!("turn {}: the model API failed: {error}", d["turn"]),
            None => {
                let calls: Vec<String> = d["calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        format!(
                            "{} {}",
                            c["name"].as_str().unwrap_or("?"),
                            c["arguments"].as_str().unwrap_or("")
                        )
                    })
                    .collect();
                format!(
                    "turn {} ({} ms, {} in / {} out): {}{}",
                    d["turn"],
                    d["latency_ms"],
                    d["usage"]["input"],
                    d["usage"]["output"],
                    d["text"].as_str().unwrap_or(""),
                    if calls.is_empty() {
                        String::new()
                    } else {
                        format!(" -> {}", calls.join("; "))
                    }
                )
            }
        },
        "agent.tool" => format!(
            "turn {}: {} {} = {}{}",
            d["turn"],
            d["name"].as_str().unwrap_or("?"),
            d["arguments"].as_str().unwrap_or(""),
            if d["error"] == true { "error: " } else { "" },
            d["output"].as_str().unwrap_or("")
        ),
        "agent.say" => format!("operator: {}", d["text"].as_str().unwrap_or("")),
        "net.decision" if d["inference"].is_object() => {
            let i = &d["inference"];
            format!(
                "model {} via {} ({} ms, {} in / {} out, {} used): {}{}",
                i["model"].as_str().unwrap_or("?"),
                i["format"].as_str().unwrap_or("?"),
                i["latency_ms"],
                i["usage"]["input"],
                i["usage"]["output"],
                i["tokens_used"],
                i["text"].as_str().unwrap_or(""),
                i["error"]
                    .as_str()
                    .map(|e| format!(" (error: {e})"))
                    .unwrap_or_default()
            )
        }
        "agent.end" => format!(
            "{}: {} after {} turns",
            d["state"].as_str().unwrap_or(""),
            d["reason"].as_str().unwrap_or(""),
            d["turns"]
        ),
        _ if d.as_object().is_some_and(|o| o.is_empty()) => String::new(),
        _ => d.to_string(),
    }
}
