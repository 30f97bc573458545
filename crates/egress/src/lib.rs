//! The egress gateway: the only way out of a cell. It runs in the warden, outside the cell,
//! decides every connection by the policy's network rules (deny wins, private destinations need
//! a rule that names them), answers refusals with a 403 whose JSON body names the reason, and
//! records every decision.
//!
//! It must never let a connection out that no rule allows, and never trust what the cell says
//! about a destination beyond what it checks itself (host syntax, resolved addresses).

mod approvals;
mod bounds;
mod dns;
mod forward;
mod host;
mod http;
mod inference;
mod intercept;
mod names;
mod path;
mod prefixed;
mod proxy;
mod pump;
mod record;
mod redirected;
mod rules;
mod secrets;
mod sni;
mod tls;
mod transparent;
mod tunnel;
mod workers;

pub use approvals::{AnswerError, Approvals, Question, answer, pending};
pub use bounds::Bounds;
pub use host::{Host, HostError};
pub use proxy::{Gateway, Resolver};
pub use record::{Decision, LINES_PER_SECOND, read_log};
pub use rules::{Request, Rules, RulesError, Verdict};
pub use secrets::{SecretError, Secrets};
pub use tls::{Interceptor, TlsError};
pub use workers::Workers;

/// Port the gateway listens on inside the cell's loopback.
pub const GATEWAY_PORT: u16 = 3128;
/// Port that connections of clients ignoring the proxy variables are redirected to.
pub const TRANSPARENT_PORT: u16 = 3129;
