//! A randomized differential test of the workspace's promise: after an apply of the whole diff,
//! the host directory is exactly what the cell saw in its workspace (names, kinds, contents,
//! link targets, modes), and the diff lists exactly what differs. Each seed builds a random host
//! tree, makes a cell on it through a real daemon, runs random operations in the cell, lists the
//! cell's view from inside, applies, and lists the host directory the same way.
//!
//! `WARDEN_APPLY_SEEDS=A..B` runs other seeds (the default is `0..100`); a failure names its seed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

/// SplitMix64: small, fixed, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

const NAMES: &[&str] = &[
    "a",
    "b.txt",
    "src",
    "with space",
    "ünï cödé",
    "日本",
    "x-y_z",
    "data.bin",
    "lib",
    "notes.md",
];

/// A file's bytes: empty, short text, binary, or more than 64 KiB.
fn content(rng: &mut Rng) -> Vec<u8> {
    match rng.below(5) {
        0 => Vec::new(),
        1 | 2 => format!("line {}\nmore {}\n", rng.next(), rng.below(100)).into_bytes(),
        3 => (0..rng.below(3000)).map(|_| rng.next() as u8).collect(),
        _ => {
            let len = 65_536 + rng.below(40_000) as usize;
            let fill = rng.next() as u8;
            (0..len)
                .map(|i| fill.wrapping_add((i % 251) as u8))
                .collect()
        }
    }
}

fn build_host(rng: &mut Rng, dir: &Path, depth: u32) {
    let entries = 2 + rng.below(4);
    for _ in 0..entries {
        let name = *rng.pick(NAMES);
        let path = dir.join(name);
        if path.symlink_metadata().is_ok() {
            continue;
        }
        match rng.below(10) {
            0..=2 if depth < 3 => {
                std::fs::create_dir(&path).unwrap();
                build_host(rng, &path, depth + 1);
                let mode = *rng.pick(&[0o755, 0o755, 0o700, 0o750]);
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            }
            3 => {
                let target = *rng.pick(&[
                    "b.txt",
                    "../a",
                    "/etc/hostname",
                    "missing",
                    "src",
                    ".",
                    "../src",
                ]);
                std::os::unix::fs::symlink(target, &path).unwrap();
            }
            _ => {
                std::fs::write(&path, content(rng)).unwrap();
                let mode = *rng.pick(&[0o644, 0o644, 0o755, 0o444, 0o600, 0o640]);
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            }
        }
    }
}

/// Prints one JSON line per entry below ROOT (argv[1]), sorted: path, kind, mode, and a file's
/// size and SHA-256 or a link's target.
const LISTING: &str = r#"
import hashlib, json, os, stat, sys
root = sys.argv[1]
out = []
def walk(rel):
    full = os.path.join(root, rel) if rel else root
    for name in sorted(os.listdir(full)):
        r = os.path.join(rel, name) if rel else name
        p = os.path.join(root, r)
        st = os.lstat(p)
        e = {"path": r, "mode": stat.S_IMODE(st.st_mode)}
        if stat.S_ISLNK(st.st_mode):
            e["kind"] = "symlink"; e["target"] = os.readlink(p)
        elif stat.S_ISDIR(st.st_mode):
            e["kind"] = "dir"
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                data = f.read()
            e["kind"] = "file"; e["size"] = len(data); e["sha256"] = hashlib.sha256(data).hexdigest()
        else:
            e["kind"] = "special"
        out.append(e)
        if e["kind"] == "dir":
            walk(r)
walk("")
for e in out:
    print(json.dumps(e, sort_keys=True, ensure_ascii=False))
"#;

/// Random operations on /workspace, from Python's own seeded generator (deterministic: every
/// choice is made over sorted listings).
const OPERATIONS: &str = r#"
import os, random, shutil, sys
rng = random.Random(int(sys.argv[1]))
W = "/workspace"
NAMES = ["a", "b.txt", "src", "with space", "ünï cödé", "日本", "new", "n2.dat", "lib", "moved dir"]
def entries():
    out = []
    for d, dirs, files in os.walk(W):
        dirs.sort()
        for n in sorted(dirs) + sorted(files):
            out.append(os.path.join(d, n))
    return out
def of(pred):
    return [p for p in entries() if pred(p)]
def isdir(p): return os.path.isdir(p) and not os.path.islink(p)
def isfile(p): return os.path.isfile(p) and not os.path.islink(p)
def dirs(): return [W] + of(isdir)
def content():
    k = rng.randrange(5)
    if k == 0: return b""
    if k in (1, 2): return ("text %d\nline\n" % rng.randrange(1000)).encode()
    if k == 3: return bytes(rng.randrange(256) for _ in range(rng.randrange(2000)))
    return bytes([rng.randrange(256)]) * (65536 + rng.randrange(30000))
def newpath():
    return os.path.join(rng.choice(dirs()), rng.choice(NAMES))
def gone(p):
    if isdir(p): shutil.rmtree(p)
    elif os.path.lexists(p): os.unlink(p)
def fill(d):
    for _ in range(rng.randrange(1, 4)):
        p = os.path.join(d, rng.choice(NAMES))
        if not os.path.lexists(p):
            log("  fill", p)
            with open(p, "wb") as f: f.write(content())
def op():
    k = rng.randrange(15)
    if k == 0:  # a new file
        p = newpath()
        if not os.path.lexists(p):
            with open(p, "wb") as f: f.write(content())
            log("new file", p)
    elif k == 1:  # a file changed: written over, appended to, or cut
        fs = of(isfile)
        if fs:
            p = rng.choice(fs); m = rng.randrange(3); log("change", p, m)
            if m == 0:
                with open(p, "wb") as f: f.write(content())
            elif m == 1:
                with open(p, "ab") as f: f.write(b"appended\n")
            else:
                os.truncate(p, 0)
    elif k == 2:  # a file or link deleted
        xs = of(lambda p: not isdir(p))
        if xs: p = rng.choice(xs); log("unlink", p); os.unlink(p)
    elif k == 3:  # a directory and all it holds deleted
        ds = of(isdir)
        if ds: p = rng.choice(ds); log("rm -r", p); shutil.rmtree(p)
    elif k == 4:  # a directory replaced by a file
        ds = of(isdir)
        if ds:
            p = rng.choice(ds); log("dir to file", p); shutil.rmtree(p)
            with open(p, "wb") as f: f.write(content())
    elif k == 5:  # a file replaced by a directory
        fs = of(lambda p: not isdir(p))
        if fs:
            p = rng.choice(fs); log("file to dir", p); os.unlink(p); os.mkdir(p); fill(p)
    elif k == 6:  # a directory renamed
        ds = of(isdir)
        if ds:
            src = rng.choice(ds); dst = newpath()
            if not os.path.lexists(dst) and not (dst + "/").startswith(src + "/"):
                log("mv dir", src, dst); os.rename(src, dst)
    elif k == 7:  # a file renamed, maybe over another
        fs = of(isfile)
        if fs:
            src = rng.choice(fs)
            others = of(isfile)
            dst = rng.choice(others) if rng.randrange(2) else newpath()
            if not isdir(dst): log("mv", src, dst); os.rename(src, dst)
    elif k == 8:  # a mode changed
        xs = of(lambda p: not os.path.islink(p))
        if xs:
            p = rng.choice(xs); log("chmod", p)
            if isdir(p): os.chmod(p, rng.choice([0o755, 0o700, 0o750, 0o775]))
            else: os.chmod(p, rng.choice([0o644, 0o755, 0o600, 0o444, 0o700, 0o640, 0o664]))
    elif k == 9:  # a symlink: relative, absolute, dangling, to a directory
        p = newpath()
        if not os.path.lexists(p):
            t = rng.choice(["b.txt", "../src", "/etc/hostname", "/workspace/a", "nowhere", "src", "."])
            log("ln -s", t, p); os.symlink(t, p)
    elif k == 10:  # a directory deleted and made again (opaque), some of its old names again
        ds = of(isdir)
        if ds:
            p = rng.choice(ds); log("dir again", p)
            old = [(n, isdir(os.path.join(p, n))) for n in sorted(os.listdir(p))]
            shutil.rmtree(p); os.mkdir(p)
            for n, was_dir in old:
                if rng.randrange(2):
                    q = os.path.join(p, n); log("  again", q)
                    if was_dir: os.mkdir(q); fill(q)
                    else:
                        with open(q, "wb") as f: f.write(content())
            fill(p)
    elif k == 11:  # a hard link
        fs = of(isfile)
        if fs:
            src = rng.choice(fs); dst = newpath()
            if not os.path.lexists(dst): log("ln", src, dst); os.link(src, dst)
    elif k == 12:  # a new directory with files
        p = newpath()
        if not os.path.lexists(p):
            log("new dir", p); os.mkdir(p); fill(p)
    elif k == 13:  # a link replaced by a file, or by a directory (with copies of what it led to)
        ls = of(os.path.islink)
        if ls:
            p = rng.choice(ls); log("link to other", p)
            led = [os.path.join(p, n) for n in sorted(os.listdir(p))] if isdir(os.path.realpath(p)) and os.path.realpath(p).startswith(W) else []
            led = [q for q in led if isfile(os.path.realpath(q))]
            copies = [(os.path.basename(q), open(q, "rb").read(), os.stat(q).st_mode & 0o777) for q in led]
            os.unlink(p)
            if rng.randrange(2):
                os.mkdir(p)
                for n, data, mode in copies:
                    if rng.randrange(2):
                        q = os.path.join(p, n); log("  copy", q)
                        with open(q, "wb") as f: f.write(data)
                        os.chmod(q, mode)
                fill(p)
            else:
                with open(p, "wb") as f: f.write(content())
    else:  # a file written through a hard link made earlier, or appended
        fs = of(isfile)
        if fs:
            p = rng.choice(fs); log("append", p)
            with open(p, "ab") as f: f.write(content()[:100])
def log(*a): print(*(x.replace(W + "/", "") if isinstance(x, str) else x for x in a))
for i in range(int(sys.argv[2])):
    try:
        op()
    except OSError as e:
        print("op", i, "failed:", e, file=sys.stderr)
"#;

type Listing = BTreeMap<String, Value>;

fn parse_listing(text: &str) -> Listing {
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|_| panic!("listing line {l}"));
            (v["path"].as_str().unwrap().to_owned(), v)
        })
        .collect()
}

fn host_listing(root: &Path) -> Listing {
    let out = std::process::Command::new("python3")
        .args(["-c", LISTING])
        .arg(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_listing(&String::from_utf8(out.stdout).unwrap())
}

/// Whether two entries differ as the diff counts it (a directory by its kind and mode only).
fn differs(a: &Value, b: &Value) -> bool {
    if a["kind"] == "dir" && b["kind"] == "dir" {
        return a["mode"] != b["mode"];
    }
    a != b
}

/// The paths at which two listings differ, with what each holds there.
fn differences(a: &Listing, b: &Listing) -> Vec<String> {
    let mut out = Vec::new();
    for path in a
        .keys()
        .chain(b.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        match (a.get(path), b.get(path)) {
            (Some(x), Some(y)) if !differs(x, y) => {}
            (x, y) => out.push(format!(
                "{path}: {} | {}",
                x.map_or("-".into(), Value::to_string),
                y.map_or("-".into(), Value::to_string)
            )),
        }
    }
    out
}

/// Checks the diff against the two listings: each path that differs is listed, as what it is
/// in the cell, and nothing else is. Returns the problems found.
fn check_diff(diff: &Value, before: &Listing, cell: &Listing) -> Vec<String> {
    let mut problems = Vec::new();
    let mut listed = BTreeMap::new();
    for change in diff["changes"].as_array().unwrap() {
        let path = change["path"].as_str().unwrap().to_owned();
        if listed.insert(path.clone(), change.clone()).is_some() {
            problems.push(format!("{path} is listed twice"));
        }
    }
    let mut expected = Vec::new();
    for path in before
        .keys()
        .chain(cell.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        let (old, new) = (before.get(path), cell.get(path));
        if let (Some(x), Some(y)) = (old, new)
            && !differs(x, y)
        {
            continue;
        }
        expected.push(path.clone());
        // A directory deleted, or replaced by a file or link, is listed with what it held
        // one level down; what lies deeper goes with it unlisted.
        let covered = ancestors(path).any(|a| {
            listed
                .get(a)
                .is_some_and(|c| c["entry"] != "dir" || c["kind"] == "deleted")
                && before.get(a).is_some_and(|b| b["kind"] == "dir")
        });
        if covered && !listed.contains_key(path) {
            continue;
        }
        let Some(change) = listed.get(path) else {
            problems.push(format!(
                "{path} differs and is not listed: {:?} -> {:?}",
                old.map(Value::to_string),
                new.map(Value::to_string)
            ));
            continue;
        };
        let kind = match (old, new) {
            (None, _) => "added",
            (_, None) => "deleted",
            _ => "modified",
        };
        let entry = new.or(old).unwrap();
        let mut wrong = Vec::new();
        if change["kind"] != kind {
            wrong.push(format!("kind {} (expected {kind})", change["kind"]));
        }
        if change["entry"] != entry["kind"] {
            wrong.push(format!(
                "entry {} (expected {})",
                change["entry"], entry["kind"]
            ));
        }
        if let Some(new) = new {
            if !change["new_mode"].is_null() && change["new_mode"] != new["mode"] {
                wrong.push(format!(
                    "new_mode {} (expected {})",
                    change["new_mode"], new["mode"]
                ));
            }
            if new["kind"] == "file" && change["size"] != new["size"] {
                wrong.push(format!(
                    "size {} (expected {})",
                    change["size"], new["size"]
                ));
            }
            if new["kind"] == "symlink" && change["link_target"] != new["target"] {
                wrong.push(format!(
                    "link_target {} (expected {})",
                    change["link_target"], new["target"]
                ));
            }
        }
        if !wrong.is_empty() {
            problems.push(format!("{path}: {}", wrong.join(", ")));
        }
    }
    for path in listed.keys() {
        if !expected.contains(path) {
            problems.push(format!(
                "{path} is listed and does not differ: {}",
                listed[path]
            ));
        }
    }
    problems
}

/// The proper ancestors of a relative path, nearest first.
fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.char_indices()
        .rev()
        .filter(|&(_, c)| c == '/')
        .map(move |(i, _)| &path[..i])
}

/// One round: returns the problems found (empty when the promise held).
fn round(daemon: &Daemon, seed: u64) -> Vec<String> {
    let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed);
    let host = tempdir();
    build_host(&mut rng, host.path(), 0);
    let before = host_listing(host.path());
    let ops = 6 + rng.below(14);

    let cell = daemon.create(
        &unique(&format!("rnd{seed}")),
        json!({ "workspace": host.path().display().to_string() }),
    );
    // The operations in one to three turns, a snapshot between two (the cell's upper layer
    // then lies on the snapshot's: a stack of layers, each with its whiteouts and opaque
    // directories).
    let turns = 1 + rng.below(3);
    let mut ops_log = String::new();
    for turn in 0..turns {
        if turn > 0 {
            let snap = daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/snapshot"),
                Some(json!({})),
            );
            assert_eq!(snap.status, 201, "seed {seed}: snapshot: {}", snap.text());
            ops_log.push_str("-- snapshot\n");
        }
        let ops_events = daemon.exec(
            &cell,
            json!({ "argv": ["python3", "-c", OPERATIONS, (seed * 10 + turn).to_string(), ops.to_string()] }),
        );
        assert_eq!(
            exit_of(&ops_events)["code"],
            0,
            "seed {seed}: operations: {}",
            String::from_utf8_lossy(&stream_bytes(&ops_events, "stderr"))
        );
        ops_log.push_str(&String::from_utf8_lossy(&stream_bytes(
            &ops_events,
            "stdout",
        )));
    }
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["python3", "-c", LISTING, "/workspace"] }),
    );
    assert_eq!(
        exit_of(&events)["code"],
        0,
        "seed {seed}: listing: {}",
        String::from_utf8_lossy(&stream_bytes(&events, "stderr"))
    );
    let seen = parse_listing(&String::from_utf8(stream_bytes(&events, "stdout")).unwrap());

    let diff = daemon
        .call("GET", &format!("/v1/cells/{cell}/diff"), None)
        .json();
    let mut problems = check_diff(&diff, &before, &seen);
    for change in diff["changes"].as_array().unwrap() {
        if !change["refused"].is_null() {
            problems.push(format!("refused: {change}"));
        }
    }
    let applied = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/apply"),
        Some(json!({ "include_sensitive": true, "digest": diff["digest"] })),
    );
    if applied.status != 200 {
        problems.push(format!("apply: {} {}", applied.status, applied.text()));
    } else {
        let report = applied.json();
        if report["skipped"].as_array().is_some_and(|s| !s.is_empty()) {
            problems.push(format!("skipped: {}", report["skipped"]));
        }
    }
    let after = host_listing(host.path());
    for d in differences(&seen, &after) {
        problems.push(format!("cell | host after the apply: {d}"));
    }
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert!(
        deleted.status / 100 == 2,
        "delete: {} {}",
        deleted.status,
        deleted.text()
    );
    if !problems.is_empty() {
        problems.insert(0, format!("diff: {diff}"));
        problems.insert(0, format!("operations:\n{ops_log}"));
    }
    problems
}

fn seeds() -> std::ops::Range<u64> {
    match std::env::var("WARDEN_APPLY_SEEDS") {
        Ok(range) => {
            let (a, b) = range.split_once("..").expect("WARDEN_APPLY_SEEDS=A..B");
            a.parse().unwrap()..b.parse().unwrap()
        }
        Err(_) => 0..100,
    }
}

#[test]
fn an_apply_of_the_whole_diff_makes_the_host_what_the_cell_saw() {
    if !cgroups_available("apply_random") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let mut failed = Vec::new();
    for seed in seeds() {
        let problems = round(&daemon, seed);
        if !problems.is_empty() {
            eprintln!("seed {seed}:\n  {}", problems.join("\n  "));
            failed.push(seed);
        }
    }
    assert!(
        failed.is_empty(),
        "seeds that broke the promise: {failed:?} (WARDEN_APPLY_SEEDS=N..N+1 runs one)"
    );
}
