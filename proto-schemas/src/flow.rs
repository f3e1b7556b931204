//! The flow messages of seed 004, as versioned subject payloads.
//!
//! These move tasks, handoffs, clarifications and callbacks between services and to agents
//! that talk to the broker over NATS or REST instead of a WebSocket.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::enums::PlannerName;
use crate::error::{ErrorBody, ErrorCode};
use crate::frames::Command;
use crate::registry::{
    AgentAction, AgentActionOutcome, AgentQuery, AgentRegistration, AgentStatus,
};
use crate::sessions::{TaskAccepted, TaskState};
use crate::version::V1;

/// Ask for work to be done (REST `POST /api/tasks`, NATS submit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct TaskRequest {
    /// Always 1.
    pub version: V1,
    /// The task's id; chosen by the broker when absent.
    // 256 is `MAX_ID_BYTES`, which counts UTF-8 bytes; the REST document can count characters.
    #[schema(min_length = 1, max_length = 256)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// What to do, in words (sent to a UFO device as the task's request).
    // Not blank: at least one character that `str::trim` keeps.
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    pub description: String,
    /// Structured input for the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Who asks (an agent id, or a REST caller's name).
    pub originating_agent_id: String,
    /// Where to POST the outcome (validated, signed, retried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
    /// Or send the CallbackNotifications to this agent as `callback` frames (it must have
    /// announced the `callback` extension); kept until it connects. Not with `callback_url`.
    #[schema(min_length = 1, max_length = 256)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_agent: Option<String>,
    /// Besides the end (always) and a question (always), the states whose entry is also
    /// POSTed to `callback_url` (e.g. `dispatched`, `working`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub callback_on: Vec<TaskState>,
    /// Higher runs first when an agent is busy (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Run on this agent (must be online).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Otherwise, run on an available agent with all of these.
    #[serde(default)]
    pub required_capabilities: Vec<String>,
    /// A name for the task (`[A-Za-z0-9._-]`, not starting with `.`); UFO's result lookup uses it.
    #[schema(pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]*$")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_name: Option<String>,
    /// Scripted planner: the command rounds to send, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<Vec<Command>>>,
    /// The requester drives the task itself (no planner): it sends commands with
    /// `POST /api/tasks/{id}/commands` and ends the task with `POST /api/tasks/{id}/complete`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub driver: bool,
    /// Who plans a task without `steps` (default: the session service's configured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerName>,
    /// Fail with TASK_TIMEOUT after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// The status of a [`TaskResponse`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TaskResponseStatus {
    /// Done.
    Success,
    /// Ended badly.
    Failed,
    /// Still running.
    InProgress,
}

/// The outcome (or progress) of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct TaskResponse {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The result data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Where the task stands.
    pub status: TaskResponseStatus,
    /// The agent that did (or does) the work.
    pub agent_id: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A task moved from one agent to another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HandoffNotification {
    /// Always 1.
    pub version: V1,
    /// The task (its id does not change).
    pub task_id: String,
    /// The agent giving it up.
    pub current_agent_id: String,
    /// The agent taking it.
    pub new_agent_id: String,
    /// Why.
    pub reason: String,
}

/// Hand a task to another agent: by id, or any available agent with the capabilities
/// (NATS `sessions.handoff`; REST `POST /api/tasks/{id}/handoff` takes the same fields but
/// `task_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct HandoffRequest {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The agent to take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Otherwise, an available agent with all of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_capabilities: Vec<String>,
    /// Why.
    pub reason: String,
    /// Who asks.
    pub requested_by: String,
}

/// The executor needs an answer before it can go on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct ClarificationRequest {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// Identifies this question; the answer names it.
    pub clarification_id: String,
    /// The question.
    pub question: String,
    /// Structured detail of what is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The agent asking.
    pub requested_by: String,
    /// When the task fails unless the question is answered (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

/// The answer to a [`ClarificationRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct ClarificationResponse {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The question answered.
    pub clarification_id: String,
    /// The answer.
    pub answer: String,
    /// Structured additional information.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Who answered.
    pub provided_by: String,
}

/// The status of a [`CallbackNotification`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallbackStatus {
    /// The task completed.
    Complete,
    /// The task failed (or was cancelled, rejected, timed out).
    Failed,
    /// A progress update.
    InProgress,
}

/// What is delivered to a task's callback URL or originating agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallbackNotification {
    /// Always 1.
    pub version: V1,
    /// The task.
    pub task_id: String,
    /// The result data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Where the task stands.
    pub status: CallbackStatus,
    /// The callback URL or agent id it goes to.
    pub sent_to: String,
    /// The task's state (`completed`, `failed`, `canceled`, `rejected`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The open question, when the task waits for an answer (`input_required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clarification: Option<ClarificationRequest>,
}

/// An error about a task (or none), from any party.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorMessage {
    /// Always 1.
    pub version: V1,
    /// The task, if the error is about one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// What went wrong.
    pub error: String,
    /// The machine-readable code.
    pub error_code: ErrorCode,
    /// Who reports it.
    pub originating_agent_id: String,
}

/// The two kinds of seed 004's agent management a [`TaskRequest`] may be.
///
/// A request is one when its `description` holds the kind's phrase, in any case, anywhere
/// ("register me as an agent" is looked for first). Its parameters come from `data` (a JSON
/// object) or from the text after the phrase; see [`TaskRequest::agent_action`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentRequestKind {
    /// "register me as an agent".
    Register,
    /// "find an agent".
    Find,
}

impl AgentRequestKind {
    /// The phrase that makes a TaskRequest this kind of request (lower case).
    pub fn phrase(self) -> &'static str {
        match self {
            AgentRequestKind::Register => "register me as an agent",
            AgentRequestKind::Find => "find an agent",
        }
    }

    /// Seed 004's error for such a request that cannot be parsed.
    pub fn invalid(self) -> &'static str {
        match self {
            AgentRequestKind::Register => "Invalid registration request",
            AgentRequestKind::Find => "Invalid lookup request",
        }
    }

    /// The kind `description` asks for, with the text after its phrase.
    pub fn of(description: &str) -> Option<(Self, &str)> {
        // ASCII lower-casing keeps every byte offset, so an offset found in `lower` is one
        // of `description` too (and on a character boundary: the phrases are ASCII).
        let lower = description.to_ascii_lowercase();
        [AgentRequestKind::Register, AgentRequestKind::Find]
            .into_iter()
            .find_map(|kind| {
                let at = lower.find(kind.phrase())?;
                Some((kind, &description[at + kind.phrase().len()..]))
            })
    }
}

/// An agent management request whose parameters are missing or malformed; shown as seed
/// 004's words, a colon and the detail (`Invalid registration request: no address`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", kind.invalid())]
pub struct InvalidAgentRequest {
    /// Which request.
    pub kind: AgentRequestKind,
    /// What is wrong.
    pub detail: String,
}

/// Longest accepted `address`, in bytes.
const MAX_ADDRESS_BYTES: usize = 2048;

impl TaskRequest {
    /// The agent management this request asks for: `None` for an ordinary task (neither
    /// phrase in `description`); else the parsed action, or why it cannot be parsed.
    ///
    /// Register takes `agent_id`, `capabilities`, `address` and `status` (default
    /// `available`), each either from `data` (`{"agent_id": "a", "capabilities": ["x"],
    /// "address": "host:port", "status": "available"}`) or from the text after the phrase as
    /// whitespace-separated `key=value` words (`id=a capabilities=x,y address=host:port
    /// status=busy`; `agent_id=` is the same as `id=`), never from both. Find takes
    /// `capabilities` from exactly one of `data.capabilities`, `required_capabilities` or the
    /// text after the phrase: `[:] [with] [capabilities|capability] [=|:] a, b`.
    pub fn agent_action(&self) -> Option<Result<AgentAction, InvalidAgentRequest>> {
        let (kind, rest) = AgentRequestKind::of(&self.description)?;
        let invalid = |detail: String| InvalidAgentRequest { kind, detail };
        let data = match &self.data {
            None => None,
            Some(Value::Object(map)) => Some(map),
            Some(_) => return Some(Err(invalid("`data` must be a JSON object".into()))),
        };
        Some(match kind {
            AgentRequestKind::Register => parse_registration(data, rest)
                .map(AgentAction::Register)
                .map_err(invalid),
            AgentRequestKind::Find => parse_query(data, &self.required_capabilities, rest)
                .map(AgentAction::Find)
                .map_err(invalid),
        })
    }
}

impl TaskResponse {
    /// The `agent_id` of the answers to agent management: the registry did the work.
    pub const AGENT_MANAGER: &'static str = "aip-registry";

    /// The answer to an agent management request: `success` with the registration or
    /// `{"agents": [...]}`, or `failed` with the registry's (or the parser's) words.
    pub fn for_agent_action(task_id: String, outcome: Result<AgentActionOutcome, String>) -> Self {
        let (status, result, error) = match outcome {
            Ok(AgentActionOutcome::Registered(agent)) => (
                TaskResponseStatus::Success,
                serde_json::to_value(agent).ok(),
                None,
            ),
            Ok(AgentActionOutcome::Found(agents)) => (
                TaskResponseStatus::Success,
                Some(serde_json::json!({ "agents": agents })),
                None,
            ),
            Err(error) => (TaskResponseStatus::Failed, None, Some(error)),
        };
        TaskResponse {
            version: V1,
            task_id,
            result,
            status,
            agent_id: Self::AGENT_MANAGER.to_owned(),
            error,
        }
    }

    /// Whether a registry refusal is an answer to put in a `failed` TaskResponse (a taken
    /// id, nothing found, a malformed request) rather than a failure of the broker.
    pub fn answers_agent_action(refusal: &ErrorBody) -> bool {
        matches!(
            refusal.error_code,
            ErrorCode::RegistrationFailed | ErrorCode::NotFound | ErrorCode::InvalidRequest
        )
    }
}

/// The `sessions.submit` reply payload: a task accepted, or the immediate answer to an agent
/// management request (no task is created for those).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SubmitOutcome {
    /// Seed 004's agent management, answered at once.
    Answered(TaskResponse),
    /// A task was created.
    Accepted(TaskAccepted),
}

/// One parameter, read from `data` or from the text, not from both.
fn one_of<T>(name: &str, data: Option<T>, text: Option<T>) -> Result<Option<T>, String> {
    match (data, text) {
        (Some(_), Some(_)) => Err(format!(
            "`{name}` is given both in `data` and in the description"
        )),
        (data, text) => Ok(data.or(text)),
    }
}

/// A string field of `data`, if there.
fn data_string<'a>(
    data: Option<&'a serde_json::Map<String, Value>>,
    key: &str,
) -> Result<Option<&'a str>, String> {
    match data.and_then(|d| d.get(key)) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(format!("`data.{key}` must be a string")),
    }
}

/// The capabilities of `data`, if there.
fn data_capabilities(
    data: Option<&serde_json::Map<String, Value>>,
) -> Result<Option<Vec<String>>, String> {
    let not_list = || "`data.capabilities` must be a list of strings".to_owned();
    match data.and_then(|d| d.get("capabilities")) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned).ok_or_else(not_list))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(not_list()),
    }
}

/// Checked capabilities: at least one, each a non-empty word without commas, duplicates
/// dropped (first kept).
fn capabilities(list: Vec<String>) -> Result<Vec<String>, String> {
    if list.is_empty() {
        return Err("no capabilities".into());
    }
    let mut checked: Vec<String> = Vec::with_capacity(list.len());
    for capability in list {
        if capability.is_empty()
            || capability.contains(',')
            || capability.chars().any(char::is_whitespace)
        {
            return Err(format!(
                "capability {capability:?} is not a non-empty word without commas"
            ));
        }
        if !checked.contains(&capability) {
            checked.push(capability);
        }
    }
    Ok(checked)
}

/// A comma-separated list of the text form (blanks around items allowed).
fn text_list(list: &str) -> Vec<String> {
    list.split(',').map(|item| item.trim().to_owned()).collect()
}

/// Whether `address` is `scheme://authority[/…]` or `host:port`.
fn check_address(address: &str) -> Result<(), String> {
    let bad = || {
        format!("address {address:?} is not a URL (`scheme://host[:port][/path]`) or `host:port`")
    };
    if address.is_empty()
        || address.len() > MAX_ADDRESS_BYTES
        || address.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(bad());
    }
    if let Some((scheme, rest)) = address.split_once("://") {
        let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        return if scheme_ok && !authority.is_empty() {
            Ok(())
        } else {
            Err(bad())
        };
    }
    match address.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && !host.contains('/')
                && port.parse::<u16>().is_ok_and(|p| p != 0) =>
        {
            Ok(())
        }
        _ => Err(bad()),
    }
}

/// The `key=value` words of the text form of a registration.
#[derive(Default)]
struct RegistrationWords<'a> {
    agent_id: Option<&'a str>,
    capabilities: Option<&'a str>,
    address: Option<&'a str>,
    status: Option<&'a str>,
}

impl<'a> RegistrationWords<'a> {
    fn parse(text: &'a str) -> Result<Self, String> {
        let text = text.trim_start();
        let text = text.strip_prefix(':').unwrap_or(text);
        let mut words = RegistrationWords::default();
        for word in text.split_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                return Err(format!("{word:?} is not `key=value`"));
            };
            let slot = match key {
                "id" | "agent_id" => &mut words.agent_id,
                "capabilities" => &mut words.capabilities,
                "address" => &mut words.address,
                "status" => &mut words.status,
                other => {
                    return Err(format!(
                        "unknown key `{other}` (use id, capabilities, address, status)"
                    ));
                }
            };
            if value.is_empty() {
                return Err(format!("`{key}=` has no value"));
            }
            if slot.replace(value).is_some() {
                return Err(format!("`{key}` is given twice"));
            }
        }
        Ok(words)
    }
}

fn parse_registration(
    data: Option<&serde_json::Map<String, Value>>,
    text: &str,
) -> Result<AgentRegistration, String> {
    let words = RegistrationWords::parse(text)?;
    let agent_id =
        one_of("agent_id", data_string(data, "agent_id")?, words.agent_id)?.ok_or("no agent id")?;
    if agent_id.trim().is_empty() || agent_id.len() > crate::MAX_ID_BYTES {
        return Err(format!(
            "the agent id must be 1 to {} bytes, not blank",
            crate::MAX_ID_BYTES
        ));
    }
    let capabilities = one_of(
        "capabilities",
        data_capabilities(data)?,
        words.capabilities.map(text_list),
    )?
    .ok_or("no capabilities")
    .map_err(str::to_owned)
    .and_then(capabilities)?;
    let address =
        one_of("address", data_string(data, "address")?, words.address)?.ok_or("no address")?;
    check_address(address)?;
    let status = match one_of("status", data_string(data, "status")?, words.status)? {
        None => AgentStatus::Available,
        Some(status) => AgentStatus::from_wire(status)
            .ok_or_else(|| format!("status {status:?} is not one of available, busy, offline"))?,
    };
    Ok(AgentRegistration {
        agent_id: agent_id.to_owned(),
        capabilities,
        address: address.to_owned(),
        status,
    })
}

/// Strips `word` (any case) from the start of `text` when a blank, `=`, `:` or the end
/// follows it.
fn strip_word<'a>(text: &'a str, word: &str) -> Option<&'a str> {
    let head = text.get(..word.len())?;
    let rest = &text[word.len()..];
    (head.eq_ignore_ascii_case(word)
        && (rest.is_empty()
            || rest.starts_with(|c: char| c.is_whitespace() || c == '=' || c == ':')))
    .then_some(rest)
}

fn parse_query(
    data: Option<&serde_json::Map<String, Value>>,
    required: &[String],
    text: &str,
) -> Result<AgentQuery, String> {
    let mut rest = text.trim();
    if let Some(after) = rest.strip_prefix(':') {
        rest = after.trim_start();
    }
    if let Some(after) = strip_word(rest, "with") {
        rest = after.trim_start();
    }
    for word in ["capabilities", "capability"] {
        if let Some(after) = strip_word(rest, word) {
            rest = after.trim_start();
            break;
        }
    }
    if let Some(after) = rest.strip_prefix(['=', ':']) {
        rest = after.trim_start();
    }
    let from_text = (!rest.is_empty()).then(|| text_list(rest));
    let from_field = (!required.is_empty()).then(|| required.to_vec());
    let sources = [data_capabilities(data)?, from_field, from_text];
    let mut given = sources.into_iter().flatten();
    let list = given.next().ok_or("no capabilities")?;
    if given.next().is_some() {
        return Err(
            "give the capabilities once: in `data.capabilities`, `required_capabilities` or the description"
                .into(),
        );
    }
    Ok(AgentQuery {
        capabilities: capabilities(list)?,
    })
}

#[cfg(test)]
mod agent_management_tests {
    use super::*;

    fn request(description: &str, data: Option<Value>) -> TaskRequest {
        TaskRequest {
            version: V1,
            task_id: None,
            description: description.to_owned(),
            data,
            originating_agent_id: "me".to_owned(),
            callback_url: None,
            callback_agent: None,
            callback_on: vec![],
            priority: None,
            target_id: None,
            required_capabilities: vec![],
            task_name: None,
            steps: None,
            driver: false,
            planner: None,
            timeout_secs: None,
        }
    }

    fn action(description: &str, data: Option<Value>) -> Result<AgentAction, String> {
        request(description, data)
            .agent_action()
            .expect("agent management")
            .map_err(|e| e.to_string())
    }

    fn registration(id: &str, caps: &[&str], address: &str, status: AgentStatus) -> AgentAction {
        AgentAction::Register(AgentRegistration {
            agent_id: id.to_owned(),
            capabilities: caps.iter().map(|c| (*c).to_owned()).collect(),
            address: address.to_owned(),
            status,
        })
    }

    fn query(caps: &[&str]) -> AgentAction {
        AgentAction::Find(AgentQuery {
            capabilities: caps.iter().map(|c| (*c).to_owned()).collect(),
        })
    }

    #[test]
    fn ordinary_tasks_are_not_agent_management() {
        assert_eq!(request("open notepad", None).agent_action(), None);
        assert_eq!(request("register me as a user", None).agent_action(), None);
    }

    #[test]
    fn registration_in_text() {
        assert_eq!(
            action(
                "Please REGISTER ME AS AN AGENT: id=web-1 capabilities=search,summarize address=https://w.example/aip status=busy",
                None
            ),
            Ok(registration(
                "web-1",
                &["search", "summarize"],
                "https://w.example/aip",
                AgentStatus::Busy
            ))
        );
        assert_eq!(
            action(
                "register me as an agent agent_id=a capabilities=x,x address=10.0.0.1:8080",
                None
            ),
            Ok(registration(
                "a",
                &["x"],
                "10.0.0.1:8080",
                AgentStatus::Available
            ))
        );
    }

    #[test]
    fn registration_in_data() {
        let data = serde_json::json!({
            "agent_id": "a", "capabilities": ["x", "y"], "address": "[::1]:9000",
            "status": "offline", "other": 1
        });
        assert_eq!(
            action("register me as an agent", Some(data)),
            Ok(registration(
                "a",
                &["x", "y"],
                "[::1]:9000",
                AgentStatus::Offline
            ))
        );
        let partial = serde_json::json!({ "capabilities": ["x"] });
        assert_eq!(
            action("register me as an agent id=a address=h:1", Some(partial)),
            Ok(registration("a", &["x"], "h:1", AgentStatus::Available))
        );
    }

    #[test]
    fn bad_registrations_use_the_seeds_words() {
        for (description, data, detail) in [
            ("register me as an agent", None, "no agent id"),
            (
                "register me as an agent id=a address=h:1",
                None,
                "no capabilities",
            ),
            (
                "register me as an agent id=a capabilities=x",
                None,
                "no address",
            ),
            (
                "register me as an agent id=a capabilities=x address=h:1 colour=red",
                None,
                "unknown key `colour` (use id, capabilities, address, status)",
            ),
            (
                "register me as an agent id=a id=b",
                None,
                "`id` is given twice",
            ),
            (
                "register me as an agent please",
                None,
                "\"please\" is not `key=value`",
            ),
            ("register me as an agent id=", None, "`id=` has no value"),
            (
                "register me as an agent id=a capabilities=x,,y address=h:1",
                None,
                "capability \"\" is not a non-empty word without commas",
            ),
            (
                "register me as an agent id=a capabilities=x address=h:99999",
                None,
                "address \"h:99999\" is not a URL (`scheme://host[:port][/path]`) or `host:port`",
            ),
            (
                "register me as an agent id=a capabilities=x address=h:1 status=sleepy",
                None,
                "status \"sleepy\" is not one of available, busy, offline",
            ),
            (
                "register me as an agent id=a capabilities=x address=h:1",
                Some(serde_json::json!({ "agent_id": "b" })),
                "`agent_id` is given both in `data` and in the description",
            ),
            (
                "register me as an agent",
                Some(serde_json::json!("a string")),
                "`data` must be a JSON object",
            ),
            (
                "register me as an agent",
                Some(serde_json::json!({ "agent_id": "a", "capabilities": "x", "address": "h:1" })),
                "`data.capabilities` must be a list of strings",
            ),
        ] {
            assert_eq!(
                action(description, data),
                Err(format!("Invalid registration request: {detail}")),
                "{description}"
            );
        }
    }

    #[test]
    fn addresses() {
        for good in [
            "http://h",
            "https://h:8443/x?y",
            "h:1",
            "127.0.0.1:80",
            "[::1]:1",
        ] {
            assert_eq!(check_address(good), Ok(()), "{good}");
        }
        for bad in [
            "h",
            "h:0",
            ":80",
            "http://",
            "://h",
            "1http://h",
            "h 1:2",
            "a/b:80",
            "",
        ] {
            assert!(check_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lookups() {
        assert_eq!(
            action("find an agent with capabilities search, summarize", None),
            Ok(query(&["search", "summarize"]))
        );
        assert_eq!(
            action("Find An Agent: capability=x", None),
            Ok(query(&["x"]))
        );
        assert_eq!(action("find an agent x,y", None), Ok(query(&["x", "y"])));
        assert_eq!(
            action(
                "find an agent",
                Some(serde_json::json!({ "capabilities": ["x"] }))
            ),
            Ok(query(&["x"]))
        );
        let mut with_field = request("please find an agent", None);
        with_field.required_capabilities = vec!["z".to_owned()];
        assert_eq!(with_field.agent_action(), Some(Ok(query(&["z"]))));
    }

    #[test]
    fn bad_lookups_use_the_seeds_words() {
        for (description, data, detail) in [
            ("find an agent", None, "no capabilities".to_owned()),
            ("find an agent with capabilities", None, "no capabilities".to_owned()),
            (
                "find an agent that can search the web",
                None,
                "capability \"that can search the web\" is not a non-empty word without commas"
                    .to_owned(),
            ),
            (
                "find an agent with capabilities x",
                Some(serde_json::json!({ "capabilities": ["y"] })),
                "give the capabilities once: in `data.capabilities`, `required_capabilities` or the description".to_owned(),
            ),
        ] {
            assert_eq!(
                action(description, data),
                Err(format!("Invalid lookup request: {detail}")),
                "{description}"
            );
        }
    }

    #[test]
    fn register_is_looked_for_first() {
        assert!(matches!(
            action("find an agent, or register me as an agent", None),
            Err(e) if e.starts_with("Invalid registration request")
        ));
    }

    #[test]
    fn responses() {
        let failed =
            TaskResponse::for_agent_action("t".into(), Err("No available agents found".into()));
        assert_eq!(failed.status, TaskResponseStatus::Failed);
        assert_eq!(failed.error.as_deref(), Some("No available agents found"));
        assert_eq!(failed.agent_id, TaskResponse::AGENT_MANAGER);
        let found =
            TaskResponse::for_agent_action("t".into(), Ok(AgentActionOutcome::Found(vec![])));
        assert_eq!(found.result, Some(serde_json::json!({ "agents": [] })));
    }
}
