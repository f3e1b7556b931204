//! The agent registry's request/reply subjects, as a typed client.
//!
//! The gateway (register, unregister, device information) and the session service (a task's
//! target, agents by capability) both ask the registry over the bus. This client is the one
//! place that encodes those requests, sends them with a timeout, tells "no registry running"
//! from "no answer in time", and decodes the `{"ok": …}` / `{"error": …}` reply.

use std::time::Duration;

use proto_schemas::registry::{
    AgentRecord, GatewayStarted, GatewayStartedAck, GetAgent, GetAgents, LookupAgents,
    RegisterAgent, Registered, RegistryWrites, Reply, UnregisterAgent, Unregistered, WriteAnswer,
};
use proto_schemas::{ErrorBody, ErrorCode, Subjects, V1};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::{BusError, Headers, SharedBus};

/// Why a registry request gave no answer to act on.
///
/// The texts are what clients are shown (ERROR frames, task refusals).
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Nobody listens on the subject: the registry is down or not started yet.
    #[error("the agent registry is not running: try again later")]
    NotRunning,
    /// The request went out but no reply came (timeout), or the bus failed to send it.
    #[error("the agent registry did not answer: {0}")]
    Unanswered(#[source] BusError),
    /// The reply is not the JSON the subject promises: a registry of another version.
    #[error("invalid reply from a service: {0}")]
    InvalidReply(#[source] serde_json::Error),
    /// The request could not be encoded (a bug: request types are plain data).
    #[error("internal error: {0}")]
    Encode(#[source] serde_json::Error),
    /// The registry answered with an error (unknown agent, identity taken, bad request).
    #[error("{}", .0.detail)]
    Refused(ErrorBody),
    /// The request carrying this one with others (`registry.write`) failed so.
    #[error("{0}")]
    Gathered(std::sync::Arc<RegistryError>),
}

impl RegistryError {
    /// The code for an ERROR frame or an error body: the registry's own for a refusal.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            RegistryError::NotRunning | RegistryError::Unanswered(_) => ErrorCode::Unavailable,
            RegistryError::InvalidReply(_) | RegistryError::Encode(_) => ErrorCode::Internal,
            RegistryError::Refused(body) => body.error_code,
            RegistryError::Gathered(error) => error.error_code(),
        }
    }

    /// The error as a body: the registry's own body for a refusal, else code and text.
    pub fn into_error_body(self) -> ErrorBody {
        match self {
            RegistryError::Refused(body) => body,
            RegistryError::Gathered(error) => match &*error {
                RegistryError::Refused(body) => body.clone(),
                other => ErrorBody::new(other.error_code(), other.to_string()),
            },
            other => ErrorBody::new(other.error_code(), other.to_string()),
        }
    }
}

/// Requests to the agent registry over the bus.
#[derive(Clone)]
pub struct RegistryClient {
    bus: SharedBus,
    subjects: Subjects,
    /// How long to wait for each reply; the registry answers from memory or one database
    /// write, so a missing reply means it is overloaded or stuck.
    timeout: Duration,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient")
            .field("subjects", &self.subjects)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RegistryClient {
    /// A client for the registry serving `subjects`' prefix.
    pub fn new(bus: SharedBus, subjects: Subjects, timeout: Duration) -> Self {
        RegistryClient {
            bus,
            subjects,
            timeout,
        }
    }

    /// `registry.register`: records a client that sent a valid REGISTER.
    pub async fn register(&self, request: &RegisterAgent) -> Result<Registered, RegistryError> {
        self.request(self.subjects.registry_register(), request)
            .await
    }

    /// `registry.unregister`: a connection ended.
    pub async fn unregister(
        &self,
        request: &UnregisterAgent,
    ) -> Result<Unregistered, RegistryError> {
        self.request(self.subjects.registry_unregister(), request)
            .await
    }

    /// `registry.write`: several registrations and unregistrations in one request, answered
    /// in their order (at most [`proto_schemas::registry::MAX_WRITES`]).
    pub async fn write(&self, request: &RegistryWrites) -> Result<Vec<WriteAnswer>, RegistryError> {
        self.request(self.subjects.registry_write(), request).await
    }

    /// `registry.gateway_started`: the connections a previous process of `gateway_id` held
    /// are over.
    pub async fn gateway_started(
        &self,
        gateway_id: &str,
    ) -> Result<GatewayStartedAck, RegistryError> {
        let request = GatewayStarted {
            version: V1,
            gateway_id: gateway_id.to_owned(),
        };
        self.request(self.subjects.registry_gateway_started(), &request)
            .await
    }

    /// `registry.get`: one agent by id (refused with `NOT_FOUND` for an unknown id).
    pub async fn get(&self, agent_id: &str) -> Result<AgentRecord, RegistryError> {
        let request = GetAgent {
            version: V1,
            agent_id: agent_id.to_owned(),
        };
        self.request(self.subjects.registry_get(), &request).await
    }

    /// `registry.get_many`: the agents among `agent_ids` that exist (at most
    /// [`proto_schemas::registry::MAX_GET_MANY`] ids), in no particular order.
    pub async fn get_many(&self, agent_ids: &[String]) -> Result<Vec<AgentRecord>, RegistryError> {
        let request = GetAgents {
            version: V1,
            agent_ids: agent_ids.to_vec(),
        };
        self.request(self.subjects.registry_get_many(), &request)
            .await
    }

    /// `registry.lookup`: available, live agents with the capabilities, least loaded first.
    pub async fn lookup(&self, request: &LookupAgents) -> Result<Vec<AgentRecord>, RegistryError> {
        self.request(self.subjects.registry_lookup(), request).await
    }

    /// `registry.agents`: seed 004's agent management (register an agent reached at an
    /// address, or find available agents); a domain refusal (a taken id, nothing found, an
    /// invalid request) is [`RegistryError::Refused`] with its code.
    pub async fn manage(
        &self,
        request: &proto_schemas::registry::ManageAgents,
    ) -> Result<proto_schemas::registry::AgentActionOutcome, RegistryError> {
        self.request(self.subjects.registry_agents(), request).await
    }

    async fn request<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
    ) -> Result<Rep, RegistryError> {
        let payload = serde_json::to_vec(body).map_err(|e| {
            tracing::error!(%subject, "registry request not serialisable: {e}");
            RegistryError::Encode(e)
        })?;
        let span = crate::trace::messaging_span(
            crate::trace::Operation::Request,
            &subject,
            &subject,
            None,
        );
        // Called inside the span, so the request carries the span's context.
        let request = async {
            self.bus
                .request(subject, Headers::new(), payload.into(), self.timeout)
                .await
        };
        let reply = request.instrument(span).await.map_err(|e| match e {
            BusError::NoResponders { .. } => RegistryError::NotRunning,
            other => RegistryError::Unanswered(other),
        })?;
        let reply: Reply<Rep> =
            serde_json::from_slice(&reply.payload).map_err(RegistryError::InvalidReply)?;
        reply.into_result().map_err(RegistryError::Refused)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::StreamExt;

    use super::*;
    use crate::{Bus, LocalBus, respond};

    const PREFIX: &str = "test";

    fn client(bus: &Arc<LocalBus>, timeout: Duration) -> RegistryClient {
        let subjects = Subjects::new(PREFIX).expect("valid prefix");
        RegistryClient::new(bus.clone(), subjects, timeout)
    }

    /// Answers the next request on `registry.get` with `payload`.
    async fn answer_once(bus: &Arc<LocalBus>, payload: &'static [u8]) {
        let subjects = Subjects::new(PREFIX).expect("valid prefix");
        let mut requests = bus
            .subscribe(subjects.registry_get())
            .await
            .expect("subscribed");
        let responder = bus.clone();
        tokio::spawn(async move {
            if let Some(request) = requests.next().await {
                respond(responder.as_ref(), &request, Headers::new(), payload.into())
                    .await
                    .expect("answered");
            }
        });
    }

    #[tokio::test]
    async fn no_registry_is_not_running() {
        let bus = Arc::new(LocalBus::new());
        let error = client(&bus, Duration::from_secs(1))
            .get("pc-1")
            .await
            .expect_err("nobody answers");
        assert!(matches!(error, RegistryError::NotRunning), "{error:?}");
        assert_eq!(error.error_code(), ErrorCode::Unavailable);
    }

    #[tokio::test]
    async fn a_silent_registry_is_unanswered() {
        let bus = Arc::new(LocalBus::new());
        let subjects = Subjects::new(PREFIX).expect("valid prefix");
        let _silent = bus
            .subscribe(subjects.registry_get())
            .await
            .expect("subscribed");
        let error = client(&bus, Duration::from_millis(50))
            .get("pc-1")
            .await
            .expect_err("no reply");
        assert!(
            matches!(error, RegistryError::Unanswered(BusError::Timeout { .. })),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn a_refusal_keeps_the_registrys_body() {
        let bus = Arc::new(LocalBus::new());
        answer_once(
            &bus,
            br#"{"error":{"detail":"no agent pc-1","error_code":"NOT_FOUND"}}"#,
        )
        .await;
        let error = client(&bus, Duration::from_secs(1))
            .get("pc-1")
            .await
            .expect_err("refused");
        assert_eq!(error.to_string(), "no agent pc-1");
        assert_eq!(
            error.into_error_body(),
            ErrorBody::new(ErrorCode::NotFound, "no agent pc-1")
        );
    }

    #[tokio::test]
    async fn a_reply_of_the_wrong_shape_is_invalid() {
        let bus = Arc::new(LocalBus::new());
        answer_once(&bus, br#"{"ok":"not an agent"}"#).await;
        let error = client(&bus, Duration::from_secs(1))
            .get("pc-1")
            .await
            .expect_err("invalid");
        assert!(matches!(error, RegistryError::InvalidReply(_)), "{error:?}");
        assert_eq!(error.error_code(), ErrorCode::Internal);
    }
}
