//! Built-in presets. Each is policy YAML parsed by the same strict parser as a user's file.

use crate::model::Policy;
use crate::parse::{PolicyError, from_yaml};

/// Name, one-line description and YAML of every built-in preset.
pub const PRESETS: &[(&str, &str, &str)] = &[
    (
        "default",
        "host system directories read-only, workspace read-write, no network, 1 GiB / 512 pids",
        "version: 1\n",
    ),
    (
        "minimal",
        "only /usr and the libraries, 256 MiB / 64 pids, 10 minutes of wall time",
        include_str!("presets/minimal.yaml"),
    ),
    (
        "python",
        "default, with pypi.org and files.pythonhosted.org allowed (HTTPS), 2 GiB",
        include_str!("presets/python.yaml"),
    ),
    (
        "node",
        "default, with registry.npmjs.org allowed (HTTPS), 2 GiB / 1024 pids",
        include_str!("presets/node.yaml"),
    ),
    (
        "rust",
        "default, with crates.io allowed (HTTPS) and ~/.rustup, ~/.cargo/bin read-only, 4 GiB, 8 GiB of disk",
        include_str!("presets/rust.yaml"),
    ),
];

/// Returns the named preset, or an error that lists the known names.
pub fn preset(name: &str) -> Result<Policy, PolicyError> {
    let Some((_, _, yaml)) = PRESETS.iter().find(|(known, _, _)| *known == name) else {
        let known = PRESETS
            .iter()
            .map(|(n, _, _)| *n)
            .collect::<Vec<_>>()
            .join(", ");
        return Err(PolicyError::UnknownPreset {
            name: name.to_owned(),
            known,
        });
    };
    from_yaml(&format!("preset {name}"), yaml)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses() {
        for (name, _, _) in PRESETS {
            preset(name).unwrap();
        }
        assert_eq!(preset("default").unwrap(), Policy::default());
    }

    /// A resolved policy travels as JSON (a cell spec to its tier): it must come back the same.
    #[test]
    fn every_preset_survives_a_json_round_trip() {
        for (name, _, _) in PRESETS {
            let policy = preset(name).unwrap();
            let text = serde_json::to_string(&policy).unwrap();
            let back: Policy = serde_json::from_str(&text).unwrap();
            assert_eq!(back, policy, "{name}: {text}");
        }
        let full = crate::from_yaml(
            "t",
            "version: 1\nlimits: {memory: 64MiB, wall: 90s, disk: 1GiB}\nnetwork:\n  allow: [{host: 10.0.0.1, ports: [80]}]\n  ask: [{host: example.org}]\n",
        )
        .unwrap();
        let back: Policy = serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn unknown_preset_lists_known_ones() {
        let err = preset("nope").unwrap_err().to_string();
        assert!(
            err.contains("unknown preset `nope`") && err.contains("default"),
            "{err}"
        );
    }
}
