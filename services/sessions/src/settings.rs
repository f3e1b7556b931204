//! Session service configuration.

use std::net::SocketAddr;

use aip_runtime::service::{
    Common, DEFAULT_DATABASE_URL, DEFAULT_NATS_URL, Exposure, Guard, ServiceName, ServiceSettings,
    StartError,
};
use aip_runtime::telemetry::LogFormat;
use proto_schemas::PlannerName;
use serde::{Deserialize, Serialize};

/// Everything the session service can be told: the settings every service shares (see
/// [`aip_runtime::service`]) at the top, its own in `[sessions]`. Environment:
/// `AIP_SESSIONS__<FIELD>` for the `[sessions]` section, `AIP_<FIELD>` at the top.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// NATS server URL.
    pub nats_url: String,
    /// NATS credentials and TLS beside the URL (`nats_creds_file`, `nats_user`, …, top level).
    #[serde(flatten)]
    pub nats: aip_bus::NatsSettings,
    /// Database URL (`postgres://…`, or `sqlite://…` embedded).
    pub database_url: String,
    /// Subject prefix shared by every service of one deployment.
    pub subject_prefix: String,
    /// `pretty` for a terminal, `json` for a log collector.
    pub log_format: LogFormat,
    /// Threads that run the service's work (`AIP_WORKER_THREADS`); unset: one per CPU the
    /// process may use. See [`aip_runtime::runner`] for when fewer are faster.
    pub worker_threads: Option<usize>,
    /// The `[sessions]` section (`AIP_SESSIONS__…`).
    pub sessions: SessionSettings,
}

/// The `[sessions]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionSettings {
    /// Address of the REST API.
    pub listen: SocketAddr,
    /// Keys accepted on `/api/*` (`X-API-Key` or `Authorization: Bearer`). Empty: no
    /// authentication, allowed only on a loopback address unless `allow_no_auth` is set.
    /// A list, or one comma-separated string in the environment.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub api_keys: Vec<String>,
    /// Serve `/api/*` without keys on a non-loopback address.
    pub allow_no_auth: bool,
    /// Web origins allowed to call the REST API (`*` for any); a browser's request from any
    /// other origin is refused. A list, or one comma-separated string in the environment.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub allowed_origins: Vec<String>,
    /// Tasks one agent runs at once; more wait in priority order.
    pub max_tasks_per_agent: i64,
    /// A task not finished after this long fails with TASK_TIMEOUT (a task may ask for less).
    pub task_timeout_secs: u64,
    /// A command whose results do not arrive within this long fails its task (TASK_TIMEOUT).
    pub command_timeout_secs: u64,
    /// How long the remote planner may take for one step.
    pub planner_timeout_ms: u64,
    /// Timeout of requests to the registry.
    pub request_timeout_ms: u64,
    /// Frames-stream messages processed at once by this replica (a `frames_many` is one).
    pub max_in_flight: usize,
    /// Live (not ended) tasks the leader holds in memory at most; beyond it new tasks are
    /// refused with UNAVAILABLE until some end.
    pub max_live_tasks: usize,
    /// Live tasks one requester id (a constellation, a NATS or REST requester) holds at most;
    /// beyond it its new tasks are refused with RATE_LIMITED. Operator keys are not held to
    /// it; a principal's `max_live_tasks` replaces it for that key.
    pub max_live_tasks_per_requester: usize,
    /// Bytes of the leader's filter of the task ids the database holds ([`crate::known`]): a
    /// new task's id is looked up in the database only when the filter may hold it. Sized for
    /// about 500,000 ids per MiB; past that more ids are looked up. 0 looks up every id.
    pub known_task_ids_bytes: usize,
    /// The highest `priority` a requester may give a task (a higher one is refused with
    /// FORBIDDEN); operator keys may give any, a principal's `max_priority` replaces it.
    pub max_client_priority: i32,
    /// A TOML file of principals: API keys limited to the requesters they act for, the
    /// devices they target, and quotas (see README, "Security"). Its keys are accepted beside
    /// `api_keys`.
    pub principals_file: Option<std::path::PathBuf>,
    /// REST requests that may wait for task events at once (open event streams and
    /// `/commands` waiting for results); one more is refused with RATE_LIMITED.
    pub max_event_watchers: usize,
    /// Changes written in one transaction at most (group commit).
    pub max_batch: usize,
    /// How often a standby replica tries to become the leader.
    pub standby_retry_ms: u64,
    /// How long the leadership lasts unless the leader renews it (PostgreSQL): the longest a
    /// frozen or cut-off leader holds everything up before a standby takes over. The leader
    /// renews at a third of it; at least 1000.
    pub leader_lease_ms: u64,
    /// How long a frame for a client is sent again while no gateway acknowledges writing it;
    /// after that it is dropped (its client is gone, and its connection's end ended its tasks).
    pub outbox_retention_ms: u64,
    /// On SIGTERM, how long to let work in progress finish.
    pub shutdown_grace_ms: u64,
    /// Signs callbacks as Standard Webhooks do: `whsec_` and base64. A list (or one
    /// comma-separated string) signs with each, for key rotation. Empty: callbacks go unsigned.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub callback_secret: Vec<String>,
    /// Allow callback URLs on loopback, private, link-local and other non-public addresses.
    pub callback_allow_private: bool,
    /// Attempts per callback before it is dead-lettered.
    pub callback_max_attempts: u32,
    /// How long one callback attempt may take.
    pub callback_timeout_ms: u64,
    /// The wait before the second attempt; it doubles each time (with jitter).
    pub callback_backoff_ms: u64,
    /// The longest wait between two attempts (also the cap on a receiver's `Retry-After`).
    pub callback_max_backoff_ms: u64,
    /// How long a question waits for its answer at most (and by default): unanswered, the
    /// task fails with TASK_TIMEOUT.
    pub clarification_timeout_secs: u64,
    /// Handoffs per task at most (a bound on loops).
    pub max_handoffs: u32,
    /// Who plans tasks without steps (`[sessions.planner]`, `AIP_SESSIONS__PLANNER__…`).
    pub planner: PlannerSettings,
    /// The built-in tool-calling agent (`[sessions.llm]`, `AIP_SESSIONS__LLM__…`).
    pub llm: LlmSettings,
}

/// The `[sessions.planner]` section: the planner of a task that carries no steps and names none.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerSettings {
    /// `nats`, `http` or `llm`. Absent: `http` when `url` is set, else `llm` when a model
    /// endpoint is configured, else `nats`.
    pub default: Option<PlannerName>,
    /// The HTTP planner: each PlanRequest is POSTed here and the answer is a PlanReply.
    pub url: Option<String>,
    /// Signs the HTTP planner's requests as Standard Webhooks do (`webhook-id`,
    /// `webhook-timestamp`, `webhook-signature`): `whsec_` and base64.
    pub secret: Option<String>,
    /// Attempts per step at the HTTP planner (a connection error, 429 or 5xx is tried again,
    /// waiting longer each time), at least 1.
    pub attempts: u32,
}

/// The `[sessions.llm]` section: an OpenAI-compatible chat-completions endpoint (OpenAI, Azure
/// OpenAI, vLLM, Ollama, LM Studio). `OPENAI_BASE_URL` and `OPENAI_API_KEY` are read when
/// `base_url` and `api_key` are not set here.
#[derive(Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LlmSettings {
    /// e.g. `https://api.openai.com/v1`, `http://127.0.0.1:11434/v1`; `/chat/completions` is
    /// appended.
    pub base_url: Option<String>,
    /// Sent as `Authorization: Bearer`; never logged.
    pub api_key: Option<String>,
    /// The model name the endpoint knows.
    pub model: String,
    /// Model calls per task at most; one more fails the task.
    pub max_steps: u32,
    /// Tokens (prompt and completion, as the endpoint counts them) per task at most.
    pub max_tokens: u64,
    /// How long one model call may take.
    pub timeout_ms: u64,
    /// A tool's result longer than this (characters of its JSON) is cut before the model
    /// sees it.
    pub max_result_chars: usize,
    /// Replaces the built-in system prompt.
    pub system_prompt: Option<String>,
}

impl Default for LlmSettings {
    fn default() -> Self {
        LlmSettings {
            base_url: None,
            api_key: None,
            model: "gpt-4o-mini".to_owned(),
            max_steps: 20,
            max_tokens: 200_000,
            timeout_ms: 120_000,
            max_result_chars: 20_000,
            system_prompt: None,
        }
    }
}

impl std::fmt::Debug for LlmSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmSettings")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("model", &self.model)
            .field("max_steps", &self.max_steps)
            .field("max_tokens", &self.max_tokens)
            .field("timeout_ms", &self.timeout_ms)
            .field("max_result_chars", &self.max_result_chars)
            .finish_non_exhaustive()
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            nats_url: DEFAULT_NATS_URL.to_owned(),
            nats: aip_bus::NatsSettings::default(),
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            subject_prefix: proto_schemas::subjects::DEFAULT_PREFIX.to_owned(),
            log_format: LogFormat::Pretty,
            worker_threads: None,
            sessions: SessionSettings::default(),
        }
    }
}

impl Default for SessionSettings {
    fn default() -> Self {
        SessionSettings {
            listen: SocketAddr::from(([127, 0, 0, 1], 5002)),
            api_keys: Vec::new(),
            allow_no_auth: false,
            allowed_origins: Vec::new(),
            max_tasks_per_agent: 1,
            task_timeout_secs: 3600,
            command_timeout_secs: 600,
            planner_timeout_ms: 30_000,
            request_timeout_ms: 5_000,
            max_in_flight: 1024,
            max_live_tasks: 100_000,
            max_live_tasks_per_requester: 1_000,
            known_task_ids_bytes: 4 << 20,
            max_client_priority: 0,
            principals_file: None,
            max_event_watchers: 10_000,
            max_batch: 2_000,
            standby_retry_ms: 1_000,
            leader_lease_ms: 5_000,
            outbox_retention_ms: 120_000,
            shutdown_grace_ms: 10_000,
            callback_secret: Vec::new(),
            callback_allow_private: false,
            callback_max_attempts: 8,
            callback_timeout_ms: 10_000,
            callback_backoff_ms: 1_000,
            callback_max_backoff_ms: 600_000,
            clarification_timeout_secs: 3_600,
            max_handoffs: 5,
            planner: PlannerSettings {
                attempts: 3,
                ..PlannerSettings::default()
            },
            llm: LlmSettings::default(),
        }
    }
}

impl SessionSettings {
    /// The longest a planner may take for one step, retries included: a request older than
    /// this (and a margin) was lost, and the step is asked for again.
    pub fn planning_window_ms(&self, planner: PlannerName) -> u64 {
        let attempts = u64::from(self.planner.attempts.max(1));
        let backoff = attempts
            * u64::try_from(crate::planners::http::MAX_RETRY_DELAY.as_millis()).unwrap_or(0);
        match planner {
            PlannerName::Nats => self.planner_timeout_ms,
            PlannerName::Http => self.planner_timeout_ms * attempts + backoff,
            PlannerName::Llm => self.llm.timeout_ms * attempts + backoff,
        }
    }
}

/// Below this, a leader busy with one large group commit could lose its lease.
const MIN_LEADER_LEASE_MS: u64 = 1_000;

impl ServiceSettings for Settings {
    const SERVICE: ServiceName = ServiceName::Sessions;
    const GUARD: Guard = Guard::ApiKeys;
    const VARIABLES: &'static [(&'static str, &'static str)] = &[
        (
            "OPENAI_API_KEY",
            "the built-in agent's key unless sessions.llm.api_key is set",
        ),
        (
            "OPENAI_BASE_URL",
            "the built-in agent's endpoint unless sessions.llm.base_url is set",
        ),
    ];

    fn common(&self) -> Common<'_> {
        Common {
            nats_url: &self.nats_url,
            nats: &self.nats,
            database_url: Some(&self.database_url),
            subject_prefix: &self.subject_prefix,
            log_format: self.log_format,
            worker_threads: self.worker_threads,
        }
    }

    fn exposure(&self) -> Exposure {
        Exposure {
            listen: self.sessions.listen,
            secured: !self.sessions.api_keys.is_empty() || self.sessions.principals_file.is_some(),
            allow_no_auth: self.sessions.allow_no_auth,
        }
    }

    fn check_own(&self) -> Result<(), StartError> {
        if self.sessions.max_tasks_per_agent < 1 {
            return Err(StartError::invalid(
                ServiceName::Sessions,
                "max_tasks_per_agent must be at least 1",
            ));
        }
        if self.sessions.leader_lease_ms < MIN_LEADER_LEASE_MS {
            return Err(StartError::invalid(
                ServiceName::Sessions,
                format!("leader_lease_ms must be at least {MIN_LEADER_LEASE_MS}"),
            ));
        }
        if self.sessions.max_event_watchers < 1 {
            return Err(StartError::invalid(
                ServiceName::Sessions,
                "max_event_watchers must be at least 1",
            ));
        }
        if self.sessions.max_live_tasks_per_requester < 1 {
            return Err(StartError::invalid(
                ServiceName::Sessions,
                "max_live_tasks_per_requester must be at least 1",
            ));
        }
        self.sessions.api_keys()?;
        crate::planners::Planners::check(&self.sessions, &|name| std::env::var(name).ok())
            .map_err(|e| StartError::invalid(ServiceName::Sessions, e))?;
        crate::callbacks::Callbacks::new(&self.sessions)
            .map_err(|e| StartError::invalid(ServiceName::Sessions, e))?;
        Ok(())
    }
}

impl SessionSettings {
    /// The keys accepted on `/api/*`: `api_keys` (operators) and the principals file's.
    pub fn api_keys(&self) -> Result<aip_runtime::api_keys::ApiKeys, StartError> {
        aip_runtime::api_keys::ApiKeys::load(&self.api_keys, self.principals_file.as_deref())
            .map_err(|e| StartError::invalid(ServiceName::Sessions, e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_variables_keep_their_names() {
        let environment = [
            ("AIP_DATABASE_URL", "sqlite://x.db"),
            ("AIP_SESSIONS__LISTEN", "0.0.0.0:6002"),
            ("AIP_SESSIONS__API_KEYS", "k1"),
            ("AIP_SESSIONS__MAX_TASKS_PER_AGENT", "3"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let s: Settings =
            aip_runtime::settings::load_from(None, environment.into()).expect("loads");
        assert_eq!(s.database_url, "sqlite://x.db");
        assert_eq!(s.sessions.listen, "0.0.0.0:6002".parse().expect("addr"));
        assert_eq!(s.sessions.api_keys, ["k1"]);
        assert_eq!(s.sessions.max_tasks_per_agent, 3);
        s.validate().expect("keys on the network");
    }

    #[test]
    fn an_open_api_on_the_network_is_refused() {
        let mut s = Settings::default();
        s.sessions.listen = "0.0.0.0:5002".parse().expect("addr");
        let err = s.validate().expect_err("no keys on 0.0.0.0");
        assert!(err.to_string().contains("AIP_SESSIONS__API_KEYS"), "{err}");
        s.sessions.allow_no_auth = true;
        s.validate().expect("explicitly allowed");
    }
}
