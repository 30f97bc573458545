//! The host's checkpoint signing key.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};

use crate::error::JournalError;

/// The private key (32 raw bytes, owner-only).
pub const KEY_FILE: &str = "signing.key";
/// The public key, in hex, for anyone who verifies.
pub const PUBLIC_FILE: &str = "signing.pub";

/// What a checkpoint signs: the chain's head after entry `seq`.
pub(crate) fn checkpoint_message(seq: u64, head: &str) -> Vec<u8> {
    format!("warden-journal-checkpoint {seq} {head}").into_bytes()
}

/// The signing key of this journal directory.
#[derive(Debug)]
pub struct SigningKeys {
    key: SigningKey,
}

impl SigningKeys {
    /// Loads the key from `dir`, creating one the first time.
    pub fn load_or_create(dir: &Path) -> Result<Self, JournalError> {
        let path = dir.join(KEY_FILE);
        let io = |source: io::Error| JournalError::Io {
            what: "reading the signing key",
            path: path.clone(),
            source: std::sync::Arc::new(source),
        };
        match fs::read(&path) {
            Ok(bytes) => {
                let bytes: [u8; 32] = bytes
                    .try_into()
                    .map_err(|_| JournalError::BadKey { path: path.clone() })?;
                Ok(Self {
                    key: SigningKey::from_bytes(&bytes),
                })
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let mut bytes = [0u8; 32];
                getrandom::fill(&mut bytes).map_err(|e| io(io::Error::other(e.to_string())))?;
                let key = SigningKey::from_bytes(&bytes);
                let mut file = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io)?;
                file.write_all(&bytes).map_err(io)?;
                file.sync_all().map_err(io)?;
                let public = hex::encode(key.verifying_key().to_bytes());
                fs::write(dir.join(PUBLIC_FILE), format!("{public}\n")).map_err(io)?;
                Ok(Self { key })
            }
            Err(err) => Err(io(err)),
        }
    }

    pub fn public_hex(&self) -> String {
        hex::encode(self.key.verifying_key().to_bytes())
    }

    pub(crate) fn sign(&self, seq: u64, head: &str) -> String {
        hex::encode(self.key.sign(&checkpoint_message(seq, head)).to_bytes())
    }
}

/// Parses a public key given in hex.
pub(crate) fn parse_public(text: &str) -> Option<VerifyingKey> {
    let bytes: [u8; 32] = hex::decode(text.trim()).ok()?.try_into().ok()?;
    VerifyingKey::from_bytes(&bytes).ok()
}

/// Whether `signature` (hex) signs the head after `seq` under `key`.
pub(crate) fn check(key: &VerifyingKey, seq: u64, head: &str, signature: &str) -> bool {
    let Some(bytes) = hex::decode(signature)
        .ok()
        .and_then(|b| <[u8; 64]>::try_from(b).ok())
    else {
        return false;
    };
    key.verify(
        &checkpoint_message(seq, head),
        &Signature::from_bytes(&bytes),
    )
    .is_ok()
}
