//! The built-in tool-calling agent: a planner on any OpenAI-compatible chat-completions
//! endpoint that drives a UFO device through the tools the device advertises.
//!
//! As UFO's own agents do, it starts with `list_tools` on the executor (step 0). From the
//! returned MCPToolInfo list it builds the model's function tools, then each model call is one
//! step: the model's tool calls become the step's Commands (the tool's `tool_type`, the call's
//! id as `call_id`), their Results go back as the tool messages of the next call, and the
//! model's final answer completes the task with that answer as the result. A built-in
//! `ask_user` tool lets the model ask the requester a question: the task waits in
//! `input_required`, and the answer comes back as that call's result.
//!
//! The agent keeps no state of its own: each model turn is written to the task's event log (a
//! `planned` event with the messages it added, the tools on the first turn, and the tokens the
//! endpoint counted), and the conversation is read back from there for the next step, so it
//! survives a failover to another replica.

use std::collections::HashMap;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use proto_schemas::frames::{ActionResult, Command, JsonObject, McpToolInfo};
use proto_schemas::sessions::{PlanRequest, PlanStep};
use proto_schemas::{PlannerName, ToolType};
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::http::{parse_http_url, quote};
use super::{Planned, PlannerError};
use crate::engine::Engine;
use crate::settings::LlmSettings;
use crate::task::EventKind;

/// Where OpenAI's API is when only a key is configured.
pub const OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
/// The tool the agent offers the model for questions to the requester.
pub const ASK_USER: &str = "ask_user";
/// The Command that lists a UFO device's tools.
const LIST_TOOLS: &str = "list_tools";
/// Events read per query when the conversation is rebuilt.
const EVENT_PAGE: i64 = 1_000;
const MIN_RETRY_DELAY: Duration = Duration::from_millis(500);
/// The longest function name chat-completions endpoints accept.
const MAX_FUNCTION_NAME: usize = 64;

const DEFAULT_SYSTEM_PROMPT: &str = "You are the planner of the aip broker. You carry out the \
user's task on the device `{executor}` (platform: {platform}) by calling its tools. Call the \
tools you need; each tool's result comes back to you. When the task is done, answer with a short \
message that states the outcome: that message is the task's result. If you cannot go on without \
information only the user has, call `ask_user` with your question.";

/// The agent, with its endpoint.
pub struct LlmPlanner {
    client: reqwest::Client,
    endpoint: reqwest::Url,
    api_key: Option<String>,
    settings: LlmSettings,
    attempts: usize,
}

impl LlmPlanner {
    /// `None` when no endpoint is configured: neither `base_url`/`api_key` in the settings nor
    /// `OPENAI_BASE_URL`/`OPENAI_API_KEY` in `env`.
    pub fn from_settings(
        settings: &LlmSettings,
        attempts: u32,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, String> {
        let set = |value: Option<String>| value.filter(|v| !v.trim().is_empty());
        let base_url = set(settings.base_url.clone()).or_else(|| set(env("OPENAI_BASE_URL")));
        let api_key = set(settings.api_key.clone()).or_else(|| set(env("OPENAI_API_KEY")));
        if base_url.is_none() && api_key.is_none() {
            return Ok(None);
        }
        let base_url = base_url.unwrap_or_else(|| OPENAI_BASE_URL.to_owned());
        let endpoint = parse_http_url(&format!(
            "{}/chat/completions",
            base_url.trim_end_matches('/')
        ))
        .map_err(|e| format!("[sessions.llm] base_url: {e}"))?;
        if settings.model.trim().is_empty() {
            return Err("[sessions.llm] model must name a model".into());
        }
        if settings.max_steps == 0 || settings.timeout_ms == 0 {
            return Err("[sessions.llm] max_steps and timeout_ms must be at least 1".into());
        }
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(settings.timeout_ms))
            .build()
            .map_err(|e| format!("cannot build the model endpoint's client: {e}"))?;
        Ok(Some(LlmPlanner {
            client,
            endpoint,
            api_key,
            settings: settings.clone(),
            attempts: usize::try_from(attempts.max(1)).unwrap_or(1),
        }))
    }

    /// The model and its endpoint.
    pub fn describe(&self) -> String {
        format!("model {} at {}", self.settings.model, self.endpoint)
    }

    /// The step after `request.last_results`.
    pub async fn ask(&self, engine: &Engine, request: &PlanRequest) -> Planned {
        if request.step == 0 {
            return Planned {
                decision: Ok(list_tools()),
                note: None,
                handoff_candidates: None,
            };
        }
        let conversation = match Conversation::read(engine, &request.task_id).await {
            Ok(conversation) => conversation,
            Err(e) => {
                return Planned {
                    decision: Err(e),
                    note: None,
                    handoff_candidates: None,
                };
            }
        };
        self.turn(conversation, request).await
    }

    /// One model turn on top of what the task's events hold.
    async fn turn(&self, mut conversation: Conversation, request: &PlanRequest) -> Planned {
        let mut note = Note {
            planner: PlannerName::Llm,
            turn: conversation.turns + 1,
            tools: None,
            messages: Vec::new(),
            usage: None,
        };
        let fail = |note: Note, error: PlannerError| Planned {
            decision: Err(error),
            note: Some(note.to_value()),
            handoff_candidates: None,
        };
        if conversation.turns == 0 {
            let tools = match tools_of(&request.last_results) {
                Ok(tools) => tools,
                Err(e) => return fail(note, e),
            };
            conversation.tools = Toolbox::new(&tools);
            note.tools = Some(tools);
            note.messages
                .push(json!({ "role": "system", "content": self.system_prompt(request) }));
            note.messages
                .push(json!({ "role": "user", "content": user_message(request) }));
        } else {
            note.messages.extend(tool_messages(
                &conversation,
                &request.last_results,
                self.settings.max_result_chars,
            ));
        }
        if conversation.turns >= self.settings.max_steps {
            return fail(
                note,
                PlannerError::Bound(format!(
                    "{} model calls (AIP_SESSIONS__LLM__MAX_STEPS)",
                    self.settings.max_steps
                )),
            );
        }
        if conversation.tokens >= self.settings.max_tokens {
            return fail(
                note,
                PlannerError::Bound(format!(
                    "{} of {} tokens used (AIP_SESSIONS__LLM__MAX_TOKENS)",
                    conversation.tokens, self.settings.max_tokens
                )),
            );
        }
        let mut messages = conversation.messages.clone();
        messages.extend(note.messages.iter().cloned());
        let completion = match self.complete(&messages, &conversation.tools).await {
            Ok(completion) => completion,
            Err(e) => return fail(note, e),
        };
        note.usage = completion.usage.clone();
        let Some(choice) = completion.choices.into_iter().next() else {
            return fail(
                note,
                PlannerError::Model("the answer has no choices".into()),
            );
        };
        note.messages.push(choice.message.to_value());
        let decision = decide(&conversation.tools, choice.message);
        Planned {
            decision,
            note: Some(note.to_value()),
            handoff_candidates: None,
        }
    }

    fn system_prompt(&self, request: &PlanRequest) -> String {
        let prompt = self
            .settings
            .system_prompt
            .as_deref()
            .unwrap_or(DEFAULT_SYSTEM_PROMPT);
        prompt
            .replace("{executor}", &request.executor_id)
            .replace("{platform}", request.platform.as_str())
    }

    /// One chat completion, tried again on a connection error, a timeout, 429 or a 5xx.
    async fn complete(
        &self,
        messages: &[Value],
        tools: &Toolbox,
    ) -> Result<Completion, PlannerError> {
        let body = json!({
            "model": self.settings.model,
            "messages": messages,
            "tools": tools.functions(),
            "tool_choice": "auto",
        });
        let send = || async {
            let mut post = self.client.post(self.endpoint.clone()).json(&body);
            if let Some(key) = &self.api_key {
                post = post.bearer_auth(key);
            }
            let response = post.send().await.map_err(|e| (true, without_url(e)))?;
            let status = response.status();
            let bytes = response.bytes().await.map_err(|e| (true, without_url(e)))?;
            if status.is_success() {
                return Ok(bytes);
            }
            let again = status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error();
            Err((again, format!("HTTP {status}: {}", quote(&bytes))))
        };
        let retry = ExponentialBuilder::default()
            .with_min_delay(MIN_RETRY_DELAY)
            .with_max_delay(super::http::MAX_RETRY_DELAY)
            .with_max_times(self.attempts - 1);
        let bytes = send
            .retry(retry)
            .when(|(again, _)| *again)
            .notify(|(_, why), wait| {
                tracing::warn!(?wait, "the model endpoint failed, trying again: {why}");
            })
            .await
            .map_err(|(_, why)| PlannerError::Model(why))?;
        serde_json::from_slice(&bytes).map_err(|e| {
            PlannerError::Model(format!(
                "the answer is not a chat completion ({e}): {}",
                quote(&bytes)
            ))
        })
    }
}

/// A request error without its URL (a key can sit in a query, as in Azure's `api-key`).
fn without_url(error: reqwest::Error) -> String {
    error.without_url().to_string()
}

/// Step 0: ask the device what it offers.
fn list_tools() -> PlanStep {
    let mut parameters = JsonObject::new();
    parameters.insert("tool_type".into(), json!("action"));
    PlanStep::Commands {
        actions: vec![Command {
            tool_name: LIST_TOOLS.to_owned(),
            parameters: Some(parameters),
            tool_type: ToolType::Action,
            call_id: None,
        }],
        agent_name: None,
        process_name: None,
        root_name: None,
    }
}

/// The tools in the answer to `list_tools`.
fn tools_of(results: &[ActionResult]) -> Result<Vec<McpToolInfo>, PlannerError> {
    let Some(result) = results.first() else {
        return Err(PlannerError::BadToolCall(
            "the executor answered `list_tools` with no result".into(),
        ));
    };
    if let Some(error) = &result.error {
        return Err(PlannerError::Model(format!(
            "the executor could not list its tools: {error}"
        )));
    }
    serde_json::from_value(result.result.clone().unwrap_or(Value::Null)).map_err(|e| {
        PlannerError::BadToolCall(format!(
            "the executor's `list_tools` result is not a list of MCPToolInfo: {e}"
        ))
    })
}

fn user_message(request: &PlanRequest) -> String {
    match &request.data {
        Some(data) => format!("{}\n\nInput data (JSON): {data}", request.request),
        None => request.request.clone(),
    }
}

/// The tool messages answering the last assistant message's calls, from the step's results
/// (matched by `call_id`, else by position).
fn tool_messages(
    conversation: &Conversation,
    results: &[ActionResult],
    max_chars: usize,
) -> Vec<Value> {
    let calls = conversation.pending_calls();
    calls
        .iter()
        .enumerate()
        .map(|(i, call_id)| {
            let result = results
                .iter()
                .find(|r| r.call_id.as_deref() == Some(call_id.as_str()))
                .or_else(|| results.get(i));
            let content = match result {
                Some(r) => cut(
                    json!({ "status": r.status, "result": r.result, "error": r.error }).to_string(),
                    max_chars,
                ),
                None => "the device returned no result for this call".to_owned(),
            };
            json!({ "role": "tool", "tool_call_id": call_id, "content": content })
        })
        .collect()
}

/// `text` cut to `max_chars` characters, saying so.
fn cut(text: String, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((end, _)) => format!("{}… (cut at {max_chars} characters)", &text[..end]),
        None => text,
    }
}

/// What the model's message means for the task.
fn decide(tools: &Toolbox, message: AssistantMessage) -> Result<PlanStep, PlannerError> {
    if message.tool_calls.is_empty() {
        return match message.content {
            Some(answer) if !answer.trim().is_empty() => Ok(PlanStep::Complete {
                result: Some(Value::String(answer)),
            }),
            _ => Err(PlannerError::BadToolCall(
                "the model answered with neither a tool call nor text".into(),
            )),
        };
    }
    let mut actions = Vec::with_capacity(message.tool_calls.len());
    for call in message.tool_calls {
        let arguments = parse_arguments(&call)?;
        if call.function.name == ASK_USER && !tools.by_function.contains_key(ASK_USER) {
            let question = arguments
                .get("question")
                .and_then(Value::as_str)
                .filter(|q| !q.trim().is_empty())
                .ok_or_else(|| {
                    PlannerError::BadToolCall(format!("`{ASK_USER}` was called without a question"))
                })?;
            // The answer comes back as this call's result; other calls of the turn wait.
            return Ok(PlanStep::Clarify {
                question: question.to_owned(),
                data: None,
                timeout_secs: None,
                call_id: Some(call.id),
            });
        }
        let Some(tool) = tools.by_function.get(&call.function.name) else {
            return Err(PlannerError::BadToolCall(format!(
                "the model called `{}`, which the device does not offer",
                call.function.name
            )));
        };
        actions.push(Command {
            tool_name: tool.tool_name.clone(),
            parameters: Some(arguments),
            tool_type: ToolType::from_wire(&tool.tool_type).unwrap_or(ToolType::Action),
            call_id: Some(call.id),
        });
    }
    Ok(PlanStep::Commands {
        actions,
        agent_name: None,
        process_name: None,
        root_name: None,
    })
}

fn parse_arguments(call: &ToolCall) -> Result<JsonObject, PlannerError> {
    if call.function.arguments.trim().is_empty() {
        return Ok(JsonObject::new());
    }
    match serde_json::from_str::<Value>(&call.function.arguments) {
        Ok(Value::Object(arguments)) => Ok(arguments),
        Ok(_) | Err(_) => Err(PlannerError::BadToolCall(format!(
            "the arguments of the call to `{}` are not a JSON object: {}",
            call.function.name,
            quote(call.function.arguments.as_bytes())
        ))),
    }
}

/// The device's tools as the model's functions. Function names allow `[A-Za-z0-9_-]`, at most
/// 64; other tool names are mapped to such a name.
#[derive(Debug, Default)]
struct Toolbox {
    functions: Vec<Value>,
    by_function: HashMap<String, McpToolInfo>,
}

impl Toolbox {
    fn new(tools: &[McpToolInfo]) -> Self {
        let mut toolbox = Toolbox::default();
        for tool in tools {
            let base = function_name(&tool.tool_name);
            let mut name = base.clone();
            let mut n = 2;
            while toolbox.by_function.contains_key(&name) {
                let suffix = format!("_{n}");
                let keep = base.len().min(MAX_FUNCTION_NAME - suffix.len());
                name = format!("{}{suffix}", &base[..keep]);
                n += 1;
            }
            let parameters = tool
                .input_schema
                .clone()
                .map(Value::Object)
                .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
            toolbox.functions.push(json!({
                "type": "function",
                "function": {
                    "name": name,
                    "description": tool.description.clone().unwrap_or_default(),
                    "parameters": parameters,
                }
            }));
            toolbox.by_function.insert(name, tool.clone());
        }
        if !toolbox.by_function.contains_key(ASK_USER) {
            toolbox.functions.push(json!({
                "type": "function",
                "function": {
                    "name": ASK_USER,
                    "description": "Ask the user a question when the task cannot go on without their answer.",
                    "parameters": {
                        "type": "object",
                        "properties": { "question": { "type": "string" } },
                        "required": ["question"],
                    },
                }
            }));
        }
        toolbox
    }

    fn functions(&self) -> &[Value] {
        &self.functions
    }
}

/// A tool name as a function name: characters other than `[A-Za-z0-9_-]` become `_` (so the
/// name is ASCII), at most [`MAX_FUNCTION_NAME`].
fn function_name(tool_name: &str) -> String {
    let name: String = tool_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_FUNCTION_NAME)
        .collect();
    if name.is_empty() {
        "_".to_owned()
    } else {
        name
    }
}

/// The conversation so far, read back from the task's `planned` events.
#[derive(Debug, Default)]
struct Conversation {
    tools: Toolbox,
    messages: Vec<Value>,
    turns: u32,
    tokens: u64,
}

impl Conversation {
    async fn read(engine: &Engine, task_id: &str) -> Result<Self, PlannerError> {
        let mut conversation = Conversation::default();
        let mut after = 0;
        loop {
            let events = engine
                .store
                .events(task_id, after, EVENT_PAGE)
                .await
                .map_err(|e| PlannerError::Store(e.to_string()))?;
            let Some(last) = events.last() else {
                break;
            };
            after = last.seq;
            let full = i64::try_from(events.len()).unwrap_or(0) == EVENT_PAGE;
            for event in events {
                if event.kind != EventKind::Planned.as_str() {
                    continue;
                }
                let Some(data) = event.data else { continue };
                let Ok(note) = serde_json::from_value::<Note>(data) else {
                    continue;
                };
                if let Some(tools) = &note.tools {
                    conversation.tools = Toolbox::new(tools);
                }
                conversation.turns += 1;
                conversation.tokens += note.usage.as_ref().map_or(0, |u| u.total_tokens);
                conversation.messages.extend(note.messages);
            }
            if !full {
                break;
            }
        }
        Ok(conversation)
    }

    /// The ids of the calls in the last assistant message.
    fn pending_calls(&self) -> Vec<String> {
        self.messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
            .and_then(|m| m.get("tool_calls"))
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// One model turn, as the `planned` event keeps it.
#[derive(Debug, Serialize, Deserialize)]
struct Note {
    planner: PlannerName,
    turn: u32,
    /// The device's tools (first turn only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<McpToolInfo>>,
    /// The messages this turn added: the tool results it answered, then the model's message.
    messages: Vec<Value>,
    /// What the endpoint counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl Note {
    fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The parts of a chat completion the agent reads.
#[derive(Debug, Deserialize)]
struct Completion {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    message: AssistantMessage,
}

#[derive(Debug, Deserialize)]
struct AssistantMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCall>,
}

impl AssistantMessage {
    /// The message as the next request sends it back.
    fn to_value(&self) -> Value {
        let mut message = json!({ "role": "assistant", "content": self.content });
        if !self.tool_calls.is_empty() {
            message["tool_calls"] = self
                .tool_calls
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": { "name": c.function.name, "arguments": c.function.arguments },
                    })
                })
                .collect();
        }
        message
    }
}

#[derive(Debug, Deserialize)]
struct ToolCall {
    id: String,
    function: FunctionCall,
}

#[derive(Debug, Deserialize)]
struct FunctionCall {
    name: String,
    #[serde(default)]
    arguments: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> McpToolInfo {
        serde_json::from_value(json!({
            "tool_key": format!("action::{name}"), "tool_name": name, "namespace": "n",
            "tool_type": "action", "description": "d",
            "input_schema": { "type": "object", "properties": { "text": { "type": "string" } } },
        }))
        .expect("tool")
    }

    fn message(value: Value) -> AssistantMessage {
        serde_json::from_value(value).expect("message")
    }

    #[test]
    fn tool_calls_become_commands_with_the_models_call_ids() {
        let tools = Toolbox::new(&[tool("type_text")]);
        let step = decide(
            &tools,
            message(
                json!({ "content": null, "tool_calls": [{ "id": "call_1", "type": "function",
                "function": { "name": "type_text", "arguments": "{\"text\":\"hello\"}" } }] }),
            ),
        )
        .expect("a step");
        let PlanStep::Commands { actions, .. } = step else {
            panic!("commands expected");
        };
        assert_eq!(actions[0].tool_name, "type_text");
        assert_eq!(actions[0].call_id.as_deref(), Some("call_1"));
        assert_eq!(
            actions[0].parameters.as_ref().expect("args")["text"],
            "hello"
        );
    }

    #[test]
    fn unknown_tools_bad_arguments_and_questions_fail_clearly() {
        let tools = Toolbox::new(&[tool("type_text")]);
        let call = |name: &str, arguments: &str| {
            message(json!({ "tool_calls": [{ "id": "c", "type": "function",
                "function": { "name": name, "arguments": arguments } }] }))
        };
        let unknown = decide(&tools, call("rm_rf", "{}")).expect_err("unknown");
        assert!(matches!(unknown, PlannerError::BadToolCall(_)), "{unknown}");
        assert!(unknown.to_string().contains("rm_rf"), "{unknown}");
        let bad = decide(&tools, call("type_text", "[1,2]")).expect_err("not an object");
        assert!(matches!(bad, PlannerError::BadToolCall(_)), "{bad}");
        let question =
            decide(&tools, call(ASK_USER, "{\"question\":\"Which file?\"}")).expect("a question");
        assert_eq!(
            question,
            PlanStep::Clarify {
                question: "Which file?".into(),
                data: None,
                timeout_secs: None,
                call_id: Some("c".into()),
            }
        );
        let empty = decide(&tools, message(json!({ "content": "  " }))).expect_err("empty");
        assert!(matches!(empty, PlannerError::BadToolCall(_)), "{empty}");
    }

    #[test]
    fn a_final_answer_completes_with_the_answer() {
        let step = decide(
            &Toolbox::default(),
            message(json!({ "content": "Done: hello typed." })),
        )
        .expect("complete");
        assert_eq!(
            step,
            PlanStep::Complete {
                result: Some(json!("Done: hello typed."))
            }
        );
    }

    #[test]
    fn odd_tool_names_get_distinct_function_names() {
        let tools = Toolbox::new(&[tool("a.b"), tool("a b"), tool("ok")]);
        let names: Vec<&str> = tools
            .functions()
            .iter()
            .filter_map(|f| f["function"]["name"].as_str())
            .collect();
        assert_eq!(names.len(), 4, "{names:?}");
        assert!(names.iter().all(|n| {
            n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        }));
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), 4, "{names:?}");
        assert_eq!(tools.by_function["a_b"].tool_name, "a.b");
        assert_eq!(tools.by_function["a_b_2"].tool_name, "a b");
    }

    #[test]
    fn long_results_are_cut_for_the_model() {
        assert_eq!(cut("abc".into(), 5), "abc");
        assert!(cut("é".repeat(10), 3).starts_with("ééé…"));
    }
}
