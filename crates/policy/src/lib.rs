//! Warden policy: the declarative YAML document that says what a cell may do.
//!
//! A policy is parsed strictly (unknown fields are errors that carry line and column), validated
//! once, and then handed to the tiers as plain data. This crate never touches the operating
//! system: it must stay usable by every face (CLI, API, SDK) to check a policy before a cell exists.

mod explain;
mod model;
mod parse;
mod preset;
mod units;

pub use explain::explain;
pub use model::{
    ApplyApproval, ApprovalOutcome, Approvals, CommandDefault, CommandRules, CommandVerdict,
    Commands, Credential, Credentials, DEFAULT_CWD, DEFAULT_USER, EnvPolicy, Filesystem, Gpu,
    Inference, LifecycleAction, Limits, MAX_CONNECTIONS, NameLookup, NetRule, Network,
    NetworkDefault, Policy, Process, Tier, Workspace, WorkspaceMode,
};
pub use parse::{PolicyError, extended_preset, from_file, from_yaml, preset, sections, to_yaml};
pub use preset::PRESETS;
pub use units::{ByteSize, Duration};
