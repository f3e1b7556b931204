//! The session service's REST API.
//!
//! Richer routes under `/api/tasks` and UFO's `POST /api/dispatch` and
//! `GET /api/task_result/{task_name}` with their exact shapes. Every error is
//! `{"detail": …, "error_code": …}` with the status of its code. The OpenAPI document is
//! [`openapi`], served at `/openapi.json` and checked in as `services/sessions/openapi.json`.

use std::convert::Infallible;
use std::time::Duration;

use aip_runtime::api_keys::{self, ApiKeys};
use aip_runtime::health::{self, Check, CheckName, Probes, Readiness, Role};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use futures::Stream;
use proto_schemas::flow::TaskRequest;
use proto_schemas::sessions::{TaskEvent, TaskState, TaskView};
use proto_schemas::{ErrorBody, ErrorCode};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{
    Engine, EngineError, NewTask, Placement, Plan, Requester, TASK_NAME_RULE, valid_task_name,
};
use crate::store::{ListFilter, StoreError};
use crate::workers::new_task_from_request;

/// Why a REST request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Refused with a code (bad input, unknown task, conflict, …).
    #[error("{0}")]
    Refused(ErrorBody),
    /// Refused with a status other than the code's usual one (UFO's 422 for a body that is
    /// not an object).
    #[error("{1}")]
    WithStatus(StatusCode, ErrorBody),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ApiError {
    fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        ApiError::Refused(ErrorBody::new(code, detail))
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Refused(body) => ApiError::Refused(body),
            EngineError::Store(e) => ApiError::Store(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match self {
            ApiError::WithStatus(status, body) => return (status, Json(body)).into_response(),
            ApiError::Refused(body) => body,
            ApiError::Store(e) => {
                tracing::error!("REST request failed: {e}");
                ErrorBody::new(
                    ErrorCode::Unavailable,
                    "the task database is unavailable; retry shortly",
                )
            }
        };
        let status = StatusCode::from_u16(body.error_code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(body)).into_response()
    }
}

/// A JSON body whose rejection is an [`ApiError`] (422 for a body that is not the object).
pub struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Body<T> {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(rejection) => {
                let detail = format!("invalid JSON body: {}", rejection.body_text());
                let status = if rejection.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE {
                    StatusCode::UNSUPPORTED_MEDIA_TYPE
                } else {
                    StatusCode::UNPROCESSABLE_ENTITY
                };
                Err((
                    status,
                    Json(ErrorBody::new(ErrorCode::InvalidRequest, detail)),
                )
                    .into_response())
            }
        }
    }
}

/// The routes, with API keys required on `/api/*`.
pub fn router(engine: Engine, keys: ApiKeys) -> Router {
    let api = Router::new()
        .route("/api/tasks", post(create_task).get(list_tasks))
        .route("/api/tasks/{id}", get(get_task))
        .route("/api/tasks/{id}/events", get(task_events))
        .route("/api/tasks/{id}/events/stream", get(task_event_stream))
        .route("/api/tasks/{id}/cancel", post(cancel_task))
        .route("/api/tasks/{id}/commands", post(send_commands))
        .route("/api/tasks/{id}/complete", post(complete_task))
        .route("/api/dispatch", post(ufo_dispatch))
        .route("/api/task_result/{task_name}", get(ufo_task_result))
        .layer(middleware::from_fn_with_state(keys, api_keys::require));
    Router::new()
        .merge(api)
        .route("/openapi.json", get(|| async { Json(openapi()) }))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(ready))
        .with_state(engine)
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

async fn create_task(
    State(engine): State<Engine>,
    Body(request): Body<TaskRequest>,
) -> Result<Response, ApiError> {
    let new = new_task_from_request(request, Requester::Rest).map_err(ApiError::Refused)?;
    let started = engine.submit(new).await?;
    Ok((StatusCode::CREATED, Json(started.task.view())).into_response())
}

/// Query of `GET /api/tasks`.
#[derive(Debug, Deserialize)]
struct ListQuery {
    state: Option<String>,
    executor: Option<String>,
    requester: Option<String>,
    task_name: Option<String>,
    cursor: Option<String>,
    limit: Option<i64>,
}

async fn list_tasks(
    State(engine): State<Engine>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let state = match &q.state {
        None => None,
        Some(state) => Some(TaskState::from_wire(state).ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("unknown state {state:?}"),
            )
        })?),
    };
    let cursor = match &q.cursor {
        None => None,
        Some(c) => {
            let parsed = c
                .split_once(':')
                .and_then(|(ms, id)| ms.parse::<i64>().ok().map(|ms| (ms, id.to_owned())));
            Some(parsed.ok_or_else(|| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    "invalid cursor: use next_cursor as given",
                )
            })?)
        }
    };
    let limit = q.limit.unwrap_or(50).clamp(1, 500);
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
    let tasks: Vec<TaskView> = rows.iter().map(|r| r.view()).collect();
    Ok(Json(json!({ "tasks": tasks, "next_cursor": next_cursor })))
}

async fn get_task(
    State(engine): State<Engine>,
    Path(id): Path<String>,
) -> Result<Json<TaskView>, ApiError> {
    let task = engine.store.get(&id).await?.ok_or_else(|| not_found(&id))?;
    Ok(Json(task.view()))
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no task '{id}'"))
}

/// Query of the event routes.
#[derive(Debug, Deserialize)]
struct EventsQuery {
    after: Option<i64>,
    limit: Option<i64>,
}

async fn task_events(
    State(engine): State<Engine>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
) -> Result<Json<Value>, ApiError> {
    engine.store.get(&id).await?.ok_or_else(|| not_found(&id))?;
    let events = engine
        .store
        .events(
            &id,
            q.after.unwrap_or(0),
            q.limit.unwrap_or(1000).clamp(1, 10_000),
        )
        .await?;
    Ok(Json(json!({ "task_id": id, "events": events })))
}

/// Server-Sent Events of a task's log from `after` (or the `Last-Event-ID` header), one event
/// per entry with its sequence number as id; ends after the terminal event.
async fn task_event_stream(
    State(engine): State<Engine>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    engine.store.get(&id).await?.ok_or_else(|| not_found(&id))?;
    let last_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    let after = last_id.or(q.after).unwrap_or(0);
    let stream = futures::stream::unfold(
        (engine, id, after, false),
        |(engine, id, after, done)| async move {
            if done {
                return None;
            }
            loop {
                match engine.store.events(&id, after, 100).await {
                    Ok(events) if !events.is_empty() => {
                        let last: &TaskEvent = events.last()?;
                        let next_after = last.seq;
                        let finished = last.state.is_terminal();
                        let batch: Vec<Result<Event, Infallible>> = events
                            .iter()
                            .map(|e| {
                                Ok(Event::default()
                                    .id(e.seq.to_string())
                                    .event(e.kind.clone())
                                    .data(serde_json::to_string(e).unwrap_or_default()))
                            })
                            .collect();
                        return Some((
                            futures::stream::iter(batch),
                            (engine, id, next_after, finished),
                        ));
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    Err(e) => {
                        tracing::warn!("event stream read failed: {e}");
                        return None;
                    }
                }
            }
        },
    );
    use futures::StreamExt;
    Ok(Sse::new(stream.flatten()).keep_alive(KeepAlive::default()))
}

/// Body of `POST /api/tasks/{id}/cancel`.
#[derive(Debug, Default, Deserialize)]
struct CancelBody {
    reason: Option<String>,
}

async fn cancel_task(
    State(engine): State<Engine>,
    Path(id): Path<String>,
    body: Option<Json<CancelBody>>,
) -> Result<Json<TaskView>, ApiError> {
    let reason = body
        .and_then(|Json(b)| b.reason)
        .unwrap_or_else(|| "requested over REST".to_owned());
    let task = engine.cancel(&id, &reason).await?;
    Ok(Json(task.view()))
}

/// Body of `POST /api/tasks/{id}/commands`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandsBody {
    actions: Vec<proto_schemas::Command>,
    agent_name: Option<String>,
    process_name: Option<String>,
    root_name: Option<String>,
    /// How long to wait for the results (default 60 s, at most 600 s).
    timeout_secs: Option<u64>,
}

/// A tool call on the executor of a requester-driven task: sends the commands and waits for
/// their results (504 TASK_TIMEOUT if they do not come in time; the command stays pending).
async fn send_commands(
    State(engine): State<Engine>,
    Path(id): Path<String>,
    Body(body): Body<CommandsBody>,
) -> Result<Json<Value>, ApiError> {
    if body.actions.is_empty() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`actions` must not be empty",
        ));
    }
    let wait = Duration::from_secs(body.timeout_secs.unwrap_or(60).clamp(1, 600));
    let step = proto_schemas::sessions::PlanStep::Commands {
        actions: body.actions,
        agent_name: body.agent_name,
        process_name: body.process_name,
        root_name: body.root_name,
    };
    let (response_id, sent_seq) = engine.send_commands(&id, step).await?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut after = sent_seq;
    loop {
        for event in engine.store.events(&id, after, 100).await? {
            after = event.seq;
            let answers = event
                .data
                .as_ref()
                .and_then(|d| d.get("response_id"))
                .and_then(Value::as_str);
            if event.kind == "results_received" && answers == Some(response_id.as_str()) {
                let data = event.data.unwrap_or_default();
                return Ok(Json(
                    json!({ "response_id": response_id, "status": data["status"], "results": data["results"] }),
                ));
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
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::new(
                ErrorCode::TaskTimeout,
                format!(
                    "no results for command `{response_id}` within {} s; it is still pending",
                    wait.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Body of `POST /api/tasks/{id}/complete`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteBody {
    result: Option<Value>,
    /// Set to end the task as failed, with this reason.
    error: Option<String>,
}

/// Ends a requester-driven task.
async fn complete_task(
    State(engine): State<Engine>,
    Path(id): Path<String>,
    Body(body): Body<CompleteBody>,
) -> Result<Json<TaskView>, ApiError> {
    let task = engine.complete(&id, body.result, body.error).await?;
    Ok(Json(task.view()))
}

/// UFO's dispatch: send a task to an online device, which echoes it and is then driven.
async fn ufo_dispatch(
    State(engine): State<Engine>,
    Body(body): Body<Value>,
) -> Result<Json<Value>, ApiError> {
    let Some(object) = body.as_object() else {
        let body = ErrorBody::new(ErrorCode::InvalidRequest, "the body must be a JSON object");
        return Err(ApiError::WithStatus(StatusCode::UNPROCESSABLE_ENTITY, body));
    };
    let text = |key: &str| object.get(key).and_then(Value::as_str).map(str::to_owned);
    let request = text("request").unwrap_or_default();
    if request.trim().is_empty() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "Empty task content",
        ));
    }
    let client_id = text("client_id").unwrap_or_default();
    if client_id.is_empty() {
        return Err(ApiError::new(ErrorCode::InvalidRequest, "Empty client ID"));
    }
    let task_name = match object.get("task_name") {
        None => None,
        Some(Value::String(name)) if valid_task_name(name) => Some(name.clone()),
        Some(_) => {
            return Err(ApiError::new(ErrorCode::InvalidRequest, TASK_NAME_RULE));
        }
    };
    let plan = match object.get("steps") {
        Some(steps) => Plan::Scripted(serde_json::from_value(steps.clone()).map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("`steps` must be lists of Commands: {e}"),
            )
        })?),
        None => Plan::Remote,
    };
    let new = NewTask {
        task_name,
        ufo_dispatch: true,
        ..NewTask::new(
            request,
            Requester::Rest("dispatch".to_owned()),
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
    Ok(Json(json!({
        "status": "dispatched",
        "task_name": started.task.task_name,
        "client_id": client_id,
        "session_id": started.task.task_id,
    })))
}

/// UFO's result lookup by task name: `{"status":"pending"}` until the task ends, then
/// `{"status":"done","result":…}` (plus `state` and, for failures, `error`).
async fn ufo_task_result(
    State(engine): State<Engine>,
    Path(task_name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if !valid_task_name(&task_name) {
        return Err(ApiError::new(ErrorCode::InvalidRequest, TASK_NAME_RULE));
    }
    let task = engine.store.get_by_name(&task_name).await?.ok_or_else(|| {
        ApiError::new(ErrorCode::NotFound, format!("no task named '{task_name}'"))
    })?;
    if !task.state().is_terminal() {
        return Ok(Json(json!({ "status": "pending" })));
    }
    let mut body = json!({
        "status": "done",
        "result": task.result,
        "state": task.state().as_str(),
        "session_id": task.task_id,
    });
    if let Some(error) = &task.error {
        body["error"] = Value::from(error.detail.clone());
    }
    Ok(Json(body))
}

/// The OpenAPI 3.1 document of this API.
pub fn openapi() -> Value {
    let settings =
        schemars::generate::SchemaSettings::draft2020_12().with(|s| s.meta_schema = None);
    let components = proto_schemas::schema::components(settings, "/components/schemas/", |g| {
        vec![
            ("TaskRequest", g.subschema_for::<TaskRequest>().to_value()),
            ("TaskView", g.subschema_for::<TaskView>().to_value()),
            ("TaskEvent", g.subschema_for::<TaskEvent>().to_value()),
            ("ErrorBody", g.subschema_for::<ErrorBody>().to_value()),
            (
                "Command",
                g.subschema_for::<proto_schemas::Command>().to_value(),
            ),
            (
                "Result",
                g.subschema_for::<proto_schemas::ActionResult>().to_value(),
            ),
        ]
    });
    let error = |description: &str| json!({ "description": description, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ErrorBody" } } } });
    let ok = |description: &str, schema: Value| json!({ "description": description, "content": { "application/json": { "schema": schema } } });
    let task_ref = json!({ "$ref": "#/components/schemas/TaskView" });
    let id_param = json!({ "name": "id", "in": "path", "required": true, "schema": { "type": "string" }, "description": "the task id (its AIP session_id)" });
    let after_param = json!({ "name": "after", "in": "query", "schema": { "type": "integer", "minimum": 0 }, "description": "only events with a larger sequence number" });
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "aip-sessions",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Tasks of the aip broker: submit, follow, cancel, and read results. `/api/*` needs an API key \
                (`X-API-Key` or `Authorization: Bearer`) when keys are configured."
        },
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": { "type": "apiKey", "in": "header", "name": "X-API-Key" },
                "bearer": { "type": "http", "scheme": "bearer" }
            }
        },
        "security": [{ "apiKey": [] }, { "bearer": [] }],
        "paths": {
            "/api/tasks": {
                "post": {
                    "summary": "Submit a task (explicit target or required capabilities)",
                    "requestBody": { "required": true, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/TaskRequest" } } } },
                    "responses": {
                        "201": ok("the task, dispatched or queued", task_ref.clone()),
                        "400": error("invalid request"), "401": error("missing or invalid API key"),
                        "404": error("the target device is not online (DEVICE_NOT_FOUND)"),
                        "409": error("the task id is taken"),
                        "422": error("no available agent has the capabilities (CAPABILITY_MISMATCH), or the body is not a TaskRequest"),
                        "503": error("the registry or the database is unavailable")
                    }
                },
                "get": {
                    "summary": "List tasks, newest first, with cursor pagination",
                    "parameters": [
                        { "name": "state", "in": "query", "schema": { "type": "string" } },
                        { "name": "executor", "in": "query", "schema": { "type": "string" } },
                        { "name": "requester", "in": "query", "schema": { "type": "string" } },
                        { "name": "task_name", "in": "query", "schema": { "type": "string" } },
                        { "name": "cursor", "in": "query", "schema": { "type": "string" }, "description": "next_cursor of the previous page" },
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": 500, "default": 50 } }
                    ],
                    "responses": {
                        "200": ok("a page of tasks", json!({ "type": "object", "required": ["tasks", "next_cursor"], "properties": {
                            "tasks": { "type": "array", "items": task_ref.clone() },
                            "next_cursor": { "type": ["string", "null"] } } })),
                        "400": error("invalid filter or cursor"), "401": error("missing or invalid API key")
                    }
                }
            },
            "/api/tasks/{id}": {
                "get": {
                    "summary": "One task",
                    "parameters": [id_param.clone()],
                    "responses": { "200": ok("the task", task_ref.clone()), "401": error("missing or invalid API key"), "404": error("no such task") }
                }
            },
            "/api/tasks/{id}/events": {
                "get": {
                    "summary": "A task's event log (gap-free sequence numbers from 1)",
                    "parameters": [id_param.clone(), after_param.clone(),
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": 10000, "default": 1000 } }],
                    "responses": {
                        "200": ok("events in order", json!({ "type": "object", "required": ["task_id", "events"], "properties": {
                            "task_id": { "type": "string" },
                            "events": { "type": "array", "items": { "$ref": "#/components/schemas/TaskEvent" } } } })),
                        "401": error("missing or invalid API key"), "404": error("no such task")
                    }
                }
            },
            "/api/tasks/{id}/events/stream": {
                "get": {
                    "summary": "The event log as Server-Sent Events, resuming after `after` or `Last-Event-ID`; ends after the terminal event",
                    "parameters": [id_param.clone(), after_param,
                        { "name": "Last-Event-ID", "in": "header", "schema": { "type": "string" } }],
                    "responses": {
                        "200": { "description": "an event stream; each event's id is its sequence number, its data a TaskEvent",
                                 "content": { "text/event-stream": { "schema": { "type": "string" } } } },
                        "401": error("missing or invalid API key"), "404": error("no such task")
                    }
                }
            },
            "/api/tasks/{id}/cancel": {
                "post": {
                    "summary": "Cancel a live task; its executor (and a client requester) get task_end",
                    "parameters": [id_param.clone()],
                    "requestBody": { "required": false, "content": { "application/json": { "schema": {
                        "type": "object", "properties": { "reason": { "type": "string" } } } } } },
                    "responses": { "200": ok("the canceled task", task_ref.clone()), "401": error("missing or invalid API key"),
                                   "404": error("no such task"), "409": error("the task has already ended") }
                }
            },
            "/api/tasks/{id}/commands": {
                "post": {
                    "summary": "A tool call on the executor of a requester-driven task (submitted with \"driver\": true): sends the commands and waits for their results",
                    "parameters": [id_param.clone()],
                    "requestBody": { "required": true, "content": { "application/json": { "schema": {
                        "type": "object", "required": ["actions"], "additionalProperties": false, "properties": {
                            "actions": { "type": "array", "items": { "$ref": "#/components/schemas/Command" }, "minItems": 1 },
                            "agent_name": { "type": "string" }, "process_name": { "type": "string" }, "root_name": { "type": "string" },
                            "timeout_secs": { "type": "integer", "minimum": 1, "maximum": 600, "default": 60 } } } } } },
                    "responses": {
                        "200": ok("the results, one per command, in order", json!({ "type": "object", "required": ["response_id", "results"], "properties": {
                            "response_id": { "type": "string" }, "status": { "type": "string" },
                            "results": { "type": "array", "items": { "$ref": "#/components/schemas/Result" } } } })),
                        "400": error("no actions"), "401": error("missing or invalid API key"), "404": error("no such task"),
                        "409": error("not a driver task, not running, or a command is still pending"),
                        "504": error("no results in time (TASK_TIMEOUT); the command stays pending")
                    }
                }
            },
            "/api/tasks/{id}/complete": {
                "post": {
                    "summary": "End a requester-driven task, completed (or failed with `error`)",
                    "parameters": [id_param.clone()],
                    "requestBody": { "required": true, "content": { "application/json": { "schema": {
                        "type": "object", "additionalProperties": false, "properties": { "result": {}, "error": { "type": "string" } } } } } },
                    "responses": { "200": ok("the ended task", task_ref.clone()), "401": error("missing or invalid API key"),
                                   "404": error("no such task"), "409": error("not a driver task, or already ended") }
                }
            },
            "/api/dispatch": {
                "post": {
                    "summary": "UFO's dispatch: send a task to an online device",
                    "requestBody": { "required": true, "content": { "application/json": { "schema": {
                        "type": "object", "required": ["client_id", "request"], "properties": {
                            "client_id": { "type": "string" }, "request": { "type": "string" },
                            "task_name": { "type": "string", "pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]*$" },
                            "steps": { "type": "array", "description": "extension: scripted steps (lists of Commands)" } } } } } },
                    "responses": {
                        "200": ok("dispatched", json!({ "type": "object", "required": ["status", "task_name", "client_id", "session_id"], "properties": {
                            "status": { "const": "dispatched" }, "task_name": { "type": "string" },
                            "client_id": { "type": "string" }, "session_id": { "type": "string" } } })),
                        "400": error("Empty task content, Empty client ID, or Invalid task_name"),
                        "401": error("missing or invalid API key"), "404": error("Client not online"),
                        "422": error("the body is not a JSON object")
                    }
                }
            },
            "/api/task_result/{task_name}": {
                "get": {
                    "summary": "UFO's result lookup by task name (the newest task of that name)",
                    "parameters": [{ "name": "task_name", "in": "path", "required": true, "schema": { "type": "string" } }],
                    "responses": {
                        "200": ok("pending or done", json!({ "type": "object", "required": ["status"], "properties": {
                            "status": { "enum": ["pending", "done"] }, "result": {}, "state": { "type": "string" },
                            "error": { "type": "string" }, "session_id": { "type": "string" } } })),
                        "400": error("invalid task name"), "401": error("missing or invalid API key"), "404": error("no task of that name")
                    }
                }
            },
            "/healthz": { "get": { "summary": "The process is up", "security": [], "responses": { "200": { "description": "ok" } } } },
            "/readyz": { "get": { "summary": "This replica leads and the database answers", "security": [], "responses": { "200": { "description": "ready" }, "503": { "description": "not ready" } } } }
        }
    })
}
