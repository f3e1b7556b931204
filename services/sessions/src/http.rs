//! The session service's REST API.
//!
//! Richer routes under `/api/tasks` and UFO's `POST /api/dispatch` and
//! `GET /api/task_result/{task_name}` with their exact shapes. Every error is an
//! [`ApiError`]: `{"detail": …, "error_code": …}` with the status of its code. The OpenAPI
//! document is [`openapi`], generated from the handlers' annotations and types, served at
//! `/openapi.json` and checked in as `services/sessions/openapi.json`.
//!
//! PostgreSQL text cannot hold NUL (U+0000): a NUL in a body's text is stored as U+FFFD, and
//! an id or filter with NUL matches nothing without asking the database.

use std::convert::Infallible;
use std::time::Duration;

use aip_runtime::api_error::{self, ApiError, JsonBody, Path, Query};
use aip_runtime::api_keys::{self, ApiKeys, Caller};
use aip_runtime::health::{self, Check, CheckName, Probes, Readiness, Role};
use aip_runtime::origin::OriginPolicy;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router, middleware};
use futures::Stream;
use proto_schemas::flow::{TaskRequest, TaskResponse};
use proto_schemas::registry::AgentAction;
use proto_schemas::sessions::{TaskEvent, TaskState, TaskView};
use proto_schemas::{ActionResult, Command, ErrorBody, ErrorCode, PlannerName};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::openapi::OpenApi;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::engine::{
    Engine, EngineError, NewTask, Placement, Plan, Requester, TASK_NAME_RULE, valid_task_name,
};
use crate::machine::{Allowance, Answer, Answerer, DriverQuestion};
use crate::store::{ListFilter, NUL, StoreError, storable};
use crate::task::{Task, rfc3339};
use crate::watch::Watcher;
use crate::workers::{answer_agent_request, new_task_from_request};

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ApiError::failed(
            ErrorCode::Unavailable,
            "the task database is unavailable; retry shortly",
            e,
        )
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Refused(body) => ApiError::Refused(body),
            EngineError::Store(e) => e.into(),
        }
    }
}

/// The `/api` routes with their documentation.
fn api_routes() -> OpenApiRouter<Engine> {
    OpenApiRouter::new()
        .routes(routes!(create_task, list_tasks))
        .routes(routes!(get_task))
        .routes(routes!(task_events))
        .routes(routes!(task_event_stream))
        .routes(routes!(cancel_task))
        .routes(routes!(send_commands))
        .routes(routes!(complete_task))
        .routes(routes!(task_callbacks))
        .routes(routes!(answer_clarification))
        .routes(routes!(ask_clarification))
        .routes(routes!(handoff_task))
        .routes(routes!(redeliver_callbacks))
        .routes(routes!(ufo_dispatch))
        .routes(routes!(ufo_task_result))
}

/// The routes, with API keys required on `/api/*` and browsers held to `origins`.
pub fn router(engine: Engine, keys: ApiKeys, origins: OriginPolicy) -> Router {
    let (api, _) = api_routes()
        .layer(middleware::from_fn_with_state(keys, api_keys::require))
        .layer(middleware::from_fn(aip_runtime::telemetry::traced_request))
        .split_for_parts();
    let document = openapi();
    Router::new()
        .merge(api)
        .route("/openapi.json", get(move || async move { Json(document) }))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(ready))
        .route("/metrics", get(aip_runtime::metrics::render))
        .method_not_allowed_fallback(api_error::method_not_allowed)
        .fallback(api_error::no_such_path)
        .with_state(engine)
        .layer(middleware::from_fn_with_state(
            std::sync::Arc::new(origins),
            aip_runtime::origin::guard,
        ))
}

/// `/readyz`: the bus and the database answer, and this replica leads (a standby serves reads
/// but takes no changes, so a load balancer should not send it any).
async fn ready(State(engine): State<Engine>) -> Readiness {
    let role = if engine.is_leading() {
        Role::Leader
    } else if engine.is_standby() {
        Role::Standby
    } else {
        Role::Starting
    };
    let readiness = Probes::new()
        .bus(engine.bus().clone())
        .database(engine.store.database().clone())
        .check()
        .await
        .with_role(role);
    if role != Role::Leader {
        return readiness;
    }
    let frames = match engine.frames.stalled(crate::task::now_ms()) {
        None => Check::ok(),
        Some(why) => Check::failed(why),
    };
    readiness.with_check(CheckName::Frames, frames)
}

/// The 404 of the routes about one task.
const NO_TASK: &str = "no task with this id";
/// The 429 of the routes that wait for a task's events.
const WATCHERS_FULL: &str = "as many requests as allowed already wait for task events (RATE_LIMITED; sessions.max_event_watchers)";
/// The 429 of the routes that start a task.
const QUOTA_FULL: &str = "its requester already has as many live tasks as its quota allows (RATE_LIMITED; sessions.max_live_tasks_per_requester, or the key's max_live_tasks)";
/// The 503 of every route that reads or writes the task database.
const DATABASE_DOWN: &str = "the task database (or the registry) is unavailable; retry";

/// Submits a task to an explicit target or to an agent with the required capabilities.
#[utoipa::path(
    post,
    path = "/api/tasks",
    operation_id = "create_task",
    tag = "tasks",
    request_body(
        content = TaskRequest,
        description = "give `target_id` or `required_capabilities`; `steps` or `driver: true`, not both",
        example = json!({
            "version": 1,
            "description": "say hi",
            "originating_agent_id": "me",
            "required_capabilities": ["demo"],
            "steps": [[{ "tool_name": "echo", "tool_type": "action", "parameters": { "text": "hi" } }]]
        })
    ),
    responses(
        (status = 201, description = "the task, dispatched or queued", body = TaskView),
        (status = 200, description = "a request whose `description` says \"register me as an agent\" or \"find an agent\" (seed 004's agent management, any case) creates no task: its TaskResponse, `success` with the registration or `{\"agents\": [...]}`, or `failed` with the reason (\"Invalid registration request: …\", \"Invalid lookup request: …\", \"Agent with ID X is already registered\", \"No available agents found\")", body = TaskResponse),
        (status = 400, description = "invalid request", body = ErrorBody),
        (status = 404, description = "the target device is not online (DEVICE_NOT_FOUND)", body = ErrorBody),
        (status = 409, description = "the task id is taken", body = ErrorBody),
        (status = 422, description = "no available agent has the capabilities (CAPABILITY_MISMATCH)", body = ErrorBody),
        (status = 429, description = QUOTA_FULL, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn create_task(
    State(engine): State<Engine>,
    caller: Caller,
    JsonBody(body): JsonBody<Value>,
) -> Result<Response, ApiError> {
    let request: TaskRequest = read_body(whole_numbers(body, WHOLE_NUMBER_FIELDS))?;
    caller.check_acts_for(&request.originating_agent_id)?;
    if let Some(action) = request.agent_action() {
        // Registering an agent id is acting for it.
        if let Ok(AgentAction::Register(registration)) = &action {
            caller.check_acts_for(&registration.agent_id)?;
        }
        let requested_by = format!("rest:{}", caller.name());
        let response = answer_agent_request(&engine, request.task_id, action, requested_by).await?;
        return Ok((StatusCode::OK, Json(response)).into_response());
    }
    // A task runs somewhere: on a device the key may target.
    may_target(
        &engine,
        &caller,
        request.target_id.as_deref(),
        &request.required_capabilities,
    )
    .await?;
    let mut new = new_task_from_request(
        request,
        Requester::Rest,
        engine.planners(),
        engine.callbacks(),
    )?;
    new.allowance = allowance(&caller);
    let started = engine.submit(new).await?;
    Ok((StatusCode::CREATED, Json(started.task.view())).into_response())
}

/// What `caller`'s tasks may ask of the service: an operator is held to no per-requester
/// quota or priority ceiling; a limited key to its own, or the service's.
fn allowance(caller: &Caller) -> Allowance {
    match caller.limits() {
        None => Allowance::Operator,
        Some(limits) => Allowance::Requester {
            max_live: limits.max_live_tasks,
            max_priority: limits.max_priority,
        },
    }
}

/// `Ok` when `caller` may send a task to `device` (or, without one, where `required`
/// capabilities place it); a device's capabilities are asked of the registry only when the
/// caller's targets name capabilities its id does not match (an unknown device has none).
async fn may_target(
    engine: &Engine,
    caller: &Caller,
    device: Option<&str>,
    required: &[String],
) -> Result<(), ApiError> {
    let capabilities = match device {
        Some(device) if caller.needs_capabilities_of(device) => {
            match engine.registry().get(device).await {
                Ok(record) => Some(record.capabilities),
                Err(aip_bus::RegistryError::Refused(_)) => Some(Vec::new()),
                Err(e) => return Err(ApiError::Refused(e.into_error_body())),
            }
        }
        _ => None,
    };
    caller.check_target(device, required, capabilities.as_deref())
}

/// The task `id`, when `caller` may act for its requester (else 403).
async fn readable_task(engine: &Engine, caller: &Caller, id: &str) -> Result<Task, ApiError> {
    possible_id(id)?;
    let task = engine.store.get(id).await?.ok_or_else(|| not_found(id))?;
    allowed(caller, id, task.requester.id())?;
    Ok(task)
}

/// Before a change of task `id`: `Ok` when `caller` is an operator or acts for its requester.
async fn changeable_task(engine: &Engine, caller: &Caller, id: &str) -> Result<(), ApiError> {
    possible_id(id)?;
    if caller.limits().is_none() {
        return Ok(());
    }
    let requester = engine.store.owner(id).await?.ok_or_else(|| not_found(id))?;
    allowed(caller, id, &requester)
}

/// The 403 of a task whose requester `caller` does not act for.
fn allowed(caller: &Caller, id: &str, requester: &str) -> Result<(), ApiError> {
    if caller.may_act_for(requester) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "key `{}` may not act on task '{id}': its requester is not one the key acts for",
            caller.name()
        ),
    ))
}

/// The whole-number fields of a [`TaskRequest`].
const WHOLE_NUMBER_FIELDS: &[&str] = &["version", "priority", "timeout_secs"];

/// JSON has one number type: `1.0` is the integer 1 to JSON Schema (and to the document), so
/// `fields` of the body object written with a zero fraction are read as integers.
fn whole_numbers(mut body: Value, fields: &[&str]) -> Value {
    if let Some(object) = body.as_object_mut() {
        for field in fields {
            if let Some(value) = object.get_mut(*field)
                && let Some(whole) = as_whole_number(value)
            {
                *value = whole;
            }
        }
    }
    body
}

/// `value` as an integer, if it is a number with a zero fraction within `i64` or `u64`.
fn as_whole_number(value: &Value) -> Option<Value> {
    let Value::Number(number) = value else {
        return None;
    };
    if number.is_i64() || number.is_u64() {
        return None;
    }
    let float = number.as_f64()?;
    if float.fract() != 0.0 {
        return None;
    }
    // 2^64 and -2^63 are exact in f64; within these bounds `as` converts exactly.
    const U64_END: f64 = 18_446_744_073_709_551_616.0;
    const I64_START: f64 = -9_223_372_036_854_775_808.0;
    if (0.0..U64_END).contains(&float) {
        Some(Value::from(float as u64))
    } else if (I64_START..0.0).contains(&float) {
        Some(Value::from(float as i64))
    } else {
        None
    }
}

/// serde: an optional whole number that may be written with a zero fraction (`60.0`).
fn optional_whole_number<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let Some(value) = Option::<Value>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let value = as_whole_number(&value).unwrap_or(value);
    T::deserialize(value)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// Query of `GET /api/tasks`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Only tasks in this state.
    #[param(value_type = Option<TaskState>)]
    state: Option<String>,
    /// Only tasks run by this agent.
    executor: Option<String>,
    /// Only tasks asked by this requester id.
    requester: Option<String>,
    /// Only tasks with this name.
    task_name: Option<String>,
    /// `next_cursor` of the previous page, as given.
    #[param(pattern = "^[0-9]{1,18}:[^\\u0000]*$")]
    cursor: Option<String>,
    /// At most this many (default 50; 0 counts as 1, more than 500 as 500).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_u64)]
    limit: Option<u32>,
}

/// Default page size of `GET /api/tasks`.
const DEFAULT_PAGE: u32 = 50;
/// Largest page of `GET /api/tasks`: one page stays one quick query.
const MAX_PAGE: u32 = 500;
/// Longest `created_ms` of a cursor, in digits: any 18 digits fit an `i64`.
const CURSOR_MS_DIGITS: usize = 18;

/// A page of `GET /api/tasks`.
#[derive(Debug, Serialize, ToSchema)]
struct TaskPage {
    /// Newest first.
    tasks: Vec<TaskView>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    next_cursor: Option<String>,
}

/// Parses a cursor `created_ms:task_id` (what `next_cursor` gives).
fn parse_cursor(cursor: &str) -> Option<(i64, String)> {
    let (ms, id) = cursor.split_once(':')?;
    if id.contains(NUL) {
        return None;
    }
    let digits_only =
        !ms.is_empty() && ms.len() <= CURSOR_MS_DIGITS && ms.bytes().all(|b| b.is_ascii_digit());
    if !digits_only {
        return None;
    }
    Some((ms.parse().ok()?, id.to_owned()))
}

/// Lists tasks, newest first, with cursor pagination.
#[utoipa::path(
    get,
    path = "/api/tasks",
    operation_id = "list_tasks",
    tag = "tasks",
    params(ListQuery),
    responses(
        (status = 200, description = "a page of tasks", body = TaskPage),
        (status = 400, description = "an unknown state, an invalid cursor or limit", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn list_tasks(
    State(engine): State<Engine>,
    caller: Caller,
    Query(mut q): Query<ListQuery>,
) -> Result<Json<TaskPage>, ApiError> {
    if caller.limits().is_some() {
        match (&q.requester, caller.only_requester()) {
            (Some(requester), _) => caller.check_acts_for(requester)?,
            (None, Some(only)) => q.requester = Some(only.to_owned()),
            (None, None) => {
                return Err(ApiError::new(
                    ErrorCode::Forbidden,
                    format!(
                        "key `{}` acts for several requesters: give `requester` (one of them)",
                        caller.name()
                    ),
                ));
            }
        }
    }
    let state = match &q.state {
        None => None,
        Some(state) => Some(
            TaskState::from_wire(state)
                .ok_or_else(|| ApiError::invalid(format!("unknown state {state:?}")))?,
        ),
    };
    let cursor = match &q.cursor {
        None => None,
        Some(c) => Some(
            parse_cursor(c)
                .ok_or_else(|| ApiError::invalid("invalid cursor: use next_cursor as given"))?,
        ),
    };
    let limit = i64::from(q.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE));
    let filters = [&q.executor, &q.requester, &q.task_name];
    if filters
        .iter()
        .any(|f| f.as_deref().is_some_and(|f| f.contains(NUL)))
    {
        // No stored text holds NUL: nothing matches.
        return Ok(Json(TaskPage {
            tasks: Vec::new(),
            next_cursor: None,
        }));
    }
    let filter = ListFilter {
        state,
        executor: q.executor,
        requester: q.requester,
        task_name: q.task_name,
        cursor,
        limit,
    };
    let rows = engine.store.list(filter).await?;
    let next_cursor = (rows.len() as i64 == limit)
        .then(|| {
            rows.last()
                .map(|r| format!("{}:{}", r.created_ms, r.task_id))
        })
        .flatten();
    let tasks = rows.iter().map(|r| r.view()).collect();
    Ok(Json(TaskPage { tasks, next_cursor }))
}

/// One task.
#[utoipa::path(
    get,
    path = "/api/tasks/{id}",
    operation_id = "get_task",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id (its AIP session_id)")),
    responses(
        (status = 200, description = "the task", body = TaskView),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn get_task(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<TaskView>, ApiError> {
    let task = readable_task(&engine, &caller, &id).await?;
    Ok(Json(task.view()))
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no task '{id}'"))
}

/// Refuses an id no task can have (it contains NUL) before it reaches the database.
fn possible_id(id: &str) -> Result<(), ApiError> {
    if id.contains(NUL) {
        return Err(not_found(id));
    }
    Ok(())
}

/// A body as `T`, its text made storable: NUL in any string or key becomes U+FFFD
/// (PostgreSQL text and jsonb cannot hold NUL; the document says so).
fn read_body<T: serde::de::DeserializeOwned>(mut body: Value) -> Result<T, ApiError> {
    storable(&mut body);
    serde_json::from_value(body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// Query of the event routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Only events with a larger sequence number (default 0: from the first).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// At most this many (default 1000; 0 counts as 1, more than 10000 as 10000).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_u64)]
    limit: Option<u32>,
}

/// Default number of events per answer.
const DEFAULT_EVENTS: u32 = 1000;
/// Most events per answer: one answer stays one quick query.
const MAX_EVENTS: u32 = 10_000;
/// Events read per query while streaming.
const STREAM_BATCH: i64 = 100;
/// How long a stream waits for a wake-up before it reads again anyway (a standby replica is
/// never woken: it reads at this pace).
const STREAM_FALLBACK: Duration = Duration::from_secs(1);

impl EventsQuery {
    /// `after`, refused when negative (sequence numbers start at 1).
    fn after(&self) -> Result<i64, ApiError> {
        match self.after {
            Some(after) if after < 0 => Err(ApiError::invalid(format!(
                "`after` must be 0 or more (got {after})"
            ))),
            after => Ok(after.unwrap_or(0)),
        }
    }
}

/// A task's event log.
#[derive(Debug, Serialize, ToSchema)]
struct TaskEvents {
    /// The task.
    task_id: String,
    /// In order of their sequence numbers.
    events: Vec<TaskEvent>,
}

/// A task's event log (gap-free sequence numbers from 1).
#[utoipa::path(
    get,
    path = "/api/tasks/{id}/events",
    operation_id = "task_events",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id"), EventsQuery),
    responses(
        (status = 200, description = "events in order", body = TaskEvents),
        (status = 400, description = "a negative `after`, or an invalid limit", body = ErrorBody),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn task_events(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
) -> Result<Json<TaskEvents>, ApiError> {
    let after = q.after()?;
    let limit = i64::from(q.limit.unwrap_or(DEFAULT_EVENTS).clamp(1, MAX_EVENTS));
    readable_task(&engine, &caller, &id).await?;
    let events = engine.store.events(&id, after, limit).await?;
    Ok(Json(TaskEvents {
        task_id: id,
        events,
    }))
}

/// One attempt at delivering a callback.
#[derive(Debug, Serialize, ToSchema)]
struct CallbackAttempt {
    /// 1 for the first attempt; redeliveries go on counting.
    attempt: i32,
    /// When it started (RFC 3339).
    at: String,
    /// How long it took.
    duration_ms: i64,
    /// The receiver's HTTP status, if it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<i32>,
    /// Why it did not deliver.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// A callback and its delivery log.
#[derive(Debug, Serialize, ToSchema)]
struct CallbackView {
    /// Its `webhook-id`: `<task_id>:<event seq>`.
    callback_id: String,
    /// The URL.
    target: String,
    /// `pending`, `delivered`, `gone` (the receiver answered 410) or `dead` (attempts ran out).
    state: String,
    /// The CallbackNotification sent, byte for byte as signed.
    #[schema(value_type = Object)]
    notification: Value,
    /// Attempts made.
    attempts: i32,
    /// When a pending callback is tried next (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    next_attempt_at: Option<String>,
    /// When it was written (RFC 3339).
    created_at: String,
    /// The last change (RFC 3339).
    updated_at: String,
    /// Every attempt, in order.
    log: Vec<CallbackAttempt>,
}

/// A task's callbacks.
#[derive(Debug, Serialize, ToSchema)]
struct TaskCallbacks {
    /// The task.
    task_id: String,
    /// In the order they were written.
    callbacks: Vec<CallbackView>,
}

/// A task's callbacks (one per state its requester is told of over HTTP) and every delivery
/// attempt.
#[utoipa::path(
    get,
    path = "/api/tasks/{id}/callbacks",
    operation_id = "task_callbacks",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    responses(
        (status = 200, description = "the callbacks and their delivery logs", body = TaskCallbacks),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn task_callbacks(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<TaskCallbacks>, ApiError> {
    readable_task(&engine, &caller, &id).await?;
    let (callbacks, attempts) = engine.store.callbacks(&id).await?;
    let callbacks = callbacks
        .into_iter()
        .map(|c| CallbackView {
            log: attempts
                .iter()
                .filter(|a| a.callback_id == c.callback_id)
                .map(|a| CallbackAttempt {
                    attempt: a.attempt,
                    at: rfc3339(a.at_ms),
                    duration_ms: a.duration_ms,
                    status: a.status,
                    error: a.error.clone(),
                })
                .collect(),
            notification: serde_json::from_str(&c.payload).unwrap_or(Value::String(c.payload)),
            next_attempt_at: (c.state == "pending").then(|| rfc3339(c.next_attempt_ms)),
            callback_id: c.callback_id,
            target: c.target,
            state: c.state,
            attempts: c.attempts,
            created_at: rfc3339(c.created_ms),
            updated_at: rfc3339(c.updated_ms),
        })
        .collect();
    Ok(Json(TaskCallbacks {
        task_id: id,
        callbacks,
    }))
}

/// How many callbacks were queued again.
#[derive(Debug, Serialize, ToSchema)]
struct Redelivered {
    /// The task.
    task_id: String,
    /// Callbacks queued again (delivered, gone or dead ones), each with a fresh budget.
    requeued: u64,
}

/// Queues a task's callbacks that are no longer pending (delivered, gone or dead-lettered)
/// again, each with a fresh budget of attempts and the same `webhook-id`.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/callbacks/redeliver",
    operation_id = "redeliver_callbacks",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    responses(
        (status = 202, description = "queued again", body = Redelivered),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "the task has no callback that is not pending", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn redeliver_callbacks(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Redelivered>), ApiError> {
    readable_task(&engine, &caller, &id).await?;
    let requeued = engine.store.redeliver_callbacks(&id).await?;
    if requeued == 0 {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("task '{id}' has no callback to deliver again (none, or all still pending)"),
        ));
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(Redelivered {
            task_id: id,
            requeued,
        }),
    ))
}

/// A task's event log as Server-Sent Events from `after` (or the `Last-Event-ID` header), one
/// event per entry with its sequence number as id; ends after the terminal event.
#[utoipa::path(
    get,
    path = "/api/tasks/{id}/events/stream",
    operation_id = "task_event_stream",
    tag = "tasks",
    params(
        ("id" = String, Path, description = "the task id"),
        ("after" = Option<i64>, Query, minimum = 0, description = "only events with a larger sequence number"),
        ("Last-Event-ID" = Option<String>, Header, description = "resume after this sequence number (wins over `after`; ignored unless a whole number)"),
    ),
    responses(
        (status = 200, description = "an event stream, one event per log entry", content_type = "text/event-stream", body = StreamedEvent),
        (status = 400, description = "a negative `after`", body = ErrorBody),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 429, description = WATCHERS_FULL, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn task_event_stream(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let after = q.after()?;
    readable_task(&engine, &caller, &id).await?;
    let last_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    let after = last_id.unwrap_or(after);
    let watcher = engine.watch.watch(&id)?;
    let stream = futures::stream::unfold(
        (engine, watcher, id, after, false),
        |(engine, watcher, id, after, done)| async move {
            if done {
                return None;
            }
            let events = match next_events(&engine, &watcher, &id, after, STREAM_FALLBACK).await {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!("event stream read failed: {e}");
                    return None;
                }
            };
            let last: &TaskEvent = events.last()?;
            let next_after = last.seq;
            let finished = last.state.is_terminal();
            let batch: Vec<Result<Event, Infallible>> =
                events.iter().filter_map(sse_event).map(Ok).collect();
            Some((
                futures::stream::iter(batch),
                (engine, watcher, id, next_after, finished),
            ))
        },
    );
    use futures::StreamExt;
    Ok(Sse::new(stream.flatten()).keep_alive(KeepAlive::default()))
}

/// Task `id`'s events after `after` (at least one): read now, else once the leader commits
/// the next ones (or after `fallback`, on a standby replica).
async fn next_events(
    engine: &Engine,
    watcher: &Watcher,
    id: &str,
    after: i64,
    fallback: Duration,
) -> Result<Vec<TaskEvent>, StoreError> {
    watcher
        .next(fallback, move || async move {
            let events = engine.store.events(id, after, STREAM_BATCH).await?;
            Ok((!events.is_empty()).then_some(events))
        })
        .await
}

/// One Server-Sent Event of `GET /api/tasks/{id}/events/stream`, as the document describes it
/// (the stream is written by [`sse_event`]).
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
struct StreamedEvent {
    /// The entry's sequence number.
    #[schema(pattern = "^[0-9]+$")]
    id: String,
    /// The entry's kind (`submitted`, `dispatched`, …).
    event: String,
    /// The entry, a TaskEvent as JSON.
    #[schema(content_media_type = "application/json")]
    data: String,
}

/// One log entry as a Server-Sent Event; `None` (logged) if it cannot be written as JSON.
fn sse_event(event: &TaskEvent) -> Option<Event> {
    match Event::default()
        .id(event.seq.to_string())
        .event(event.kind.clone())
        .json_data(event)
    {
        Ok(sse) => Some(sse),
        Err(e) => {
            tracing::error!(
                "event {} of task {} cannot be written as JSON: {e}",
                event.seq,
                event.task_id
            );
            None
        }
    }
}

/// Body of `POST /api/tasks/{id}/cancel`.
#[derive(Debug, Default, Deserialize, ToSchema)]
struct CancelBody {
    /// Why (default "requested over REST").
    reason: Option<String>,
}

/// Cancels a live task; its executor (and a client requester) get task_end.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/cancel",
    operation_id = "cancel_task",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    request_body(content = Option<CancelBody>, description = "optional; `null` is no body"),
    responses(
        (status = 200, description = "the canceled task", body = TaskView),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "the task has already ended", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn cancel_task(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    body: Option<JsonBody<Value>>,
) -> Result<Json<TaskView>, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: Option<CancelBody> = match body {
        Some(JsonBody(body)) => read_body(body)?,
        None => None,
    };
    let reason = body
        .and_then(|b| b.reason)
        .unwrap_or_else(|| "requested over REST".to_owned());
    let task = engine.cancel(&id, &reason).await?;
    Ok(Json(task.view()))
}

/// Body of `POST /api/tasks/{id}/commands`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct CommandsBody {
    /// The commands, sent in one `command` frame.
    #[schema(min_items = 1)]
    actions: Vec<Command>,
    /// The UFO agent to run them (default: the platform's agent).
    agent_name: Option<String>,
    /// Passed through to the device.
    process_name: Option<String>,
    /// Passed through to the device.
    root_name: Option<String>,
    /// How long to wait for the results (default 60 s; 0 counts as 1, more than 600 as 600).
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 4294967295_u64)]
    #[serde(default, deserialize_with = "optional_whole_number")]
    timeout_secs: Option<u32>,
}

/// Default wait for a command's results.
const DEFAULT_COMMAND_WAIT_SECS: u32 = 60;
/// Longest wait for a command's results: a REST caller should not hold a request longer.
const MAX_COMMAND_WAIT_SECS: u32 = 600;
/// How long the wait for results waits for a wake-up before it reads again anyway.
const COMMAND_FALLBACK: Duration = Duration::from_secs(1);

/// The results of one `POST /api/tasks/{id}/commands`.
#[derive(Debug, Serialize, ToSchema)]
struct CommandResults {
    /// The `response_id` of the command frame the results answer.
    response_id: String,
    /// The `status` of the results frame, as the device sent it.
    status: Value,
    /// One Result per command, in order, as the device sent them.
    #[schema(value_type = Vec<ActionResult>)]
    results: Value,
}

/// A tool call on the executor of a requester-driven task (submitted with `"driver": true`):
/// sends the commands and waits for their results.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/commands",
    operation_id = "send_commands",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    request_body = CommandsBody,
    responses(
        (status = 200, description = "the results, one per command, in order", body = CommandResults),
        (status = 400, description = "no actions, or an invalid body", body = ErrorBody),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "not a driver task, not running, a command still pending, or the task ended before the results came", body = ErrorBody),
        (status = 429, description = WATCHERS_FULL, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
        (status = 504, description = "no results in time (TASK_TIMEOUT); the command stays pending", body = ErrorBody),
    )
)]
async fn send_commands(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> Result<Json<CommandResults>, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: CommandsBody = read_body(body)?;
    if body.actions.is_empty() {
        return Err(ApiError::invalid("`actions` must not be empty"));
    }
    let wait_secs = body
        .timeout_secs
        .unwrap_or(DEFAULT_COMMAND_WAIT_SECS)
        .clamp(1, MAX_COMMAND_WAIT_SECS);
    let wait = Duration::from_secs(u64::from(wait_secs));
    let step = proto_schemas::sessions::PlanStep::Commands {
        actions: body.actions,
        agent_name: body.agent_name,
        process_name: body.process_name,
        root_name: body.root_name,
    };
    let watcher = engine.watch.watch(&id)?;
    let (response_id, sent_seq) = engine.send_commands(&id, step).await?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut after = sent_seq;
    loop {
        let next = next_events(&engine, &watcher, &id, after, COMMAND_FALLBACK);
        let Ok(events) = tokio::time::timeout_at(deadline, next).await else {
            return Err(ApiError::new(
                ErrorCode::TaskTimeout,
                format!(
                    "no results for command `{response_id}` within {} s; it is still pending",
                    wait.as_secs()
                ),
            ));
        };
        for event in events? {
            after = event.seq;
            let answers = event
                .data
                .as_ref()
                .and_then(|d| d.get("response_id"))
                .and_then(Value::as_str);
            if event.kind == "results_received" && answers == Some(response_id.as_str()) {
                let data = event.data.unwrap_or_default();
                return Ok(Json(CommandResults {
                    response_id,
                    status: data["status"].clone(),
                    results: data["results"].clone(),
                }));
            }
            if event.state.is_terminal() {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "task '{id}' ended ({}) before the results came",
                        event.state.as_str()
                    ),
                ));
            }
        }
    }
}

/// Body of `POST /api/tasks/{id}/complete`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct CompleteBody {
    /// The task's result.
    result: Option<Value>,
    /// Set to end the task as failed, with this reason.
    error: Option<String>,
}

/// Ends a requester-driven task, completed (or failed with `error`).
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/complete",
    operation_id = "complete_task",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    request_body = CompleteBody,
    responses(
        (status = 200, description = "the ended task", body = TaskView),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "not a driver task, or already ended", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn complete_task(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> Result<Json<TaskView>, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: CompleteBody = read_body(body)?;
    let task = engine.complete(&id, body.result, body.error).await?;
    Ok(Json(task.view()))
}

/// Body of `POST /api/tasks/{id}/clarifications/{clarification_id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct AnswerBody {
    /// The answer; not blank.
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    answer: String,
    /// Structured detail.
    #[serde(default)]
    data: Option<Value>,
    /// Who answers (shown as `rest:<name>`; default `api`).
    #[serde(default)]
    #[schema(nullable = false)]
    provided_by: Option<String>,
}

/// Body of `POST /api/tasks/{id}/clarifications`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct AskBody {
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    question: String,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    #[schema(nullable = false, min_length = 1, max_length = 256)]
    clarification_id: Option<String>,
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 4294967295_u64)]
    #[serde(default, deserialize_with = "optional_whole_number")]
    timeout_secs: Option<u32>,
    #[serde(default)]
    #[schema(nullable = false)]
    asked_by: Option<String>,
}

/// The driver of a requester-driven task (submitted with `"driver": true`) asks its requester
/// a question between commands: the task goes to `input_required` until the answer
/// (`POST /api/tasks/{id}/clarifications/{clarification_id}`, or a `clarification_response`
/// frame from a requester that announced the extension), then waits for the next command.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/clarifications",
    operation_id = "ask_clarification",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    request_body = AskBody,
    responses(
        (status = 201, description = "the task, waiting for the answer (its `clarification` is the question)", body = TaskView),
        (status = 400, description = "an empty question, or a body of the wrong shape", body = ErrorBody),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "not a driven task, a command's results or another answer are awaited, or the task has ended", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn ask_clarification(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> Result<Response, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: AskBody = read_body(whole_numbers(body, &["timeout_secs"]))?;
    if body.question.trim().is_empty() {
        return Err(ApiError::invalid("`question` must not be empty"));
    }
    if body.timeout_secs == Some(0) {
        return Err(ApiError::invalid("`timeout_secs` must be at least 1"));
    }
    if body
        .clarification_id
        .as_ref()
        .is_some_and(|q| q.is_empty() || q.len() > proto_schemas::MAX_ID_BYTES)
    {
        return Err(ApiError::invalid(format!(
            "`clarification_id` must be 1 to {} bytes",
            proto_schemas::MAX_ID_BYTES
        )));
    }
    let question = DriverQuestion {
        id: body.clarification_id,
        text: body.question,
        data: body.data,
        by: format!(
            "rest:{}",
            body.asked_by
                .unwrap_or_else(|| caller.requester_or("api").to_owned())
        ),
        timeout_secs: body.timeout_secs.map(u64::from),
    };
    let task = engine.ask_as_driver(&id, question).await?;
    Ok((StatusCode::CREATED, Json(task.view())).into_response())
}

/// Answers a task's open question (`input_required`, see `clarification` in the task): the
/// task goes on in `working`, and the answer reaches whoever asked (the executor by frame, or
/// the planner in its next request). Accepted once.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/clarifications/{clarification_id}",
    operation_id = "answer_clarification",
    tag = "tasks",
    params(
        ("id" = String, Path, description = "the task id"),
        ("clarification_id" = String, Path, description = "the open question's id"),
    ),
    request_body = AnswerBody,
    responses(
        (status = 200, description = "the task, going on", body = TaskView),
        (status = 400, description = "an empty answer, or a body of the wrong shape", body = ErrorBody),
        (status = 404, description = NO_TASK, body = ErrorBody),
        (status = 409, description = "not the open question (answered already, or another one), or the task has ended", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn answer_clarification(
    State(engine): State<Engine>,
    caller: Caller,
    Path((id, clarification_id)): Path<(String, String)>,
    JsonBody(body): JsonBody<Value>,
) -> Result<Json<TaskView>, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: AnswerBody = read_body(body)?;
    let answer = Answer {
        clarification_id,
        text: body.answer,
        data: body.data,
        by: Answerer::Rest(body.provided_by.unwrap_or_else(|| "api".to_owned())),
    };
    let task = engine.answer_question(&id, answer).await?;
    Ok(Json(task.view()))
}

/// Body of `POST /api/tasks/{id}/handoff`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct HandoffBody {
    /// The agent to take it.
    #[serde(default)]
    #[schema(nullable = false)]
    target_id: Option<String>,
    /// Otherwise, an available agent with all of these.
    #[serde(default)]
    required_capabilities: Vec<String>,
    /// Why; not blank.
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    reason: String,
    /// Who asks (shown as `rest:<name>`; default `api`).
    #[serde(default)]
    #[schema(nullable = false)]
    requested_by: Option<String>,
}

/// Hands a task to another agent, by id or by capability. Its id, request, data and results
/// so far stay; the old executor is released (and gets `task_end` saying where the task went);
/// the new one goes on from the current step; the requester is told (a `handoff` frame if it
/// announced the extension, a callback if it gave one). Refused, the task stays where it was.
#[utoipa::path(
    post,
    path = "/api/tasks/{id}/handoff",
    operation_id = "handoff_task",
    tag = "tasks",
    params(("id" = String, Path, description = "the task id")),
    request_body = HandoffBody,
    responses(
        (status = 200, description = "the task on its new executor", body = TaskView),
        (status = 400, description = "no `target_id` nor capabilities, a blank reason, or a body of the wrong shape", body = ErrorBody),
        (status = 404, description = "no task with this id, or the target device is not connected", body = ErrorBody),
        (status = 409, description = "the task has ended, waits for an answer, already runs there, reached `max_handoffs`, or the target runs all the tasks it may", body = ErrorBody),
        (status = 422, description = "no other available agent has the capabilities", body = ErrorBody),
        (status = 503, description = "the registry or database is unavailable", body = ErrorBody),
    )
)]
async fn handoff_task(
    State(engine): State<Engine>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> Result<Json<TaskView>, ApiError> {
    changeable_task(&engine, &caller, &id).await?;
    let body: HandoffBody = read_body(body)?;
    may_target(
        &engine,
        &caller,
        body.target_id.as_deref(),
        &body.required_capabilities,
    )
    .await?;
    let to = match body.target_id {
        Some(target) => Placement::Target(target),
        None => Placement::Capabilities(body.required_capabilities),
    };
    let by = format!(
        "rest:{}",
        body.requested_by.unwrap_or_else(|| "api".to_owned())
    );
    let task = engine.handoff(&id, to, body.reason, by).await?;
    Ok(Json(task.view()))
}

/// Body of UFO's `POST /api/dispatch`, as documented. The handler reads it as JSON itself, to
/// answer each mistake with UFO's words and in UFO's order.
#[derive(Debug, ToSchema)]
#[allow(dead_code)]
struct DispatchRequest {
    /// The online device to run the task.
    #[schema(min_length = 1)]
    client_id: String,
    /// What to do, in words; not blank.
    #[schema(
        pattern = r"[^\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    )]
    request: String,
    /// A name for the task (`[A-Za-z0-9._-]`, not starting with `.`); the result lookup uses it.
    #[schema(nullable = false, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]*$")]
    task_name: Option<String>,
    /// Extension: scripted steps, the command rounds to send in order.
    #[schema(nullable = false)]
    steps: Option<Vec<Vec<Command>>>,
    /// Extension: who plans the task when it has no `steps` (default: the broker's).
    #[schema(nullable = false)]
    planner: Option<PlannerName>,
}

/// What UFO's dispatch answers.
#[derive(Debug, Serialize, ToSchema)]
struct Dispatched {
    /// Always `dispatched`.
    #[schema(pattern = "^dispatched$")]
    status: &'static str,
    /// The task's name (given or chosen).
    task_name: String,
    /// The device.
    client_id: String,
    /// The task id, also its AIP session id.
    session_id: String,
}

/// UFO's dispatch: send a task to an online device, which echoes it and is then driven.
#[utoipa::path(
    post,
    path = "/api/dispatch",
    operation_id = "ufo_dispatch",
    tag = "ufo",
    request_body = DispatchRequest,
    responses(
        (status = 200, description = "dispatched", body = Dispatched),
        (status = 400, description = "Empty task content, Empty client ID, Invalid task_name, or steps that are not lists of Commands", body = ErrorBody),
        (status = 404, description = "Client not online", body = ErrorBody),
        (status = 409, description = "a task with this name is live", body = ErrorBody),
        (status = 422, description = "the body is not a JSON object", body = ErrorBody),
        (status = 429, description = QUOTA_FULL, body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn ufo_dispatch(
    State(engine): State<Engine>,
    caller: Caller,
    JsonBody(mut body): JsonBody<Value>,
) -> Result<Json<Dispatched>, ApiError> {
    storable(&mut body);
    let Some(object) = body.as_object() else {
        let body = ErrorBody::new(ErrorCode::InvalidRequest, "the body must be a JSON object");
        return Err(ApiError::WithStatus(StatusCode::UNPROCESSABLE_ENTITY, body));
    };
    let text = |key: &str| object.get(key).and_then(Value::as_str).map(str::to_owned);
    let request = text("request").unwrap_or_default();
    if request.trim().is_empty() {
        return Err(ApiError::invalid("Empty task content"));
    }
    let client_id = text("client_id").unwrap_or_default();
    if client_id.is_empty() {
        return Err(ApiError::invalid("Empty client ID"));
    }
    may_target(&engine, &caller, Some(&client_id), &[]).await?;
    let task_name = match object.get("task_name") {
        None => None,
        Some(Value::String(name)) if valid_task_name(name) => Some(name.clone()),
        Some(_) => {
            return Err(ApiError::invalid(TASK_NAME_RULE));
        }
    };
    let requested = match object.get("planner") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) if PlannerName::from_wire(name).is_some() => {
            PlannerName::from_wire(name)
        }
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "`planner` must be one of {} (got {other})",
                PlannerName::expected()
            )));
        }
    };
    let plan = match (object.get("steps"), requested) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("`planner` is for tasks without `steps`"));
        }
        (Some(steps), None) => {
            Plan::Scripted(serde_json::from_value(steps.clone()).map_err(|e| {
                ApiError::invalid(format!("`steps` must be lists of Commands: {e}"))
            })?)
        }
        (None, requested) => Plan::Planner(engine.planners().choose(requested)?),
    };
    let new = NewTask {
        task_name,
        ufo_dispatch: true,
        allowance: allowance(&caller),
        ..NewTask::new(
            request,
            Requester::Rest(caller.requester_or("dispatch").to_owned()),
            Placement::Target(client_id.clone()),
            plan,
        )
    };
    let started = engine.submit(new).await.map_err(|e| match e {
        EngineError::Refused(body) if body.error_code == ErrorCode::DeviceNotFound => {
            ApiError::new(ErrorCode::DeviceNotFound, "Client not online")
        }
        other => other.into(),
    })?;
    Ok(Json(Dispatched {
        status: "dispatched",
        task_name: started.task.task_name,
        client_id,
        session_id: started.task.task_id,
    }))
}

/// What UFO's result lookup answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
enum UfoTaskResult {
    /// The task has not ended.
    Pending,
    /// The task has ended.
    Done {
        /// Its result (`null` when it has none).
        result: Option<Value>,
        /// How it ended.
        state: TaskState,
        /// The task id.
        session_id: String,
        /// Why it failed, was cancelled or rejected.
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// UFO's result lookup by task name (the newest task of that name).
#[utoipa::path(
    get,
    path = "/api/task_result/{task_name}",
    operation_id = "ufo_task_result",
    tag = "ufo",
    params(("task_name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]*$", description = "the task's name")),
    responses(
        (status = 200, description = "pending, or done with the result", body = UfoTaskResult),
        (status = 400, description = "invalid task name", body = ErrorBody),
        (status = 404, description = "no task of that name", body = ErrorBody),
        (status = 503, description = DATABASE_DOWN, body = ErrorBody),
    )
)]
async fn ufo_task_result(
    State(engine): State<Engine>,
    caller: Caller,
    Path(task_name): Path<String>,
) -> Result<Json<UfoTaskResult>, ApiError> {
    if !valid_task_name(&task_name) {
        return Err(ApiError::invalid(TASK_NAME_RULE));
    }
    let task = engine
        .store
        .get_by_name(&task_name)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no task named '{task_name}'")))?;
    allowed(&caller, &task.task_id, task.requester.id())?;
    let state = task.state();
    if !state.is_terminal() {
        return Ok(Json(UfoTaskResult::Pending));
    }
    Ok(Json(UfoTaskResult::Done {
        result: task.result_value(),
        state,
        session_id: task.task_id,
        error: task.error.map(|e| e.detail),
    }))
}

/// The OpenAPI 3.1 document of this API, generated from the handlers' annotations and types.
pub fn openapi() -> OpenApi {
    let mut document = OpenApiRouter::<Engine>::with_openapi(info())
        .merge(api_routes())
        .into_openapi();
    aip_runtime::api_error::document(&mut document);
    task_request_rules(&mut document);
    dispatch_rules(&mut document);
    handoff_rules(&mut document);
    add_links(&mut document);
    document
}

fn info() -> OpenApi {
    let mut document = OpenApi::default();
    document.info.title = "aip-sessions".to_owned();
    document.info.version = env!("CARGO_PKG_VERSION").to_owned();
    document.info.description = Some(
        "Tasks of the aip broker: submit, follow, cancel, and read results. `/api/*` needs \
         an API key (`X-API-Key` or `Authorization: Bearer`) when keys are configured. \
         A NUL (U+0000) in the text of a body is stored as U+FFFD."
            .to_owned(),
    );
    document.info.license = None;
    document.info.contact = None;
    document
}

/// The rules of a [`TaskRequest`] that its type cannot say (`new_task_from_request` enforces
/// them), added to the body of `POST /api/tasks`: a `target_id` or at least one required
/// capability; `steps` or `driver: true`, not both; `planner` only without either.
fn task_request_rules(document: &mut OpenApi) {
    use utoipa::openapi::schema::{
        AllOfBuilder, AnyOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type,
    };
    use utoipa::openapi::{Ref, RefOr};
    let Some(body) = document
        .paths
        .paths
        .get_mut("/api/tasks")
        .and_then(|item| item.post.as_mut())
        .and_then(|post| post.request_body.as_mut())
    else {
        return;
    };
    let RefOr::T(body) = body else { return };
    let Some(RefOr::T(content)) = body.content.get_mut("application/json") else {
        return;
    };
    let with_property = |name: &str, schema: Schema, required: bool| {
        let mut object = ObjectBuilder::new().property(name, schema);
        if required {
            object = object.required(name);
        }
        Schema::Object(object.build())
    };
    let placement = AnyOfBuilder::new()
        .item(with_property(
            "target_id",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .build()
                .into(),
            true,
        ))
        .item(with_property(
            "required_capabilities",
            ArrayBuilder::new()
                .items(ObjectBuilder::new().schema_type(Type::String))
                .min_items(Some(1))
                .build()
                .into(),
            true,
        ))
        .description(Some("a target or at least one capability"));
    let plan = AnyOfBuilder::new()
        .item(with_property(
            "steps",
            ObjectBuilder::new().schema_type(Type::Null).build().into(),
            false,
        ))
        .item(with_property(
            "driver",
            ObjectBuilder::new()
                .schema_type(Type::Boolean)
                .enum_values(Some([false]))
                .build()
                .into(),
            false,
        ))
        .description(Some("`steps` or `driver: true`, not both"));
    let null = || ObjectBuilder::new().schema_type(Type::Null).build();
    let planned = AnyOfBuilder::new()
        .item(with_property("planner", null().into(), false))
        .item(Schema::Object(
            ObjectBuilder::new()
                .property("steps", null())
                .property(
                    "driver",
                    ObjectBuilder::new()
                        .schema_type(Type::Boolean)
                        .enum_values(Some([false])),
                )
                .build(),
        ))
        .description(Some("`planner` only without `steps` and `driver: true`"));
    let callback = AnyOfBuilder::new()
        .item(with_property("callback_url", null().into(), false))
        .item(with_property("callback_agent", null().into(), false))
        .description(Some("`callback_url` or `callback_agent`, not both"));
    content.schema = Some(
        AllOfBuilder::new()
            .item(Ref::from_schema_name("TaskRequest"))
            .item(placement)
            .item(plan)
            .item(planned)
            .item(callback)
            .into(),
    );
    // The callback URL's form (its address is checked too: see `callback_allow_private`).
    if let Some(components) = document.components.as_mut()
        && let Some(RefOr::T(Schema::Object(request))) = components.schemas.get_mut("TaskRequest")
        && let Some(RefOr::T(Schema::Object(url))) = request.properties.get_mut("callback_url")
    {
        url.pattern = Some(crate::callbacks::CALLBACK_URL_PATTERN.to_owned());
    }
}

/// Narrows the JSON body of `POST path` to `schema` (by name) and also `rule`: a rule its
/// type cannot say.
fn restrict_body(
    document: &mut OpenApi,
    path: &str,
    schema: &str,
    rule: utoipa::openapi::schema::AnyOfBuilder,
) {
    use utoipa::openapi::schema::AllOfBuilder;
    use utoipa::openapi::{Ref, RefOr};
    let Some(RefOr::T(body)) = document
        .paths
        .paths
        .get_mut(path)
        .and_then(|item| item.post.as_mut())
        .and_then(|post| post.request_body.as_mut())
    else {
        return;
    };
    let Some(RefOr::T(content)) = body.content.get_mut("application/json") else {
        return;
    };
    content.schema = Some(
        AllOfBuilder::new()
            .item(Ref::from_schema_name(schema))
            .item(rule)
            .into(),
    );
}

/// The rule of a handoff body that its type cannot say: a target or at least one capability.
fn handoff_rules(document: &mut OpenApi) {
    use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type};
    let target = ObjectBuilder::new()
        .property("target_id", ObjectBuilder::new().schema_type(Type::String))
        .required("target_id")
        .build();
    let capabilities = ObjectBuilder::new()
        .property(
            "required_capabilities",
            ArrayBuilder::new()
                .items(ObjectBuilder::new().schema_type(Type::String))
                .min_items(Some(1)),
        )
        .required("required_capabilities")
        .build();
    let where_to = AnyOfBuilder::new()
        .item(Schema::Object(target))
        .item(Schema::Object(capabilities))
        .description(Some("a target or at least one capability"));
    restrict_body(document, "/api/tasks/{id}/handoff", "HandoffBody", where_to);
}

/// The rules of a dispatch body that its type cannot say: `planner` only without `steps`.
fn dispatch_rules(document: &mut OpenApi) {
    use utoipa::openapi::schema::{AnyOfBuilder, ObjectBuilder, Schema, Type};
    let absent = |name: &str| {
        Schema::Object(
            ObjectBuilder::new()
                .property(name, ObjectBuilder::new().schema_type(Type::Null))
                .build(),
        )
    };
    let one_plan = AnyOfBuilder::new()
        .item(absent("planner"))
        .item(absent("steps"))
        .description(Some("`planner` only without `steps`"));
    restrict_body(document, "/api/dispatch", "DispatchRequest", one_plan);
}

/// Links from the answers that name a task to the routes about that task, so a client (or a
/// stateful fuzzer) can follow from a new or listed task to its state, events and changes.
fn add_links(document: &mut OpenApi) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::link::LinkBuilder;
    /// Routes about one task, by operation id, with the parameter naming it.
    const ABOUT_A_TASK: &[&str] = &[
        "get_task",
        "task_events",
        "cancel_task",
        "send_commands",
        "complete_task",
    ];
    let mut add =
        |path: &str, post: bool, status: &str, links: Vec<(String, &str, &str, String)>| {
            let Some(item) = document.paths.paths.get_mut(path) else {
                return;
            };
            let operation = if post {
                item.post.as_mut()
            } else {
                item.get.as_mut()
            };
            let Some(RefOr::T(response)) =
                operation.and_then(|o| o.responses.responses.get_mut(status))
            else {
                return;
            };
            for (name, operation_id, parameter, expression) in links {
                response.links.insert(
                    name,
                    LinkBuilder::new()
                        .operation_id(operation_id)
                        .parameter(parameter, expression)
                        .build()
                        .into(),
                );
            }
        };
    let about = |from: &str, expression: &str| {
        ABOUT_A_TASK
            .iter()
            .map(|op| (format!("{from}_{op}"), *op, "id", expression.to_owned()))
            .collect::<Vec<_>>()
    };
    let mut created = about("created", "$response.body#/task_id");
    created.push((
        "created_ufo_task_result".to_owned(),
        "ufo_task_result",
        "task_name",
        "$response.body#/task_name".to_owned(),
    ));
    add("/api/tasks", true, "201", created);
    let mut listed = about("listed", "$response.body#/tasks/0/task_id");
    listed.push((
        "next_page".to_owned(),
        "list_tasks",
        "cursor",
        "$response.body#/next_cursor".to_owned(),
    ));
    add("/api/tasks", false, "200", listed);
    add("/api/dispatch", true, "200", {
        let mut dispatched = about("dispatched", "$response.body#/session_id");
        dispatched.push((
            "dispatched_ufo_task_result".to_owned(),
            "ufo_task_result",
            "task_name",
            "$response.body#/task_name".to_owned(),
        ));
        dispatched
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn whole_numbers_written_with_a_fraction_are_integers() {
        let body = whole_numbers(
            json!({ "version": 1.0, "priority": -3.0, "timeout_secs": 2.5, "data": 1.0 }),
            WHOLE_NUMBER_FIELDS,
        );
        assert_eq!(
            body,
            json!({ "version": 1, "priority": -3, "timeout_secs": 2.5, "data": 1.0 })
        );
        assert_eq!(as_whole_number(&json!(1.8446744073709552e19)), None);
    }

    #[test]
    fn cursors_are_what_next_cursor_gives() {
        assert_eq!(parse_cursor("17:a:b"), Some((17, "a:b".to_owned())));
        for bad in ["x:1", ":1", "1234567890123456789:a", "1", "1:a\0"] {
            assert_eq!(parse_cursor(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn nul_is_stored_as_the_replacement_character() {
        let mut body = json!({ "a\u{0}": ["x\u{0}y", { "k": "\u{0}" }], "n": 1 });
        storable(&mut body);
        assert_eq!(
            body,
            json!({ "a\u{FFFD}": ["x\u{FFFD}y", { "k": "\u{FFFD}" }], "n": 1 })
        );
    }
}
