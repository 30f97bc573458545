//! Built-in presets. Each is policy YAML parsed by the same strict parser as a user's file
//! (`preset` in `parse.rs`).

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

/// The YAML of the named preset.
pub(crate) fn yaml(name: &str) -> Option<&'static str> {
    PRESETS
        .iter()
        .find(|(known, _, _)| *known == name)
        .map(|(_, _, yaml)| *yaml)
}
