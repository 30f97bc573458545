//! `bench-report`: runs every benchmark of this folder, one after the other, and writes
//! `docs/benchmarks.md` with their tables, charts of the figures that compare Warden with its
//! peers (SVG, drawn with `plotters`), the machine it ran on and the peers' versions. Run it as
//! root from the repository's root after `cargo build --release --workspace`.
//!
//! Usage: `bench-report [--quick] [--out FILE]` (`--quick`: fewer rounds, for a look);
//! `bench-report --check FILE` prints the targets' section (`targets.rs`) for the figures of a
//! report written before, without running anything.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use plotters::prelude::*;

mod targets;

/// One benchmark: its binary, its arguments (full and quick), and what to chart of its table.
struct Bench {
    title: &'static str,
    binary: &'static str,
    args: &'static [&'static str],
    quick: &'static [&'static str],
    charts: &'static [Chart],
}

/// A bar chart of one column of a benchmark's first markdown table that has that column.
struct Chart {
    file: &'static str,
    title: &'static str,
    column: &'static str,
}

const BENCHES: &[Bench] = &[
    Bench {
        title: "Cold start",
        binary: "coldstart",
        args: &["--runs", "200"],
        quick: &["--runs", "20"],
        charts: &[Chart {
            file: "coldstart.svg",
            title: "cold start: create, run `true`, tear down (median ms, lower is better)",
            column: "median (ms)",
        }],
    },
    Bench {
        title: "Workspace operations",
        binary: "workspace-ops",
        args: &["--runs", "15"],
        quick: &["--runs", "3"],
        charts: &[Chart {
            file: "workspace.svg",
            title: "workspace operations on 10,000 files, 1,000 changed (median ms)",
            column: "median (ms)",
        }],
    },
    Bench {
        title: "Egress",
        binary: "egress",
        args: &["--requests", "2000"],
        quick: &["--requests", "200"],
        charts: &[
            Chart {
                file: "egress-throughput.svg",
                title: "100 MiB downloads (median MiB/s, higher is better)",
                column: "download MiB/s",
            },
            Chart {
                file: "egress-latency.svg",
                title: "small requests on new connections (median ms, lower is better)",
                column: "median (ms)",
            },
            Chart {
                file: "egress-cpu.svg",
                title: "CPU seconds per GiB relayed (lower is better)",
                column: "CPU s per GiB",
            },
        ],
    },
    Bench {
        title: "Daemon",
        binary: "daemon-bench",
        args: &["--runs", "300", "--cells", "500"],
        quick: &["--runs", "30", "--cells", "20"],
        charts: &[],
    },
    Bench {
        title: "The gVisor tier",
        binary: "gvisor-bench",
        args: &["--runs", "30"],
        quick: &["--runs", "5"],
        charts: &[],
    },
];

fn main() -> Result<()> {
    warden_bench::end_on_signal()?;
    let mut quick = false;
    let mut out = PathBuf::from("docs/benchmarks.md");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--out" => out = PathBuf::from(args.next().context("--out needs a file")?),
            "--check" => {
                let path = args.next().context("--check needs a report's file")?;
                let report = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading the report {path}"))?;
                // Each benchmark's tables are in the report as it printed them.
                let outputs = BENCHES
                    .iter()
                    .map(|bench| (bench.binary, report.clone()))
                    .collect();
                print!("{}", targets::section(&targets::check(&outputs)));
                return Ok(());
            }
            "--help" | "-h" => {
                println!("usage: bench-report [--quick] [--out FILE] | --check FILE");
                return Ok(());
            }
            other => bail!(
                "unknown argument {other}; usage: bench-report [--quick] [--out FILE] | --check FILE"
            ),
        }
    }
    let dir = std::env::current_exe()?
        .parent()
        .context("the binary's folder")?
        .to_path_buf();
    let charts_dir = out.parent().unwrap_or(Path::new(".")).join("bench");
    std::fs::create_dir_all(&charts_dir)
        .with_context(|| format!("making {}", charts_dir.display()))?;

    let mut doc = String::new();
    doc.push_str("# Benchmarks\n\n");
    doc.push_str(
        "Written by `target/release/bench-report` (`bench/src/report.rs`): every benchmark of \
         `bench/` run one after the other on one machine, each comparing Warden with the peers \
         installed there side by side in the same run. Absolute times hold for this machine \
         only; the ratios are what to compare. Reproduce with\n\n\
         ```sh\ncargo build --release --workspace\nsudo target/release/bench-report   # as root: the root and rootless rows\n```\n\n",
    );
    doc.push_str(&machine());
    // The targets' section goes here, once every benchmark has run.
    let targets_at = doc.len();
    let mut outputs = std::collections::HashMap::new();
    let mut failed = Vec::new();
    for bench in BENCHES {
        let args = if quick { bench.quick } else { bench.args };
        warden_bench::tell!("bench-report: {} {}", bench.binary, args.join(" "));
        // What the last benchmark wrote goes to the disk first (a workspace benchmark leaves
        // seconds of writeback, under which every fdatasync of the next one waits longer).
        settle_disk();
        let started = std::time::Instant::now();
        let run = Command::new(dir.join(bench.binary)).args(args).output();
        doc.push_str(&format!(
            "## {}\n\n`target/release/{} {}`",
            bench.title,
            bench.binary,
            args.join(" ")
        ));
        let output = match run {
            Ok(output) if output.status.success() => {
                doc.push_str(&format!(" ({:.0} s)\n\n", started.elapsed().as_secs_f64()));
                String::from_utf8_lossy(&output.stdout).into_owned()
            }
            Ok(output) => {
                failed.push(bench.binary);
                doc.push_str(&format!(
                    "\n\nfailed ({}):\n\n```\n{}{}\n```\n\n",
                    output.status,
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ));
                continue;
            }
            Err(e) => {
                failed.push(bench.binary);
                doc.push_str(&format!("\n\ncould not be started: {e} (build it with `cargo build --release --workspace`)\n\n"));
                continue;
            }
        };
        // Markdown tables stay tables; other lines are kept as written.
        let mut in_code = false;
        for line in output.lines() {
            let table = line.starts_with('|');
            if !table && !line.trim().is_empty() && !in_code && !looks_like_prose(line) {
                doc.push_str("```\n");
                in_code = true;
            }
            if in_code && (table || line.trim().is_empty() || looks_like_prose(line)) {
                doc.push_str("```\n");
                in_code = false;
            }
            doc.push_str(line);
            doc.push('\n');
        }
        if in_code {
            doc.push_str("```\n");
        }
        doc.push('\n');
        outputs.insert(bench.binary, output.clone());
        for chart in bench.charts {
            let Some(rows) = column(&output, chart.column) else {
                continue;
            };
            let path = charts_dir.join(chart.file);
            bar_chart(&path, chart.title, &rows)
                .with_context(|| format!("drawing {}", path.display()))?;
            let rel = Path::new("bench").join(chart.file);
            doc.push_str(&format!("![{}]({})\n\n", chart.title, rel.display()));
        }
    }
    doc.insert_str(targets_at, &targets::section(&targets::check(&outputs)));
    std::fs::write(&out, &doc).with_context(|| format!("writing {}", out.display()))?;
    warden_bench::say!(
        "wrote {} and its charts in {}",
        out.display(),
        charts_dir.display()
    );
    if !failed.is_empty() {
        bail!(
            "these benchmarks failed (their output is in the report): {}",
            failed.join(", ")
        );
    }
    Ok(())
}

/// A line of a benchmark's output that reads as a sentence rather than an aligned table.
fn looks_like_prose(line: &str) -> bool {
    !line.contains("  ") || line.ends_with(':')
}

/// The machine and the peers' versions, as a section of the report.
fn machine() -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("?".to_owned(), |s| s.trim().to_owned());
    let cores = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let memory = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .map_or("?".to_owned(), |kib| {
            format!("{:.1} GiB", kib as f64 / (1 << 20) as f64)
        });
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map_or("?".to_owned(), |s| s.trim_matches('"').to_owned());
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_owned();
    // Every new mount namespace copies the host's mount table: sandboxes' cold starts grow
    // with it (41 tmpfs mounts added here: bwrap's 0.48 ms slower; a cell's, not measurably).
    let mounts = read("/proc/self/mountinfo").lines().count();
    let mut out = format!(
        "## Machine\n\n| | |\n|---|---|\n| CPU | {cpu}, {cores} cores |\n| memory | {memory} |\n| system | {os}, Linux {kernel} |\n| host mounts | {mounts} (each new mount namespace copies them) |\n| user | {} |\n| run | {} |\n\n",
        if rustix_root() { "root" } else { "not root" },
        date()
    );
    out.push_str("| peer | version |\n|---|---|\n");
    for (name, argv) in [
        ("bwrap", &["bwrap", "--version"][..]),
        ("unshare", &["unshare", "--version"][..]),
        ("runsc", &["runsc", "--version"][..]),
        ("crun", &["crun", "--version"][..]),
        ("squid", &["squid", "-v"][..]),
        ("haproxy", &["haproxy", "-v"][..]),
    ] {
        let version = Command::new(argv[0])
            .args(&argv[1..])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_owned()
            })
            .unwrap_or_else(|| "not installed".to_owned());
        out.push_str(&format!("| {name} | {} |\n", version.replace('|', "/")));
    }
    out.push('\n');
    out
}

fn rustix_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|l| l.split_whitespace().next() == Some("0"))
        })
        .unwrap_or(false)
}

fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The rows (first cell, number in `name`'s column) of the first markdown table with that
/// column.
fn column(output: &str, name: &str) -> Option<Vec<(String, f64)>> {
    let mut lines = output.lines().peekable();
    while let Some(line) = lines.next() {
        if !line.starts_with('|') {
            continue;
        }
        let header = targets::cells(line);
        let Some(index) = header.iter().position(|h| h == name) else {
            continue;
        };
        let mut rows = Vec::new();
        for row in lines.by_ref() {
            if !row.starts_with('|') {
                break;
            }
            let row = targets::cells(row);
            if row
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
            {
                continue;
            }
            let value = row.get(index).and_then(|v| targets::number(v));
            if let (Some(label), Some(value)) = (row.first(), value) {
                rows.push((label.clone(), value));
            }
        }
        return (!rows.is_empty()).then_some(rows);
    }
    None
}

/// A horizontal bar chart, one bar per row, Warden's rows in their own colour.
fn bar_chart(path: &Path, title: &str, rows: &[(String, f64)]) -> Result<()> {
    let height = 80 + 26 * rows.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let max = rows.iter().map(|(_, v)| *v).fold(0.0, f64::max).max(1e-9) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 17))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(260)
        .build_cartesian_2d(0.0..max, (0..rows.len() as i32).into_segmented())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(i) => rows
                .len()
                .checked_sub(1 + *i as usize)
                .and_then(|at| rows.get(at))
                .map(|r| r.0.clone())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .y_labels(rows.len())
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let warden = RGBColor(0x2b, 0x6c, 0xb0);
    let peer = RGBColor(0x9a, 0xa5, 0xb1);
    chart
        .draw_series(rows.iter().rev().enumerate().map(|(i, (label, value))| {
            let colour = if label.contains("warden") {
                warden
            } else {
                peer
            };
            let y = i as i32;
            let mut bar = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(y)),
                    (*value, SegmentValue::Exact(y + 1)),
                ],
                colour.filled(),
            );
            bar.set_margin(4, 4, 0, 0);
            bar
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Writes out every dirty page (`sync`), then gives the disk a moment to go quiet.
fn settle_disk() {
    let _ = Command::new("sync").status();
    std::thread::sleep(std::time::Duration::from_secs(2));
}
