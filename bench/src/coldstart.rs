//! Cold-start benchmark: create a sandbox, run `true`, tear it down, many times, for Warden and
//! for the peers installed on this machine, in one run, and print a table with ratios.
//!
//! Usage: `coldstart [--runs N] [--warden PATH] [--baseline PATH]` (see bench/README.md).
//! `--baseline` adds the rows of another build of warden (an older one), interleaved with the
//! rest, so that a change is measured against what it changed in one run. As root, two rows
//! go through a daemon of the benchmark's own (`warden serve --pool default=2`), over its API:
//! create, exec `true`, delete; with a name (a cell started for the create, its keeper started
//! ahead) and without (a cell of the pool's: the row waits, untimed, until the pool has one
//! ready before each sample).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

struct Contender {
    name: String,
    argv: Vec<String>,
    /// Through the daemon's API instead of a command: from its pool or not.
    through: Option<Through>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Through {
    Daemon,
    Pool,
    /// A cell of the pool's, in one call (`POST /v1/run`).
    PoolRun,
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

fn contenders(warden: &str, baseline: Option<&str>) -> Vec<Contender> {
    let rootless = is_root() && which("setpriv").is_some();
    let mut out = Vec::new();
    let builds = std::iter::once(("warden run", warden)).chain(baseline.map(|b| ("baseline", b)));
    for (label, build) in builds {
        let warden_run = strings(&[build, "run", "--", "true"]);
        out.push(Contender {
            name: label.to_owned(),
            argv: warden_run.clone(),
            through: None,
        });
        if rootless {
            out.push(Contender {
                name: format!("{label} (rootless)"),
                argv: as_nobody(&warden_run),
                through: None,
            });
        }
    }
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
    if which("bwrap").is_some() {
        out.push(Contender {
            name: "bwrap --unshare-all".to_owned(),
            argv: bwrap.clone(),
            through: None,
        });
        if rootless {
            out.push(Contender {
                name: "bwrap (rootless)".to_owned(),
                argv: as_nobody(&bwrap),
                through: None,
            });
        }
    }
    if which("unshare").is_some() {
        out.push(Contender {
            name: "unshare -Umpnif".to_owned(),
            argv: strings(&["unshare", "-Umpnif", "true"]),
            through: None,
        });
    }
    if which("runsc").is_some() {
        out.push(Contender {
            name: "runsc do".to_owned(),
            argv: strings(&["runsc", "--network=none", "do", "true"]),
            through: None,
        });
    }
    if is_root() {
        for (name, through) in [
            ("warden (daemon)", Through::Daemon),
            ("warden (daemon, warm pool)", Through::Pool),
            ("warden (daemon, warm pool, one call)", Through::PoolRun),
        ] {
            out.push(Contender {
                name: name.to_owned(),
                argv: Vec::new(),
                through: Some(through),
            });
        }
    }
    out
}

/// Create, exec `true`, delete through the daemon's API; a cell of the pool's (waited for,
/// untimed, and its refill waited for after, untimed), in three calls or in one, or one
/// started for a named create.
fn time_through(daemon: &warden_bench::Daemon, through: Through, n: usize) -> Result<Duration> {
    let pooled = through != Through::Daemon;
    let create = match pooled {
        true => {
            warden_bench::wait_for_pool(&daemon.socket, 2, Duration::from_secs(10))?;
            "{}".to_owned()
        }
        false => format!(r#"{{"name":"cold{n}"}}"#),
    };
    let start = Instant::now();
    let name = match through {
        Through::PoolRun => warden_bench::run_once(&daemon.socket, &create)?,
        Through::Pool | Through::Daemon => {
            warden_bench::create_exec_delete(&daemon.socket, &create)?
        }
    };
    let took = start.elapsed();
    // A cell of the pool's has a name the daemon drew.
    if pooled && !name.starts_with("cell-") {
        bail!("the create was not the pool's: {name}");
    }
    // The pool's refill (a cell's start) is not left running under the next row.
    if pooled {
        warden_bench::wait_for_pool(&daemon.socket, 2, Duration::from_secs(10))?;
    }
    Ok(took)
}

fn time_once(argv: &[String]) -> Result<Duration> {
    let start = Instant::now();
    let mut command = Command::new(&argv[0]);
    if argv[0] == "setpriv" {
        // Rootless runs keep their state where `nobody` may create it.
        command
            .envs(warden_bench::nobody_env())
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
    warden_bench::end_on_signal()?;
    let mut runs = 200usize;
    let mut warden = String::from("target/release/warden");
    let mut baseline = None;
    let mut args = std::env::args().skip(1);
    const USAGE: &str = "usage: coldstart [--runs N] [--warden PATH] [--baseline PATH]";
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().context("--runs needs a number")?.parse()?,
            "--warden" => warden = args.next().context("--warden needs a path")?,
            "--baseline" => baseline = Some(args.next().context("--baseline needs a path")?),
            "--help" | "-h" => {
                warden_bench::say!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument {other}; {USAGE}"),
        }
    }
    let found = |path: &str| -> Result<String> {
        Ok(std::fs::canonicalize(path)
            .with_context(|| {
                format!("{path} not found; build it with `cargo build --release` or pass its path")
            })?
            .display()
            .to_string())
    };
    let warden = found(&warden)?;
    let baseline = baseline.as_deref().map(found).transpose()?;
    for binary in std::iter::once(&warden).chain(baseline.as_ref()) {
        warden_bench::settle(std::path::Path::new(binary))?;
    }
    let contenders = contenders(&warden, baseline.as_deref());
    let daemon_dir = std::env::temp_dir().join(format!("warden-coldstart-{}", std::process::id()));
    let daemon = match contenders.iter().any(|c| c.through.is_some()) {
        true => Some(warden_bench::Daemon::start(
            std::path::Path::new(&warden),
            &daemon_dir,
            &["--pool", "default=2"],
        )?),
        false => None,
    };
    let mut made = 0usize;
    let mut time = |c: &Contender| -> Result<Duration> {
        match (c.through, &daemon) {
            (Some(through), Some(daemon)) => {
                made += 1;
                time_through(daemon, through, made)
            }
            _ => time_once(&c.argv),
        }
    };
    let mut results: Vec<(&str, Vec<Duration>)> = contenders
        .iter()
        .map(|c| (c.name.as_str(), Vec::new()))
        .collect();
    // Warm-up, then interleave the contenders so that machine noise hits them alike, in a new
    // order each round: what one leaves behind falls on whichever runs next (a sandbox made
    // just after another's namespaces went waits several ms on this VM while the kernel
    // tears them down), so no row may always follow the same one.
    for c in &contenders {
        for _ in 0..5 {
            time(c)?;
        }
    }
    let mut order: Vec<usize> = (0..contenders.len()).collect();
    let mut seed = warden_bench::SHUFFLE_SEED;
    for round in 0..runs {
        warden_bench::shuffle(&mut order, &mut seed);
        for &i in &order {
            let c = &contenders[i];
            // gVisor is two orders of magnitude slower; sample it less often.
            if c.name.starts_with("runsc") && round % 10 != 0 {
                continue;
            }
            results[i].1.push(time(c)?);
        }
    }
    let warden_median = {
        let mut s = results[0].1.clone();
        s.sort();
        percentile(&s, 0.5)
    };
    warden_bench::say!(
        "cold start: create a sandbox, run `true`, tear it down ({runs} rounds, interleaved)"
    );
    warden_bench::say!();
    warden_bench::say!(
        "| {:<36} | {:>5} | {:>11} | {:>8} | {:>17} |",
        "sandbox",
        "runs",
        "median (ms)",
        "p90 (ms)",
        "median vs warden"
    );
    warden_bench::say!(
        "|{:-<38}|{:->7}|{:->13}|{:->10}|{:->19}|",
        "",
        "",
        "",
        "",
        ""
    );
    // A build against the one before: each round measured both, so the difference within a
    // round leaves out the host's slow and quick stretches that the medians of the two rows
    // each take in.
    let paired: Vec<(String, Vec<f64>)> = [
        ("warden run", "baseline"),
        ("warden run (rootless)", "baseline (rootless)"),
    ]
    .into_iter()
    .filter_map(|(this, before)| {
        let find = |name: &str| results.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
        let (this_samples, before_samples) = (find(this)?, find(before)?);
        let differences = this_samples
            .iter()
            .zip(before_samples)
            .map(|(a, b)| ms(*a) - ms(*b))
            .collect();
        Some((this.to_owned(), differences))
    })
    .collect();
    for (name, mut samples) in results {
        samples.sort();
        let median = percentile(&samples, 0.5);
        let p90 = percentile(&samples, 0.9);
        warden_bench::say!(
            "| {:<36} | {:>5} | {:>11.2} | {:>8.2} | {:>16.2}x |",
            name,
            samples.len(),
            ms(median),
            ms(p90),
            ms(median) / ms(warden_median)
        );
    }
    for (name, differences) in &paired {
        let (median, low, high) = median_with_interval(differences);
        warden_bench::say!(
            "{name} against the baseline, round by round: {median:+.3} ms median difference (95% interval {low:+.3} to {high:+.3}, {} rounds)",
            differences.len()
        );
    }
    drop(daemon);
    let _ = std::fs::remove_dir_all(&daemon_dir);
    Ok(())
}

/// The median of `values`, and a 95% interval for it by resampling `values` with replacement
/// (2,000 resamples, a fixed seed: the same samples give the same interval).
fn median_with_interval(values: &[f64]) -> (f64, f64, f64) {
    fn median(sorted: &mut [f64]) -> f64 {
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    }
    if values.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mut seed = warden_bench::SHUFFLE_SEED;
    let mut medians: Vec<f64> = (0..2000)
        .map(|_| {
            let mut resample: Vec<f64> = (0..values.len())
                .map(|_| {
                    values[(warden_bench::next_random(&mut seed) % values.len() as u64) as usize]
                })
                .collect();
            median(&mut resample)
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    let at = |p: f64| medians[((medians.len() - 1) as f64 * p).round() as usize];
    (median(&mut values.to_vec()), at(0.025), at(0.975))
}

#[cfg(test)]
mod tests {
    use super::median_with_interval;

    #[test]
    fn the_interval_holds_the_median_and_narrows_with_more_rounds() {
        let few: Vec<f64> = (0..20).map(|i| f64::from(i % 7) - 3.0).collect();
        let many: Vec<f64> = (0..2000).map(|i| f64::from(i % 7) - 3.0).collect();
        let (m, low, high) = median_with_interval(&few);
        assert!(low <= m && m <= high, "{low} {m} {high}");
        let (m2, low2, high2) = median_with_interval(&many);
        assert_eq!(m2, 0.0);
        assert!(
            high2 - low2 <= high - low,
            "{low2}..{high2} against {low}..{high}"
        );
        assert!(low2 <= 0.0 && high2 >= 0.0);
        // A shift shows as an interval that leaves zero out.
        let shifted: Vec<f64> = many.iter().map(|v| v + 5.0).collect();
        let (m3, low3, _) = median_with_interval(&shifted);
        assert_eq!(m3, 5.0);
        assert!(low3 > 0.0, "{low3}");
    }
}
