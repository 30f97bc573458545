//! `warden audit verify`: proves the chain and every checkpoint signature.

use std::fs::File;
use std::io::{self, BufRead as _, BufReader};
use std::path::{Path, PathBuf};

use crate::CHECKPOINT;
use crate::entry::{Entry, GENESIS};
use crate::keys::{self, PUBLIC_FILE};
use crate::writer::check_line;

/// What a successful verification saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
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
    #[error("entry {seq} (line {line}) is bad: {reason}")]
    Bad {
        line: u64,
        /// The entry's sequence number as it should be.
        seq: u64,
        reason: String,
    },
}

/// Verifies the journal at `path`; `key` (hex) overrides the public key next to it.
pub fn verify(path: &Path, key: Option<&str>) -> Result<Report, VerifyError> {
    let io = |source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let key_text = match key {
        Some(k) => k.to_owned(),
        None => {
            let pub_path = path.with_file_name(PUBLIC_FILE);
            std::fs::read_to_string(&pub_path).map_err(|_| VerifyError::NoKey { path: pub_path })?
        }
    };
    let public = keys::parse_public(&key_text).ok_or_else(|| VerifyError::NoKey {
        path: path.with_file_name(PUBLIC_FILE),
    })?;
    let key_hex = key_text.trim().to_owned();
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let mut report = Report {
        entries: 0,
        checkpoints: 0,
        last_seq: 0,
        head: GENESIS.to_owned(),
        key: key_hex.clone(),
        unsigned_tail: 0,
        torn_bytes: 0,
    };
    let mut line = Vec::new();
    let mut number = 0u64;
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(io)?;
        if read == 0 {
            break;
        }
        number += 1;
        let expected_seq = report.last_seq + 1;
        let bad = |reason: String| VerifyError::Bad {
            line: number,
            seq: expected_seq,
            reason,
        };
        if line.last() != Some(&b'\n') {
            // Only the very last line can be torn, and only if nothing follows it.
            report.torn_bytes = line.len() as u64;
            break;
        }
        let entry = check_line(&line[..line.len() - 1]).map_err(bad)?;
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
            check_checkpoint(&entry, &public, &key_hex, &report).map_err(bad)?;
            report.checkpoints += 1;
            report.unsigned_tail = 0;
        } else {
            report.unsigned_tail += 1;
        }
        report.entries += 1;
        report.last_seq = entry.seq;
        report.head = entry.hash;
    }
    Ok(report)
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
        let report = verify(&path, None).unwrap();
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
            match verify(&path, None) {
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
        let err = verify(&path, None).unwrap_err();
        assert!(err.to_string().contains("entry 2 (line 2)"), "{err}");

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
        let err = verify(&path, None).unwrap_err();
        assert!(
            err.to_string().contains("signature does not verify"),
            "{err}"
        );
        drop(dir);
    }
}
