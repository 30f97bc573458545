//! `warden audit export`: the journal as JSON lines or as OCSF events.

use std::fs::File;
use std::io::{self, BufRead as _, BufReader, Write};
use std::path::Path;

use serde_json::{Value, json};

use crate::entry::Entry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The entries exactly as stored.
    Jsonl,
    /// One OCSF 1.1 event per entry.
    Ocsf,
}

/// Writes the entries of the journal in `dir` (every segment, in order) that match the
/// filters to `out`; returns how many.
/// Lines that do not parse are skipped here: `warden audit verify` is the place that judges them.
pub fn export(
    dir: &Path,
    format: Format,
    cell: Option<&str>,
    since_ms: Option<u64>,
    out: &mut dyn Write,
) -> io::Result<u64> {
    let mut count = 0;
    for path in crate::segments::segments(dir)? {
        for line in BufReader::new(File::open(path)?).lines() {
            let line = line?;
            let Ok(entry) = serde_json::from_str::<Entry>(&line) else {
                continue;
            };
            if cell.is_some_and(|c| entry.cell.as_deref() != Some(c)) {
                continue;
            }
            if since_ms.is_some_and(|t| entry.time_ms < t) {
                continue;
            }
            match format {
                Format::Jsonl => writeln!(out, "{line}")?,
                Format::Ocsf => writeln!(out, "{}", ocsf(&entry))?,
            }
            count += 1;
        }
    }
    Ok(count)
}

/// Maps an entry onto the OCSF class that fits it best; the entry itself travels in `unmapped`
/// so nothing is lost.
fn ocsf(entry: &Entry) -> Value {
    let (area, event) = entry.kind.split_once('.').unwrap_or((&entry.kind, ""));
    // (class_uid, class_name, category_uid, activity_id, activity_name)
    let (class_uid, class_name, category_uid, activity_id, activity) = match (area, event) {
        ("exec", "start") => (1007, "Process Activity", 1, 1, "Launch"),
        ("exec", "exit") => (1007, "Process Activity", 1, 2, "Terminate"),
        ("exec", _) => (1007, "Process Activity", 1, 99, "Other"),
        ("net", _) => (4002, "HTTP Activity", 4, 99, "Other"),
        ("file", _) | ("workspace", _) => (1001, "File System Activity", 1, 99, "Other"),
        ("api", _) => (6003, "API Activity", 6, 99, "Other"),
        ("cell", "create") => (6003, "API Activity", 6, 1, "Create"),
        ("cell", "delete") => (6003, "API Activity", 6, 4, "Delete"),
        ("cell", _) | ("policy", _) | ("approval", _) => (6003, "API Activity", 6, 3, "Update"),
        _ => (0, "Base Event", 0, 99, "Other"),
    };
    let type_uid = if class_uid == 0 {
        99
    } else {
        class_uid * 100 + activity_id
    };
    json!({
        "class_uid": class_uid,
        "class_name": class_name,
        "category_uid": category_uid,
        "activity_id": activity_id,
        "activity_name": activity,
        "type_uid": type_uid,
        "severity_id": 1,
        "time": entry.time_ms,
        "message": entry.kind,
        "metadata": {
            "version": "1.1.0",
            "uid": entry.seq.to_string(),
            "product": { "name": "Warden", "vendor_name": "Warden" },
            "log_name": "warden-journal",
        },
        "resource": entry.cell.as_ref().map(|c| json!({ "type": "cell", "name": c })),
        "unmapped": {
            "kind": entry.kind,
            "data": entry.data,
            "hash": entry.hash,
            "prev": entry.prev,
        },
    })
}
