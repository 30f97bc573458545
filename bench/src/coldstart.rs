//! Cold-start benchmark: create a sandbox, run `true`, tear it down, many times, for Warden and
//! for the peers installed on this machine, in one run, and print a table with ratios.
//!
//! Usage: `coldstart [--runs N] [--warden PATH]` (see bench/README.md).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

struct Contender {
    name: &'static str,
    argv: Vec<String>,
}

/// Runs a command as `nobody`, so that rootless sandboxes can be measured from a root shell;
/// both rootless rows pay the same extra exec of setpriv.
fn as_nobody(argv: &[String]) -> Vec<String> {
    let mut out = strings(&[
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--",
    ]);
    out.extend(argv.iter().cloned());
    out
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn contenders(warden: &str) -> Vec<Contender> {
    let warden_run = strings(&[warden, "run", "--", "true"]);
    let bwrap = strings(&[
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "true",
    ]);
    let mut out = vec![Contender {
        name: "warden run",
        argv: warden_run.clone(),
    }];
    let rootless = is_root() && which("setpriv").is_some();
    if rootless {
        out.push(Contender {
            name: "warden run (rootless)",
            argv: as_nobody(&warden_run),
        });
    }
    if which("bwrap").is_some() {
        out.push(Contender {
            name: "bwrap --unshare-all",
            argv: bwrap.clone(),
        });
        if rootless {
            out.push(Contender {
                name: "bwrap (rootless)",
                argv: as_nobody(&bwrap),
            });
        }
    }
    if which("unshare").is_some() {
        out.push(Contender {
            name: "unshare -Umpnif",
            argv: strings(&["unshare", "-Umpnif", "true"]),
        });
    }
    if which("runsc").is_some() {
        out.push(Contender {
            name: "runsc do",
            argv: strings(&["runsc", "--network=none", "do", "true"]),
        });
    }
    out
}

fn time_once(argv: &[String]) -> Result<Duration> {
    let start = Instant::now();
    let mut command = Command::new(&argv[0]);
    if argv[0] == "setpriv" {
        // Rootless runs keep their state where `nobody` may create it.
        command
            .env(
                "WARDEN_RUNTIME_DIR",
                std::env::temp_dir().join("warden-bench-nobody"),
            )
            .env(
                "WARDEN_STATE_DIR",
                std::env::temp_dir().join("warden-bench-nobody-state"),
            )
            .env_remove("XDG_RUNTIME_DIR");
    }
    let status = command
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("starting {}", argv[0]))?;
    let took = start.elapsed();
    if !status.success() {
        bail!("`{}` failed with {status}", argv.join(" "));
    }
    Ok(took)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let mut runs = 200usize;
    let mut warden = String::from("target/release/warden");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().context("--runs needs a number")?.parse()?,
            "--warden" => warden = args.next().context("--warden needs a path")?,
            other => bail!("unknown argument {other}; usage: coldstart [--runs N] [--warden PATH]"),
        }
    }
    let warden = std::fs::canonicalize(&warden)
        .with_context(|| {
            format!(
                "{warden} not found; build it with `cargo build --release` or pass --warden PATH"
            )
        })?
        .display()
        .to_string();
    let contenders = contenders(&warden);
    let mut results: Vec<(&str, Vec<Duration>)> =
        contenders.iter().map(|c| (c.name, Vec::new())).collect();
    // Warm-up, then interleave the contenders so that machine noise hits them alike.
    for c in &contenders {
        for _ in 0..5 {
            time_once(&c.argv)?;
        }
    }
    for round in 0..runs {
        for (c, (_, samples)) in contenders.iter().zip(results.iter_mut()) {
            // gVisor is two orders of magnitude slower; sample it less often.
            if c.name.starts_with("runsc") && round % 10 != 0 {
                continue;
            }
            samples.push(time_once(&c.argv)?);
        }
    }
    let warden_median = {
        let mut s = results[0].1.clone();
        s.sort();
        percentile(&s, 0.5)
    };
    println!("cold start: create a sandbox, run `true`, tear it down ({runs} rounds, interleaved)");
    println!();
    println!(
        "| {:<28} | {:>5} | {:>11} | {:>8} | {:>17} |",
        "sandbox", "runs", "median (ms)", "p90 (ms)", "median vs warden"
    );
    println!(
        "|{:-<30}|{:->7}|{:->13}|{:->10}|{:->19}|",
        "", "", "", "", ""
    );
    for (name, mut samples) in results {
        samples.sort();
        let median = percentile(&samples, 0.5);
        let p90 = percentile(&samples, 0.9);
        println!(
            "| {:<28} | {:>5} | {:>11.2} | {:>8.2} | {:>16.2}x |",
            name,
            samples.len(),
            ms(median),
            ms(p90),
            ms(median) / ms(warden_median)
        );
    }
    Ok(())
}
