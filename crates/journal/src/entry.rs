//! One journal entry and its canonical form.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The kind of a checkpoint entry.
pub const CHECKPOINT: &str = "journal.checkpoint";

/// The `prev` of the first entry.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub seq: u64,
    /// Milliseconds since the Unix epoch, from the warden's clock.
    pub time_ms: u64,
    /// The cell the entry is about, if any.
    pub cell: Option<String>,
    /// What happened, as `area.event` (`cell.create`, `exec.exit`, `net.decision`, ...).
    pub kind: String,
    pub data: Value,
    pub prev: String,
    pub hash: String,
}

/// The fields that the hash covers, in their fixed order.
#[derive(Serialize)]
struct Hashed<'a> {
    seq: u64,
    time_ms: u64,
    cell: &'a Option<String>,
    kind: &'a str,
    data: &'a Value,
    prev: &'a str,
}

impl Entry {
    /// Builds the entry that follows `prev`, with its hash.
    pub fn seal(
        seq: u64,
        time_ms: u64,
        cell: Option<String>,
        kind: String,
        data: Value,
        prev: String,
    ) -> Self {
        let mut entry = Self {
            seq,
            time_ms,
            cell,
            kind,
            data,
            prev,
            hash: String::new(),
        };
        entry.hash = entry.compute_hash();
        entry
    }

    /// The BLAKE3 hash of the entry's canonical form without `hash`, in hex.
    pub fn compute_hash(&self) -> String {
        let hashed = Hashed {
            seq: self.seq,
            time_ms: self.time_ms,
            cell: &self.cell,
            kind: &self.kind,
            data: &self.data,
            prev: &self.prev,
        };
        // Serializing plain data to a vector cannot fail; an empty input would only ever make
        // verification fail, never pass.
        let bytes = serde_json::to_vec(&hashed).unwrap_or_default();
        blake3::hash(&bytes).to_hex().to_string()
    }

    /// The entry as its journal line, without the newline.
    pub fn to_line(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The time as RFC 3339 text.
    pub fn time_text(&self) -> String {
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.time_ms);
        humantime::format_rfc3339_millis(time).to_string()
    }
}

/// Replaces every occurrence of each secret in the string values (and keys) of `value`.
pub fn redact(value: &mut Value, secrets: &[String]) {
    if secrets.is_empty() {
        return;
    }
    let clean = |text: &str| {
        let mut text = text.to_owned();
        for secret in secrets.iter().filter(|s| !s.is_empty()) {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), "[redacted]");
            }
        }
        text
    };
    match value {
        Value::String(text) => *text = clean(text),
        Value::Array(items) => items.iter_mut().for_each(|v| redact(v, secrets)),
        Value::Object(map) => {
            let old = std::mem::take(map);
            for (key, mut item) in old {
                redact(&mut item, secrets);
                map.insert(clean(&key), item);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn the_hash_covers_every_field() {
        let entry = Entry::seal(
            1,
            5,
            Some("c".into()),
            "k".into(),
            json!({"a": 1}),
            GENESIS.into(),
        );
        assert_eq!(entry.hash, entry.compute_hash());
        let variants = [
            Entry {
                seq: 2,
                ..entry.clone()
            },
            Entry {
                time_ms: 6,
                ..entry.clone()
            },
            Entry {
                cell: None,
                ..entry.clone()
            },
            Entry {
                kind: "j".into(),
                ..entry.clone()
            },
            Entry {
                data: json!({"a": 2}),
                ..entry.clone()
            },
            Entry {
                prev: "1".repeat(64),
                ..entry.clone()
            },
        ];
        for variant in variants {
            assert_ne!(variant.compute_hash(), entry.hash, "{variant:?}");
        }
    }

    #[test]
    fn redaction_reaches_nested_strings_and_keys() {
        let mut value = json!({"argv": ["curl", "-H", "token: s3cr3t-value"], "s3cr3t-value": 1});
        redact(&mut value, &["s3cr3t-value".to_owned()]);
        let text = value.to_string();
        assert!(!text.contains("s3cr3t"), "{text}");
        assert!(text.contains("token: [redacted]"), "{text}");
    }
}
