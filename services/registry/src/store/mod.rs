//! Where agents are kept: the [`AgentStore`] trait and [`SqlAgentStore`], its one
//! implementation, on PostgreSQL or SQLite.
//!
//! The store knows tables and transactions, not policy: whether a registration may replace
//! the current holder of an id is decided by the caller's [`Admit`] function, which the store
//! calls inside the transaction that holds the row, so the decision and the write are atomic
//! even with several registry replicas. Liveness windows are passed in by the caller.
//!
//! Statements are written once with the dialect fragments of `aip_store::Backend`; where the
//! databases need different statements, the difference is stated next to the shared code:
//! PostgreSQL writes a batch of registrations or a presence flush in one statement over
//! arrays (a round trip saved per row), SQLite (in this process, no round trips) row by row;
//! reaping locks rows on PostgreSQL only, where replicas race. Times come from the database
//! clock (`now()`; SQLite's clock is this machine's), so replicas judge liveness alike.

mod addressed;
mod batch;
mod liveness;
mod reads;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aip_store::{Database, Timestamp};
use futures::FutureExt;
use futures::future::BoxFuture;
use proto_schemas::registry::{
    AddressedAgent, AgentRecord, AgentRegistration, AgentStatus, RegisterAgent, Registered,
};
use proto_schemas::{ClientType, ErrorBody, Extension, McpToolInfo, Platform};
use serde_json::Value;
use sqlx::types::Json;

/// The store for a database (migrated).
pub fn for_database(db: &Database) -> Arc<dyn AgentStore> {
    Arc::new(SqlAgentStore::new(db.clone()))
}

/// The agents and gateways tables, on either database.
#[derive(Debug)]
pub struct SqlAgentStore {
    db: Database,
    /// When this store last recorded each registering gateway as alive
    /// (see [`batch::GATEWAY_REFRESH`]).
    gateways_refreshed: Mutex<HashMap<String, Instant>>,
}

impl SqlAgentStore {
    /// A store on `db` (migrated).
    pub fn new(db: Database) -> Self {
        SqlAgentStore {
            db,
            gateways_refreshed: Mutex::default(),
        }
    }
}

impl AgentStore for SqlAgentStore {
    fn write_batch<'a>(
        &'a self,
        batch: &'a WriteBatch,
        windows: &'a Windows,
        admit: &'a Admit,
    ) -> BoxFuture<'a, Result<BatchOutcome, StoreError>> {
        self.write(batch, windows, admit).boxed()
    }

    fn is_live_device<'a>(
        &'a self,
        agent_id: &'a str,
        windows: &'a Windows,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.live_device(agent_id, windows).boxed()
    }

    fn get<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<AgentRecord>, StoreError>> {
        self.agent(agent_id).boxed()
    }

    fn get_many<'a>(
        &'a self,
        agent_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>> {
        self.agents_by_id(agent_ids).boxed()
    }

    fn lookup<'a>(
        &'a self,
        query: &'a LookupQuery,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>> {
        self.live_agents(query).boxed()
    }

    fn list<'a>(
        &'a self,
        filter: &'a AgentFilter,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>> {
        self.agents(filter).boxed()
    }

    fn online_ids(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        self.online().boxed()
    }

    fn apply_presence<'a>(
        &'a self,
        flush: &'a PresenceFlush,
    ) -> BoxFuture<'a, Result<PresenceApplied, StoreError>> {
        self.presence(flush).boxed()
    }

    fn reap<'a>(
        &'a self,
        windows: &'a Windows,
        forget_gateways_after: Duration,
    ) -> BoxFuture<'a, Result<Vec<Ended>, StoreError>> {
        self.expire(windows, forget_gateways_after).boxed()
    }

    fn end_gateway<'a>(
        &'a self,
        gateway_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Ended>, StoreError>> {
        self.gateway_restarted(gateway_id).boxed()
    }

    fn forget_offline(
        &self,
        unseen_for: Duration,
        limit: u32,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.forget_offline_agents(unseen_for, limit).boxed()
    }

    fn register_addressed<'a>(
        &'a self,
        registration: &'a AgentRegistration,
        registered_by: &'a str,
    ) -> BoxFuture<'a, Result<Option<AddressedAgent>, StoreError>> {
        self.insert_addressed(registration, registered_by).boxed()
    }

    fn find_addressed<'a>(
        &'a self,
        capabilities: &'a [String],
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<AddressedAgent>, StoreError>> {
        self.available_addressed(capabilities, limit).boxed()
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        async move { Ok(self.db.ping().await?) }.boxed()
    }
}

/// The agents table, behind either database.
///
/// Every method is one short transaction (or one statement). "Live" below means: not
/// offline, last seen within the given window, and held by a gateway whose last presence
/// report (or registration) is within the gateway window.
pub trait AgentStore: Send + Sync + 'static {
    /// Applies a batch of registrations and unregistrations, no two naming the same agent:
    /// group commit, many requests for one commit. Returns one result per write, in the
    /// batch's order. SQLite writes the batch in one transaction, and `Err` means nothing was
    /// written. PostgreSQL commits unregistrations and new ids in one statement first, then
    /// the registrations of existing ids in one transaction; `Err` may then leave the first
    /// part written, which is harmless to write again (an unregistration finds its agent
    /// offline, a new id finds its own connection holding it).
    ///
    /// Unregistrations are applied before registrations: the requests of one batch are
    /// concurrent, so this is one of their valid orders. An unregistration marks the agent
    /// offline if its connection still holds it, and says whether it went offline (false:
    /// another connection holds the id, or it was offline already); a connection that ended
    /// is never brought back by a late presence report. A registration records its gateway
    /// as alive (in a statement of its own before the transaction, at most every half second
    /// per gateway), then, holding the id's row (or the right to create it), asks `admit`
    /// about the current holder and writes the new entry if admitted. The new entry is `available`,
    /// seen now; `connected_at` and `load` are kept only when the same connection registers
    /// again.
    ///
    /// A registration whose current holder's row cannot be read fails alone, before anything
    /// is written for it; the others still commit.
    fn write_batch<'a>(
        &'a self,
        batch: &'a WriteBatch,
        windows: &'a Windows,
        admit: &'a Admit,
    ) -> BoxFuture<'a, Result<BatchOutcome, StoreError>>;

    /// Whether `agent_id` is a live device.
    fn is_live_device<'a>(
        &'a self,
        agent_id: &'a str,
        windows: &'a Windows,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// One agent, whatever its status.
    fn get<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<AgentRecord>, StoreError>>;

    /// The agents among `agent_ids` that exist, whatever their status, in one read.
    fn get_many<'a>(
        &'a self,
        agent_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>>;

    /// Live, available agents of a type having every capability asked for: least loaded
    /// first, then most recently seen, then by id.
    fn lookup<'a>(
        &'a self,
        query: &'a LookupQuery,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>>;

    /// Agents by stored status, type and capabilities (REST listing), ordered by id.
    fn list<'a>(
        &'a self,
        filter: &'a AgentFilter,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>>;

    /// Ids of every agent not offline (devices and constellations), ordered by id.
    fn online_ids(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;

    /// Writes one flush of presence reports, in one statement (PostgreSQL) or one
    /// transaction (SQLite).
    fn apply_presence<'a>(
        &'a self,
        flush: &'a PresenceFlush,
    ) -> BoxFuture<'a, Result<PresenceApplied, StoreError>>;

    /// Marks offline every agent not offline that is no longer live; returns the connections
    /// that ended so. Also forgets gateways silent for `forget_gateways_after` that hold no
    /// live agent.
    fn reap<'a>(
        &'a self,
        windows: &'a Windows,
        forget_gateways_after: Duration,
    ) -> BoxFuture<'a, Result<Vec<Ended>, StoreError>>;

    /// A gateway started again under `gateway_id`: marks offline every agent not offline that
    /// it held (`gateway_stopped`, never revived by a late presence report) and returns their
    /// connections.
    fn end_gateway<'a>(
        &'a self,
        gateway_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Ended>, StoreError>>;

    /// Deletes at most `limit` agents that are offline and unseen for `unseen_for`; returns
    /// how many. Such an id registers again as a new one (admission lets anyone take an
    /// offline id anyway). Rows a registration holds locked are left for the next round.
    fn forget_offline(
        &self,
        unseen_for: Duration,
        limit: u32,
    ) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Registers an agent reached at an address (seed 004), unless its id is taken by such an
    /// agent or by a WebSocket client not offline: the stored agent, or `None` when taken.
    fn register_addressed<'a>(
        &'a self,
        registration: &'a AgentRegistration,
        registered_by: &'a str,
    ) -> BoxFuture<'a, Result<Option<AddressedAgent>, StoreError>>;

    /// Available agents reached at an address having every capability asked for, by id, at
    /// most `limit`.
    fn find_addressed<'a>(
        &'a self,
        capabilities: &'a [String],
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<AddressedAgent>, StoreError>>;

    /// Checks that the database answers.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// Decides whether a registration may take the id from its current holder (`None`: nobody
/// has ever held it). `Ok(replaced)` admits it; `replaced` names a connection to be closed.
/// `Err` refuses it with that error.
pub type Admit =
    dyn Fn(&RegisterAgent, Option<&Holder>) -> Result<Option<String>, ErrorBody> + Send + Sync;

/// Writes for one transaction ([`AgentStore::write_batch`]); no two name the same agent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WriteBatch {
    /// Connections that ended; applied first.
    pub unregisters: Vec<Unregister>,
    /// Registrations, each judged by the batch's [`Admit`] function.
    pub registers: Vec<RegisterAgent>,
}

impl WriteBatch {
    /// How many writes it holds.
    pub fn len(&self) -> usize {
        self.unregisters.len() + self.registers.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The agents it writes, unregistrations first.
    pub fn agent_ids(&self) -> impl Iterator<Item = &str> {
        self.unregisters
            .iter()
            .map(|u| u.agent_id.as_str())
            .chain(self.registers.iter().map(|r| r.agent_id.as_str()))
    }
}

/// The end of a connection: the agent goes offline if that connection still holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unregister {
    /// The agent the connection held.
    pub agent_id: String,
    /// The connection that ended: if another one holds the agent now, nothing changes.
    pub connection_id: String,
}

/// What a [`WriteBatch`] did: one result per write, in the batch's order.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// Per unregistration: whether the agent went offline.
    pub unregistered: Vec<Result<bool, StoreError>>,
    /// Per registration: its outcome.
    pub registered: Vec<Result<RegisterOutcome, StoreError>>,
}

/// A connection that ended without its gateway reporting it (the registry announces it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub agent_id: String,
    pub client_type: ClientType,
    /// The gateway that held it.
    pub gateway_id: String,
    pub connection_id: String,
}

/// The current holder of an id, as read under the row lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The connection to close if a registration takes the id over.
    pub connection_id: String,
    /// The gateway holding that connection.
    pub gateway_id: String,
    /// The credential that registered it, told apart from the newcomer's.
    pub principal: String,
    /// As stored (an offline holder may still be live by the clock, or the reverse).
    pub status: AgentStatus,
    /// Not offline, seen within the agent window and held by a gateway seen within the
    /// gateway window.
    pub live: bool,
}

/// The outcome of a registration.
#[derive(Debug, Clone, PartialEq)]
pub enum RegisterOutcome {
    /// Committed: the record as stored, and the connection it replaced.
    Registered(Box<Registered>),
    /// Refused by the [`Admit`] function; nothing was written.
    Refused(ErrorBody),
}

/// The liveness windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// A gateway whose last report is older than this is dead.
    pub gateway: Duration,
    /// An agent whose last sign of life is older than this is gone.
    pub agent: Duration,
}

/// What [`AgentStore::lookup`] looks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupQuery {
    /// Every one of these is required.
    pub capabilities: Vec<String>,
    /// Only agents of this type.
    pub client_type: ClientType,
    /// At most this many.
    pub limit: u32,
    /// What counts as live.
    pub windows: Windows,
}

/// What [`AgentStore::list`] filters on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentFilter {
    /// Every one of these is required.
    pub capabilities: Vec<String>,
    /// Only agents with this stored status.
    pub status: Option<AgentStatus>,
    /// Only agents of this type.
    pub client_type: Option<ClientType>,
    /// At most this many.
    pub limit: u32,
}

/// Presence gathered since the last flush.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PresenceFlush {
    /// Gateways that reported, with their reporting interval: their `last_seen` becomes now.
    pub gateways: Vec<(String, u64)>,
    /// Connections that showed life: `(agent_id, connection_id, gateway_id)`. An entry
    /// refreshes its agent only if that connection on that gateway still holds it.
    pub alive: Vec<(String, String, String)>,
    /// Gateways shutting down: all their agents go offline.
    pub stopping: Vec<String>,
}

impl PresenceFlush {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.gateways.is_empty() && self.alive.is_empty() && self.stopping.is_empty()
    }
}

/// What a presence flush changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PresenceApplied {
    /// Agents whose `last_seen` was refreshed (including any brought back from a liveness
    /// expiry).
    pub refreshed: u64,
    /// Agents taken offline because their gateway is stopping.
    pub stopped: u64,
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached (down, pool exhausted, connection lost).
    #[error("the registry database is unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// A statement failed.
    #[error("registry database statement failed: {0}")]
    Query(#[source] sqlx::Error),
    /// A stored row cannot be read back (written by an incompatible build?).
    #[error("stored agent `{agent_id}` cannot be read: {detail}")]
    Corrupt {
        /// Whose row, so that it can be found and repaired.
        agent_id: String,
        /// Which column holds what this build cannot read.
        detail: String,
    },
    /// A concurrent registration of the same id got in the way, in a way this transaction
    /// cannot settle; trying again helps.
    #[error(
        "registration of `{agent_id}` collided with a concurrent registration of the same id; try again"
    )]
    Contention {
        /// The id both registrations named.
        agent_id: String,
    },
    /// The transaction of a batch failed: every write of the batch gets this error.
    #[error("{0}")]
    Batch(std::sync::Arc<StoreError>),
    /// The task writing batches has stopped (the registry is shutting down).
    #[error("the registry is shutting down and takes no more writes")]
    Stopped,
}

impl StoreError {
    /// Whether retrying later may help (the database is down or overloaded).
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Unavailable(_) | StoreError::Contention { .. } | StoreError::Stopped => {
                true
            }
            StoreError::Batch(cause) => cause.is_unavailable(),
            StoreError::Query(_) | StoreError::Corrupt { .. } => false,
        }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e),
            other => StoreError::Query(other),
        }
    }
}

/// The columns of an agent, as [`AgentRow`] reads them.
pub(crate) const AGENT_COLUMNS: &str = "a.agent_id, a.client_type, a.platform, a.status, a.capabilities, a.tools, \
     a.system_info, a.metadata, a.extensions, a.target_id, a.gateway_id, a.connection_id, a.load, \
     a.connected_at, a.last_seen";

/// [`AGENT_COLUMNS`] without the table alias, for `RETURNING` clauses of statements that
/// name the table without one (SQLite allows no alias there).
pub(crate) const RETURNING_COLUMNS: &str = "agent_id, client_type, platform, status, capabilities, tools, \
     system_info, metadata, extensions, target_id, gateway_id, connection_id, load, connected_at, last_seen";

/// One agent row as read from either database, before validation.
#[derive(sqlx::FromRow)]
pub(crate) struct AgentRow {
    agent_id: String,
    client_type: String,
    platform: String,
    status: String,
    capabilities: Json<Vec<String>>,
    tools: Json<Value>,
    system_info: Option<Json<Value>>,
    metadata: Option<Json<Value>>,
    extensions: Json<Vec<String>>,
    target_id: Option<String>,
    gateway_id: String,
    connection_id: String,
    load: i32,
    connected_at: Timestamp,
    last_seen: Timestamp,
}

impl AgentRow {
    /// Validates the row into a record. Extensions unknown to this build are skipped (a newer
    /// build may have stored them).
    pub(crate) fn into_record(self) -> Result<AgentRecord, StoreError> {
        let corrupt = |detail: String| StoreError::Corrupt {
            agent_id: self.agent_id.clone(),
            detail,
        };
        let client_type = ClientType::from_wire(&self.client_type)
            .ok_or_else(|| corrupt(format!("unknown client_type `{}`", self.client_type)))?;
        let platform = Platform::from_wire(&self.platform)
            .ok_or_else(|| corrupt(format!("unknown platform `{}`", self.platform)))?;
        let status = AgentStatus::from_wire(&self.status)
            .ok_or_else(|| corrupt(format!("unknown status `{}`", self.status)))?;
        let tools: Vec<McpToolInfo> = serde_json::from_value(self.tools.0.clone())
            .map_err(|e| corrupt(format!("tools: {e}")))?;
        let extensions = self
            .extensions
            .0
            .iter()
            .filter_map(|e| Extension::from_wire(e))
            .collect();
        Ok(AgentRecord {
            agent_id: self.agent_id,
            client_type,
            status,
            platform,
            capabilities: self.capabilities.0,
            tools,
            system_info: self.system_info.map(|j| j.0),
            metadata: self.metadata.map(|j| j.0),
            extensions,
            target_id: self.target_id,
            gateway_id: self.gateway_id,
            connection_id: self.connection_id,
            load: self.load,
            connected_at: self.connected_at.0,
            last_seen: self.last_seen.0,
        })
    }
}

/// The record a first registration writes: the request's own fields, available, no load,
/// connected and last seen at `at` (the database's time of the insert). Built here rather
/// than read back, so that a batch of new ids returns a timestamp per row, not the rows.
pub(crate) fn new_record(request: &RegisterAgent, at: Timestamp) -> AgentRecord {
    AgentRecord {
        agent_id: request.agent_id.clone(),
        client_type: request.client_type,
        status: AgentStatus::Available,
        platform: request.platform,
        capabilities: request.capabilities.clone(),
        tools: request.tools.clone(),
        system_info: request.system_info.clone(),
        metadata: request.metadata.clone(),
        extensions: request.extensions.clone(),
        target_id: request.target_id.clone(),
        gateway_id: request.gateway_id.clone(),
        connection_id: request.connection_id.clone(),
        load: 0,
        connected_at: at.0,
        last_seen: at.0,
    }
}

/// The wire names of a registration's extensions, for storage.
pub(crate) fn extension_names(extensions: &[Extension]) -> Vec<&'static str> {
    extensions.iter().map(|e| e.as_str()).collect()
}

/// Milliseconds of a window, bound where `aip_store::Backend::ago` reads them (a window too
/// long for an `i64` is as good as forever).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
