//! Agent sessions: the warden's own agent loop, its control from outside, and its transcript.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One entry of a conversation, in no provider's shape (the warden's model clients write it
/// in each wire format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Item {
    /// Words to the model: the task, or an operator's instruction (marked as such).
    User { text: String },
    /// The model's turn: what it said and the tools it called.
    Assistant {
        text: String,
        #[serde(default)]
        calls: Vec<ToolCall>,
    },
    /// What a tool call gave back.
    Result {
        call_id: String,
        output: String,
        #[serde(default)]
        error: bool,
    },
}

/// A tool the model asked for. `arguments` is the JSON text as the model wrote it (it may not
/// parse: the loop tells the model so).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// How a tool's calls are decided.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ToolMode {
    /// Run (under the cell's policy, as any exec or file call).
    #[default]
    Auto,
    /// Hold each call for a person's approval, in the approval queue.
    Ask,
    /// Refuse every call (the model is told).
    Deny,
}

/// What a session may spend. Absent fields take the defaults (`warden agent run --help`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    /// Model turns.
    pub steps: Option<u32>,
    /// Input tokens over all requests.
    pub input_tokens: Option<u64>,
    /// Output tokens over all requests.
    pub output_tokens: Option<u64>,
    /// Wall-clock seconds from the start.
    pub wall_s: Option<u64>,
    /// Bytes of one tool call's result the model gets (the rest is cut, with a note).
    pub tool_output_bytes: Option<u64>,
}

/// `POST /v1/agents`: start a session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StartAgent {
    /// What the agent is to do.
    pub task: String,
    /// `PROVIDER:MODEL`: `openai:…` (Chat Completions), `openai-responses:…`, `anthropic:…`.
    pub model: String,
    /// The API root as the provider's SDKs take it (`http://127.0.0.1:8000/v1`).
    pub base_url: Option<String>,
    /// The model API's key, from the caller's environment. Kept in the warden's memory only:
    /// never journaled, shown, or given to a cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Run in this existing cell, instead of a new one.
    pub cell: Option<String>,
    /// For a new cell: a policy document (YAML), or a preset, and a host directory.
    pub policy: Option<String>,
    pub preset: Option<String>,
    pub workspace: Option<String>,
    /// Words added to the warden's standing instructions to the model.
    pub instructions: Option<String>,
    #[serde(default)]
    pub budgets: Budgets,
    /// A mode per tool name (`exec`, `write_file`, ...); tools not named are `auto`.
    #[serde(default)]
    pub tools: BTreeMap<String, ToolMode>,
    /// Start paused: nothing runs until `resume` or `step`.
    #[serde(default)]
    pub paused: bool,
}

/// Where a session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AgentState {
    /// Its loop runs.
    Running,
    /// Held between model calls; its cell is frozen.
    Paused,
    /// The model finished its task.
    Done,
    /// An operator stopped it, or a budget did.
    Stopped,
    /// It could not go on (the model API failed for good, the cell ended).
    Failed,
}

impl AgentState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Done => "done",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }

    /// Whether its loop has ended for good (rewind or fork go on from it).
    pub fn is_over(self) -> bool {
        matches!(self, Self::Done | Self::Stopped | Self::Failed)
    }
}

/// Tokens a session used.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct TokenUsage {
    pub input: u64,
    pub output: u64,
}

/// A finished turn: the snapshot of the workspace at its end, and where the conversation was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct TurnInfo {
    pub turn: u32,
    /// `CELL@ID`: the cell's changed files at the end of the turn (none for a cell without a
    /// workspace layer).
    pub snapshot: Option<String>,
    /// Conversation items up to the end of the turn.
    pub items: usize,
}

/// A session as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AgentInfo {
    pub id: String,
    pub cell: String,
    pub state: AgentState,
    /// `PROVIDER:MODEL`.
    pub model: String,
    pub base_url: String,
    /// Turns finished (the turn the loop is in is one more).
    pub turn: u32,
    pub usage: TokenUsage,
    pub started_ms: u64,
    /// Why it ended, once it has.
    pub ended: Option<String>,
    /// The model's last words, once done.
    pub summary: Option<String>,
    /// The session and turn it was forked from.
    pub forked_from: Option<String>,
    pub turns: Vec<TurnInfo>,
}

/// What an operator may do to a session from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AgentAction {
    /// Hold the loop before its next model call (or tool call) and freeze the cell.
    Pause,
    /// Let it run on.
    Resume,
    /// Run one model turn and its tool calls, then pause.
    Step,
    /// End it (a model call or a command under way is cut).
    Stop,
}

impl AgentAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Step => "step",
            Self::Stop => "stop",
        }
    }
}

/// `POST /v1/agents/{id}/say`: an operator's instruction, delivered at the next turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Say {
    pub text: String,
}

/// `POST /v1/agents/{id}/rewind`: the workspace and the conversation as they were at the end
/// of `turn` (0: before the first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rewind {
    pub turn: u32,
}

/// `POST /v1/agents/{id}/fork`: a new session, in a new cell, from the end of `turn`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkAgent {
    pub turn: u32,
    /// An instruction for its next turn.
    pub say: Option<String>,
    /// Another `PROVIDER:MODEL` (and API root, key) to try.
    pub model: Option<String>,
    pub base_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    #[serde(default)]
    pub paused: bool,
}

/// `GET /v1/agents/{id}/transcript`: the conversation as the model will next see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Transcript {
    pub id: String,
    pub instructions: String,
    pub items: Vec<Item>,
}

/// One recorded tool call, carried out again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RerunCall {
    /// The model turn it was asked in (1: the first).
    pub turn: u32,
    pub name: String,
    pub arguments: String,
    /// Whether it gave what it gave the first time (output and error alike).
    pub same: bool,
    pub recorded: String,
    pub now: String,
}

/// `POST /v1/agents/{id}/rerun`: the session's recorded tool calls carried out again, in order,
/// in a new cell made from the session's first snapshot; where their results diverge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Rerun {
    pub id: String,
    /// The cell they ran in (kept, for a look).
    pub cell: String,
    pub calls: Vec<RerunCall>,
    /// How many gave something else.
    pub diverged: usize,
}
