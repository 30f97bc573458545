//! Makes `crates/cli/startup.order`: the functions of the `warden` binary that a `warden run --
//! true` executes (as root, and rootless when run as root), in the order they first run, for
//! the linker to place together at the start of the binary's code (see `crates/cli/build.rs`).
//!
//! It samples a build that has its symbols with `perf record` (the CPU clock, user space, 50,000
//! samples a second) over many runs: a function that runs at all is seen in some of them.
//!
//! ```sh
//! cargo build --release --workspace
//! target/release/order-startup      # as root; then build again
//! ```
//!
//! The release build keeps its symbols for this: a build with other profile settings mangles its
//! names with another hash, which the release build's linker would not find.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use warden_bench::{say, tell};

/// Runs further apart than this (the sampling loop sleeps 10 ms between runs) are different runs.
const RUN_GAP_S: f64 = 0.004;

fn main() {
    if let Err(err) = warden_bench::end_on_signal().and_then(|()| run()) {
        tell!("order-startup: {err:#}");
        std::process::exit(1);
    }
}

struct Args {
    warden: PathBuf,
    runs: u32,
    out: PathBuf,
}

fn args() -> Result<Args> {
    let mut args = Args {
        warden: PathBuf::from("target/release/warden"),
        runs: 400,
        out: PathBuf::from("crates/cli/startup.order"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--warden" => args.warden = PathBuf::from(value()?),
            "--runs" => args.runs = value()?.parse().context("--runs: a number")?,
            "--out" => args.out = PathBuf::from(value()?),
            "-h" | "--help" => {
                say!(
                    "order-startup [--warden target/release/warden] [--runs 400] [--out crates/cli/startup.order]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other} (see --help)"),
        }
    }
    Ok(args)
}

fn run() -> Result<()> {
    let args = args()?;
    let warden = std::fs::canonicalize(&args.warden)
        .with_context(|| format!("the build to sample, {}", args.warden.display()))?;
    // (`nm` says "no symbols" of a stripped binary, but ends with success.)
    let sections = Command::new("readelf")
        .args(["-S", "-W"])
        .arg(&warden)
        .stderr(Stdio::inherit())
        .output()
        .context("running readelf (binutils)")?;
    if !String::from_utf8_lossy(&sections.stdout).contains(" .symtab ") {
        bail!(
            "{} has no symbol table (a release build keeps it; see Cargo.toml)",
            warden.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("warden-order-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let data = dir.join("perf.data");
    let result = sample(&warden, args.runs, &data).and_then(|()| order(&data, &warden));
    let _ = std::fs::remove_dir_all(&dir);
    let order = result?;
    let mut text = String::from(
        "# Functions of a `warden run -- true` (as root and rootless), in the order they first\n\
         # run: see crates/cli/build.rs. Made by `order-startup` (bench/src/order.rs); made again\n\
         # when the run's code has moved.\n",
    );
    for name in &order {
        text.push_str(name);
        text.push('\n');
    }
    std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out.display()))?;
    say!("{} functions in {}", order.len(), args.out.display());
    Ok(())
}

/// Samples `runs` rounds of `warden run -- true`, and of a rootless one (as `nobody`, with its
/// folders where `nobody` may make them, as `coldstart` runs it) where this runs as root. Each
/// is tried once first, so that a run that fails says why.
fn sample(warden: &Path, runs: u32, data: &Path) -> Result<()> {
    let quoted = quote(&warden.display().to_string());
    let mut scenarios = vec![format!("{quoted} run -- true")];
    if rustix::process::geteuid().is_root() {
        let env: String = warden_bench::nobody_env()
            .iter()
            .map(|(name, dir)| format!("{name}={} ", quote(&dir.display().to_string())))
            .collect();
        scenarios.push(format!(
            "env -u XDG_RUNTIME_DIR {env}\
             setpriv --reuid=65534 --regid=65534 --clear-groups -- {quoted} run -- true"
        ));
    }
    for scenario in &scenarios {
        let out = Command::new("sh")
            .args(["-c", scenario])
            .stdin(Stdio::null())
            .output()
            .context("running sh")?;
        if !out.status.success() {
            bail!(
                "`{scenario}` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    let round: String = scenarios
        .iter()
        .map(|scenario| format!("{scenario} >/dev/null 2>&1 || exit 1; sleep 0.01; "))
        .collect();
    let script = format!("i=0; while [ $i -lt {runs} ]; do {round}i=$((i+1)); done");
    let status = Command::new("perf")
        .args(["record", "-q", "-F", "50000", "-e", "cpu-clock:u", "-o"])
        .arg(data)
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .context("running perf (linux-perf)")?;
    if !status.success() {
        bail!("sampling the runs failed ({status}): see above");
    }
    Ok(())
}

/// `text` as one word of the shell.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The functions of `warden` seen in the samples (see `order_of`).
fn order(data: &Path, warden: &Path) -> Result<Vec<String>> {
    let out = Command::new("perf")
        .args(["script", "--no-demangle", "-F", "time,ip,sym,dso", "-i"])
        .arg(data)
        .stderr(Stdio::null())
        .output()
        .context("running perf script")?;
    if !out.status.success() {
        bail!("perf script failed: {}", out.status);
    }
    let text = std::str::from_utf8(&out.stdout).context("perf script's output")?;
    let (order, samples, runs) = order_of(text, &warden.display().to_string());
    if order.is_empty() {
        bail!(
            "no samples of {} (is it the build that ran?)",
            warden.display()
        );
    }
    tell!("{samples} samples in {runs} runs");
    Ok(order)
}

/// The functions of the binary `dso` in `perf script -F time,ip,sym,dso` output, by the median
/// time of their first sample after their run's first (runs are told apart by a pause longer
/// than `RUN_GAP_S`); with the number of samples and of runs.
fn order_of(text: &str, dso: &str) -> (Vec<String>, usize, usize) {
    let dso = format!("({dso})");
    let mut samples: Vec<(f64, &str)> = Vec::new();
    for line in text.lines() {
        // `  TIME:  IP SYMBOL+OFFSET (DSO)`; the symbol may be `[unknown]`.
        let mut fields = line.split_whitespace();
        let (Some(time), Some(_ip), Some(symbol), Some(from)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (Ok(time), true) = (time.trim_end_matches(':').parse::<f64>(), from == dso) else {
            continue;
        };
        let name = symbol.split_once('+').map_or(symbol, |(name, _)| name);
        if name != "[unknown]" {
            samples.push((time, name));
        }
    }
    samples.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut first_seen: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut seen: HashMap<&str, f64> = HashMap::new();
    let mut runs = 0;
    let mut run_start = f64::NEG_INFINITY;
    let mut last = f64::NEG_INFINITY;
    for &(time, name) in &samples {
        if time - last > RUN_GAP_S {
            runs += 1;
            for (name, at) in seen.drain() {
                first_seen.entry(name).or_default().push(at);
            }
            run_start = time;
        }
        last = time;
        seen.entry(name).or_insert(time - run_start);
    }
    for (name, at) in seen.drain() {
        first_seen.entry(name).or_default().push(at);
    }
    let mut order: Vec<(f64, &str)> = first_seen
        .into_iter()
        .map(|(name, mut at)| {
            at.sort_by(f64::total_cmp);
            (at[at.len() / 2], name)
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(b.1)));
    let names = order.into_iter().map(|(_, name)| name.to_owned()).collect();
    (names, samples.len(), runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_ordered_by_when_they_first_run_in_most_runs() {
        // Three runs of `/w` (1 s apart), with another binary's samples between; `late` runs
        // first in one run only, `b` is seen only once per run after `a`.
        let text = "\
            10.000000:  1 a+0x10 (/w)\n\
            10.000100:  2 late+0x1 (/w)\n\
            10.000200:  3 b+0x2 (/w)\n\
            10.000300:  4 x+0x2 (/other)\n\
            11.000000:  1 a+0x10 (/w)\n\
            11.000100:  3 b+0x2 (/w)\n\
            11.000900:  2 late+0x1 (/w)\n\
            11.001000:  5 [unknown] (/w)\n\
            12.000000:  1 a+0x10 (/w)\n\
            12.000050:  3 b+0x2 (/w)\n\
            12.000800:  2 late (/w)\n\
            not a sample line\n";
        let (order, samples, runs) = order_of(text, "/w");
        assert_eq!(order, ["a", "b", "late"]);
        assert_eq!((samples, runs), (9, 3));
        assert_eq!(order_of(text, "/none").0, Vec::<String>::new());
    }
}
