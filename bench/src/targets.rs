//! The speed targets Warden holds itself to, each checked against the figures of one report's
//! run (`bench-report`): a table of what was aimed at, what this run measured (both sides of
//! each ratio, so that a reader can redo it), and whether it was met. The figures are read back
//! from the tables the benchmarks print; a figure that is missing (a benchmark that failed, a
//! peer that is not installed) is said to be, never guessed.

use std::collections::HashMap;

/// One target, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub what: String,
    pub goal: String,
    /// What this run measured, or why it could not be told.
    pub measured: String,
    /// `None`: not measured in this run.
    pub met: Option<bool>,
}

/// The number in `column` of the row whose first cell is `row`, in the first markdown table of
/// `output` that has both.
pub fn cell(output: &str, row: &str, column: &str) -> Option<f64> {
    let mut index = None;
    for line in output.lines() {
        if !line.starts_with('|') {
            index = None;
            continue;
        }
        let cells = cells(line);
        match index {
            None => index = Some(cells.iter().position(|h| h == column)),
            Some(Some(at)) if cells.first().map(String::as_str) == Some(row) => {
                if let Some(value) = cells.get(at).and_then(|v| number(v)) {
                    return Some(value);
                }
            }
            Some(_) => {}
        }
    }
    None
}

/// The cells of a markdown table's row, trimmed.
pub fn cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_owned())
        .collect()
}

/// The numbers of the line of `output` that starts with `label` (leading spaces aside) and
/// goes on after two spaces or more, in a benchmark's aligned plain table (`0.93 ms`,
/// `1.00x`): units are left out.
pub fn figures(output: &str, label: &str) -> Option<Vec<f64>> {
    output.lines().find_map(|line| {
        let rest = line.trim_start().strip_prefix(label)?;
        if !rest.starts_with("  ") {
            return None;
        }
        let numbers: Vec<f64> = rest.split_whitespace().filter_map(number).collect();
        (!numbers.is_empty()).then_some(numbers)
    })
}

/// A figure as the benchmarks print it: `1.32`, `1.32x`, `+0.029`.
pub fn number(text: &str) -> Option<f64> {
    text.trim_end_matches('x').parse::<f64>().ok()
}

/// A figure as precise as the benchmarks print it: 2797 MiB/s, 7.12 ms, 0.262 ms.
fn show(x: f64) -> String {
    match x.abs() {
        a if a >= 100.0 => format!("{x:.0}"),
        a if a < 1.0 => format!("{x:.3}"),
        _ => format!("{x:.2}"),
    }
}

/// Which way a figure must go against its goal.
#[derive(Clone, Copy)]
enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    fn holds(self, value: f64) -> bool {
        match self {
            // Judged as printed: two decimals.
            Self::AtMost(goal) => (value * 100.0).round() <= (goal * 100.0).round(),
            Self::AtLeast(goal) => (value * 100.0).round() >= (goal * 100.0).round(),
        }
    }

    fn say(self, unit: &str) -> String {
        match self {
            Self::AtMost(goal) => format!("at most {goal:.2}{unit}"),
            Self::AtLeast(goal) => format!("at least {goal:.2}{unit}"),
        }
    }
}

/// A figure of this run, with what it is for the table.
struct Figure {
    value: Option<f64>,
    name: String,
}

fn missing(names: &[&Figure]) -> String {
    let gone: Vec<&str> = names
        .iter()
        .filter(|f| f.value.is_none())
        .map(|f| f.name.as_str())
        .collect();
    format!("not measured in this run ({})", gone.join(", "))
}

/// `a / b` against `bound`.
fn ratio(what: &str, a: Figure, b: Figure, unit: &str, bound: Bound) -> Check {
    let goal = bound.say("x");
    match (a.value, b.value) {
        (Some(x), Some(y)) if y > 0.0 => Check {
            what: what.to_owned(),
            goal,
            measured: format!("{} / {}{unit} = {:.2}x", show(x), show(y), x / y),
            met: Some(bound.holds(x / y)),
        },
        _ => Check {
            what: what.to_owned(),
            goal,
            measured: missing(&[&a, &b]),
            met: None,
        },
    }
}

/// `a` against `bound`, in `unit`.
fn value(what: &str, a: Figure, unit: &str, bound: Bound) -> Check {
    let goal = bound.say(unit);
    match a.value {
        Some(x) => Check {
            what: what.to_owned(),
            goal,
            measured: format!("{}{unit}", show(x)),
            met: Some(bound.holds(x)),
        },
        None => Check {
            what: what.to_owned(),
            goal,
            measured: missing(&[&a]),
            met: None,
        },
    }
}

/// The targets, checked against the benchmarks' outputs (by binary name).
pub fn check(outputs: &HashMap<&str, String>) -> Vec<Check> {
    let out = |binary: &str| outputs.get(binary).map(String::as_str).unwrap_or("");
    let (cold, ws, egress, daemon) = (
        out("coldstart"),
        out("workspace-ops"),
        out("egress"),
        out("daemon-bench"),
    );
    let fig = |value: Option<f64>, name: &str| Figure {
        value,
        name: name.to_owned(),
    };
    let cold_start = |row: &str| fig(cell(cold, row, "median (ms)"), row);
    let egress_cell = |row: &str, column: &str| fig(cell(egress, row, column), row);
    let line = |label: &str, at: usize| {
        fig(
            figures(daemon, label).and_then(|f| f.get(at).copied()),
            label,
        )
    };
    let mut checks = vec![
        ratio(
            "cold start as root: `warden run` / `bwrap --unshare-all`",
            cold_start("warden run"),
            cold_start("bwrap --unshare-all"),
            " ms",
            Bound::AtMost(1.0),
        ),
        ratio(
            "cold start rootless: `warden run (rootless)` / `bwrap (rootless)`",
            cold_start("warden run (rootless)"),
            cold_start("bwrap (rootless)"),
            " ms",
            Bound::AtMost(1.0),
        ),
        ratio(
            "warm pool, create + run + delete (three calls) / `bwrap --unshare-all`",
            cold_start("warden (daemon, warm pool)"),
            cold_start("bwrap --unshare-all"),
            " ms",
            Bound::AtMost(0.5),
        ),
        ratio(
            "warm pool, one call / `bwrap --unshare-all`",
            cold_start("warden (daemon, warm pool, one call)"),
            cold_start("bwrap --unshare-all"),
            " ms",
            Bound::AtMost(0.5),
        ),
        ratio(
            "exec round trip (API): median / the host's fork and exec",
            line("warden exec (API, unix socket)", 0),
            line("fork/exec on the host", 0),
            " ms",
            Bound::AtMost(1.5),
        ),
        ratio(
            "exec round trip (API): p99 / the host's fork and exec median",
            line("warden exec (API, unix socket)", 1),
            line("fork/exec on the host", 0),
            " ms",
            Bound::AtMost(3.0),
        ),
    ];
    // Snapshot and reset of 1,000 changed files out of 10,000, and the curve's flatness.
    for (column, what) in [
        (
            "btrfs: snapshot (quiet)",
            "snapshot of a quiet cell (daemon, btrfs)",
        ),
        (
            "btrfs: reset (quiet)",
            "reset of a quiet cell to a snapshot (daemon, btrfs)",
        ),
    ] {
        checks.push(value(
            &format!("{what}, 1,000 files changed"),
            fig(cell(ws, "1000", column), column),
            " ms",
            Bound::AtMost(10.0),
        ));
        checks.push(ratio(
            &format!("{what}: flat, 10,000 files changed / 10"),
            fig(cell(ws, "10000", column), column),
            fig(cell(ws, "10", column), column),
            " ms",
            Bound::AtMost(2.0),
        ));
    }
    for row in [
        "snapshot (running cell)",
        "reset to a snapshot (running cell)",
    ] {
        checks.push(value(
            &format!("{row}, 1,000 files changed"),
            fig(cell(ws, row, "median (ms)"), row),
            " ms",
            Bound::AtMost(10.0),
        ));
    }
    // The gateway against the proxies, on the same upstreams.
    for (kind, gateway, haproxy, squid) in [
        (
            "HTTP",
            "HTTP, warden gateway",
            "HTTP, haproxy (TCP relay)",
            "HTTP, squid (forward proxy)",
        ),
        (
            "HTTPS tunnel",
            "HTTPS tunnel, warden gateway",
            "HTTPS, haproxy (TCP relay)",
            "HTTPS tunnel, squid (CONNECT)",
        ),
    ] {
        let rate = "download MiB/s";
        checks.push(ratio(
            &format!("gateway throughput, {kind} / haproxy"),
            egress_cell(gateway, rate),
            egress_cell(haproxy, rate),
            " MiB/s",
            Bound::AtLeast(1.0),
        ));
        checks.push(ratio(
            &format!("gateway throughput, {kind} / squid"),
            egress_cell(gateway, rate),
            egress_cell(squid, rate),
            " MiB/s",
            Bound::AtLeast(2.0),
        ));
        checks.push(ratio(
            &format!("gateway CPU per GiB, {kind} / haproxy"),
            egress_cell(gateway, "CPU s per GiB"),
            egress_cell(haproxy, "CPU s per GiB"),
            " s",
            Bound::AtMost(1.0),
        ));
        for (peer, row) in [("haproxy", haproxy), ("squid", squid)] {
            checks.push(ratio(
                &format!("small request's median latency, {kind}: gateway / {peer}"),
                egress_cell(gateway, "median (ms)"),
                egress_cell(row, "median (ms)"),
                " ms",
                Bound::AtMost(1.0),
            ));
        }
    }
    let (ours, theirs) = ("HTTPS, warden interception", "HTTPS, squid ssl-bump");
    checks.push(ratio(
        "interception throughput / squid ssl-bump",
        egress_cell(ours, "download MiB/s"),
        egress_cell(theirs, "download MiB/s"),
        " MiB/s",
        Bound::AtLeast(1.0),
    ));
    checks.push(ratio(
        "interception median latency / squid ssl-bump",
        egress_cell(ours, "median (ms)"),
        egress_cell(theirs, "median (ms)"),
        " ms",
        Bound::AtMost(1.0),
    ));
    checks
}

/// The report's section of the targets.
pub fn section(checks: &[Check]) -> String {
    let met = checks.iter().filter(|c| c.met == Some(true)).count();
    let told = checks.iter().filter(|c| c.met.is_some()).count();
    let mut out = format!(
        "## Targets\n\nThe speed targets, each checked against this run's figures (ratios within \
         the one run; a latency ratio compares medians): {met} of {told} met here.\n\n\
         | target | goal | this run | met |\n|---|---|---|---|\n"
    );
    for check in checks {
        let met = match check.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "-",
        };
        out.push_str(&format!(
            "| {} | {} | {} | {met} |\n",
            check.what, check.goal, check.measured
        ));
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const COLD: &str = "\
cold start: create a sandbox, run `true`, tear it down (200 rounds, interleaved)

| sandbox                              |  runs | median (ms) | p90 (ms) |  median vs warden |
|--------------------------------------|-------|-------------|----------|-------------------|
| warden run                           |   200 |        7.12 |     8.56 |             1.00x |
| warden run (rootless)                |   200 |        6.50 |    11.03 |             1.23x |
| bwrap --unshare-all                  |   200 |        5.39 |     6.75 |             0.76x |
| bwrap (rootless)                     |   200 |        7.07 |     8.75 |             0.99x |
| warden (daemon, warm pool, one call) |   200 |        2.39 |     3.39 |             0.34x |
";

    const DAEMON: &str = "\
exec round trip of `true` (300 runs each, warden and fork/exec interleaved, 2-core VM)
                                                  median         p99  median/warden
warden exec (API, unix socket)                   0.93 ms     1.16 ms          1.00x
warden exec (API, one kept connection)           0.96 ms     1.23 ms          1.03x
fork/exec on the host                            0.60 ms     0.80 ms          0.65x
";

    const WORKSPACE: &str = "\
| operation                                | median (ms) | p90 (ms) |
|------------------------------------------|-------------|----------|
| snapshot (running cell)                  |        4.97 |     6.59 |
| reset to a snapshot (running cell)       |       40.73 |    50.23 |

| files changed |        btrfs: snapshot (quiet) |           btrfs: reset (quiet) |
|---------------|--------------------------------|--------------------------------|
|            10 |                           1.39 |                           2.59 |
|          1000 |                           4.98 |                           2.72 |
|         10000 |                           8.07 |                           3.02 |
";

    fn outputs() -> HashMap<&'static str, String> {
        HashMap::from([
            ("coldstart", COLD.to_owned()),
            ("daemon-bench", DAEMON.to_owned()),
            ("workspace-ops", WORKSPACE.to_owned()),
        ])
    }

    fn find<'a>(checks: &'a [Check], what: &str) -> &'a Check {
        checks
            .iter()
            .find(|c| c.what.starts_with(what))
            .unwrap_or_else(|| panic!("no check named {what}"))
    }

    #[test]
    fn figures_are_read_from_markdown_and_aligned_tables() {
        assert_eq!(cell(COLD, "bwrap (rootless)", "median (ms)"), Some(7.07));
        assert_eq!(
            cell(COLD, "bwrap (rootless)", "median vs warden"),
            Some(0.99)
        );
        // A row's label must be the whole first cell: `warden run` is not its rootless row.
        assert_eq!(cell(COLD, "warden run", "p90 (ms)"), Some(8.56));
        assert_eq!(cell(COLD, "warden", "median (ms)"), None);
        assert_eq!(cell(COLD, "warden run", "no such column"), None);
        assert_eq!(cell(WORKSPACE, "10000", "btrfs: reset (quiet)"), Some(3.02));
        assert_eq!(
            figures(DAEMON, "warden exec (API, unix socket)"),
            Some(vec![0.93, 1.16, 1.0])
        );
        assert_eq!(figures(DAEMON, "warden exec (API"), None);
    }

    #[test]
    fn each_target_is_judged_from_both_sides_of_its_ratio() {
        let checks = check(&outputs());
        let root = find(&checks, "cold start as root");
        assert_eq!(root.met, Some(false));
        assert_eq!(root.measured, "7.12 / 5.39 ms = 1.32x");
        // 6.50 / 7.07: below 1.0x, met.
        assert_eq!(find(&checks, "cold start rootless").met, Some(true));
        assert_eq!(find(&checks, "warm pool, one call").met, Some(true));
        // 0.93 / 0.60 = 1.55x against at most 1.5x; the p99's 1.16 / 0.60 = 1.93x against 3x.
        assert_eq!(
            find(&checks, "exec round trip (API): median").met,
            Some(false)
        );
        assert_eq!(find(&checks, "exec round trip (API): p99").met, Some(true));
        let snapshot = find(&checks, "snapshot of a quiet cell (daemon, btrfs), 1,000");
        assert_eq!(
            (snapshot.met, snapshot.measured.as_str()),
            (Some(true), "4.98 ms")
        );
        // 8.07 / 1.39 is not flat; 3.02 / 2.59 is.
        assert_eq!(
            find(&checks, "snapshot of a quiet cell (daemon, btrfs): flat").met,
            Some(false)
        );
        assert_eq!(
            find(
                &checks,
                "reset of a quiet cell to a snapshot (daemon, btrfs): flat"
            )
            .met,
            Some(true)
        );
        assert_eq!(
            find(&checks, "reset to a snapshot (running cell)").met,
            Some(false)
        );
    }

    #[test]
    fn a_figure_that_is_missing_is_said_to_be_and_never_judged() {
        let checks = check(&outputs());
        // No egress output, and no warm pool of three calls in the cold start's table.
        let gateway = find(&checks, "gateway throughput, HTTP / haproxy");
        assert_eq!(gateway.met, None);
        assert_eq!(
            gateway.measured,
            "not measured in this run (HTTP, warden gateway, HTTP, haproxy (TCP relay))"
        );
        let pool = find(&checks, "warm pool, create + run + delete");
        assert_eq!(pool.met, None);
        assert!(pool.measured.contains("warden (daemon, warm pool)"));
        let section = section(&checks);
        assert!(section.contains("| **no** |"), "{section}");
        let judged = checks.iter().filter(|c| c.met.is_some()).count();
        let met = checks.iter().filter(|c| c.met == Some(true)).count();
        assert!(
            section.contains(&format!("{met} of {judged} met here")),
            "{section}"
        );
    }

    #[test]
    fn a_goal_is_judged_as_the_figure_is_printed() {
        assert_eq!(
            [show(2797.0), show(7.124), show(0.2615)],
            ["2797", "7.12", "0.262"].map(String::from)
        );
        assert!(Bound::AtMost(1.5).holds(1.504));
        assert!(!Bound::AtMost(1.5).holds(1.506));
        assert!(Bound::AtLeast(2.0).holds(1.996));
        assert!(!Bound::AtLeast(2.0).holds(1.99));
    }
}
