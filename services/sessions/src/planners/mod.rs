//! Planners: who decides the next step of a task that carries no steps of its own.
//!
//! A task names its planner (`planner` on a TaskRequest, a dispatch or a `task` frame's
//! `metadata`) or gets the configured default. Every planner answers the same question, a
//! [`PlanRequest`], with the same [`PlanStep`]:
//! - `nats`: a process answering `planner.next` (request/reply);
//! - `http`: a URL the leader POSTs the request to ([`http`]), signed as Standard Webhooks do;
//! - `llm`: the built-in tool-calling agent on an OpenAI-compatible endpoint ([`llm`]).
//!
//! The leader sends each step to [`run_planner`] after the batch that asked for it commits;
//! the answer comes back as an op, with what the planner wants kept in the task's event log.

pub mod http;
pub mod llm;

use std::sync::Arc;
use std::time::Duration;

use aip_bus::Headers;
use proto_schemas::registry::Reply;
use proto_schemas::sessions::{PlanRequest, PlanStep};
use proto_schemas::{ErrorBody, ErrorCode, PlannerName};
use serde_json::Value;
use tokio::sync::{Semaphore, mpsc};

use crate::engine::{Engine, Op, Placement};
use crate::settings::SessionSettings;
use proto_schemas::registry::AgentRecord;

/// One step to plan, and who plans it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanJob {
    pub planner: PlannerName,
    pub request: PlanRequest,
}

/// A planner's answer for one step.
#[derive(Debug)]
pub struct Planned {
    /// What to do next.
    pub decision: Result<PlanStep, PlannerError>,
    /// Kept in the task's event log as a `planned` event (the agent's conversation turn).
    pub note: Option<Value>,
    /// For a handoff decision: the agents the registry offered.
    pub handoff_candidates: Option<Result<Vec<AgentRecord>, ErrorBody>>,
}

impl Planned {
    fn bare(decision: Result<PlanStep, PlannerError>) -> Self {
        Planned {
            decision,
            note: None,
            handoff_candidates: None,
        }
    }
}

/// Why a planner gave no step. The task fails with [`PlannerError::code`].
#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    /// Nobody listens on the planner subject.
    #[error(
        "no planner is running on `{subject}`: start a remote planner, or give the task its steps \
         (metadata.steps over WebSocket, `steps` over REST), or name another planner"
    )]
    NoPlanner {
        /// The subject asked.
        subject: String,
    },
    /// The task names a planner this service has no settings for.
    #[error("{0}")]
    NotConfigured(String),
    /// The planner answered with an error.
    #[error("the planner refused: {}", .0.detail)]
    Refused(ErrorBody),
    /// The planner's answer could not be read.
    #[error("the planner's answer is not a PlanReply: {0}")]
    BadReply(String),
    /// The request failed or timed out.
    #[error("the planner did not answer: {0}")]
    NoAnswer(String),
    /// The request could not be encoded.
    #[error("the planning request could not be encoded: {0}")]
    Encode(serde_json::Error),
    /// The model endpoint failed or could not be reached.
    #[error("the model endpoint failed: {0}")]
    Model(String),
    /// The model asked for something the agent cannot do (an unknown tool, arguments that are
    /// not a JSON object, neither a tool call nor an answer).
    #[error("the model broke the tool protocol: {0}")]
    BadToolCall(String),
    /// A per-task bound of the agent was reached.
    #[error("the agent reached its bound: {0}")]
    Bound(String),
    /// The task's own records could not be read.
    #[error("the task's planning record could not be read: {0}")]
    Store(String),
}

impl PlannerError {
    /// The code the task fails with.
    pub fn code(&self) -> ErrorCode {
        match self {
            PlannerError::NoPlanner { .. }
            | PlannerError::NotConfigured(_)
            | PlannerError::Model(_)
            | PlannerError::Store(_) => ErrorCode::Unavailable,
            PlannerError::Encode(_) => ErrorCode::Internal,
            PlannerError::BadToolCall(_) => ErrorCode::ProtocolError,
            PlannerError::Bound(_) => ErrorCode::TaskTimeout,
            PlannerError::Refused(_) | PlannerError::BadReply(_) | PlannerError::NoAnswer(_) => {
                ErrorCode::CommandFailed
            }
        }
    }
}

/// The planners this service can reach, from its settings.
pub struct Planners {
    default: PlannerName,
    http: Option<http::HttpPlanner>,
    llm: Option<llm::LlmPlanner>,
    nats_timeout: Duration,
}

impl Planners {
    /// Reads the settings, and `OPENAI_BASE_URL` / `OPENAI_API_KEY` through `env` for what
    /// `[sessions.llm]` leaves unset.
    pub fn new(
        settings: &SessionSettings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        // The HTTP clients below need rustls' provider, whoever embeds this service.
        aip_runtime::install_crypto_provider();
        let http = match &settings.planner.url {
            Some(url) => Some(http::HttpPlanner::new(
                url,
                settings.planner.secret.as_deref(),
                Duration::from_millis(settings.planner_timeout_ms),
                settings.planner.attempts,
            )?),
            None if settings.planner.secret.is_some() => {
                return Err("[sessions.planner] secret is set without a url".into());
            }
            None => None,
        };
        let llm = llm::LlmPlanner::from_settings(&settings.llm, settings.planner.attempts, env)?;
        let default = match settings.planner.default {
            Some(name) => name,
            None if http.is_some() => PlannerName::Http,
            None if llm.is_some() => PlannerName::Llm,
            None => PlannerName::Nats,
        };
        let planners = Planners {
            default,
            http,
            llm,
            nats_timeout: Duration::from_millis(settings.planner_timeout_ms),
        };
        if let Err(e) = planners.choose(Some(default)) {
            return Err(format!("the default planner is not usable: {}", e.detail));
        }
        Ok(planners)
    }

    /// As [`Planners::new`], for checking settings at start-up.
    pub fn check(
        settings: &SessionSettings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), String> {
        Self::new(settings, env).map(|_| ())
    }

    /// The planner used when a task names none.
    pub fn default_planner(&self) -> PlannerName {
        self.default
    }

    /// The default planner and where it is, in words (never a key).
    pub fn describe(&self) -> String {
        match (self.default, &self.http, &self.llm) {
            (PlannerName::Http, Some(http), _) => format!("http, {}", http.url()),
            (PlannerName::Llm, _, Some(llm)) => format!("llm, {}", llm.describe()),
            (name, ..) => format!("{name}, a planner process answering `planner.next`"),
        }
    }

    /// The planner of a new task: the one it names if this service can reach it, else the
    /// default.
    pub fn choose(&self, requested: Option<PlannerName>) -> Result<PlannerName, ErrorBody> {
        let name = requested.unwrap_or(self.default);
        let missing = match name {
            PlannerName::Nats => None,
            PlannerName::Http if self.http.is_none() => Some(
                "the `http` planner is not configured on this broker: set \
                 AIP_SESSIONS__PLANNER__URL (aip dev: --planner-url)",
            ),
            PlannerName::Llm if self.llm.is_none() => Some(
                "the `llm` planner is not configured on this broker: set OPENAI_BASE_URL or \
                 AIP_SESSIONS__LLM__BASE_URL (aip dev: --llm-base-url)",
            ),
            PlannerName::Http | PlannerName::Llm => None,
        };
        // Like an agent that is not there: which planners exist is the deployment's choice.
        match missing {
            Some(why) => Err(ErrorBody::new(ErrorCode::NotFound, why)),
            None => Ok(name),
        }
    }

    /// Asks `job`'s planner for its step.
    async fn ask(&self, engine: &Engine, job: &PlanJob) -> Planned {
        match job.planner {
            PlannerName::Nats => Planned::bare(self.ask_nats(engine, &job.request).await),
            PlannerName::Http => match &self.http {
                Some(http) => Planned::bare(http.ask(&job.request).await),
                None => Planned::bare(Err(not_configured(PlannerName::Http))),
            },
            PlannerName::Llm => match &self.llm {
                Some(llm) => llm.ask(engine, &job.request).await,
                None => Planned::bare(Err(not_configured(PlannerName::Llm))),
            },
        }
    }

    async fn ask_nats(
        &self,
        engine: &Engine,
        request: &PlanRequest,
    ) -> Result<PlanStep, PlannerError> {
        let subject = engine.subjects().planner_next();
        let payload = serde_json::to_vec(request).map_err(PlannerError::Encode)?;
        match engine
            .bus()
            .request(
                subject.clone(),
                Headers::new(),
                payload.into(),
                self.nats_timeout,
            )
            .await
        {
            Ok(reply) => serde_json::from_slice::<Reply<PlanStep>>(&reply.payload)
                .map_err(|e| PlannerError::BadReply(e.to_string()))?
                .into_result()
                .map_err(PlannerError::Refused),
            Err(aip_bus::BusError::NoResponders { .. }) => Err(PlannerError::NoPlanner { subject }),
            Err(e) => Err(PlannerError::NoAnswer(e.to_string())),
        }
    }
}

/// A task stored with a planner that this replica has no settings for (another replica's
/// configuration, or settings changed since).
fn not_configured(name: PlannerName) -> PlannerError {
    PlannerError::NotConfigured(format!(
        "the task's planner `{name}` is not configured on this replica"
    ))
}

/// Asks each job's planner, at most `concurrency` at once, and hands the answers to the
/// applier.
pub async fn run_planner(
    engine: Engine,
    planners: Arc<Planners>,
    mut jobs: mpsc::Receiver<PlanJob>,
    concurrency: usize,
) {
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    while let Some(job) = jobs.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let engine = engine.clone();
        let planners = planners.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let mut planned = planners.ask(&engine, &job).await;
            let outcome = match &planned.decision {
                Ok(_) => "answered",
                Err(_) => "failed",
            };
            metrics::counter!("aip_sessions_planner_requests_total", "planner" => job.planner.as_str(), "outcome" => outcome)
                .increment(1);
            metrics::histogram!("aip_sessions_planner_request_seconds", "planner" => job.planner.as_str())
                .record(started.elapsed().as_secs_f64());
            if let Ok(PlanStep::Handoff {
                target_id,
                required_capabilities,
                ..
            }) = &planned.decision
            {
                let to = match target_id {
                    Some(target) => Placement::Target(target.clone()),
                    None => Placement::Capabilities(required_capabilities.clone()),
                };
                planned.handoff_candidates = Some(engine.handoff_candidates(&to).await);
            }
            let step = i32::try_from(job.request.step).unwrap_or(i32::MAX);
            engine
                .send_op(Op::Planned {
                    task_id: job.request.task_id,
                    step,
                    planned,
                })
                .await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> SessionSettings {
        SessionSettings::default()
    }

    #[test]
    fn the_default_follows_what_is_configured() {
        let none = |_: &str| None;
        assert_eq!(
            Planners::new(&settings(), &none)
                .expect("ok")
                .default_planner(),
            PlannerName::Nats
        );
        let openai = |name: &str| (name == "OPENAI_API_KEY").then(|| "sk-x".to_owned());
        let planners = Planners::new(&settings(), &openai).expect("ok");
        assert_eq!(planners.default_planner(), PlannerName::Llm);
        assert!(
            planners
                .describe()
                .contains("https://api.openai.com/v1/chat/completions"),
            "{}",
            planners.describe()
        );
        assert!(
            !planners.describe().contains("sk-x"),
            "the key is never shown"
        );
        let mut with_url = settings();
        with_url.planner.url = Some("http://127.0.0.1:9/plan".into());
        assert_eq!(
            Planners::new(&with_url, &openai)
                .expect("ok")
                .default_planner(),
            PlannerName::Http,
            "a planner URL is the default before the model"
        );
        with_url.planner.default = Some(PlannerName::Nats);
        assert_eq!(
            Planners::new(&with_url, &openai)
                .expect("ok")
                .default_planner(),
            PlannerName::Nats,
            "an explicit default wins"
        );
    }

    #[test]
    fn unusable_settings_are_refused_at_start() {
        let none = |_: &str| None;
        let mut s = settings();
        s.planner.default = Some(PlannerName::Llm);
        let e = Planners::new(&s, &none).err().expect("no endpoint");
        assert!(e.contains("OPENAI_BASE_URL"), "{e}");
        let mut s = settings();
        s.planner.url = Some("ftp://x".into());
        assert!(Planners::new(&s, &none).is_err());
        let mut s = settings();
        s.planner.url = Some("http://127.0.0.1:9/".into());
        s.planner.secret = Some("not base64!".into());
        assert!(Planners::new(&s, &none).is_err());
        let mut s = settings();
        s.planner.secret = Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
        assert!(Planners::new(&s, &none).is_err(), "a secret without a URL");
        let mut s = settings();
        s.llm.base_url = Some("http://127.0.0.1:11434/v1".into());
        s.llm.model = " ".into();
        assert!(Planners::new(&s, &none).is_err(), "no model");
    }

    #[test]
    fn a_named_planner_must_be_configured() {
        let planners = Planners::new(&settings(), &|_| None).expect("ok");
        assert_eq!(planners.choose(None), Ok(PlannerName::Nats));
        let refusal = planners
            .choose(Some(PlannerName::Http))
            .expect_err("no URL");
        assert_eq!(refusal.error_code, ErrorCode::NotFound);
    }
}
