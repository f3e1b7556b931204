//! # proto-schemas: the AIP wire contract
//!
//! The one crate that knows what travels between aip's clients and services:
//!
//! - [`frames`]: the two WebSocket frame shapes of AIP, [`ClientMessage`] and [`ServerMessage`],
//!   and their parts ([`Command`], [`ActionResult`], [`McpToolInfo`], [`SystemInfo`]), faithful
//!   to Microsoft UFO's pydantic models (`ufo-aip.schema.json`);
//! - [`enums`]: the exact enum strings (`type`, `status`, `client_type`, `tool_type`, …) and the
//!   negotiated [`Extension`]s;
//! - [`validate`]: [`parse_client_frame`], which parses untrusted bytes into a valid frame or an
//!   error naming the frame, the field and the problem;
//! - [`server`]: constructors for every frame the server sends;
//! - [`flow`]: seed 004's flow messages (TaskRequest, HandoffNotification, …) and [`registry`]:
//!   the registry's messages, both versioned subject payloads;
//! - [`sessions`]: the session service's payloads (frames from gateways, the planner, tasks);
//! - [`gateways`]: what gateways ask each other (device information, several devices at once);
//! - [`error`]: the one [`ErrorCode`] used in ERROR frames, HTTP bodies and NATS replies;
//! - [`subjects`]: the subject catalogue under a configurable prefix, with a reversible
//!   encoding of client-provided ids into subject tokens;
//! - [`schema`]: the generated JSON Schemas and AsyncAPI document, checked in beside this crate.
//!
//! ## Conventions
//! - Input is tolerant where UFO is: unknown keys are ignored; `null` and absent are the same.
//! - Input is strict on enums and field types: a wrong value is an error, never a default.
//! - Output omits absent fields instead of writing `null` (UFO's pydantic clients fill the
//!   defaults), keeping frames small; every frame still validates against UFO's schema.

pub mod enums;
pub mod error;
pub mod flow;
pub mod frames;
pub mod gateways;
pub mod registry;
pub mod schema;
pub mod server;
pub mod sessions;
pub mod shape;
pub mod subjects;
pub mod validate;
pub mod version;

pub use enums::{
    ClientMessageType, ClientType, Extension, PlannerName, Platform, ResultStatus,
    ServerMessageType, TaskStatus, ToolType,
};
pub use error::{ErrorBody, ErrorCode};
pub use frames::{
    ActionResult, ClientMessage, Command, JsonObject, McpToolInfo, ServerMessage, SystemInfo,
};
pub use subjects::Subjects;
pub use validate::{
    FrameError, MAX_ID_BYTES, RegisterDetails, parse_client_frame, register_details,
};
pub use version::V1;

/// The largest frame UFO's server and clients accept (100 MiB); the gateway's default limit.
pub const MAX_FRAME_BYTES: usize = 100 * 1024 * 1024;
