//! What the e2b SDKs send and expect, as JSON: the control plane's sandbox objects, the envd
//! services' messages (proto3 JSON: camelCase names out, both spellings in, `bytes` as base64,
//! enums by name or number), and the Connect protocol's 5-byte stream envelopes.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// The envd version the face says it is: stdin (0.3.0) and the default user (0.4.0) are
/// understood; below 0.5.7 the SDKs upload files as multipart, which is what is served.
pub const ENVD_VERSION: &str = "0.5.6";

/// The one working directory and home of a sandbox's user: the cell's workspace mount.
pub const HOME: &str = "/home/user";

/// Another name of the same directory, where sandbox clients of agent frameworks put their
/// workspace by default (the OpenAI Agents SDK's manifest root): a link in the cell, the same
/// root for the files API.
pub const ALIAS: &str = "/workspace";

/// A create request, of either SDK generation (unknown fields are ignored).
#[derive(Debug, Deserialize)]
pub struct NewSandbox {
    #[serde(rename = "templateID", default = "base")]
    pub template: String,
    /// Seconds until the sandbox is killed (or paused, with `autoPause`).
    pub timeout: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(rename = "envVars", default)]
    pub env_vars: BTreeMap<String, String>,
    #[serde(rename = "autoPause", default)]
    pub auto_pause: bool,
}

fn base() -> String {
    "base".to_owned()
}

#[derive(Debug, Default, Deserialize)]
pub struct Timeout {
    pub timeout: Option<u64>,
}

/// A sandbox as create and connect answer it.
#[derive(Debug, Serialize)]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template: String,
    #[serde(rename = "sandboxID")]
    pub id: String,
    #[serde(rename = "clientID")]
    pub client: &'static str,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    #[serde(rename = "envdAccessToken")]
    pub token: String,
}

/// A sandbox as list and get answer it.
#[derive(Debug, Serialize)]
pub struct Listed {
    #[serde(rename = "templateID")]
    pub template: String,
    #[serde(rename = "sandboxID")]
    pub id: String,
    #[serde(rename = "clientID")]
    pub client: &'static str,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    pub metadata: BTreeMap<String, String>,
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// `bytes` of proto3 JSON.
pub fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let text = String::deserialize(d)?;
    B64.decode(text.trim())
        .map_err(|e| serde::de::Error::custom(format!("not base64: {e}")))
}

pub fn b64(data: &[u8]) -> String {
    B64.encode(data)
}

/// A uint32 of proto3 JSON: a number or a string of one.
fn uint<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    match Value::deserialize(d)? {
        Value::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| serde::de::Error::custom("not a uint32")),
        Value::String(s) => s.parse().map_err(serde::de::Error::custom),
        _ => Err(serde::de::Error::custom("not a uint32")),
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct ProcessConfig {
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Size {
    #[serde(deserialize_with = "uint")]
    pub cols: u32,
    #[serde(deserialize_with = "uint")]
    pub rows: u32,
}

#[derive(Debug, Deserialize)]
pub struct Pty {
    pub size: Size,
}

#[derive(Debug, Deserialize)]
pub struct StartRequest {
    pub process: ProcessConfig,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

/// Which process: by pid or by tag.
#[derive(Debug, Deserialize)]
pub struct Selector {
    #[serde(default, deserialize_with = "opt_uint")]
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

fn opt_uint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    uint(d).map(Some)
}

#[derive(Debug, Deserialize)]
pub struct Selected {
    pub process: Selector,
}

#[derive(Debug, Deserialize)]
pub struct Input {
    #[serde(default, deserialize_with = "opt_bytes")]
    pub stdin: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "opt_bytes")]
    pub pty: Option<Vec<u8>>,
}

fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    bytes(d).map(Some)
}

#[derive(Debug, Deserialize)]
pub struct SendInput {
    pub process: Selector,
    pub input: Input,
}

#[derive(Debug, Deserialize)]
pub struct SendSignal {
    pub process: Selector,
    pub signal: Value,
}

impl SendSignal {
    /// The signal's number: `SIGNAL_SIGKILL`, `SIGNAL_SIGTERM`, or their numbers.
    pub fn number(&self) -> Option<i32> {
        match &self.signal {
            Value::String(name) => match name.as_str() {
                "SIGNAL_SIGKILL" => Some(9),
                "SIGNAL_SIGTERM" => Some(15),
                _ => None,
            },
            Value::Number(n) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
            _ => None,
        }
        .filter(|n| *n > 0)
    }
}

#[derive(Debug, Deserialize)]
pub struct Update {
    pub process: Selector,
    pub pty: Option<Pty>,
}

#[derive(Debug, Deserialize)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Deserialize)]
pub struct ListDir {
    pub path: String,
    #[serde(default, deserialize_with = "opt_uint")]
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
pub struct Watch {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

#[derive(Debug, Deserialize)]
pub struct WatcherId {
    #[serde(alias = "watcher_id", rename = "watcherId")]
    pub id: String,
}

#[derive(Debug, Deserialize)]
pub struct Move {
    pub source: String,
    pub destination: String,
}

/// One file's entry (`EntryInfo`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64: a string in proto3 JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

/// A Connect stream envelope: flags, then the message's length, then the message.
pub fn envelope(flags: u8, message: &Value) -> Vec<u8> {
    let body = message.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(flags);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// The flags of the envelope that ends a stream.
pub const END_STREAM: u8 = 0x02;

/// The one message of a server-streaming request's body.
pub fn unwrap_envelope(body: &[u8]) -> Result<&[u8], String> {
    if body.len() < 5 {
        return Err("the request is not a Connect envelope (fewer than 5 bytes)".to_owned());
    }
    if body[0] & 0x01 != 0 {
        return Err("compressed messages are not accepted (send `identity`)".to_owned());
    }
    let length = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let message = body
        .get(5..5 + length)
        .ok_or_else(|| "the envelope says more bytes than the request has".to_owned())?;
    // One message, and only it: bytes after it (a second envelope, or junk) were left unread.
    if body.len() > 5 + length {
        return Err(format!(
            "the request has {} bytes after its one envelope (of {length} bytes); a \
             server-streaming call takes exactly one message",
            body.len() - 5 - length
        ));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_envelope_round_trips_and_a_short_one_is_refused() {
        let message = serde_json::json!({ "a": 1 });
        let wrapped = envelope(0, &message);
        assert_eq!(&wrapped[..5], &[0, 0, 0, 0, 7]);
        let inner = unwrap_envelope(&wrapped).unwrap();
        assert_eq!(serde_json::from_slice::<Value>(inner).unwrap(), message);
        assert!(unwrap_envelope(&wrapped[..8]).is_err());
        assert!(unwrap_envelope(&[1, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn proto_json_is_read_leniently() {
        // 2.31 pretty-prints; numbers may come as strings; bytes are base64.
        let start: StartRequest = serde_json::from_str(
            "{\n \"process\": {\"cmd\": \"/bin/bash\", \"args\": [\"-c\", \"x\"]},\n \"pty\": {\"size\": {\"cols\": \"80\", \"rows\": 24}}, \"stdin\": false\n}",
        )
        .unwrap();
        assert_eq!(start.process.args, ["-c", "x"]);
        assert_eq!(start.pty.unwrap().size.cols, 80);
        let input: SendInput =
            serde_json::from_str(r#"{"process":{"pid":"7"},"input":{"stdin":"aGk="}}"#).unwrap();
        assert_eq!(
            (input.process.pid, input.input.stdin),
            (Some(7), Some(b"hi".to_vec()))
        );
        let kill: SendSignal =
            serde_json::from_str(r#"{"process":{"pid":1},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(kill.number(), Some(9));
        let odd: SendSignal =
            serde_json::from_str(r#"{"process":{"pid":1},"signal":"SIGNAL_UNSPECIFIED"}"#).unwrap();
        assert_eq!(odd.number(), None);
    }
}
