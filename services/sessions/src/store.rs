//! The session service's tables, on PostgreSQL or SQLite.
//!
//! The leader writes every change of a group in one transaction ([`Writer::write`]): task rows,
//! their events with gap-free sequence numbers, the ids of the frames applied (so a
//! redelivered frame changes nothing twice) and the frames to send (the outbox). Reads run on
//! the pool. The `tasks` columns are listed once, in [`COLUMNS`]: the statements of both
//! databases and the encoding of a [`Task`] come from that list. Text for states, kinds and
//! codes exists only here, at the database edge.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::LazyLock;

use aip_store::text::json_text;
pub use aip_store::text::{NUL, NUL_REPLACEMENT, storable, storable_text};
use aip_store::{Conn, Database, List, Sql};
use proto_schemas::sessions::{TaskEvent, TaskState};
use proto_schemas::{ClientType, Command, ErrorCode, Extension, Platform};
use serde_json::Value;
use sqlx::types::Json;

use crate::apart;
use crate::outbox::Grouped;
use crate::task::{
    EventKind, ExecutorRef, Plan, PlannerKind, Question, Requester, RequesterKind, Task, TaskError,
    TaskResult, Waiting,
};
pub use crate::task::{now_ms, rfc3339};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored value this version cannot read (written by hand, or by a newer version).
    #[error("task '{task_id}': column {column} holds {value:?}, which this version cannot read")]
    Corrupt {
        task_id: String,
        column: &'static str,
        /// What it holds.
        value: String,
    },
    /// A JSON column could not be encoded.
    #[error("cannot encode task '{task_id}' for the database: {source}")]
    Encode {
        task_id: String,
        source: serde_json::Error,
    },
    /// Another replica took the leadership over (this one's lease ran out, say while it was
    /// frozen): nothing more is written under the old term.
    #[error("the leadership passed to another replica (term {term} of '{name}' is over)")]
    LeaseLost { name: String, term: i64 },
}

/// How a column's values travel: its SQL type on PostgreSQL (JSON goes as text and is cast).
#[derive(Debug, Clone, Copy)]
enum Kind {
    Text,
    Json,
    Int4,
    Int8,
    Bool,
}

/// One value of a row, typed for binding.
enum Cell {
    Text(Option<String>),
    Int4(i32),
    Int8(i64),
    Bool(bool),
}

/// A column of `tasks`: its name, how it travels, whether an upsert changes it (the others
/// are fixed when the task is created), and how a [`Task`] fills it.
struct Column {
    name: &'static str,
    kind: Kind,
    mutable: bool,
    cell: fn(&Task) -> Result<Cell, serde_json::Error>,
}

fn text(s: &str) -> Result<Cell, serde_json::Error> {
    Ok(Cell::Text(Some(storable_text(s))))
}

fn maybe(s: Option<&str>) -> Result<Cell, serde_json::Error> {
    Ok(Cell::Text(s.map(storable_text)))
}

fn json<T: serde::Serialize>(value: Option<&T>) -> Result<Cell, serde_json::Error> {
    value.map(json_text).transpose().map(Cell::Text)
}

/// The `history` column as written whole (SQLite; PostgreSQL keeps large results apart): with
/// the results kept encoded copied in, not encoded again.
fn history_cell(task: &Task) -> Result<Cell, serde_json::Error> {
    if task.encoded_results.is_empty() {
        return json(Some(&task.history));
    }
    let mut out = Vec::new();
    task.write_history(&mut out)?;
    match String::from_utf8(out) {
        // The kept texts hold no escaped NUL; the other entries may.
        Ok(text) if !text.contains("\\u0000") => Ok(Cell::Text(Some(text))),
        _ => json(Some(&task.history)),
    }
}

/// The `tasks` table, the one place its columns are listed.
const COLUMNS: &[Column] = &[
    Column {
        name: "task_id",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(&t.task_id),
    },
    Column {
        name: "task_name",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(&t.task_name),
    },
    Column {
        name: "state",
        kind: Kind::Text,
        mutable: true,
        cell: |t| text(t.state().as_str()),
    },
    Column {
        name: "request",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(&t.request),
    },
    Column {
        name: "data",
        kind: Kind::Json,
        mutable: false,
        cell: |t| json(t.data.as_ref()),
    },
    Column {
        name: "requester_kind",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(t.requester.kind().as_str()),
    },
    Column {
        name: "requester_id",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(t.requester.id()),
    },
    Column {
        name: "requester_type",
        kind: Kind::Text,
        mutable: false,
        cell: |t| match &t.requester {
            Requester::Client { client_type, .. } => text(client_type.as_str()),
            Requester::Rest(_) | Requester::Nats(_) => maybe(None),
        },
    },
    Column {
        name: "requester_connection",
        kind: Kind::Text,
        mutable: false,
        cell: |t| match &t.requester {
            Requester::Client { connection, .. } => maybe(connection.as_deref()),
            Requester::Rest(_) | Requester::Nats(_) => maybe(None),
        },
    },
    Column {
        name: "executor_id",
        kind: Kind::Text,
        mutable: true,
        cell: |t| text(&t.executor.id),
    },
    Column {
        name: "executor_platform",
        kind: Kind::Text,
        mutable: true,
        cell: |t| text(t.executor.platform.as_str()),
    },
    Column {
        name: "executor_connection",
        kind: Kind::Text,
        mutable: true,
        cell: |t| maybe(t.executor.connection.as_deref()),
    },
    Column {
        name: "required_capabilities",
        kind: Kind::Json,
        mutable: false,
        cell: |t| json(Some(&t.required_capabilities)),
    },
    Column {
        name: "planner",
        kind: Kind::Text,
        mutable: false,
        cell: |t| text(t.plan.kind().as_str()),
    },
    Column {
        name: "steps",
        kind: Kind::Json,
        mutable: false,
        cell: |t| match &t.plan {
            Plan::Scripted(steps) => json(Some(steps)),
            Plan::Planner(_) | Plan::Driver => json::<()>(None),
        },
    },
    Column {
        name: "step",
        kind: Kind::Int4,
        mutable: true,
        cell: |t| Ok(Cell::Int4(t.step)),
    },
    Column {
        name: "pending_response_id",
        kind: Kind::Text,
        mutable: true,
        cell: |t| maybe(t.waiting.response_id()),
    },
    Column {
        name: "needs_plan",
        kind: Kind::Bool,
        mutable: true,
        cell: |t| Ok(Cell::Bool(t.waiting == Waiting::Plan)),
    },
    Column {
        name: "ufo_dispatch",
        kind: Kind::Bool,
        mutable: false,
        cell: |t| Ok(Cell::Bool(t.ufo_dispatch)),
    },
    Column {
        name: "awaiting_echo",
        kind: Kind::Bool,
        mutable: true,
        cell: |t| Ok(Cell::Bool(t.waiting == Waiting::Echo)),
    },
    Column {
        name: "history",
        kind: Kind::Json,
        mutable: true,
        cell: history_cell,
    },
    Column {
        name: "priority",
        kind: Kind::Int4,
        mutable: false,
        cell: |t| Ok(Cell::Int4(t.priority)),
    },
    Column {
        name: "result",
        kind: Kind::Json,
        mutable: true,
        cell: |t| match &t.result {
            Some(TaskResult::Value(value)) => json(Some(value)),
            Some(TaskResult::History) | None => Ok(Cell::Text(None)),
        },
    },
    Column {
        name: "error",
        kind: Kind::Text,
        mutable: true,
        cell: |t| maybe(t.error.as_ref().map(|e| e.detail.as_str())),
    },
    Column {
        name: "error_code",
        kind: Kind::Text,
        mutable: true,
        cell: |t| maybe(t.error.as_ref().map(|e| e.code.as_str())),
    },
    Column {
        name: "callback_url",
        kind: Kind::Text,
        mutable: false,
        cell: |t| maybe(t.callback_url.as_deref()),
    },
    Column {
        name: "task_deadline_ms",
        kind: Kind::Int8,
        mutable: false,
        cell: |t| Ok(Cell::Int8(t.task_deadline_ms)),
    },
    Column {
        name: "deadline_ms",
        kind: Kind::Int8,
        mutable: true,
        cell: |t| Ok(Cell::Int8(t.deadline_ms)),
    },
    Column {
        name: "created_ms",
        kind: Kind::Int8,
        mutable: false,
        cell: |t| Ok(Cell::Int8(t.created_ms)),
    },
    Column {
        name: "updated_ms",
        kind: Kind::Int8,
        mutable: true,
        cell: |t| Ok(Cell::Int8(t.updated_ms)),
    },
    Column {
        name: "next_seq",
        kind: Kind::Int8,
        mutable: true,
        cell: |t| Ok(Cell::Int8(t.next_seq)),
    },
    Column {
        name: "question",
        kind: Kind::Json,
        mutable: true,
        cell: |t| json(t.waiting.question()),
    },
    Column {
        name: "handoffs",
        kind: Kind::Int4,
        mutable: true,
        cell: |t| Ok(Cell::Int4(t.handoffs)),
    },
    Column {
        name: "callback_on",
        kind: Kind::Json,
        mutable: false,
        cell: |t| match t.callback_on.is_empty() {
            true => json::<()>(None),
            false => json(Some(&t.callback_on)),
        },
    },
    Column {
        name: "requester_extensions",
        kind: Kind::Json,
        mutable: false,
        cell: |t| match &t.requester {
            Requester::Client { extensions, .. } if !extensions.is_empty() => {
                json(Some(extensions))
            }
            _ => json::<()>(None),
        },
    },
    Column {
        name: "result_is_history",
        kind: Kind::Bool,
        mutable: true,
        cell: |t| Ok(Cell::Bool(result_is_history(t))),
    },
];

/// A scripted task's result is its history (every step's commands and results), so the row
/// keeps it once: `result` is NULL and `result_is_history` true. A 90 MiB screenshot in a
/// command's results is then written to the row once, not twice.
fn result_is_history(task: &Task) -> bool {
    task.result == Some(TaskResult::History)
}

/// Event data and `task_end` frames at least this large that repeat what the task's row holds
/// are stored as references to it ([`HISTORY_REF`], [`TaskEndOf`]). Smaller ones are stored
/// as they are, so reading a task's events costs no read of the task.
const LARGE_VALUE_BYTES: usize = 64 * 1024;

/// The key of an event's stored data that stands for (a part of) the task's history: `"all"`
/// in an ended event whose `result` is the whole history, or the index of the history entry
/// a `results_received` event holds. Only the store writes and reads it.
const HISTORY_REF: &str = "$history";

/// An event's data as stored. What repeats the task's row (written in the same group) is
/// written there once: a history entry or a result of [`LARGE_VALUE_BYTES`] or more becomes a
/// [`HISTORY_REF`], so a 90 MiB screenshot is not written three times; smaller ones are
/// copied, so reading a task's events costs no read of the task. [`TaskStore::events`] puts
/// references back. `task` is the event's task as the group writes it.
fn stored_event_data<'a>(event: &'a NewEvent, task: Option<&'a Task>) -> Option<Cow<'a, Value>> {
    let (data, task) = match (event.data.as_ref()?, task) {
        (EventData::Value(value), _) => return Some(Cow::Borrowed(value)),
        (data, Some(task)) => (data, task),
        (_, None) => {
            tracing::error!(task = %event.task_id, seq = event.seq, "an event refers to a task its group does not write; its data is not stored");
            return None;
        }
    };
    match data {
        EventData::Value(value) => Some(Cow::Borrowed(value)),
        EventData::Entry(index) => {
            let entry = task.history.get(*index)?;
            if !is_large(entry) {
                return Some(Cow::Borrowed(entry));
            }
            let mut stored = serde_json::Map::new();
            stored.insert(HISTORY_REF.to_owned(), Value::from(*index));
            Some(Cow::Owned(Value::Object(stored)))
        }
        EventData::Ended(fields) => {
            let mut stored = fields.clone();
            match &task.result {
                Some(TaskResult::History) if history_is_large(&task.history) => {
                    stored.insert(HISTORY_REF.to_owned(), Value::from("all"));
                }
                _ => {
                    stored.insert(
                        "result".to_owned(),
                        task.result_value().unwrap_or(Value::Null),
                    );
                }
            }
            Some(Cow::Owned(Value::Object(stored)))
        }
    }
}

/// Whether `value` takes [`LARGE_VALUE_BYTES`] or more as JSON.
fn is_large(value: &Value) -> bool {
    aip_store::text::json_len_reaches(value, LARGE_VALUE_BYTES)
}

/// Whether a history takes [`LARGE_VALUE_BYTES`] or more as JSON (an array).
fn history_is_large(history: &[Value]) -> bool {
    aip_store::text::items_json_len_reaches(history, LARGE_VALUE_BYTES)
}

/// Puts back what [`stored_event_data`] replaced by a reference to `history`.
fn restore_event_data(data: &mut Value, history: &[Value]) {
    let Some(reference) = data.as_object_mut().and_then(|d| d.remove(HISTORY_REF)) else {
        return;
    };
    match reference {
        Value::String(all) if all == "all" => {
            if let Some(fields) = data.as_object_mut() {
                fields.insert("result".to_owned(), Value::Array(history.to_vec()));
            }
        }
        Value::Number(index) => {
            if let Some(entry) = index.as_u64().and_then(|i| history.get(i as usize)) {
                *data = entry.clone();
            }
        }
        _ => {}
    }
}

fn column_names() -> String {
    COLUMNS
        .iter()
        .map(|c| c.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `ON CONFLICT … DO UPDATE SET` of every mutable column.
fn upsert_tail() -> String {
    let set: Vec<String> = COLUMNS
        .iter()
        .filter(|c| c.mutable)
        .map(|c| format!("{0} = excluded.{0}", c.name))
        .collect();
    format!(" ON CONFLICT (task_id) DO UPDATE SET {}", set.join(", "))
}

/// `SELECT <every column> FROM tasks`.
static SELECT_TASKS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM tasks", column_names()));

/// The start of SQLite's multi-row insert.
static LITE_INSERT_TASKS: LazyLock<String> =
    LazyLock::new(|| format!("INSERT INTO tasks ({}) ", column_names()));

/// SQLite's conflict clause.
static LITE_UPSERT_TAIL: LazyLock<String> = LazyLock::new(upsert_tail);

/// PostgreSQL's write of a whole group in one statement, so a group commit costs one round
/// trip and the server's commit, whatever it holds. Each `tasks` column and each column of
/// the other tables travels as one array, and `UNNEST` turns the arrays back into rows; an
/// empty array writes nothing. The first part renews the lease of this term (the fence): the
/// others write only when it did, so a replica whose term is over writes nothing, and the
/// renewed row stays locked until the statement commits, so no other replica takes the lease
/// meanwhile. The statement returns how many lease rows it renewed (1, or 0: the term is
/// over). Data-modifying `WITH` parts run on one snapshot: no part reads another's rows (the
/// outbox rows deleted are those of earlier groups).
static PG_WRITE_GROUP: LazyLock<String> = LazyLock::new(|| {
    let mut next = 0;
    let mut param = |ty: &str| {
        next += 1;
        format!("${next}::{ty}")
    };
    let (name, holder, duration, term) =
        (param("text"), param("text"), param("int8"), param("int8"));
    let task_select: Vec<String> = COLUMNS
        .iter()
        .map(|c| match c.kind {
            Kind::Json => format!("{}::json", c.name),
            _ => c.name.to_owned(),
        })
        .collect();
    let task_arrays: Vec<String> = COLUMNS
        .iter()
        .map(|c| {
            param(match c.kind {
                Kind::Text | Kind::Json => "text[]",
                Kind::Int4 => "int4[]",
                Kind::Int8 => "int8[]",
                Kind::Bool => "bool[]",
            })
        })
        .collect();
    let events = [
        param("text[]"),
        param("int8[]"),
        param("int8[]"),
        param("text[]"),
        param("text[]"),
        param("text[]"),
    ]
    .join(", ");
    let processed = param("text[]");
    let processed_b = param("text[]");
    let now = param("int8");
    let outbox = [
        param("text[]"),
        param("text[]"),
        param("text[]"),
        param("bytea[]"),
        param("text[]"),
    ]
    .join(", ");
    let published = param("text[]");
    let callbacks = [
        param("text[]"),
        param("text[]"),
        param("text[]"),
        param("text[]"),
    ]
    .join(", ");
    let leading = "EXISTS (SELECT 1 FROM lease)";
    format!(
        "WITH lease AS (\
             UPDATE session_leader SET expires_ms = {DB_NOW_MS} + {duration} \
             WHERE name = {name} AND holder = {holder} AND term = {term} RETURNING 1), \
         written_tasks AS (\
             INSERT INTO tasks ({names}) SELECT {task_select} \
             FROM UNNEST({task_arrays}) AS u({names}) WHERE {leading}{tail}), \
         written_events AS (\
             INSERT INTO task_events (task_id, seq, at_ms, kind, state, data) \
             SELECT task_id, seq, at_ms, kind, state, data::json \
             FROM UNNEST({events}) AS u(task_id, seq, at_ms, kind, state, data) \
             WHERE {leading}), \
         written_processed AS (\
             INSERT INTO processed_messages (msg_id, at_ms) \
             SELECT id, {now} FROM UNNEST({processed}) AS u(id) WHERE {leading} \
             ON CONFLICT (msg_id) DO NOTHING), \
         written_processed_b AS (\
             INSERT INTO processed_messages_b (msg_id, at_ms) \
             SELECT id, {now} FROM UNNEST({processed_b}) AS u(id) WHERE {leading} \
             ON CONFLICT (msg_id) DO NOTHING), \
         written_outbox AS (\
             INSERT INTO task_outbox (msg_id, subject, client_id, connection_id, payload, \
                 payload_kind, created_ms) \
             SELECT msg_id, '', client_id, connection_id, payload, payload_kind, {now} \
             FROM UNNEST({outbox}) AS u(msg_id, client_id, connection_id, payload, payload_kind) \
             WHERE {leading} ON CONFLICT (msg_id) DO NOTHING), \
         deleted_outbox AS (\
             DELETE FROM task_outbox WHERE msg_id = ANY({published}) AND {leading}), \
         written_callbacks AS (\
             INSERT INTO task_callbacks (callback_id, task_id, target, payload, state, \
                 next_attempt_ms, created_ms, updated_ms) \
             SELECT id, task_id, target, payload, 'pending', {now}, {now}, {now} \
             FROM UNNEST({callbacks}) AS u(id, task_id, target, payload) WHERE {leading} \
             ON CONFLICT (callback_id) DO NOTHING) \
         SELECT count(*) FROM lease",
        names = column_names(),
        task_select = task_select.join(", "),
        task_arrays = task_arrays.join(", "),
        tail = upsert_tail(),
    )
});

/// A read of whole tasks: every column, then `tail` (the same text on both databases).
fn select_tasks(tail: &str) -> Sql {
    Sql::render(|_| format!("{} {tail}", *SELECT_TASKS))
}

/// The reads, each written once for both databases.
static GET_TASK: LazyLock<Sql> = LazyLock::new(|| select_tasks("WHERE task_id = $1"));
static GET_TASK_BY_NAME: LazyLock<Sql> =
    LazyLock::new(|| select_tasks("WHERE task_name = $1 ORDER BY created_ms DESC LIMIT 1"));
static LIST_TASKS: LazyLock<Sql> = LazyLock::new(|| {
    select_tasks(
        "WHERE ($1 = '' OR state = $1) AND ($2 = '' OR executor_id = $2) \
         AND ($3 = '' OR requester_id = $3) AND ($4 = '' OR task_name = $4) \
         AND (created_ms < $5 OR (created_ms = $5 AND task_id < $6)) \
         ORDER BY created_ms DESC, task_id DESC LIMIT $7",
    )
});
static LIVE_TASKS: LazyLock<Sql> = LazyLock::new(|| {
    select_tasks(
        "WHERE state IN ('submitted', 'dispatched', 'working', 'input_required') \
         ORDER BY created_ms, task_id",
    )
});
static TASK_OWNERS: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|backend| {
        format!(
            "SELECT task_id, requester_id FROM tasks WHERE {}",
            backend.in_list("task_id", 1)
        )
    })
});
static TASK_EVENTS: Sql = Sql::same(
    "SELECT task_id, seq, at_ms, kind, state, data FROM task_events \
     WHERE task_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
);
static TASK_OWNER: Sql = Sql::same("SELECT requester_id FROM tasks WHERE task_id = $1");
/// A page of task ids in key order, from `$1` on (`>=`: the first page starts at `''`, and an
/// empty id is a key too).
static TASK_IDS_FROM: Sql =
    Sql::same("SELECT task_id FROM tasks WHERE task_id >= $1 ORDER BY task_id LIMIT $2");
/// Reads the id back, a text on both databases (`SELECT 1` is INT4 on PostgreSQL).
static PROCESSED: Sql = Sql::same(
    "SELECT msg_id FROM processed_messages WHERE msg_id = $1 \
     UNION ALL SELECT msg_id FROM processed_messages_b WHERE msg_id = $1",
);
/// Outbox rows committed before `$1`, oldest first, but those in the list `$3` (frames this
/// replica published a moment ago whose acknowledgement may be on its way).
static STALE_OUTBOX: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|backend| {
        format!(
            "SELECT msg_id, subject, client_id, connection_id, payload, payload_kind \
             FROM task_outbox \
             WHERE created_ms < $1 AND NOT ({}) ORDER BY created_ms LIMIT $2",
            backend.in_list("msg_id", 3)
        )
    })
});

/// An outbox row: message id, subject (of rows from before `client_id`), client, connection,
/// payload and payload kind.
type OutboxRow = (
    String,
    String,
    Option<String>,
    Option<String>,
    Vec<u8>,
    String,
);

/// The client of an outbox row written before rows named it: the last token of the per-client
/// subject it was to be published on (`<prefix>.deliver.<client token>`).
fn client_of_subject(subject: &str) -> Option<String> {
    let (family, token) = subject.rsplit_once('.')?;
    if family != "deliver" && !family.ends_with(".deliver") {
        return None;
    }
    proto_schemas::subjects::decode_token(token)
}

/// Outbox rows committed before `$1` (no gateway acknowledged them since), oldest first.
static EXPIRED_OUTBOX: Sql =
    Sql::same("SELECT msg_id FROM task_outbox WHERE created_ms < $1 ORDER BY created_ms LIMIT $2");

/// A `tasks` row as the database returns it: text where [`Task`] has enums.
#[derive(Debug, sqlx::FromRow)]
struct TaskRecord {
    task_id: String,
    task_name: String,
    state: String,
    request: String,
    data: Option<Json<Value>>,
    requester_kind: String,
    requester_id: String,
    requester_type: Option<String>,
    requester_connection: Option<String>,
    executor_id: Option<String>,
    executor_platform: Option<String>,
    executor_connection: Option<String>,
    required_capabilities: Json<Vec<String>>,
    planner: String,
    steps: Option<Json<Vec<Vec<Command>>>>,
    step: i32,
    pending_response_id: Option<String>,
    needs_plan: bool,
    ufo_dispatch: bool,
    awaiting_echo: bool,
    history: Json<Vec<Value>>,
    priority: i32,
    result: Option<Json<Value>>,
    error: Option<String>,
    error_code: Option<String>,
    callback_url: Option<String>,
    task_deadline_ms: i64,
    deadline_ms: i64,
    created_ms: i64,
    updated_ms: i64,
    next_seq: i64,
    question: Option<Json<Question>>,
    requester_extensions: Option<Json<Vec<Extension>>>,
    handoffs: i32,
    callback_on: Option<Json<Vec<TaskState>>>,
    result_is_history: bool,
}

impl TryFrom<TaskRecord> for Task {
    type Error = StoreError;

    fn try_from(r: TaskRecord) -> Result<Self, StoreError> {
        let corrupt = |column: &'static str, value: &str| StoreError::Corrupt {
            task_id: r.task_id.clone(),
            column,
            value: value.to_owned(),
        };
        let state = TaskState::from_wire(&r.state).ok_or_else(|| corrupt("state", &r.state))?;
        let requester = match RequesterKind::from_db(&r.requester_kind) {
            Some(RequesterKind::Client) => {
                let kind = r.requester_type.as_deref().unwrap_or_default();
                let client_type =
                    ClientType::from_wire(kind).ok_or_else(|| corrupt("requester_type", kind))?;
                Requester::Client {
                    id: r.requester_id.clone(),
                    client_type,
                    connection: r.requester_connection.clone(),
                    extensions: r
                        .requester_extensions
                        .clone()
                        .map(|e| e.0)
                        .unwrap_or_default(),
                }
            }
            Some(RequesterKind::Rest) => Requester::Rest(r.requester_id.clone()),
            Some(RequesterKind::Nats) => Requester::Nats(r.requester_id.clone()),
            None => return Err(corrupt("requester_kind", &r.requester_kind)),
        };
        let executor_id = r
            .executor_id
            .clone()
            .ok_or_else(|| corrupt("executor_id", "NULL"))?;
        let platform_text = r.executor_platform.as_deref().unwrap_or("NULL");
        let platform = Platform::from_wire(platform_text)
            .ok_or_else(|| corrupt("executor_platform", platform_text))?;
        let plan = match PlannerKind::from_db(&r.planner) {
            Some(PlannerKind::Scripted) => Plan::Scripted(
                r.steps
                    .as_ref()
                    .map(|s| s.0.clone())
                    .ok_or_else(|| corrupt("steps", "NULL"))?,
            ),
            Some(PlannerKind::Planner(name)) => Plan::Planner(name),
            Some(PlannerKind::Driver) => Plan::Driver,
            None => return Err(corrupt("planner", &r.planner)),
        };
        let waiting = match (
            &r.question,
            &r.pending_response_id,
            r.needs_plan,
            r.awaiting_echo,
        ) {
            (Some(Json(question)), ..) => Waiting::Answer(Box::new(question.clone())),
            (None, _, _, true) => Waiting::Echo,
            (None, Some(response_id), _, _) => Waiting::Results {
                response_id: response_id.clone(),
            },
            (None, None, true, _) => Waiting::Plan,
            (None, None, false, false) => Waiting::Nothing,
        };
        let error = match (&r.error, &r.error_code) {
            (None, _) => None,
            (Some(detail), Some(code)) => Some(TaskError::new(
                ErrorCode::from_wire(code).ok_or_else(|| corrupt("error_code", code))?,
                detail.clone(),
            )),
            (Some(_), None) => return Err(corrupt("error_code", "NULL")),
        };
        Ok(Task {
            state,
            requester,
            executor: ExecutorRef {
                id: executor_id,
                platform,
                connection: r.executor_connection,
            },
            plan,
            waiting,
            error,
            data: r.data.map(|j| j.0),
            required_capabilities: r.required_capabilities.0,
            result: match r.result_is_history {
                true => Some(TaskResult::History),
                false => r.result.map(|j| TaskResult::Value(j.0)),
            },
            history: r.history.0,
            task_id: r.task_id,
            task_name: r.task_name,
            request: r.request,
            step: r.step,
            ufo_dispatch: r.ufo_dispatch,
            priority: r.priority,
            callback_url: r.callback_url,
            callback_on: r.callback_on.map(|c| c.0).unwrap_or_default(),
            evented_state: state,
            task_deadline_ms: r.task_deadline_ms,
            deadline_ms: r.deadline_ms,
            created_ms: r.created_ms,
            updated_ms: r.updated_ms,
            next_seq: r.next_seq,
            handoffs: r.handoffs,
            encoded_results: Default::default(),
        })
    }
}

/// The cells of a task, in [`COLUMNS`] order; `history`, when given, is the text of its
/// `history` column (with results kept apart, [`crate::apart`]).
fn cells(task: &Task, history: Option<String>) -> Result<Vec<Cell>, StoreError> {
    let mut history = history;
    COLUMNS
        .iter()
        .map(|c| match history.take_if(|_| c.name == "history") {
            Some(text) => Ok(Cell::Text(Some(text))),
            None => (c.cell)(task).map_err(|source| StoreError::Encode {
                task_id: task.task_id.clone(),
                source,
            }),
        })
        .collect()
}

#[derive(Debug, sqlx::FromRow)]
struct EventRecord {
    task_id: String,
    seq: i64,
    at_ms: i64,
    kind: String,
    state: String,
    data: Option<Json<Value>>,
}

impl TryFrom<EventRecord> for TaskEvent {
    type Error = StoreError;

    fn try_from(r: EventRecord) -> Result<Self, StoreError> {
        let state = TaskState::from_wire(&r.state).ok_or_else(|| StoreError::Corrupt {
            task_id: r.task_id.clone(),
            column: "task_events.state",
            value: r.state.clone(),
        })?;
        Ok(TaskEvent {
            task_id: r.task_id,
            seq: r.seq,
            at: rfc3339(r.at_ms),
            kind: r.kind,
            state,
            data: r.data.map(|j| j.0),
        })
    }
}

/// The task store.
#[derive(Clone)]
pub struct TaskStore {
    db: Database,
}

/// An event to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub task_id: String,
    /// Its gap-free sequence number.
    pub seq: i64,
    /// Epoch ms.
    pub at_ms: i64,
    /// What happened.
    pub kind: EventKind,
    /// The task's state after it.
    pub state: TaskState,
    pub data: Option<EventData>,
}

/// What an event says, as the leader records it. Data that repeats the task is recorded by
/// reference, so a step's results of tens of MiB are not copied into their events; the
/// store writes the copy or (when large) a reference ([`stored_event_data`]).
#[derive(Debug, Clone, PartialEq)]
pub enum EventData {
    /// Data of its own.
    Value(Value),
    /// The task's history entry at this index (`results_received`).
    Entry(usize),
    /// These fields, and `result`: the task's result (an ended event).
    Ended(serde_json::Map<String, Value>),
}

/// A frame to publish once its batch has committed.
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// The message id gateways de-duplicate on (`Nats-Msg-Id`), also the outbox key.
    pub msg_id: String,
    /// The client it is for; published to the gateway holding the client.
    pub client_id: String,
    /// The one connection of the client that may receive it (an executor's frames go to the
    /// connection its task is bound to); `None`: whichever connection the client has.
    pub connection: Option<String>,
    pub payload: bytes::Bytes,
    /// The task whose `task_end` this frame is. A large one is stored as this reference, not
    /// as its bytes (the task's row holds the result), and built again from the task if it
    /// must be sent again.
    pub task_end_of: Option<TaskEndOf>,
    /// The trace the frame continues (not stored: a frame sent again after a restart starts
    /// no span).
    pub trace: Option<aip_bus::trace::Context>,
}

/// Which task's `task_end` an outbox frame is, and its `response_id`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TaskEndOf {
    pub task_id: String,
    pub response_id: String,
}

/// What an outbox row's `payload` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PayloadKind {
    /// The frame's bytes.
    Frame,
    /// A [`TaskEndOf`] as JSON: the frame is built from the task when it is sent again.
    TaskEndOf,
    /// The small frames of a group commit ([`crate::outbox`]).
    Frames,
}

impl PayloadKind {
    fn as_str(self) -> &'static str {
        match self {
            PayloadKind::Frame => "frame",
            PayloadKind::TaskEndOf => "task_end_of",
            PayloadKind::Frames => "frames",
        }
    }

    fn from_db(kind: &str) -> Option<Self> {
        match kind {
            "frame" => Some(PayloadKind::Frame),
            "task_end_of" => Some(PayloadKind::TaskEndOf),
            "frames" => Some(PayloadKind::Frames),
            _ => None,
        }
    }
}

/// An outbox row's payload as stored: a `task_end` at least [`LARGE_VALUE_BYTES`] long
/// becomes its [`TaskEndOf`], so its result is written once (in the task's row), not once
/// more for the requester and once for the executor.
fn stored_payload(frame: &OutFrame) -> (PayloadKind, std::borrow::Cow<'_, [u8]>) {
    match &frame.task_end_of {
        Some(of) if frame.payload.len() >= LARGE_VALUE_BYTES => match serde_json::to_vec(of) {
            Ok(reference) => (PayloadKind::TaskEndOf, reference.into()),
            Err(_) => (PayloadKind::Frame, frame.payload.as_ref().into()),
        },
        _ => (PayloadKind::Frame, frame.payload.as_ref().into()),
    }
}

/// A row of `task_outbox` as written.
struct OutboxEntry<'a> {
    /// The frame's message id, or a group's key.
    key: Cow<'a, str>,
    /// `None` for a group (each of its frames names its client).
    client_id: Option<&'a str>,
    connection: Option<&'a str>,
    payload: Cow<'a, [u8]>,
    kind: PayloadKind,
}

impl<'a> OutboxEntry<'a> {
    fn alone(frame: &'a OutFrame) -> Self {
        let (kind, payload) = stored_payload(frame);
        OutboxEntry {
            key: frame.msg_id.as_str().into(),
            client_id: Some(&frame.client_id),
            connection: frame.connection.as_deref(),
            payload,
            kind,
        }
    }
}

/// The outbox rows a batch writes: its small frames in one row ([`crate::outbox::group`]),
/// every other frame, and the unacknowledged frames of the groups split, in rows of their own.
fn outbox_rows(batch: &Batch) -> Result<(Vec<OutboxEntry<'_>>, Option<Grouped>), StoreError> {
    let group = crate::outbox::group(&batch.outbox).map_err(|source| StoreError::Encode {
        task_id: String::new(),
        source,
    })?;
    let mut rows = Vec::with_capacity(batch.outbox.len() + batch.split.len());
    let mut grouped = None;
    if let Some(group) = group {
        rows.push(OutboxEntry {
            key: group.grouped.key.clone().into(),
            client_id: None,
            connection: None,
            payload: group.payload.into(),
            kind: PayloadKind::Frames,
        });
        grouped = Some(group.grouped);
    }
    let mut members = grouped.iter().flat_map(|g| g.members.iter()).peekable();
    for (i, frame) in batch.outbox.iter().enumerate() {
        if members.next_if(|&&m| m == i).is_none() {
            rows.push(OutboxEntry::alone(frame));
        }
    }
    rows.extend(
        batch
            .split
            .iter()
            .flat_map(|split| &split.frames)
            .map(OutboxEntry::alone),
    );
    Ok((rows, grouped))
}

/// The outbox rows a batch deletes: those acknowledged, and the groups split.
fn outbox_deleted(batch: &Batch) -> Vec<&str> {
    batch
        .published
        .iter()
        .map(String::as_str)
        .chain(batch.split.iter().map(|split| split.key.as_str()))
        .collect()
}

/// Which of the two tables of processed-frame ids a group writes to. Ids are remembered so
/// that a frame JetStream delivers again (its ack wait is 30 s) is recognised; ten minutes is
/// far more than enough. Each table holds the ids of alternate ten-minute periods
/// ([`PROCESSED_PERIOD_MS`]): the leader writes to the current period's table and empties it
/// when its period begins, so the ids it drops are at least one period old and forgetting
/// them is one TRUNCATE, not a DELETE of hundreds of thousands of rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ProcessedHalf {
    #[default]
    A,
    B,
}

/// How long each half of the processed ids is written to ([`ProcessedHalf`]).
pub const PROCESSED_PERIOD_MS: i64 = 600_000;

impl ProcessedHalf {
    /// The half of the period holding `now_ms`.
    pub fn at(now_ms: i64) -> Self {
        match now_ms.div_euclid(PROCESSED_PERIOD_MS).rem_euclid(2) {
            0 => ProcessedHalf::A,
            _ => ProcessedHalf::B,
        }
    }

    fn table(self) -> &'static str {
        match self {
            ProcessedHalf::A => "processed_messages",
            ProcessedHalf::B => "processed_messages_b",
        }
    }
}

/// The ids a batch writes to `half`: all of them or none.
fn processed_ids(batch: &Batch, half: ProcessedHalf) -> &[String] {
    if batch.processed_into == half {
        &batch.processed
    } else {
        &[]
    }
}

/// A callback to deliver, written with the state change it tells of.
#[derive(Debug, Clone)]
pub struct NewCallback {
    /// `<task_id>:<event seq>`: the `webhook-id`.
    pub callback_id: String,
    pub task_id: String,
    /// The URL.
    pub target: String,
    /// The CallbackNotification as JSON text (sent and signed as is).
    pub payload: String,
}

/// Everything one group commit writes, in one transaction.
#[derive(Debug, Default)]
pub struct Batch {
    /// Tasks created or changed (the last version of each), shared with the leader's state.
    pub tasks: Vec<std::sync::Arc<Task>>,
    /// Events appended.
    pub events: Vec<NewEvent>,
    /// Ids of the frames applied, so a redelivery is recognised.
    pub processed: Vec<String>,
    /// Frames sent by these changes.
    pub outbox: Vec<OutFrame>,
    /// Outbox rows of earlier batches whose frames gateways acknowledged since (or that were
    /// dropped).
    pub published: Vec<String>,
    /// Stale groups of outbox frames, split.
    pub split: Vec<crate::outbox::Split>,
    /// The table the processed ids go to.
    pub processed_into: ProcessedHalf,
    /// Empty that table first: a new period began ([`ProcessedHalf`]).
    pub clear_processed: bool,
    /// Callbacks to deliver.
    pub callbacks: Vec<NewCallback>,
}

impl Batch {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
            && self.events.is_empty()
            && self.processed.is_empty()
            && self.outbox.is_empty()
            && self.published.is_empty()
            && self.split.is_empty()
            && !self.clear_processed
            && self.callbacks.is_empty()
    }
}

/// Ids per `IN (…)`/`ANY` read: far below the bind-parameter limits of both databases
/// (SQLite allows 32,766, PostgreSQL 65,535).
const IDS_PER_STATEMENT: usize = 500;

/// Rows per statement of SQLite's group texts. A group whose every table has at most the
/// largest of these rows is written with one statement per table, of the smallest of these
/// sizes that holds the longest table; the rows a table lacks are NULL rows its statement
/// skips. Four sizes give four texts, each prepared once and kept by sqlx, where a text made
/// to each group's measure was parsed again every time (a fifth of the writer's time at 100
/// clients). A larger group is written in slices of the largest size, with a text of its own.
const LITE_GROUP_ROWS: [usize; 4] = [4, 16, 64, 256];

/// How a group is laid out on SQLite: rows per statement, and whether the text is one of the
/// few kept (one statement per table, however few rows it has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LiteShape {
    rows: usize,
    kept: bool,
}

impl LiteShape {
    /// The shape for a group whose longest table has `longest` rows.
    fn of(longest: usize) -> Self {
        match LITE_GROUP_ROWS.iter().find(|&&rows| rows >= longest) {
            Some(&rows) => LiteShape { rows, kept: true },
            None => LiteShape {
                rows: LITE_GROUP_ROWS[LITE_GROUP_ROWS.len() - 1],
                kept: false,
            },
        }
    }

    /// The slices of `rows`, each written by one statement of [`Self::rows`] rows: exactly
    /// one (perhaps empty) for a kept text.
    fn slices<'a, T>(&self, rows: &'a [T]) -> Vec<&'a [T]> {
        if self.kept {
            return vec![rows];
        }
        rows.chunks(self.rows).collect()
    }
}

/// Appends `SELECT * FROM (VALUES …) WHERE column1 IS NOT NULL` with `shape.rows` rows of
/// `columns` values: `rows` bound by `bind`, then NULL rows, which the `WHERE` skips (every
/// table's first column is a key, never NULL).
fn push_padded_rows<'args, T>(
    q: &mut sqlx::QueryBuilder<'args, sqlx::Sqlite>,
    shape: LiteShape,
    columns: usize,
    rows: &[T],
    mut bind: impl FnMut(&mut sqlx::query_builder::Separated<'_, 'args, sqlx::Sqlite, &'static str>, &T),
) {
    q.push("SELECT * FROM (VALUES ");
    for i in 0..shape.rows {
        q.push(if i == 0 { "(" } else { ", (" });
        let mut values = q.separated(", ");
        match rows.get(i) {
            Some(row) => bind(&mut values, row),
            None => {
                for _ in 0..columns {
                    values.push_bind(None::<i64>);
                }
            }
        }
        q.push(")");
    }
    q.push(") WHERE column1 IS NOT NULL");
}

/// The leadership of a deployment's session service, as one replica claims it.
#[derive(Debug, Clone)]
pub struct LeaseSpec {
    /// One leadership per deployment (named after its subject prefix).
    pub name: String,
    /// This replica (unique per process).
    pub holder: String,
    /// How long a claim lasts unless renewed.
    pub duration: std::time::Duration,
}

/// The database's clock in milliseconds: every replica's lease is judged by one clock.
const DB_NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::int8";

/// This connection's database session: its pid and when it started.
const DB_SESSION: &str = "pg_backend_pid(), \
     (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())";

/// Takes the lease when it is free, ran out, or is already this holder's; a new term each time.
static TAKE_LEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO session_leader AS l \
             (name, holder, term, expires_ms, holder_pid, holder_backend_start) \
         VALUES ($1, $2, 1, {DB_NOW_MS} + $3, {DB_SESSION}) \
         ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, term = l.term + 1, \
             expires_ms = excluded.expires_ms, holder_pid = excluded.holder_pid, \
             holder_backend_start = excluded.holder_backend_start \
         WHERE l.expires_ms < {DB_NOW_MS} OR l.holder = excluded.holder \
         RETURNING term"
    )
});

/// Ends the database session of another holder whose lease ran out, if it is still open: a
/// leader frozen halfway through a statement keeps its transaction, and its locks, open
/// (the server's idle-in-transaction timeout does not cover a half-sent message), and that
/// would keep every standby from taking over. Matched on pid and start, so a reused pid is
/// never ended.
static END_EXPIRED_HOLDER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT pg_terminate_backend(a.pid) FROM session_leader l \
         JOIN pg_stat_activity a ON a.pid = l.holder_pid \
             AND a.backend_start IS NOT DISTINCT FROM l.holder_backend_start \
         WHERE l.name = $1 AND l.holder <> $2 AND l.expires_ms < {DB_NOW_MS}"
    )
});

/// Renews the lease if this holder's term still holds it (the fence of every write).
static RENEW_LEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE session_leader SET expires_ms = {DB_NOW_MS} + $3 \
         WHERE name = $1 AND holder = $2 AND term = $4"
    )
});

/// The longest the leader's connection waits for a lock.
const MAX_LOCK_WAIT_MS: i64 = 1_000;

/// PostgreSQL's `lock_not_available` (a `lock_timeout` ran out).
const LOCK_TIMEOUT: &str = "55P03";

/// A term of leadership on PostgreSQL.
pub struct Term {
    spec: LeaseSpec,
    term: i64,
    /// When the lease was last renewed (by a write or by [`Writer::renew_if_due`]).
    renewed: std::time::Instant,
}

impl Term {
    fn lost(&self) -> StoreError {
        StoreError::LeaseLost {
            name: self.spec.name.clone(),
            term: self.term,
        }
    }

    /// Renews the lease on `conn` (inside the write's transaction, or alone).
    async fn renew(&mut self, conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        let renewed = sqlx::query(RENEW_LEASE.as_str())
            .bind(&self.spec.name)
            .bind(&self.spec.holder)
            .bind(millis(self.spec.duration))
            .bind(self.term)
            .execute(conn)
            .await?;
        if renewed.rows_affected() != 1 {
            return Err(self.lost());
        }
        self.renewed = started;
        Ok(())
    }
}

fn millis(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 4)
}

/// The leader's own connection, which writes every batch. On PostgreSQL the leadership is a
/// lease in `session_leader`: every write renews it in its own transaction and fails when
/// another replica's term began, and the connection ends a transaction left idle for half a
/// lease (a leader frozen mid-write must not keep its locks from the next one).
pub enum Writer {
    Pg {
        conn: sqlx::PgConnection,
        term: Box<Term>,
        apart: Box<Apart>,
    },
    /// SQLite (one process owns an embedded database).
    Lite(sqlx::SqliteConnection),
}

/// What the leader keeps apart from the group commit: large results ([`crate::apart`]),
/// written on pooled connections before the group.
pub struct Apart {
    pool: sqlx::PgPool,
    written: apart::Written,
}

/// Writes a batch on SQLite: the whole group is one text of statements, from `BEGIN` to
/// `COMMIT`, run in one call (sqlx runs SQLite on a worker thread of its own, and every call
/// is a hand-over to that thread and back: a group of 50 tasks was some 30 calls), and the
/// text is one of a few kept prepared ([`LITE_GROUP_ROWS`]).
async fn write_sqlite(
    conn: &mut sqlx::SqliteConnection,
    batch: &Batch,
) -> Result<Option<Grouped>, StoreError> {
    let rows = batch
        .tasks
        .iter()
        .map(|task| cells(task, None))
        .collect::<Result<Vec<_>, _>>()?;
    let tasks: HashMap<&str, &Task> = batch
        .tasks
        .iter()
        .map(|t| (t.task_id.as_str(), &**t))
        .collect();
    let now = now_ms();
    let (outbox, grouped) = outbox_rows(batch)?;
    let deleted = outbox_deleted(batch);
    let shape = LiteShape::of(
        [
            rows.len(),
            batch.events.len(),
            batch.processed.len(),
            outbox.len(),
            deleted.len(),
            batch.callbacks.len(),
        ]
        .into_iter()
        .max()
        .unwrap_or_default(),
    );
    let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("BEGIN IMMEDIATE; ");
    for slice in shape.slices(&rows) {
        q.push(LITE_INSERT_TASKS.as_str());
        push_padded_rows(&mut q, shape, COLUMNS.len(), slice, |b, row| {
            for cell in row {
                match cell {
                    Cell::Text(v) => b.push_bind(v.clone()),
                    Cell::Int4(v) => b.push_bind(*v),
                    Cell::Int8(v) => b.push_bind(*v),
                    Cell::Bool(v) => b.push_bind(*v),
                };
            }
        });
        q.push(LITE_UPSERT_TAIL.as_str());
        q.push("; ");
    }
    for slice in shape.slices(&batch.events) {
        q.push("INSERT INTO task_events (task_id, seq, at_ms, kind, state, data) ");
        push_padded_rows(&mut q, shape, 6, slice, |b, e| {
            b.push_bind(e.task_id.clone())
                .push_bind(e.seq)
                .push_bind(e.at_ms)
                .push_bind(e.kind.as_str())
                .push_bind(e.state.as_str())
                .push_bind(
                    stored_event_data(e, tasks.get(e.task_id.as_str()).copied()).map(|data| {
                        let mut data = data.into_owned();
                        storable(&mut data);
                        Json(data)
                    }),
                );
        });
        q.push("; ");
    }
    let processed_table = batch.processed_into.table();
    if batch.clear_processed {
        q.push(format!("DELETE FROM {processed_table}; "));
    }
    for slice in shape.slices(&batch.processed) {
        q.push(format!("INSERT INTO {processed_table} (msg_id, at_ms) "));
        push_padded_rows(&mut q, shape, 2, slice, |b, id| {
            b.push_bind(id.clone()).push_bind(now);
        });
        q.push(" ON CONFLICT (msg_id) DO NOTHING; ");
    }
    for slice in shape.slices(&outbox) {
        q.push(
            "INSERT INTO task_outbox (msg_id, subject, client_id, connection_id, payload, \
             payload_kind, created_ms) ",
        );
        push_padded_rows(&mut q, shape, 7, slice, |b, row| {
            b.push_bind(row.key.clone().into_owned())
                .push_bind("")
                .push_bind(row.client_id.map(str::to_owned))
                .push_bind(row.connection.map(str::to_owned))
                .push_bind(row.payload.clone().into_owned())
                .push_bind(row.kind.as_str())
                .push_bind(now);
        });
        q.push(" ON CONFLICT (msg_id) DO NOTHING; ");
    }
    for slice in shape.slices(&deleted) {
        // NULLs in the list match no row.
        q.push("DELETE FROM task_outbox WHERE msg_id IN (");
        let mut list = q.separated(", ");
        for i in 0..shape.rows {
            list.push_bind(slice.get(i).map(|key| key.to_string()));
        }
        q.push("); ");
    }
    for slice in shape.slices(&batch.callbacks) {
        q.push(
            "INSERT INTO task_callbacks (callback_id, task_id, target, payload, state, \
             next_attempt_ms, created_ms, updated_ms) ",
        );
        push_padded_rows(&mut q, shape, 8, slice, |b, c| {
            b.push_bind(c.callback_id.clone())
                .push_bind(c.task_id.clone())
                .push_bind(c.target.clone())
                .push_bind(c.payload.clone())
                .push_bind("pending")
                .push_bind(now)
                .push_bind(now)
                .push_bind(now);
        });
        q.push(" ON CONFLICT (callback_id) DO NOTHING; ");
    }
    q.push("COMMIT");
    let written = q.build().persistent(shape.kept).execute(&mut *conn).await;
    if let Err(e) = written {
        // A statement that failed stops the text before its `COMMIT`.
        if let Err(rollback) = sqlx::query("ROLLBACK").execute(&mut *conn).await {
            tracing::debug!("ROLLBACK after a failed group: {rollback}");
        }
        return Err(e.into());
    }
    Ok(grouped)
}

/// Writes a batch on PostgreSQL in one statement ([`PG_WRITE_GROUP`]), which also renews the
/// lease: one round trip and one commit per group.
async fn write_pg(
    conn: &mut sqlx::PgConnection,
    term: &mut Term,
    apart: &mut Apart,
    batch: &Batch,
) -> Result<Option<Grouped>, StoreError> {
    let encoding = std::time::Instant::now();
    let mut rows = Vec::with_capacity(batch.tasks.len());
    let mut bodies = Vec::new();
    for task in &batch.tasks {
        let (history, mut kept_apart) = apart::stored_history(task, term.term, &apart.written)?;
        rows.push(cells(task, Some(history))?);
        bodies.append(&mut kept_apart);
    }
    if !bodies.is_empty() {
        let started = std::time::Instant::now();
        apart::write(&apart.pool, &bodies).await?;
        tracing::debug!(
            bodies = bodies.len(),
            bytes = bodies.iter().map(|b| b.json.len()).sum::<usize>(),
            encode_us = started.duration_since(encoding).as_micros() as u64,
            write_us = started.elapsed().as_micros() as u64,
            "large results written apart"
        );
    }
    let started = std::time::Instant::now();
    let mut q = sqlx::query_scalar::<_, i64>(PG_WRITE_GROUP.as_str())
        .bind(&term.spec.name)
        .bind(&term.spec.holder)
        .bind(millis(term.spec.duration))
        .bind(term.term);
    for (i, column) in COLUMNS.iter().enumerate() {
        let values = rows.iter().map(|row| &row[i]);
        q = match column.kind {
            Kind::Text | Kind::Json => q.bind(
                values
                    .map(|c| match c {
                        Cell::Text(v) => v.as_deref(),
                        _ => None,
                    })
                    .collect::<Vec<Option<&str>>>(),
            ),
            Kind::Int4 => q.bind(
                values
                    .map(|c| match c {
                        Cell::Int4(v) => *v,
                        _ => 0,
                    })
                    .collect::<Vec<i32>>(),
            ),
            Kind::Int8 => q.bind(
                values
                    .map(|c| match c {
                        Cell::Int8(v) => *v,
                        _ => 0,
                    })
                    .collect::<Vec<i64>>(),
            ),
            Kind::Bool => q.bind(
                values
                    .map(|c| matches!(c, Cell::Bool(true)))
                    .collect::<Vec<bool>>(),
            ),
        };
    }
    let e = &batch.events;
    let tasks: HashMap<&str, &Task> = batch
        .tasks
        .iter()
        .map(|t| (t.task_id.as_str(), &**t))
        .collect();
    let data = e
        .iter()
        .map(|e| {
            stored_event_data(e, tasks.get(e.task_id.as_str()).copied())
                .map(|data| json_text(&*data))
                .transpose()
        })
        .collect::<Result<Vec<Option<String>>, _>>()
        .map_err(|source| StoreError::Encode {
            task_id: e.first().map(|e| e.task_id.clone()).unwrap_or_default(),
            source,
        })?;
    let (o, grouped) = outbox_rows(batch)?;
    let c = &batch.callbacks;
    let bytes = rows
        .iter()
        .flatten()
        .map(|cell| match cell {
            Cell::Text(Some(text)) => text.len(),
            _ => 8,
        })
        .chain(data.iter().map(|d| d.as_ref().map_or(0, String::len)))
        .chain(o.iter().map(|row| row.payload.len()))
        .chain(c.iter().map(|c| c.payload.len()))
        .sum::<usize>();
    let statement = q
        .bind(e.iter().map(|e| e.task_id.as_str()).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.seq).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.at_ms).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.state.as_str()).collect::<Vec<_>>())
        .bind(data)
        .bind(processed_ids(batch, ProcessedHalf::A))
        .bind(processed_ids(batch, ProcessedHalf::B))
        .bind(now_ms())
        .bind(o.iter().map(|row| row.key.as_ref()).collect::<Vec<&str>>())
        .bind(o.iter().map(|row| row.client_id).collect::<Vec<_>>())
        .bind(o.iter().map(|row| row.connection).collect::<Vec<_>>())
        .bind(
            o.iter()
                .map(|row| row.payload.as_ref())
                .collect::<Vec<&[u8]>>(),
        )
        .bind(o.iter().map(|row| row.kind.as_str()).collect::<Vec<_>>())
        .bind(outbox_deleted(batch))
        .bind(c.iter().map(|c| c.callback_id.as_str()).collect::<Vec<_>>())
        .bind(c.iter().map(|c| c.task_id.as_str()).collect::<Vec<_>>())
        .bind(c.iter().map(|c| c.target.as_str()).collect::<Vec<_>>())
        .bind(c.iter().map(|c| c.payload.as_str()).collect::<Vec<_>>());
    let renewed = if batch.clear_processed {
        write_clearing_processed(conn, batch.processed_into, statement).await?
    } else {
        statement.fetch_one(&mut *conn).await?
    };
    if renewed != 1 {
        return Err(term.lost());
    }
    term.renewed = started;
    apart.written.committed(bodies, &batch.tasks);
    if bytes > LARGE_GROUP_BYTES {
        // The connection's buffers grew to this statement's size and would keep it.
        sqlx::Connection::shrink_buffers(conn);
    }
    Ok(grouped)
}

/// Runs a group's statement after emptying the table of processed ids `half`, in one
/// transaction: TRUNCATE cannot be part of the statement, and the statement's lease check
/// fences both (a replica whose term is over empties nothing). Returns what the statement
/// returns.
async fn write_clearing_processed(
    conn: &mut sqlx::PgConnection,
    half: ProcessedHalf,
    statement: sqlx::query::QueryScalar<'_, sqlx::Postgres, i64, sqlx::postgres::PgArguments>,
) -> Result<i64, StoreError> {
    let truncate = match half {
        ProcessedHalf::A => "TRUNCATE processed_messages",
        ProcessedHalf::B => "TRUNCATE processed_messages_b",
    };
    sqlx::query("BEGIN").execute(&mut *conn).await?;
    let written = match sqlx::query(truncate).execute(&mut *conn).await {
        Ok(_) => statement.fetch_one(&mut *conn).await,
        Err(e) => Err(e),
    };
    let end = match written {
        Ok(1) => "COMMIT",
        Ok(_) | Err(_) => "ROLLBACK",
    };
    let ended = sqlx::query(end).execute(&mut *conn).await;
    let renewed = written?;
    ended?;
    Ok(renewed)
}

/// A group whose statement carries more than this leaves the leader's connection with its
/// buffers shrunk back to their default size.
const LARGE_GROUP_BYTES: usize = 1 << 20;

impl Writer {
    /// Writes a batch in one transaction: all of it, or (on error) none of it. Says which of
    /// its outbox frames were stored together in one row.
    pub async fn write(&mut self, batch: &Batch) -> Result<Option<Grouped>, StoreError> {
        if batch.is_empty() {
            return Ok(None);
        }
        match self {
            Writer::Pg { conn, term, apart } => write_pg(conn, term, apart, batch).await,
            Writer::Lite(conn) => write_sqlite(conn, batch).await,
        }
    }

    /// Renews the lease when a third of it has passed since the last renewal (a leader with
    /// nothing to write still holds it). Fails when another replica took it over.
    pub async fn renew_if_due(&mut self) -> Result<(), StoreError> {
        match self {
            Writer::Pg { conn, term, .. } if term.renewed.elapsed() >= term.spec.duration / 3 => {
                term.renew(conn).await
            }
            Writer::Pg { .. } | Writer::Lite(_) => Ok(()),
        }
    }

    /// Gives the lease up at once (a graceful stop): a standby need not wait for it to run
    /// out. Best effort; an error leaves the lease to run out.
    pub async fn resign(&mut self) {
        if let Writer::Pg { conn, term, .. } = self {
            let resigned = sqlx::query(
                "UPDATE session_leader SET expires_ms = 0 \
                 WHERE name = $1 AND holder = $2 AND term = $3",
            )
            .bind(&term.spec.name)
            .bind(&term.spec.holder)
            .bind(term.term)
            .execute(conn)
            .await;
            if let Err(e) = resigned {
                tracing::warn!(
                    "could not give the leadership up; it passes when the lease runs out: {e}"
                );
            }
        }
    }

    /// Every task that has not ended, oldest first (what a new leader takes over). A row
    /// this version cannot read is logged and left alone, so that it cannot keep every
    /// replica from leading.
    pub async fn load_live(&mut self) -> Result<Vec<Task>, StoreError> {
        let (conn, mut apart) = match self {
            Writer::Pg { conn, apart, .. } => (Conn::Postgres(conn), Some(apart)),
            Writer::Lite(conn) => (Conn::Sqlite(conn), None),
        };
        let mut records: Vec<TaskRecord> = conn.query(&LIVE_TASKS).fetch_all().await?;
        if let Some(apart) = apart.as_mut() {
            for record in &mut records {
                let found =
                    apart::restore(&apart.pool, &record.task_id, &mut record.history.0).await?;
                apart.written.found(&record.task_id, found);
            }
        }
        Ok(records
            .into_iter()
            .filter_map(|r| match Task::try_from(r) {
                Ok(task) => Some(task),
                Err(e) => {
                    tracing::error!("a live task is not taken over: {e}");
                    None
                }
            })
            .collect())
    }
}

impl TaskStore {
    /// A store over an open (migrated) database.
    pub fn new(db: Database) -> Self {
        TaskStore { db }
    }

    /// The database (for readiness probes).
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Tries to become the leader: the one replica that applies changes. On PostgreSQL this
    /// takes the lease `lease.name` on a connection of its own, and returns `None` while
    /// another replica's lease runs, keeping that connection in `spare` for the next try (a
    /// standby does not open a connection per try). On SQLite (one process) it always
    /// succeeds.
    pub async fn try_lead(
        &self,
        lease: &LeaseSpec,
        spare: &mut Option<sqlx::PgConnection>,
    ) -> Result<Option<Writer>, StoreError> {
        Ok(match &self.db {
            Database::Postgres(pool) => {
                let mut conn = match spare.take() {
                    Some(conn) => conn,
                    None => {
                        let mut conn = pool.acquire().await?.detach();
                        // A transaction left idle for half a lease (a frozen leader) ends,
                        // and no statement waits long for a lock: only the leader writes
                        // these tables, so a lock held for long is a frozen old leader's.
                        let half = (millis(lease.duration) / 2).max(1);
                        let settings = [
                            ("idle_in_transaction_session_timeout", half),
                            ("lock_timeout", half.min(MAX_LOCK_WAIT_MS)),
                        ];
                        for (setting, ms) in settings {
                            sqlx::query(&format!("SET {setting} = {ms}"))
                                .execute(&mut conn)
                                .await?;
                        }
                        // Every statement of the leader touches rows by key. Its group write
                        // is prepared once, and the plan PostgreSQL keeps is the one made
                        // while the tables were small (a sequential scan of the outbox, say):
                        // it must stay an index scan as the tables grow.
                        sqlx::query("SET enable_seqscan = off")
                            .execute(&mut conn)
                            .await?;
                        conn
                    }
                };
                sqlx::query(END_EXPIRED_HOLDER.as_str())
                    .bind(&lease.name)
                    .bind(&lease.holder)
                    .execute(&mut conn)
                    .await?;
                let started = std::time::Instant::now();
                let taken = sqlx::query_as(TAKE_LEASE.as_str())
                    .bind(&lease.name)
                    .bind(&lease.holder)
                    .bind(millis(lease.duration))
                    .fetch_optional(&mut conn)
                    .await;
                let term: Option<(i64,)> = match taken {
                    Ok(term) => term,
                    // The old holder's session still holds the row (it is being ended): taken
                    // at a later try.
                    Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_TIMEOUT) => {
                        None
                    }
                    Err(e) => return Err(e.into()),
                };
                match term {
                    Some((term,)) => Some(Writer::Pg {
                        conn,
                        term: Box::new(Term {
                            spec: lease.clone(),
                            term,
                            renewed: started,
                        }),
                        apart: Box::new(Apart {
                            pool: pool.clone(),
                            written: apart::Written::default(),
                        }),
                    }),
                    None => {
                        *spare = Some(conn);
                        None
                    }
                }
            }
            Database::Sqlite(pool) => Some(Writer::Lite(pool.acquire().await?.detach())),
        })
    }

    /// One task by id.
    pub async fn get(&self, task_id: &str) -> Result<Option<Task>, StoreError> {
        let record: Option<TaskRecord> = self
            .db
            .query(&GET_TASK)
            .bind(task_id.to_owned())
            .fetch_optional()
            .await?;
        self.decode(record.into_iter().collect())
            .await
            .map(|mut t| t.pop())
    }

    /// The newest task with a name.
    pub async fn get_by_name(&self, task_name: &str) -> Result<Option<Task>, StoreError> {
        let record: Option<TaskRecord> = self
            .db
            .query(&GET_TASK_BY_NAME)
            .bind(task_name.to_owned())
            .fetch_optional()
            .await?;
        self.decode(record.into_iter().collect())
            .await
            .map(|mut t| t.pop())
    }

    /// Tasks, newest first, after a cursor (`created_ms:task_id` of the last row seen).
    pub async fn list(&self, filter: ListFilter) -> Result<Vec<Task>, StoreError> {
        let (cursor_ms, cursor_id) = filter.cursor.unwrap_or((i64::MAX, String::new()));
        let records: Vec<TaskRecord> = self
            .db
            .query(&LIST_TASKS)
            .bind(
                filter
                    .state
                    .map(|s| s.as_str().to_owned())
                    .unwrap_or_default(),
            )
            .bind(filter.executor.unwrap_or_default())
            .bind(filter.requester.unwrap_or_default())
            .bind(filter.task_name.unwrap_or_default())
            .bind(cursor_ms)
            .bind(cursor_id)
            .bind(filter.limit)
            .fetch_all()
            .await?;
        self.decode(records).await
    }

    /// Tasks from their rows, with the results kept apart put back.
    async fn decode(&self, mut records: Vec<TaskRecord>) -> Result<Vec<Task>, StoreError> {
        if let Database::Postgres(pool) = &self.db {
            for record in &mut records {
                apart::restore(pool, &record.task_id, &mut record.history.0).await?;
            }
        }
        records.into_iter().map(Task::try_from).collect()
    }

    /// A task's events after a sequence number, at most `limit`.
    pub async fn events(
        &self,
        task_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<TaskEvent>, StoreError> {
        let records: Vec<EventRecord> = self
            .db
            .query(&TASK_EVENTS)
            .bind(task_id.to_owned())
            .bind(after)
            .bind(limit)
            .fetch_all()
            .await?;
        let mut events = records
            .into_iter()
            .map(TaskEvent::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let shared = |e: &TaskEvent| {
            e.data
                .as_ref()
                .is_some_and(|d| d.get(HISTORY_REF).is_some())
        };
        if events.iter().any(shared)
            && let Some(task) = self.get(task_id).await?
        {
            for event in events.iter_mut().filter(|e| shared(e)) {
                if let Some(data) = event.data.as_mut() {
                    restore_event_data(data, &task.history);
                }
            }
        }
        Ok(events)
    }

    /// The requester of the task with this id, if it exists.
    pub async fn owner(&self, task_id: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> = self
            .db
            .query(&TASK_OWNER)
            .bind(task_id.to_owned())
            .fetch_optional()
            .await?;
        Ok(row.map(|r| r.0))
    }

    /// Up to `limit` task ids in key order, from `from` on (`from` itself included): pages of
    /// every id in the database, each page starting at the last id of the one before.
    pub async fn task_ids_from(&self, from: &str, limit: usize) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = self
            .db
            .query(&TASK_IDS_FROM)
            .bind(from.to_owned())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all()
            .await?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// The requesters of those of these task ids that exist, in one query per
    /// [`IDS_PER_STATEMENT`] ids.
    pub async fn owners(&self, task_ids: &[String]) -> Result<HashMap<String, String>, StoreError> {
        let mut owners = std::collections::HashMap::new();
        for chunk in task_ids.chunks(IDS_PER_STATEMENT) {
            let rows: Vec<(String, String)> = self
                .db
                .query(&TASK_OWNERS)
                .bind(List(chunk))
                .planned_each_time()
                .fetch_all()
                .await?;
            owners.extend(rows);
        }
        Ok(owners)
    }

    /// Whether the frame with this id was applied.
    pub async fn processed(&self, msg_id: &str) -> Result<bool, StoreError> {
        let row: Option<(String,)> = self
            .db
            .query(&PROCESSED)
            .bind(msg_id.to_owned())
            .fetch_optional()
            .await?;
        Ok(row.is_some())
    }

    /// Outbox rows older than `older_than` (epoch ms): frames whose publish failed, or that
    /// a crash left unsent; not those in `except`.
    pub async fn stale_outbox(
        &self,
        older_than: i64,
        except: &[String],
        limit: i64,
    ) -> Result<Vec<crate::outbox::Stored>, StoreError> {
        use crate::outbox::Stored;
        let rows: Vec<OutboxRow> = self
            .db
            .query(&STALE_OUTBOX)
            .bind(older_than)
            .bind(limit)
            .bind(List(except))
            .fetch_all()
            .await?;
        let mut frames = Vec::with_capacity(rows.len());
        for (msg_id, subject, client_id, connection, payload, kind) in rows {
            let corrupt = |column, value: String| StoreError::Corrupt {
                task_id: String::new(),
                column,
                value,
            };
            if PayloadKind::from_db(&kind) == Some(PayloadKind::Frames) {
                let grouped = crate::outbox::frames_of(&payload)
                    .map_err(|e| corrupt("task_outbox.payload", format!("{msg_id}: {e}")))?;
                frames.push(Stored::Group {
                    key: msg_id,
                    frames: grouped,
                });
                continue;
            }
            let Some(client_id) = client_id.or_else(|| client_of_subject(&subject)) else {
                return Err(corrupt("task_outbox.subject", subject));
            };
            let (payload, task_end_of) = match PayloadKind::from_db(&kind) {
                Some(PayloadKind::Frame) => (bytes::Bytes::from(payload), None),
                Some(PayloadKind::TaskEndOf) => {
                    let of: TaskEndOf = serde_json::from_slice(&payload)
                        .map_err(|e| corrupt("task_outbox.payload_kind", format!("{kind}: {e}")))?;
                    let Some(task) = self.get(&of.task_id).await? else {
                        tracing::warn!(task = %of.task_id, "the task of a task_end in the outbox is gone; not sent");
                        continue;
                    };
                    let frame =
                        serde_json::to_vec(&task.task_end(&of.response_id)).map_err(|source| {
                            StoreError::Encode {
                                task_id: of.task_id.clone(),
                                source,
                            }
                        })?;
                    (bytes::Bytes::from(frame), Some(of))
                }
                Some(PayloadKind::Frames) | None => {
                    return Err(corrupt("task_outbox.payload_kind", kind));
                }
            };
            frames.push(Stored::Alone(OutFrame {
                msg_id,
                client_id,
                connection,
                payload,
                task_end_of,
                trace: None,
            }));
        }
        Ok(frames)
    }
}

impl TaskStore {
    /// Ids of outbox rows committed before `older_than` (ms), oldest first, at most `limit`.
    pub async fn expired_outbox(
        &self,
        older_than: i64,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = self
            .db
            .query(&EXPIRED_OUTBOX)
            .bind(older_than)
            .bind(limit)
            .fetch_all()
            .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }
}

/// Due callbacks, claimed: each is pushed `$2` ms into the future so that no other replica
/// (nor this one's next sweep) takes it while it is being delivered. PostgreSQL re-checks the
/// outer conditions on a row another replica claimed meanwhile, so one claim wins.
static CLAIM_CALLBACKS: Sql = Sql::same(
    "UPDATE task_callbacks SET next_attempt_ms = $1 + $2 \
     WHERE callback_id IN (SELECT callback_id FROM task_callbacks \
         WHERE state = 'pending' AND next_attempt_ms <= $1 ORDER BY next_attempt_ms LIMIT $3) \
     AND state = 'pending' AND next_attempt_ms <= $1 \
     RETURNING callback_id, task_id, target, payload, attempts, attempts_base, created_ms",
);
static RECORD_ATTEMPT: Sql = Sql::same(
    "INSERT INTO callback_attempts (callback_id, attempt, at_ms, duration_ms, status, error) \
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (callback_id, attempt) DO NOTHING",
);
static SETTLE_CALLBACK: Sql = Sql::same(
    "UPDATE task_callbacks SET state = $2, attempts = $3, next_attempt_ms = $4, updated_ms = $5, \
     last_status = $6, last_error = $7 WHERE callback_id = $1",
);
static TASK_CALLBACKS: Sql = Sql::same(
    "SELECT callback_id, task_id, target, payload, state, attempts, attempts_base, \
     next_attempt_ms, created_ms, updated_ms, last_status, last_error \
     FROM task_callbacks WHERE task_id = $1 ORDER BY created_ms, callback_id",
);
static CALLBACK_ATTEMPTS: Sql = Sql::same(
    "SELECT a.callback_id, a.attempt, a.at_ms, a.duration_ms, a.status, a.error \
     FROM callback_attempts a JOIN task_callbacks c ON c.callback_id = a.callback_id \
     WHERE c.task_id = $1 ORDER BY a.callback_id, a.attempt",
);
static REDELIVER_CALLBACKS: Sql = Sql::same(
    "UPDATE task_callbacks SET state = 'pending', attempts_base = attempts, \
     next_attempt_ms = $2, updated_ms = $2 WHERE task_id = $1 AND state <> 'pending'",
);

/// A callback claimed for delivery.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DueCallback {
    pub callback_id: String,
    pub task_id: String,
    pub target: String,
    pub payload: String,
    /// Attempts made before this one.
    pub attempts: i32,
    /// `attempts` when it was last queued (the budget counts from here).
    pub attempts_base: i32,
    /// When it was written (epoch ms).
    pub created_ms: i64,
}

/// A stored callback, as REST shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CallbackRecord {
    pub callback_id: String,
    pub task_id: String,
    pub target: String,
    pub payload: String,
    pub state: String,
    pub attempts: i32,
    pub attempts_base: i32,
    pub next_attempt_ms: i64,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
}

/// One delivery attempt.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AttemptRecord {
    pub callback_id: String,
    pub attempt: i32,
    pub at_ms: i64,
    pub duration_ms: i64,
    pub status: Option<i32>,
    pub error: Option<String>,
}

/// How one attempt ended, and what follows.
#[derive(Debug, Clone)]
pub struct Settled {
    /// `pending`, `delivered`, `gone` or `dead`.
    pub state: &'static str,
    /// Attempts made, this one included.
    pub attempts: i32,
    /// When to try again (pending), or now.
    pub next_attempt_ms: i64,
    pub status: Option<i32>,
    pub error: Option<String>,
}

impl TaskStore {
    /// Claims up to `limit` due callbacks for `claim_ms`.
    pub async fn claim_callbacks(
        &self,
        now: i64,
        claim_ms: i64,
        limit: i64,
    ) -> Result<Vec<DueCallback>, StoreError> {
        Ok(self
            .db
            .query(&CLAIM_CALLBACKS)
            .bind(now)
            .bind(claim_ms)
            .bind(limit)
            .fetch_all()
            .await?)
    }

    /// Records an attempt in the delivery log and its outcome on the callback.
    pub async fn settle_callback(
        &self,
        callback_id: &str,
        at_ms: i64,
        duration_ms: i64,
        settled: &Settled,
    ) -> Result<(), StoreError> {
        self.db
            .query(&RECORD_ATTEMPT)
            .bind(callback_id.to_owned())
            .bind(settled.attempts)
            .bind(at_ms)
            .bind(duration_ms)
            .bind(settled.status)
            .bind(settled.error.clone())
            .execute()
            .await?;
        self.db
            .query(&SETTLE_CALLBACK)
            .bind(callback_id.to_owned())
            .bind(settled.state)
            .bind(settled.attempts)
            .bind(settled.next_attempt_ms)
            .bind(now_ms())
            .bind(settled.status)
            .bind(settled.error.clone())
            .execute()
            .await?;
        Ok(())
    }

    /// A task's callbacks and every attempt at them.
    pub async fn callbacks(
        &self,
        task_id: &str,
    ) -> Result<(Vec<CallbackRecord>, Vec<AttemptRecord>), StoreError> {
        let callbacks = self
            .db
            .query(&TASK_CALLBACKS)
            .bind(task_id.to_owned())
            .fetch_all()
            .await?;
        let attempts = self
            .db
            .query(&CALLBACK_ATTEMPTS)
            .bind(task_id.to_owned())
            .fetch_all()
            .await?;
        Ok((callbacks, attempts))
    }

    /// Queues a task's delivered, gone and dead callbacks again, with a fresh budget of
    /// attempts; returns how many.
    pub async fn redeliver_callbacks(&self, task_id: &str) -> Result<u64, StoreError> {
        Ok(self
            .db
            .query(&REDELIVER_CALLBACKS)
            .bind(task_id.to_owned())
            .bind(now_ms())
            .execute()
            .await?)
    }
}

/// Filters of `GET /api/tasks`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this state.
    pub state: Option<TaskState>,
    /// Only this executor.
    pub executor: Option<String>,
    /// Only this requester id.
    pub requester: Option<String>,
    /// Only this task name.
    pub task_name: Option<String>,
    /// After this position: `created_ms` and `task_id` of the last row seen.
    pub cursor: Option<(i64, String)>,
    /// At most this many.
    pub limit: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_values_are_told_by_their_encoded_size() {
        // A string encodes with its two quotes.
        let string = |len: usize| Value::from("x".repeat(len));
        assert!(!is_large(&string(LARGE_VALUE_BYTES - 3)));
        assert!(is_large(&string(LARGE_VALUE_BYTES - 2)));
        assert!(is_large(&string(90 << 20)));
        assert!(!is_large(&serde_json::json!({ "results": [1, 2, 3] })));
        let many = Value::Array((0..LARGE_VALUE_BYTES / 2).map(Value::from).collect());
        assert!(
            is_large(&many),
            "two bytes or more per item, with the commas"
        );
    }

    #[test]
    fn a_group_takes_the_smallest_kept_shape_and_a_larger_one_is_sliced_whole() {
        assert_eq!(
            LiteShape::of(0),
            LiteShape {
                rows: 4,
                kept: true
            }
        );
        assert_eq!(
            LiteShape::of(5),
            LiteShape {
                rows: 16,
                kept: true
            }
        );
        assert_eq!(
            LiteShape::of(256),
            LiteShape {
                rows: 256,
                kept: true
            }
        );
        let large = LiteShape::of(257);
        assert_eq!(
            large,
            LiteShape {
                rows: 256,
                kept: false
            }
        );
        for (n, shape) in [
            (0usize, LiteShape::of(0)),
            (3, LiteShape::of(3)),
            (600, large),
        ] {
            let rows: Vec<usize> = (0..n).collect();
            let slices = shape.slices(&rows);
            let joined: Vec<usize> = slices.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(joined, rows, "n = {n}: no row lost or repeated");
            assert!(slices.iter().all(|s| s.len() <= shape.rows), "n = {n}");
            if shape.kept {
                assert_eq!(
                    slices.len(),
                    1,
                    "one statement per table, even an empty one"
                );
            }
        }
        // The largest text stays under SQLite's bind-parameter limit (32,766).
        let per_row = COLUMNS.len() + 6 + 2 + 7 + 1 + 8;
        assert!(per_row * LITE_GROUP_ROWS[LITE_GROUP_ROWS.len() - 1] + 1 < 32_766);
    }

    #[test]
    fn rows_from_before_the_client_column_name_their_client_in_the_subject() {
        assert_eq!(
            client_of_subject("t1.aip.deliver.pc~2E1").as_deref(),
            Some("pc.1")
        );
        assert_eq!(client_of_subject("deliver.~").as_deref(), Some(""));
        assert_eq!(client_of_subject("t1.aip.frames.pc"), None);
        assert_eq!(client_of_subject(""), None);
    }

    #[test]
    fn the_statements_come_from_the_one_column_list() {
        assert_eq!(COLUMNS.len(), 36);
        let upsert = PG_WRITE_GROUP.as_str();
        // The lease's four parameters, then the tasks' 36 columns, then the other tables',
        // then the callbacks' four.
        assert!(upsert.contains("$5::text[]") && upsert.contains("$40::bool[]"));
        assert!(upsert.contains("$49::int8") && upsert.contains("$59::text[]"));
        assert!(!upsert.contains("$60"));
        assert!(upsert.contains("steps::json,"));
        assert!(upsert.contains("state = excluded.state"));
        assert!(
            !upsert.contains("task_name = excluded"),
            "fixed columns are not updated"
        );
        assert!(SELECT_TASKS.starts_with("SELECT task_id, task_name, state,"));
    }
}
