//! Payloads of the registry's subjects (`registry.*`, `presence.*`).
//!
//! Requests carry `"version": 1`; replies are a [`Reply`]: `{"ok": …}` or
//! `{"error": {"detail": …, "error_code": …}}`.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::enums::{ClientType, Extension, Platform};
use crate::error::ErrorBody;
use crate::frames::McpToolInfo;
use crate::version::V1;

/// The reply to any request/reply subject: the answer or an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "Reply_for_{T}")]
pub enum Reply<T> {
    /// The request succeeded.
    Ok(T),
    /// The request failed; the code says how.
    Error(ErrorBody),
}

impl<T> Reply<T> {
    /// Converts into a `Result`.
    pub fn into_result(self) -> Result<T, ErrorBody> {
        match self {
            Reply::Ok(v) => Ok(v),
            Reply::Error(e) => Err(e),
        }
    }
}

impl<T> From<Result<T, ErrorBody>> for Reply<T> {
    fn from(r: Result<T, ErrorBody>) -> Self {
        match r {
            Ok(v) => Reply::Ok(v),
            Err(e) => Reply::Error(e),
        }
    }
}

/// An agent's availability.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AgentStatus {
    /// Connected and ready for work.
    Available,
    /// Connected, at its concurrency limit.
    Busy,
    /// Not connected (or its gateway stopped reporting it).
    Offline,
}

impl AgentStatus {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentStatus::Available => "available",
            AgentStatus::Busy => "busy",
            AgentStatus::Offline => "offline",
        }
    }

    /// Parses the wire string.
    pub fn from_wire(s: &str) -> Option<Self> {
        match s {
            "available" => Some(AgentStatus::Available),
            "busy" => Some(AgentStatus::Busy),
            "offline" => Some(AgentStatus::Offline),
            _ => None,
        }
    }
}

/// `registry.register`: a gateway registers a client that sent a valid REGISTER.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RegisterAgent {
    /// Always 1.
    pub version: V1,
    /// The client's id, as given.
    pub agent_id: String,
    /// Device or constellation.
    pub client_type: ClientType,
    /// The gateway holding the socket.
    pub gateway_id: String,
    /// The socket, unique per connection; later frames about it name it.
    pub connection_id: String,
    /// Who authenticated the socket (a credential name; `anonymous` without auth). A live
    /// registration may be taken over only by the same principal.
    pub principal: String,
    /// Device platform.
    pub platform: Platform,
    /// For a constellation: the device named in REGISTER `target_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Capabilities for lookup.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Advertised tools.
    #[serde(default)]
    pub tools: Vec<McpToolInfo>,
    /// REGISTER `metadata.system_info`, verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_info: Option<Value>,
    /// REGISTER `metadata`, verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Negotiated extensions.
    #[serde(default)]
    pub extensions: Vec<Extension>,
}

impl RegisterAgent {
    /// A device's registration with nothing but who and where it is (no capabilities, tools,
    /// system information, metadata or extensions); set the rest on the result.
    pub fn device(
        agent_id: &str,
        gateway_id: &str,
        connection_id: &str,
        principal: &str,
        platform: Platform,
    ) -> Self {
        RegisterAgent {
            version: V1,
            agent_id: agent_id.to_owned(),
            client_type: ClientType::Device,
            gateway_id: gateway_id.to_owned(),
            connection_id: connection_id.to_owned(),
            principal: principal.to_owned(),
            platform,
            target_id: None,
            capabilities: Vec::new(),
            tools: Vec::new(),
            system_info: None,
            metadata: None,
            extensions: Vec::new(),
        }
    }
}

/// `registry.register` reply payload on success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Registered {
    /// The stored record.
    pub agent: AgentRecord,
    /// The connection this registration replaced (same principal, stale socket), if any; the
    /// gateway holding it is told to close it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_connection: Option<String>,
    /// The gateway that held the replaced connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_gateway: Option<String>,
}

/// The `registry.register` reply.
pub type RegisterReply = Reply<Registered>;

/// A registration accepted, answered without its stored record: what a gateway acts on (see
/// [`RegistryWrites::without_records`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Accepted {
    /// The connection this registration replaced (same principal, stale socket), if any; the
    /// gateway holding it is told to close it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_connection: Option<String>,
    /// The gateway that held the replaced connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_gateway: Option<String>,
}

impl From<Registered> for Accepted {
    fn from(registered: Registered) -> Self {
        Accepted {
            replaced_connection: registered.replaced_connection,
            replaced_gateway: registered.replaced_gateway,
        }
    }
}

/// `registry.unregister`: a connection ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UnregisterAgent {
    /// Always 1.
    pub version: V1,
    /// The client's id.
    pub agent_id: String,
    /// The connection that ended; nothing happens if another connection holds the id now.
    pub connection_id: String,
    /// Why (closed by client, liveness timeout, gateway shutdown, …).
    pub reason: String,
}

/// `registry.unregister` reply payload: whether the agent went offline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Unregistered {
    /// False when the connection no longer held the id.
    pub went_offline: bool,
}

/// The `registry.unregister` reply.
pub type UnregisterReply = Reply<Unregistered>;

/// `registry.write`: registrations and unregistrations of one gateway that were waiting at
/// once, in one request (at most [`MAX_WRITES`]). Each is judged and written as if it had
/// come alone on `registry.register` or `registry.unregister`; the reply answers each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RegistryWrites {
    /// Always 1.
    pub version: V1,
    /// The writes, in the order of the answers.
    pub writes: Vec<RegistryWrite>,
    /// Answer each accepted registration with `accepted` (whether it replaced a connection)
    /// rather than `registered` with the whole stored record, which the gateway does not use.
    /// A registry of an earlier version ignores it and answers `registered`: a sender that
    /// asks must understand both.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub without_records: bool,
}

/// Writes per `registry.write` request at most.
pub const MAX_WRITES: usize = 256;

/// One write of a [`RegistryWrites`]: the payload its own subject would carry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RegistryWrite {
    /// As `registry.register`.
    Register(RegisterAgent),
    /// As `registry.unregister`.
    Unregister(UnregisterAgent),
}

/// The answer to one write of a [`RegistryWrites`]: what its own subject would have replied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WriteAnswer {
    /// A registration, accepted.
    Registered(Box<Registered>),
    /// A registration, accepted, answered without its record (the request asked
    /// `without_records`).
    Accepted(Accepted),
    /// An unregistration, done.
    Unregistered(Unregistered),
    /// The write was refused or failed.
    Error(ErrorBody),
}

/// The `registry.write` reply: one answer per write, in its order (a request that cannot be
/// read, or holds more than [`MAX_WRITES`] writes, is refused whole with `INVALID_REQUEST`).
pub type RegistryWritesReply = Reply<Vec<WriteAnswer>>;

/// `registry.get`: one agent by id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GetAgent {
    /// Always 1.
    pub version: V1,
    /// The agent's id.
    pub agent_id: String,
}

/// The `registry.get` reply (error `NOT_FOUND` for an unknown id).
pub type GetAgentReply = Reply<AgentRecord>;

/// `registry.get_many`: several agents by id in one request (a session replica resolves the
/// targets of the tasks it reads together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GetAgents {
    /// Always 1.
    pub version: V1,
    /// The agents' ids (at most [`MAX_GET_MANY`]; repeated ids are answered once).
    pub agent_ids: Vec<String>,
}

/// Ids per `registry.get_many` request at most.
pub const MAX_GET_MANY: usize = 1000;

/// The `registry.get_many` reply: the agents found, in no particular order (an unknown id is
/// absent; more than [`MAX_GET_MANY`] ids is refused with `INVALID_REQUEST`).
pub type GetAgentsReply = Reply<Vec<AgentRecord>>;

/// `registry.lookup`: available, live agents with every listed capability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LookupAgents {
    /// Always 1.
    pub version: V1,
    /// Required capabilities (all of them); empty matches any agent.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Only agents of this type (default: devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_type: Option<ClientType>,
    /// At most this many (default 10, at most 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// The `registry.lookup` reply: least loaded first.
pub type LookupReply = Reply<Vec<AgentRecord>>;

/// `registry.gateway_started`: a gateway (re)started under `gateway_id` and holds no
/// connection yet. Every connection registered under that id before is over: its agents go
/// offline and the session service hears of each end. A gateway sends it before it accepts
/// registrations, so that a restart under the same id does not leave the old process's
/// registrations live until the liveness window passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GatewayStarted {
    /// Always 1.
    pub version: V1,
    /// The gateway's configured id.
    pub gateway_id: String,
}

/// `registry.gateway_started` reply payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GatewayStartedAck {
    /// Connections of the previous process that were ended.
    pub ended: u32,
}

/// The `registry.gateway_started` reply.
pub type GatewayStartedReply = Reply<GatewayStartedAck>;

/// What the registry knows of one agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct AgentRecord {
    /// The agent's id.
    pub agent_id: String,
    /// Device or constellation.
    pub client_type: ClientType,
    /// Availability.
    pub status: AgentStatus,
    /// Device platform.
    pub platform: Platform,
    /// Capabilities.
    pub capabilities: Vec<String>,
    /// Advertised tools.
    pub tools: Vec<McpToolInfo>,
    /// REGISTER `metadata.system_info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_info: Option<Value>,
    /// REGISTER `metadata`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Negotiated extensions.
    pub extensions: Vec<Extension>,
    /// For a constellation: its REGISTER `target_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// The gateway holding the connection (last holder when offline).
    pub gateway_id: String,
    /// The connection (last one when offline).
    pub connection_id: String,
    /// Tasks running on it now (maintained by the session service).
    pub load: i32,
    /// When the current (or last) connection registered.
    pub connected_at: DateTime<Utc>,
    /// Last sign of life.
    pub last_seen: DateTime<Utc>,
}

/// `presence.{gateway}`: a gateway's periodic liveness report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PresenceBatch {
    /// Always 1.
    pub version: V1,
    /// The reporting gateway.
    pub gateway_id: String,
    /// How often this gateway reports, so the registry knows when it is overdue.
    pub interval_ms: u64,
    /// Clients (with their connection ids) that showed life since the last batch.
    pub alive: Vec<PresenceEntry>,
    /// Set on the gateway's last batch before a graceful exit: all its agents go offline.
    #[serde(default)]
    pub stopping: bool,
}

/// One live connection in a [`PresenceBatch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PresenceEntry {
    /// The client's id.
    pub agent_id: String,
    /// Its connection.
    pub connection_id: String,
}

/// `registry.agents`: seed 004's agent management, asked of the registry by the session
/// service once it has read a TaskRequest as one (see [`crate::flow::AgentRequestKind`]).
///
/// These agents are reached at an address (HTTP, or host and port): they are not WebSocket
/// clients, and the registry keeps them in a table of their own, one row per agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ManageAgents {
    /// Always 1.
    pub version: V1,
    /// Who asks: `rest:<key name>` or `nats:<originating_agent_id>`; kept with a registration.
    pub requested_by: String,
    /// What to do.
    pub action: AgentAction,
}

/// The two requests of seed 004's "Agent Management".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentAction {
    /// "register me as an agent".
    Register(AgentRegistration),
    /// "find an agent".
    Find(AgentQuery),
}

/// An agent to register: who it is, what it can do, where it is reached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentRegistration {
    /// The agent's id (unique among these agents and the WebSocket clients not offline).
    pub agent_id: String,
    /// What it can do (at least one; no duplicates).
    pub capabilities: Vec<String>,
    /// Where it is reached: a URL (`https://host:port/path`) or `host:port`.
    pub address: String,
    /// Its availability; only `available` agents are found.
    pub status: AgentStatus,
}

/// Agents to find: those with every one of these capabilities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentQuery {
    /// At least one; all are required.
    pub capabilities: Vec<String>,
}

/// The `registry.agents` answer (a refusal is a [`Reply::Error`]: `REGISTRATION_FAILED` for a
/// taken id, `NOT_FOUND` when no agent matches, `INVALID_REQUEST` for a malformed request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentActionOutcome {
    /// The registration, as stored.
    Registered(AddressedAgent),
    /// The agents found (never empty): addressed agents by id, then devices least loaded first.
    Found(Vec<FoundAgent>),
}

/// The `registry.agents` reply.
pub type ManageAgentsReply = Reply<AgentActionOutcome>;

/// An agent registered by "register me as an agent", as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AddressedAgent {
    /// The agent's id.
    pub agent_id: String,
    /// What it can do.
    pub capabilities: Vec<String>,
    /// Where it is reached.
    pub address: String,
    /// Its availability.
    pub status: AgentStatus,
    /// Who registered it (see [`ManageAgents::requested_by`]).
    pub registered_by: String,
    /// When.
    pub registered_at: DateTime<Utc>,
}

/// How a found agent is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FoundAgentKind {
    /// Registered by "register me as an agent": reached at its `address`.
    Addressed,
    /// A UFO device connected over WebSocket: reached through the broker (submit a task with
    /// it as `target_id`).
    Device,
}

/// One agent in the answer to "find an agent".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FoundAgent {
    /// The agent's id.
    pub agent_id: String,
    /// How it is reached.
    pub kind: FoundAgentKind,
    /// What it can do.
    pub capabilities: Vec<String>,
    /// Where it is reached (addressed agents only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Its availability (always `available`: only available agents are found).
    pub status: AgentStatus,
}
