//! The core's errors: one enum per operation a face asks of it (making a cell, exec, files,
//! control, the workspace, approvals), plus what every operation may meet (a cell that is not
//! there or not running, the journal, the core's own failure). Each variant is one failure with
//! its whole message, mapped once to the protocol's `ErrorCode` (and through it to an HTTP
//! status, an exit status and an MCP error) and named on the wire as the error body's `reason`.
//! Nothing is classified by its text. [`HarnessError`] is what a face receives: the code, the
//! message and the reason; each enum converts into it.

use warden_protocol::ErrorCode;

/// A failure as a face receives it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct HarnessError {
    pub kind: ErrorCode,
    pub message: String,
    /// Which failure it is (`cell-paused`, `denied-by-rule`, ...), for a program to act on.
    pub reason: &'static str,
}

impl HarnessError {
    /// A failure of no operation's own (the core's state, its threads): named by its code.
    pub fn new(kind: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            reason: code_word(kind),
        }
    }
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

/// The word of a code, as the wire writes it.
fn code_word(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::BadRequest => "bad-request",
        ErrorCode::Unauthorized => "unauthorized",
        ErrorCode::Forbidden => "forbidden",
        ErrorCode::NotFound => "not-found",
        ErrorCode::Conflict => "conflict",
        ErrorCode::TooLarge => "too-large",
        ErrorCode::Unavailable => "unavailable",
        ErrorCode::Internal => "internal",
    }
}

/// One failure an operation may answer with, as the API's document lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub code: ErrorCode,
    pub reason: &'static str,
    /// What it means.
    pub about: &'static str,
}

/// Declares an operation's error enum: each variant carries its message, has a code and a
/// reason, and the enum lists its failures (`FAILURES`, for the API's document). Exported for
/// the faces that have operations of their own (the agent sessions); they need `thiserror`.
#[macro_export]
macro_rules! failures {
    ($(#[$doc:meta])* $name:ident { $($(#[doc = $vdoc:literal])+ $variant:ident => $code:ident $reason:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
        pub enum $name {
            $($(#[doc = $vdoc])+ #[error("{0}")] $variant(String),)+
        }

        impl $name {
            /// Every failure of this operation: its code, its reason and what it means.
            pub const FAILURES: &'static [$crate::Failure] = &[$($crate::Failure {
                code: $crate::ErrorKind::$code,
                reason: $reason,
                about: concat!($($vdoc),+),
            }),+];

            pub fn code(&self) -> $crate::ErrorKind {
                match self {
                    $(Self::$variant(_) => $crate::ErrorKind::$code,)+
                }
            }

            /// The failure's name on the wire.
            pub fn reason(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $reason,)+
                }
            }
        }

        impl From<$name> for $crate::HarnessError {
            fn from(err: $name) -> Self {
                $crate::HarnessError {
                    kind: err.code(),
                    reason: err.reason(),
                    message: err.to_string(),
                }
            }
        }
    };
}

failures! {
    /// What any operation on a cell may meet.
    CellFailure {
        /// No cell has the name.
        NoCell => NotFound "no-such-cell",
        /// The cell has ended.
        Ended => Conflict "cell-ended",
        /// The cell is paused.
        Paused => Conflict "cell-paused",
        /// The journal could not record the request; nothing was done.
        Journal => Unavailable "journal-unavailable",
        /// The host is short of something (descriptors, memory, threads): try again.
        Unavailable => Unavailable "host-unavailable",
        /// The core failed (its state, its threads).
        Core => Internal "internal",
    }
}

failures! {
    /// Making a cell (`create`, `warden run`, a restore, a fork).
    CreateError {
        /// The request cannot be (a name, the policy, the environment, secrets, the workspace).
        Invalid => BadRequest "invalid-request",
        /// The snapshot or checkpoint it names does not exist.
        NoSource => NotFound "no-such-snapshot",
        /// A cell has the name.
        NameTaken => Conflict "name-taken",
        /// The tier refused to make it, in its words (or cannot run on this host).
        Refused => BadRequest "tier-refused",
        /// The host could not make it now.
        Unavailable => Unavailable "host-unavailable",
        /// The tier did not bring it up, or failed.
        Failed => Internal "start-failed",
    }
}

failures! {
    /// Exec, and what a face does to a process it started.
    ExecError {
        /// `argv`, `env`, `cwd`, `user`, a signal or a terminal size that cannot be.
        Invalid => BadRequest "invalid-request",
        /// A command rule, or the person its `ask` went to, refused it.
        Denied => Forbidden "denied",
        /// No process has the id.
        NoProcess => NotFound "no-such-process",
        /// The caller went away before the start, or the process cannot take this now.
        State => Conflict "wrong-state",
        /// The tier could not start it.
        StartFailed => Conflict "start-failed",
        /// The tier answered out of turn, or a pipe failed.
        Failed => Internal "exec-failed",
    }
}

failures! {
    /// The files API.
    FilesError {
        /// A path that cannot be (absolute, `..`, NUL, out of the root, not a regular file or
        /// not a directory where one is needed), or more than the API moves.
        Invalid => BadRequest "invalid-path",
        /// Nothing is at the path.
        Missing => NotFound "no-such-file",
        /// It exists, is read-only or not the cell user's, or the cell cannot do it now.
        State => Conflict "wrong-state",
        /// It did not finish in time and was killed.
        TimedOut => Unavailable "timed-out",
        /// The file operation failed.
        Failed => Internal "files-failed",
    }
}

failures! {
    /// Pause, resume, kill and delete.
    ControlError {
        /// The tier could not do it (no freezer, the cell's end).
        Refused => Conflict "refused",
        /// The warden could not start its control now.
        Unavailable => Unavailable "control-unavailable",
    }
}

failures! {
    /// Diff, apply, snapshots, reset, checkpoints, and the policy of a running cell.
    WorkspaceError {
        /// A path, name or policy document that cannot be.
        Invalid => BadRequest "invalid-request",
        /// A snapshot or checkpoint that does not exist.
        Missing => NotFound "no-such-snapshot",
        /// The changes conflict, a snapshot is in use or the name is taken, or the cell's tier
        /// cannot do it.
        Conflict => Conflict "conflict",
        /// The cell has no workspace (layer) to diff, apply, snapshot or reset.
        NoWorkspace => Conflict "no-workspace",
        /// No room was left to write the copy it needs: the cell's own disk (its
        /// `limits.disk`), or the host's.
        Full => Conflict "disk-full",
        /// The layers could not be read or written.
        Failed => Internal "workspace-failed",
    }
}

failures! {
    /// Approvals: answers, and the questions a face asks a person.
    ApprovalError {
        /// An answer that cannot be.
        Invalid => BadRequest "invalid-answer",
        /// The person refused, or nobody answered in time and the policy refuses then.
        Refused => Forbidden "refused-by-person",
        /// No open question has the id.
        NoQuestion => NotFound "no-such-question",
        /// The question was answered already, or cannot be now.
        Conflict => Conflict "already-answered",
    }
}

failures! {
    /// Reading the journal back: its pages, its check, what a reconnecting stream missed.
    HistoryError {
        /// A page size or bound that cannot be.
        Invalid => BadRequest "invalid-request",
        /// The journal's files could not be read.
        Unreadable => Internal "journal-unreadable",
    }
}
