//! The registry's rules, above any bus and any database.
//!
//! [`Registry`] answers the requests (register, unregister, get, get_many, lookup) with the
//! payloads of `proto_schemas::registry`, refusing with an [`ErrorBody`] whose code and text
//! are what the gateway forwards to the client. The admission rule for a registration,
//! [`admit`], is a pure function the store runs inside its transaction. Registrations and
//! unregistrations go through [`crate::group_commit`], many per transaction.

use std::sync::Arc;

use proto_schemas::registry::{
    AgentAction, AgentActionOutcome, AgentQuery, AgentRecord, AgentRegistration, AgentStatus,
    FoundAgent, FoundAgentKind, GatewayStarted, GatewayStartedAck, GetAgent, GetAgents,
    LookupAgents, MAX_GET_MANY, MAX_WRITES, ManageAgents, RegisterAgent, Registered, RegistryWrite,
    RegistryWrites, UnregisterAgent, Unregistered, WriteAnswer,
};
use proto_schemas::{ClientType, ErrorBody, ErrorCode};

use crate::group_commit::WriteQueue;
use crate::notices::Notices;
use crate::python_repr::python_repr;
use crate::store::{
    AgentStore, Ended, Holder, LookupQuery, RegisterOutcome, StoreError, Unregister, Windows,
};

/// The reason the session service sees for a connection replaced by a newer registration.
pub const REPLACED: &str = "replaced_by_new_registration";
/// The reason the session service sees for the connections of a gateway that started again.
pub const GATEWAY_RESTARTED: &str = "gateway_restarted";

/// Lookup answers at most this many agents unless asked for fewer.
pub const DEFAULT_LOOKUP_LIMIT: u32 = 10;
/// Lookup never answers more than this many agents.
pub const MAX_LOOKUP_LIMIT: u32 = 1000;

/// "find an agent" answers at most this many agents of each kind (addressed, devices).
pub const FIND_LIMIT: u32 = 100;

/// The registry's request handlers.
#[derive(Clone)]
pub struct Registry {
    store: Arc<dyn AgentStore>,
    windows: Windows,
    /// Registrations and unregistrations, written many per transaction.
    writes: WriteQueue,
    /// Where the ends of connections no gateway reports are announced.
    notices: Notices,
}

impl Registry {
    /// A registry over `store`, judging liveness by `windows`. Starts the task that writes
    /// registrations (see [`crate::group_commit`]), so it must be called within a Tokio
    /// runtime; that task ends when the last clone of the registry is dropped.
    pub fn new(store: Arc<dyn AgentStore>, windows: Windows, notices: Notices) -> Self {
        let writes = WriteQueue::start(store.clone(), windows, &admit);
        Registry {
            store,
            windows,
            writes,
            notices,
        }
    }

    pub fn store(&self) -> &Arc<dyn AgentStore> {
        &self.store
    }

    /// `registry.register`, with UFO's checks in UFO's order: a constellation's target must
    /// be a live device; a live id held by another connection is refused unless the same
    /// principal takes it over.
    pub async fn register(&self, request: RegisterAgent) -> Result<Registered, ErrorBody> {
        for (field, value) in [
            ("agent_id", &request.agent_id),
            ("gateway_id", &request.gateway_id),
            ("connection_id", &request.connection_id),
            ("principal", &request.principal),
        ] {
            if value.is_empty() {
                return Err(ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("{field} must not be empty"),
                ));
            }
        }
        if request.client_type == ClientType::Constellation
            && let Some(target) = request.target_id.as_deref()
            && !self
                .store
                .is_live_device(target, &self.windows)
                .await
                .map_err(store_failure)?
        {
            return Err(ErrorBody::new(
                ErrorCode::RegistrationFailed,
                format!("Target device '{target}' is not connected"),
            ));
        }
        let agent_id = request.agent_id.clone();
        match self.writes.register(request).await.map_err(store_failure)? {
            RegisterOutcome::Registered(registered) => {
                // Per connection, so at DEBUG: thousands a second under load (the row in
                // `agents` is the record).
                tracing::debug!(
                    agent_id = %registered.agent.agent_id,
                    client_type = %registered.agent.client_type,
                    gateway_id = %registered.agent.gateway_id,
                    connection_id = %registered.agent.connection_id,
                    replaced_connection = registered.replaced_connection.as_deref(),
                    "agent registered"
                );
                // The replaced connection's gateway may be dead and never report its end:
                // announced before the client hears it is registered, so its tasks end before
                // any frame of the new connection arrives.
                if let Some(connection_id) = &registered.replaced_connection {
                    let ended = Ended {
                        agent_id: registered.agent.agent_id.clone(),
                        client_type: registered.agent.client_type,
                        gateway_id: registered.replaced_gateway.clone().unwrap_or_default(),
                        connection_id: connection_id.clone(),
                    };
                    self.notices.announce(&ended, REPLACED).await;
                }
                metrics::counter!("aip_registry_registrations_total", "outcome" => "registered")
                    .increment(1);
                Ok(*registered)
            }
            RegisterOutcome::Refused(refusal) => {
                tracing::info!(%agent_id, reason = %refusal.detail, "registration refused");
                metrics::counter!("aip_registry_registrations_total", "outcome" => "refused")
                    .increment(1);
                Err(refusal)
            }
        }
    }

    /// `registry.unregister`: offline, if that connection still holds the id.
    pub async fn unregister(&self, request: UnregisterAgent) -> Result<Unregistered, ErrorBody> {
        let went_offline = self
            .writes
            .unregister(Unregister {
                agent_id: request.agent_id.clone(),
                connection_id: request.connection_id.clone(),
            })
            .await
            .map_err(store_failure)?;
        tracing::debug!(
            agent_id = %request.agent_id,
            connection_id = %request.connection_id,
            reason = %request.reason,
            went_offline,
            "agent unregistered"
        );
        Ok(Unregistered { went_offline })
    }

    /// `registry.write`: each write as on its own subject, all at once (so they share the
    /// group commit's batches), answered in their order (an accepted registration as
    /// `accepted`, without its record, when the request asks so); more than [`MAX_WRITES`] is
    /// refused.
    pub async fn write(&self, request: RegistryWrites) -> Result<Vec<WriteAnswer>, ErrorBody> {
        if request.writes.len() > MAX_WRITES {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "writes holds {} writes; at most {MAX_WRITES} per request",
                    request.writes.len()
                ),
            ));
        }
        let without_records = request.without_records;
        let writes = request.writes.into_iter().map(|write| async move {
            match write {
                RegistryWrite::Register(request) => match self.register(request).await {
                    Ok(registered) if without_records => WriteAnswer::Accepted(registered.into()),
                    Ok(registered) => WriteAnswer::Registered(Box::new(registered)),
                    Err(refusal) => WriteAnswer::Error(refusal),
                },
                RegistryWrite::Unregister(request) => match self.unregister(request).await {
                    Ok(unregistered) => WriteAnswer::Unregistered(unregistered),
                    Err(failure) => WriteAnswer::Error(failure),
                },
            }
        });
        Ok(futures::future::join_all(writes).await)
    }

    /// `registry.gateway_started`: every connection the gateway's previous process held is
    /// over; its agents go offline and each end is announced before the answer.
    pub async fn gateway_started(
        &self,
        request: GatewayStarted,
    ) -> Result<GatewayStartedAck, ErrorBody> {
        if request.gateway_id.is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "gateway_id must not be empty",
            ));
        }
        let ended = self
            .store
            .end_gateway(&request.gateway_id)
            .await
            .map_err(store_failure)?;
        self.notices.announce_all(&ended, GATEWAY_RESTARTED).await;
        tracing::info!(
            gateway_id = %request.gateway_id,
            ended = ended.len(),
            "gateway started: the connections of its previous process are over"
        );
        Ok(GatewayStartedAck {
            ended: u32::try_from(ended.len()).unwrap_or(u32::MAX),
        })
    }

    /// `registry.get_many`: the agents among the ids that exist (an unknown id is absent),
    /// in one read; more than [`MAX_GET_MANY`] ids is refused.
    pub async fn get_many(&self, request: GetAgents) -> Result<Vec<AgentRecord>, ErrorBody> {
        if request.agent_ids.len() > MAX_GET_MANY {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "agent_ids holds {} ids; at most {MAX_GET_MANY} per request",
                    request.agent_ids.len()
                ),
            ));
        }
        let mut ids = request.agent_ids;
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.store.get_many(&ids).await.map_err(store_failure)
    }

    /// `registry.get`: one agent, `NOT_FOUND` if never registered.
    pub async fn get(&self, request: GetAgent) -> Result<AgentRecord, ErrorBody> {
        self.store
            .get(&request.agent_id)
            .await
            .map_err(store_failure)?
            .ok_or_else(|| not_found(&request.agent_id))
    }

    /// `registry.lookup`: available, live agents with every capability asked for (devices
    /// unless another type is asked for), least loaded first, then most recently seen.
    pub async fn lookup(&self, request: LookupAgents) -> Result<Vec<AgentRecord>, ErrorBody> {
        let query = LookupQuery {
            capabilities: request.capabilities,
            client_type: request.client_type.unwrap_or(ClientType::Device),
            limit: request
                .limit
                .unwrap_or(DEFAULT_LOOKUP_LIMIT)
                .min(MAX_LOOKUP_LIMIT),
            windows: self.windows,
        };
        self.store.lookup(&query).await.map_err(store_failure)
    }
}

impl Registry {
    /// `registry.agents`: seed 004's agent management.
    ///
    /// Register: stores an agent reached at an address, refused (`REGISTRATION_FAILED`,
    /// "Agent with ID X is already registered") when an addressed agent or a WebSocket client
    /// not offline holds the id. Find: the available agents with every capability asked for,
    /// addressed agents (by id) then live devices (least loaded first), at most [`FIND_LIMIT`]
    /// of each; none is refused (`NOT_FOUND`, "No available agents found").
    pub async fn manage(&self, request: ManageAgents) -> Result<AgentActionOutcome, ErrorBody> {
        match request.action {
            AgentAction::Register(registration) => self
                .register_addressed(registration, &request.requested_by)
                .await
                .map(AgentActionOutcome::Registered),
            AgentAction::Find(query) => self.find(query).await.map(AgentActionOutcome::Found),
        }
    }

    async fn register_addressed(
        &self,
        registration: AgentRegistration,
        requested_by: &str,
    ) -> Result<proto_schemas::registry::AddressedAgent, ErrorBody> {
        let invalid = |detail: &str| {
            ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("Invalid registration request: {detail}"),
            )
        };
        if registration.agent_id.trim().is_empty() {
            return Err(invalid("no agent id"));
        }
        if registration.capabilities.is_empty() {
            return Err(invalid("no capabilities"));
        }
        if registration.address.is_empty() {
            return Err(invalid("no address"));
        }
        let stored = self
            .store
            .register_addressed(&registration, requested_by)
            .await
            .map_err(store_failure)?;
        match stored {
            Some(agent) => {
                tracing::info!(
                    agent_id = %agent.agent_id,
                    address = %agent.address,
                    registered_by = %agent.registered_by,
                    "Agent {} registered successfully with capabilities: {}.",
                    agent.agent_id,
                    agent.capabilities.join(", ")
                );
                Ok(agent)
            }
            None => {
                tracing::info!(
                    agent_id = %registration.agent_id,
                    "Error: Agent with ID {} is already registered.",
                    registration.agent_id
                );
                Err(ErrorBody::new(
                    ErrorCode::RegistrationFailed,
                    format!(
                        "Agent with ID {} is already registered",
                        registration.agent_id
                    ),
                ))
            }
        }
    }

    async fn find(&self, query: AgentQuery) -> Result<Vec<FoundAgent>, ErrorBody> {
        if query.capabilities.is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::InvalidRequest,
                "Invalid lookup request: no capabilities",
            ));
        }
        let devices = LookupQuery {
            capabilities: query.capabilities.clone(),
            client_type: ClientType::Device,
            limit: FIND_LIMIT,
            windows: self.windows,
        };
        let (addressed, devices) = tokio::try_join!(
            self.store.find_addressed(&query.capabilities, FIND_LIMIT),
            self.store.lookup(&devices),
        )
        .map_err(store_failure)?;
        let found: Vec<FoundAgent> = addressed
            .into_iter()
            .map(|agent| FoundAgent {
                agent_id: agent.agent_id,
                kind: FoundAgentKind::Addressed,
                capabilities: agent.capabilities,
                address: Some(agent.address),
                status: agent.status,
            })
            .chain(devices.into_iter().map(|device| FoundAgent {
                agent_id: device.agent_id,
                kind: FoundAgentKind::Device,
                capabilities: device.capabilities,
                address: None,
                status: AgentStatus::Available,
            }))
            .collect();
        if found.is_empty() {
            tracing::info!(
                capabilities = ?query.capabilities,
                "No available agents found for the requested capabilities."
            );
            return Err(ErrorBody::new(
                ErrorCode::NotFound,
                "No available agents found",
            ));
        }
        for agent in &found {
            tracing::debug!(
                "Found agent {} with capabilities: {}, address: {}.",
                agent.agent_id,
                agent.capabilities.join(", "),
                agent.address.as_deref().unwrap_or("(through the broker)")
            );
        }
        Ok(found)
    }
}

/// Whether `request` may take its id from `holder`: `Ok(replaced connection)` or the refusal.
///
/// - nobody holds it, or the holder is offline or no longer live (its gateway died or it went
///   silent): replaced; a holder not yet marked offline is named so its gateway closes it;
/// - the same connection registers again (a retried request): accepted, nothing replaced;
/// - a live holder of the same principal: taken over, the old connection is named;
/// - a live holder of another principal: refused with UFO's duplicate text.
pub fn admit(
    request: &RegisterAgent,
    holder: Option<&Holder>,
) -> Result<Option<String>, ErrorBody> {
    let Some(holder) = holder else {
        return Ok(None);
    };
    if holder.connection_id == request.connection_id {
        return Ok(None);
    }
    if holder.status == proto_schemas::registry::AgentStatus::Offline {
        return Ok(None);
    }
    // An authenticated credential may take over its own live registration (a reconnect before
    // the old socket is known dead). Unauthenticated clients prove nothing, so a live id is
    // refused as UFO refuses it.
    let same_owner = holder.principal == request.principal && request.principal != ANONYMOUS;
    if !holder.live || same_owner {
        return Ok(Some(holder.connection_id.clone()));
    }
    Err(duplicate(&request.agent_id))
}

/// The principal of connections to a gateway without credentials.
pub const ANONYMOUS: &str = "anonymous";

/// UFO's refusal of a duplicate live id.
pub fn duplicate(agent_id: &str) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::RegistrationFailed,
        format!(
            "client_id {} is already registered; duplicate registrations are not allowed",
            python_repr(agent_id)
        ),
    )
}

/// The refusal of an unknown id.
pub fn not_found(agent_id: &str) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::NotFound,
        format!("agent '{agent_id}' is not registered"),
    )
}

/// A store failure as the error a caller sees; the details go to the log.
pub fn store_failure(error: StoreError) -> ErrorBody {
    if error.is_unavailable() {
        tracing::warn!("registry store unavailable: {error}");
        ErrorBody::new(
            ErrorCode::Unavailable,
            "the registry's database is unavailable; retry shortly",
        )
    } else {
        tracing::error!("registry store failed: {error}");
        ErrorBody::new(
            ErrorCode::Internal,
            "the registry failed to process the request; see its logs",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::Platform;
    use proto_schemas::registry::AgentStatus;

    fn request(connection: &str, principal: &str) -> RegisterAgent {
        RegisterAgent::device("pc-1", "gw", connection, principal, Platform::Windows)
    }

    fn holder(connection: &str, principal: &str, status: AgentStatus, live: bool) -> Holder {
        Holder {
            connection_id: connection.to_owned(),
            gateway_id: "gw-old".to_owned(),
            principal: principal.to_owned(),
            status,
            live,
        }
    }

    #[test]
    fn admission_rules() {
        let req = request("c2", "alice");
        assert_eq!(admit(&req, None), Ok(None));
        assert_eq!(
            admit(
                &req,
                Some(&holder("c2", "bob", AgentStatus::Available, true))
            ),
            Ok(None),
            "same connection"
        );
        assert_eq!(
            admit(
                &req,
                Some(&holder("c1", "bob", AgentStatus::Offline, false))
            ),
            Ok(None),
            "offline"
        );
        assert_eq!(
            admit(
                &req,
                Some(&holder("c1", "bob", AgentStatus::Available, false))
            ),
            Ok(Some("c1".to_owned())),
            "stale"
        );
        assert_eq!(
            admit(&req, Some(&holder("c1", "alice", AgentStatus::Busy, true))),
            Ok(Some("c1".to_owned())),
            "takeover"
        );
        let refusal = admit(
            &req,
            Some(&holder("c1", "bob", AgentStatus::Available, true)),
        )
        .expect_err("duplicate");
        assert_eq!(refusal.error_code, ErrorCode::RegistrationFailed);
        assert_eq!(
            refusal.detail,
            "client_id 'pc-1' is already registered; duplicate registrations are not allowed"
        );
    }

    #[test]
    fn duplicate_text_quotes_like_python() {
        assert_eq!(
            duplicate("it's").detail,
            "client_id \"it's\" is already registered; duplicate registrations are not allowed"
        );
    }
}
