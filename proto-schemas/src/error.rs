//! One error-code type for the whole broker.
//!
//! The same code appears in an ERROR frame's `metadata.error_code`, in every HTTP error body
//! (`{"detail": "...", "error_code": "..."}`) and in NATS error replies (the `Aip-Error-Code`
//! header and an [`ErrorBody`] payload). The first seven are seed 000's; the rest are what the
//! services need beyond them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($( $(#[$meta:meta])* $variant:ident = $wire:tt => $status:literal, )+) => {
        /// A machine-readable error code. Its JSON form is the SCREAMING_SNAKE_CASE string.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
        pub enum ErrorCode {
            $( $(#[$meta])* #[serde(rename = $wire)] $variant, )+
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];

            /// The code's wire string.
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $wire,)+ }
            }

            /// Parses a wire string.
            pub fn from_wire(s: &str) -> Option<Self> {
                match s { $($wire => Some(ErrorCode::$variant),)+ _ => None }
            }

            /// The HTTP status that goes with this code in REST responses.
            pub fn http_status(self) -> u16 {
                match self { $(ErrorCode::$variant => $status,)+ }
            }
        }
    };
}

error_codes! {
    /// The connection could not be established or was lost.
    ConnectionFailed = "CONNECTION_FAILED" => 502,
    /// A REGISTER was refused (duplicate id, unknown target, not allowed for this credential).
    RegistrationFailed = "REGISTRATION_FAILED" => 409,
    /// A task or command took longer than its timeout.
    TaskTimeout = "TASK_TIMEOUT" => 504,
    /// A command failed on the executor.
    CommandFailed = "COMMAND_FAILED" => 502,
    /// A frame or message was malformed or not allowed in this state.
    ProtocolError = "PROTOCOL_ERROR" => 400,
    /// The addressed device is not known or not online.
    DeviceNotFound = "DEVICE_NOT_FOUND" => 404,
    /// No available agent has the required capabilities.
    CapabilityMismatch = "CAPABILITY_MISMATCH" => 422,
    /// Credentials are missing or wrong.
    Unauthorized = "UNAUTHORIZED" => 401,
    /// The caller is known but not allowed to do this (spoofed identity, foreign session).
    Forbidden = "FORBIDDEN" => 403,
    /// A REST or bus request was malformed.
    InvalidRequest = "INVALID_REQUEST" => 400,
    /// The addressed task, session or agent does not exist.
    NotFound = "NOT_FOUND" => 404,
    /// The request conflicts with the current state (e.g. a terminal task).
    Conflict = "CONFLICT" => 409,
    /// A frame or body is larger than the configured limit.
    FrameTooLarge = "FRAME_TOO_LARGE" => 413,
    /// Too many frames or requests; slow down.
    RateLimited = "RATE_LIMITED" => 429,
    /// The task was cancelled.
    TaskCanceled = "TASK_CANCELED" => 409,
    /// A service the request needs is not reachable right now; retry later.
    Unavailable = "UNAVAILABLE" => 503,
    /// A bug or an unexpected failure inside the broker; details are in its logs.
    Internal = "INTERNAL" => 500,
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error body used in HTTP responses and NATS error replies.
///
/// `detail` is the human text (the key UFO's FastAPI server uses, so its clients read it);
/// `error_code` is the machine-readable code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong and, where it helps, what to do.
    pub detail: String,
    /// The code.
    pub error_code: ErrorCode,
}

impl ErrorBody {
    /// An error body.
    pub fn new(error_code: ErrorCode, detail: impl Into<String>) -> Self {
        ErrorBody {
            detail: detail.into(),
            error_code,
        }
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.detail, self.error_code)
    }
}

impl std::error::Error for ErrorBody {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_codes_are_present_with_their_strings() {
        for s in [
            "CONNECTION_FAILED",
            "REGISTRATION_FAILED",
            "TASK_TIMEOUT",
            "COMMAND_FAILED",
            "PROTOCOL_ERROR",
            "DEVICE_NOT_FOUND",
            "CAPABILITY_MISMATCH",
        ] {
            let code = ErrorCode::from_wire(s).expect(s);
            assert_eq!(
                serde_json::to_value(code).ok(),
                Some(serde_json::Value::from(s))
            );
        }
    }

    #[test]
    fn every_code_round_trips() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_wire(code.as_str()), Some(*code));
            assert!((400..600).contains(&code.http_status()));
        }
    }
}
