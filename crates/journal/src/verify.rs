//! `warden audit verify`: proves the chain and every checkpoint signature.

use std::fs::File;
use std::io::{self, BufRead as _, BufReader};
use std::path::{Path, PathBuf};

use crate::entry::CHECKPOINT;
use crate::entry::{Entry, GENESIS};
use crate::keys::{self, PUBLIC_FILE};
use crate::writer::check_line;

/// What a successful verification saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The first entry verified: 1, unless the oldest segments were archived or removed.
    pub first_seq: u64,
    /// Segment files read, oldest first.
    pub segments: usize,
    pub entries: u64,
    pub checkpoints: u64,
    pub last_seq: u64,
    pub head: String,
    /// The public key the checkpoints were checked against.
    pub key: String,
    /// Entries after the last checkpoint (chained, not yet signed).
    pub unsigned_tail: u64,
    /// Bytes of a torn last line (a write cut by a crash, never acknowledged).
    pub torn_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "no public key to check checkpoints with: {path} is missing or not a hex ed25519 key (pass --key)"
    )]
    NoKey { path: PathBuf },
    #[error("entry {seq} ({file} line {line}) is bad: {reason}")]
    Bad {
        /// The segment file's name.
        file: String,
        line: u64,
        /// The entry's sequence number as it should be.
        seq: u64,
        reason: String,
    },
}

/// Verifies the journal in `dir`, every segment in chain order; `key` (hex) overrides the
/// public key kept there.
pub fn verify(dir: &Path, key: Option<&str>) -> Result<Report, VerifyError> {
    let key_text = match key {
        Some(k) => k.to_owned(),
        None => {
            let pub_path = dir.join(PUBLIC_FILE);
            std::fs::read_to_string(&pub_path).map_err(|_| VerifyError::NoKey { path: pub_path })?
        }
    };
    let public = keys::parse_public(&key_text).ok_or_else(|| VerifyError::NoKey {
        path: dir.join(PUBLIC_FILE),
    })?;
    let key_hex = key_text.trim().to_owned();
    let files = crate::segments::segments(dir).map_err(|source| VerifyError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if files.is_empty() {
        return Err(VerifyError::Io {
            path: dir.join(crate::segments::JOURNAL_FILE),
            source: io::Error::from(io::ErrorKind::NotFound),
        });
    }
    let mut report = Report {
        first_seq: 0,
        segments: files.len(),
        entries: 0,
        checkpoints: 0,
        last_seq: 0,
        head: GENESIS.to_owned(),
        key: key_hex.clone(),
        unsigned_tail: 0,
        torn_bytes: 0,
    };
    for (index, path) in files.iter().enumerate() {
        let last_file = index + 1 == files.len();
        verify_segment(path, last_file, &public, &key_hex, &mut report)?;
    }
    Ok(report)
}

fn verify_segment(
    path: &Path,
    last_file: bool,
    public: &ed25519_dalek::VerifyingKey,
    key_hex: &str,
    report: &mut Report,
) -> Result<(), VerifyError> {
    let io = |source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let mut line = Vec::new();
    let mut number = 0u64;
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(io)?;
        if read == 0 {
            break;
        }
        number += 1;
        // An error about this line, naming the entry that was due there.
        let bad = |seq: u64| {
            let file = name.clone();
            move |reason: String| VerifyError::Bad {
                file: file.clone(),
                line: number,
                seq,
                reason,
            }
        };
        let expected_seq = report.last_seq + 1;
        if line.last() != Some(&b'\n') {
            // Only the very last line can be torn, and only if nothing follows it.
            if !last_file {
                return Err(bad(expected_seq)(
                    "a closed segment ends in a partial line (it was cut or changed)".to_owned(),
                ));
            }
            report.torn_bytes = line.len() as u64;
            break;
        }
        let entry = check_line(&line[..line.len() - 1]).map_err(bad(expected_seq))?;
        if number == 1 {
            // A closed segment is named after its first entry; the first segment of all starts
            // the chain, unless it is a closed one whose elders were archived or removed.
            let due = crate::segments::segment_first_seq(path).unwrap_or(expected_seq);
            if entry.seq != due {
                return Err(bad(expected_seq)(format!(
                    "the segment's first entry is {} where {due} was due (entries were removed)",
                    entry.seq
                )));
            }
            if report.entries == 0 {
                report.first_seq = entry.seq;
                if entry.seq > 1 {
                    report.last_seq = entry.seq - 1;
                    report.head = entry.prev.clone();
                }
            }
        }
        let expected_seq = report.last_seq + 1;
        let bad = bad(expected_seq);
        if entry.seq != expected_seq {
            return Err(bad(format!(
                "its sequence number is {} where {expected_seq} was due (entries were removed or reordered)",
                entry.seq
            )));
        }
        if entry.prev != report.head {
            return Err(bad(
                "it does not follow the entry before it (the chain is broken)".to_owned(),
            ));
        }
        if entry.kind == CHECKPOINT {
            check_checkpoint(&entry, public, key_hex, report).map_err(bad)?;
            report.checkpoints += 1;
            report.unsigned_tail = 0;
        } else {
            report.unsigned_tail += 1;
        }
        report.entries += 1;
        report.last_seq = entry.seq;
        report.head = entry.hash;
    }
    Ok(())
}

fn check_checkpoint(
    entry: &Entry,
    public: &ed25519_dalek::VerifyingKey,
    key_hex: &str,
    report: &Report,
) -> Result<(), String> {
    let field = |name: &str| entry.data.get(name);
    let head_seq = field("head_seq").and_then(|v| v.as_u64());
    let head = field("head").and_then(|v| v.as_str());
    let key = field("key").and_then(|v| v.as_str());
    let signature = field("signature").and_then(|v| v.as_str());
    let (Some(head_seq), Some(head), Some(key), Some(signature)) = (head_seq, head, key, signature)
    else {
        return Err("a checkpoint without head_seq, head, key and signature".to_owned());
    };
    if head_seq != report.last_seq || head != report.head {
        return Err("a checkpoint that does not sign the entry before it".to_owned());
    }
    if !key.eq_ignore_ascii_case(key_hex) {
        return Err(format!(
            "a checkpoint signed by key {key}, not by the journal's key {key_hex}"
        ));
    }
    if !keys::check(public, head_seq, head, signature) {
        return Err("a checkpoint whose signature does not verify".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{JOURNAL_FILE, Journal};
    use serde_json::json;

    fn journal_with(n: u64) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        for i in 0..n {
            journal
                .append(Some("c"), "exec.exit", json!({"i": i, "status": 0}))
                .unwrap();
        }
        journal.close();
        let path = dir.path().join(JOURNAL_FILE);
        (dir, path)
    }

    #[test]
    fn flipping_any_single_byte_is_caught_and_named() {
        let (_dir, path) = journal_with(5);
        let original = std::fs::read(&path).unwrap();
        let dir = path.parent().unwrap().to_path_buf();
        let report = verify(&dir, None).unwrap();
        assert_eq!(report.entries, 6);
        // Flip one bit of every byte position in turn (newlines excepted: a flipped newline
        // merges or splits lines, caught the same way but not attributable to one entry).
        for at in 0..original.len() {
            if original[at] == b'\n' {
                continue;
            }
            let mut bytes = original.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&path, &bytes).unwrap();
            let line_of_byte = original[..at].iter().filter(|b| **b == b'\n').count() as u64 + 1;
            match verify(&dir, None) {
                Err(VerifyError::Bad { line, .. }) => assert_eq!(line, line_of_byte, "at {at}"),
                other => panic!("a flip at byte {at} was not caught: {other:?}"),
            }
        }
    }

    #[test]
    fn a_removed_entry_and_a_rewritten_chain_are_caught() {
        let (dir, path) = journal_with(3);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let without_second = format!("{}\n{}\n", lines[0], lines[2..].join("\n"));
        std::fs::write(&path, without_second).unwrap();
        let err = verify(dir.path(), None).unwrap_err();
        assert!(
            err.to_string().contains("entry 2 (journal.jsonl line 2)"),
            "{err}"
        );

        // Rewrite the whole chain with correct hashes but without the key: the checkpoint's
        // signature no longer verifies.
        let mut prev = GENESIS.to_owned();
        let mut out = String::new();
        for line in &lines {
            let mut entry: Entry = serde_json::from_str(line).unwrap();
            if entry.seq == 2 {
                entry.data = json!({"i": 1, "status": 1});
            }
            if entry.kind == CHECKPOINT {
                entry.data["head"] = json!(prev.clone());
            }
            let sealed = Entry::seal(
                entry.seq,
                entry.time_ms,
                entry.cell,
                entry.kind,
                entry.data,
                prev,
            );
            prev = sealed.hash.clone();
            out.push_str(&String::from_utf8(sealed.to_line()).unwrap());
            out.push('\n');
        }
        std::fs::write(&path, out).unwrap();
        let err = verify(dir.path(), None).unwrap_err();
        assert!(
            err.to_string().contains("signature does not verify"),
            "{err}"
        );
        drop(dir);
    }
}
