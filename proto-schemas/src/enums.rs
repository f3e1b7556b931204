//! The enumerations of AIP, with their exact JSON strings.
//!
//! Every enum here is strict on input: an unknown or differently-cased string is an error, never
//! a silent default. The strings are UFO's (`aip/messages.py` at `b28183f`); renaming a Rust
//! variant never changes the wire because every variant carries an explicit `serde(rename)`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $wire:tt, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $wire)] $variant, )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The exact JSON string of this value.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $wire,)+ }
            }

            /// Parses the exact JSON string (case-sensitive); `None` for anything else.
            pub fn from_wire(s: &str) -> Option<Self> {
                match s { $($wire => Some($name::$variant),)+ _ => None }
            }

            /// The accepted strings, quoted and comma-separated, for error messages.
            pub fn expected() -> String {
                Self::ALL.iter().map(|v| format!("`{}`", v.as_str())).collect::<Vec<_>>().join(", ")
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_enum! {
    /// `type` of a frame a client sends (UFO's `ClientMessageType`), plus this project's
    /// extension frames, which are accepted only from clients that negotiated them.
    pub enum ClientMessageType {
        /// Ask the server to run a task (a constellation names `target_id`; a UFO device echoes
        /// a dispatched task).
        Task = "task",
        /// Keep-alive; answered locally by the gateway.
        Heartbeat = "heartbeat",
        /// Results of the Commands of one `command` frame.
        CommandResults = "command_results",
        /// A client-side error report; echoed back as a server ERROR, as UFO does.
        Error = "error",
        /// The first frame of every connection.
        Register = "register",
        /// Extension: an agent-driven executor ends its task with a result.
        TaskEnd = "task_end",
        /// A constellation asks for a device's system information.
        DeviceInfoRequest = "device_info_request",
        /// Ignored, as UFO ignores it.
        DeviceInfoResponse = "device_info_response",
        /// Extension: progress of a running task.
        Progress = "progress",
        /// Extension: an executor needs an answer before it can go on.
        ClarificationRequest = "clarification_request",
        /// Extension: a requester answers a clarification request.
        ClarificationResponse = "clarification_response",
        /// Extension: an executor hands its task to another agent.
        Handoff = "handoff",
    }
}

wire_enum! {
    /// `type` of a frame the server sends (UFO's `ServerMessageType`), plus extension frames
    /// sent only to clients that negotiated them.
    pub enum ServerMessageType {
        /// Start a task (sent by `POST /api/dispatch`; never to a constellation's executor).
        Task = "task",
        /// Registration confirmation, heartbeat answer and task acknowledgement.
        Heartbeat = "heartbeat",
        /// The end of a session, to requester and executor.
        TaskEnd = "task_end",
        /// Commands for the executor to run.
        Command = "command",
        /// Something the client sent was refused.
        Error = "error",
        /// Not sent by this server; kept because UFO's enum has it.
        DeviceInfoRequest = "device_info_request",
        /// Answer to a constellation's `device_info_request`.
        DeviceInfoResponse = "device_info_response",
        /// Extension: progress of a task, to a requester that negotiated it.
        Progress = "progress",
        /// Extension: the executor asks the requester a question.
        ClarificationRequest = "clarification_request",
        /// Extension: the requester's answer, to the executor.
        ClarificationResponse = "clarification_response",
        /// Extension: the task moved to another executor.
        Handoff = "handoff",
        /// Extension: a CallbackNotification, to the agent a task named as its callback.
        Callback = "callback",
    }
}

wire_enum! {
    /// `status` of every frame (UFO's `TaskStatus`).
    pub enum TaskStatus {
        /// The task goes on (more steps).
        Continue = "continue",
        /// The task ended well.
        Completed = "completed",
        /// The task ended badly.
        Failed = "failed",
        /// Acknowledgement.
        Ok = "ok",
        /// Protocol-level error.
        Error = "error",
    }
}

wire_enum! {
    /// `client_type` (UFO's `ClientType`). Absent or `null` on input means `device`, UFO's default.
    pub enum ClientType {
        /// A device agent: executes commands.
        Device = "device",
        /// A Galaxy constellation client: submits tasks to devices.
        Constellation = "constellation",
    }
}

wire_enum! {
    /// `status` of one command's Result (UFO's `ResultStatus`).
    pub enum ResultStatus {
        /// The command ran and succeeded.
        Success = "success",
        /// The command ran and failed; `error` says why.
        Failure = "failure",
        /// The command was not run (an earlier one in the frame failed).
        Skipped = "skipped",
        /// No status.
        None = "none",
    }
}

wire_enum! {
    /// `tool_type` of a Command. A UFO device rejects a whole `command` frame if any Command has
    /// another value, so nothing else is ever sent.
    pub enum ToolType {
        /// Reads state (screenshots, UI trees, system info).
        DataCollection = "data_collection",
        /// Changes state.
        Action = "action",
    }
}

wire_enum! {
    /// `metadata.platform` of a device's REGISTER; decides which UFO agent runs its commands.
    pub enum Platform {
        /// Windows (UFO's default when absent): `HostAgent`.
        Windows = "windows",
        /// Linux: `LinuxAgent`.
        Linux = "linux",
        /// Android and other mobile devices: `MobileAgent`.
        Mobile = "mobile",
    }
}

impl Platform {
    /// The UFO agent that a `command` frame must name for a device of this platform.
    pub fn default_agent_name(self) -> &'static str {
        match self {
            Platform::Windows => "HostAgent",
            Platform::Linux => "LinuxAgent",
            Platform::Mobile => "MobileAgent",
        }
    }
}

wire_enum! {
    /// Who decides the steps of a task that carries none: `planner` on a TaskRequest, a
    /// dispatch, or a `task` frame's `metadata`. Absent: the session service's configured
    /// default.
    pub enum PlannerName {
        /// A planner process answering `planner.next` on NATS.
        Nats = "nats",
        /// A planner behind an HTTP URL: the session service POSTs each PlanRequest to it.
        Http = "http",
        /// The built-in tool-calling agent, on an OpenAI-compatible chat-completions endpoint.
        Llm = "llm",
    }
}

wire_enum! {
    /// Optional protocol features beyond UFO's, announced by a client in REGISTER
    /// `metadata.aip_extensions` and confirmed by the server in the registration heartbeat's
    /// `result.aip_extensions`. Extension frames go only to clients that announced them.
    pub enum Extension {
        /// The client sends `task_end` with a `result` when it finishes an agent-driven task.
        TaskEndResult = "task_end_result",
        /// The client sends and receives `progress` frames.
        Progress = "progress",
        /// The client sends and receives `clarification_request` / `clarification_response`.
        Clarification = "clarification",
        /// The client sends and receives `handoff` frames.
        Handoff = "handoff",
        /// The client receives `callback` frames (CallbackNotifications of the tasks that name
        /// it as their `callback_agent`).
        Callback = "callback",
        /// The client's `task` frames may be seed 004's agent management ("register me as an
        /// agent", "find an agent"): answered with a `task_end` whose `result` is the
        /// TaskResponse, no task started.
        AgentManagement = "agent_management",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_strings_are_exactly_ufos() {
        let client: Vec<_> = ClientMessageType::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(
            &client[..8],
            [
                "task",
                "heartbeat",
                "command_results",
                "error",
                "register",
                "task_end",
                "device_info_request",
                "device_info_response"
            ]
        );
        let server: Vec<_> = ServerMessageType::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(
            &server[..7],
            [
                "task",
                "heartbeat",
                "task_end",
                "command",
                "error",
                "device_info_request",
                "device_info_response"
            ]
        );
        let status: Vec<_> = TaskStatus::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(status, ["continue", "completed", "failed", "ok", "error"]);
        let results: Vec<_> = ResultStatus::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(results, ["success", "failure", "skipped", "none"]);
        assert_eq!(ToolType::DataCollection.as_str(), "data_collection");
        assert_eq!(ClientType::Constellation.as_str(), "constellation");
    }

    #[test]
    fn enums_are_case_sensitive() {
        assert_eq!(TaskStatus::from_wire("OK"), None);
        assert!(serde_json::from_str::<TaskStatus>("\"OK\"").is_err());
        assert_eq!(
            serde_json::from_str::<TaskStatus>("\"ok\"").ok(),
            Some(TaskStatus::Ok)
        );
    }

    #[test]
    fn serde_and_as_str_agree() {
        for t in ClientMessageType::ALL {
            assert_eq!(
                serde_json::to_value(t).ok(),
                Some(serde_json::Value::from(t.as_str()))
            );
        }
        for t in ServerMessageType::ALL {
            assert_eq!(
                serde_json::to_value(t).ok(),
                Some(serde_json::Value::from(t.as_str()))
            );
        }
    }
}
