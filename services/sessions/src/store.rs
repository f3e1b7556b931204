//! The session service's tables, on PostgreSQL or SQLite.
//!
//! Every state change happens in one transaction ([`Tx`]) that locks the task row, appends
//! its events with the next gap-free sequence numbers, records the frame that caused it (so a
//! redelivered frame changes nothing twice) and queues the frames it sends in the outbox.
//! SQL is written once with `$N` placeholders; for SQLite they become `?N`. On SQLite, writers
//! are serialised by a process-wide lock (one process owns an embedded database).

use aip_store::Database;
use proto_schemas::sessions::{TaskEvent, TaskState, TaskView};
use proto_schemas::{Command, ErrorCode};
use serde_json::Value;
use sqlx::types::Json;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[error("database error: {0}")]
pub struct StoreError(#[from] sqlx::Error);

/// A task row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskRow {
    /// Id (= session id).
    pub task_id: String,
    /// Name.
    pub task_name: String,
    /// State string.
    pub state: String,
    /// Request text.
    pub request: String,
    /// Structured input.
    pub data: Option<Json<Value>>,
    /// `client`, `rest` or `nats`.
    pub requester_kind: String,
    /// Requester id.
    pub requester_id: String,
    /// For client requesters: device or constellation.
    pub requester_type: Option<String>,
    /// Executor.
    pub executor_id: Option<String>,
    /// Executor platform.
    pub executor_platform: Option<String>,
    /// Required capabilities.
    pub required_capabilities: Json<Vec<String>>,
    /// `scripted` or `remote`.
    pub planner: String,
    /// Scripted steps.
    pub steps: Option<Json<Vec<Vec<Command>>>>,
    /// Next step to plan.
    pub step: i32,
    /// Command in flight.
    pub pending_response_id: Option<String>,
    /// The next step is to be planned.
    pub needs_plan: bool,
    /// Started by UFO's dispatch (dispatching sends a server `task` frame).
    pub ufo_dispatch: bool,
    /// A UFO dispatch waits for the device's echo.
    pub awaiting_echo: bool,
    /// Commands and results of every step.
    pub history: Json<Vec<Value>>,
    /// Priority.
    pub priority: i32,
    /// Result.
    pub result: Option<Json<Value>>,
    /// Error text.
    pub error: Option<String>,
    /// Error code.
    pub error_code: Option<String>,
    /// Callback URL.
    pub callback_url: Option<String>,
    /// Task deadline.
    pub task_deadline_ms: i64,
    /// Nearest deadline.
    pub deadline_ms: i64,
    /// Created.
    pub created_ms: i64,
    /// Updated.
    pub updated_ms: i64,
    /// Next event sequence number.
    pub next_seq: i64,
}

impl TaskRow {
    /// The parsed state (an unknown string reads as failed, and is logged).
    pub fn state(&self) -> TaskState {
        TaskState::from_wire(&self.state).unwrap_or_else(|| {
            tracing::error!(task = %self.task_id, state = %self.state, "unknown task state in the database");
            TaskState::Failed
        })
    }

    /// The REST view.
    pub fn view(&self) -> TaskView {
        let requester = match self.requester_kind.as_str() {
            "client" => self.requester_id.clone(),
            kind => format!("{kind}:{}", self.requester_id),
        };
        TaskView {
            task_id: self.task_id.clone(),
            task_name: self.task_name.clone(),
            state: self.state(),
            request: self.request.clone(),
            requester,
            executor_id: self.executor_id.clone(),
            priority: self.priority,
            result: self.result.as_ref().map(|j| j.0.clone()),
            error: self.error.clone(),
            error_code: self.error_code.as_deref().and_then(ErrorCode::from_wire),
            created_at: rfc3339(self.created_ms),
            updated_at: rfc3339(self.updated_ms),
            events: self.next_seq - 1,
        }
    }
}

/// Milliseconds since the epoch as RFC 3339.
pub fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Now, in epoch milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[derive(Debug, sqlx::FromRow)]
struct EventRow {
    task_id: String,
    seq: i64,
    at_ms: i64,
    kind: String,
    state: String,
    data: Option<Json<Value>>,
}

impl EventRow {
    fn into_event(self) -> TaskEvent {
        TaskEvent {
            task_id: self.task_id,
            seq: self.seq,
            at: rfc3339(self.at_ms),
            kind: self.kind,
            state: TaskState::from_wire(&self.state).unwrap_or(TaskState::Failed),
            data: self.data.map(|j| j.0),
        }
    }
}

/// `$1` → `?1` for SQLite.
fn lite(sql: &str) -> String {
    sql.replace('$', "?")
}

const TASK_COLUMNS: &str = "task_id, task_name, state, request, data, requester_kind, requester_id, requester_type, \
    executor_id, executor_platform, required_capabilities, planner, steps, step, pending_response_id, needs_plan, \
    ufo_dispatch, awaiting_echo, history, priority, result, error, error_code, callback_url, task_deadline_ms, deadline_ms, \
    created_ms, updated_ms, next_seq";

/// The task store.
#[derive(Clone)]
pub struct TaskStore {
    db: Database,
}

macro_rules! fetch {
    ($target:expr, $ty:ty, $sql:expr, [$($arg:expr),* $(,)?], $method:ident) => {
        match $target {
            Target::Pg(c) => sqlx::query_as::<_, $ty>(sqlx::AssertSqlSafe(($sql).to_string()))$(.bind($arg))*.$method(c).await,
            Target::Lite(c) => sqlx::query_as::<_, $ty>(sqlx::AssertSqlSafe(lite($sql)))$(.bind($arg))*.$method(c).await,
        }
    };
}

/// Where a read runs.
enum Target<'a> {
    Pg(&'a mut sqlx::PgConnection),
    Lite(&'a mut sqlx::SqliteConnection),
}

/// An event to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// The task.
    pub task_id: String,
    /// Its gap-free sequence number.
    pub seq: i64,
    /// When.
    pub at_ms: i64,
    /// What happened.
    pub kind: String,
    /// The task's state after it.
    pub state: String,
    /// Details.
    pub data: Option<Value>,
}

/// A frame to publish once its batch has committed.
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// The message id gateways de-duplicate on (`Nats-Msg-Id`), also the outbox key.
    pub msg_id: String,
    /// Subject to publish on.
    pub subject: String,
    /// Body.
    pub payload: Vec<u8>,
}

/// Everything one group commit writes, in one transaction.
#[derive(Debug, Default)]
pub struct Batch {
    /// Tasks created or changed (the whole row; the last version of each).
    pub tasks: Vec<TaskRow>,
    /// Events appended.
    pub events: Vec<NewEvent>,
    /// Ids of the frames applied, so a redelivery is recognised.
    pub processed: Vec<String>,
    /// Frames sent by these changes.
    pub outbox: Vec<OutFrame>,
    /// Outbox rows of earlier batches that have been published since.
    pub published: Vec<String>,
    /// Forget processed-frame ids older than this.
    pub prune_processed_before: Option<i64>,
}

impl Batch {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
            && self.events.is_empty()
            && self.processed.is_empty()
            && self.outbox.is_empty()
            && self.published.is_empty()
            && self.prune_processed_before.is_none()
    }
}

/// Rows per statement: far below the bind-parameter limits of both databases (29 columns
/// × 500 rows = 14,500 parameters; SQLite allows 32,766, PostgreSQL 65,535).
const ROWS_PER_STATEMENT: usize = 500;

/// Splits rows into slices of a few fixed sizes (256, 32, 4 and 1 rows), so a multi-row
/// statement has one of a few texts and stays in the connection's prepared-statement cache
/// instead of being parsed again for every batch size.
fn sized_chunks<T>(mut rows: &[T]) -> Vec<&[T]> {
    let mut chunks = Vec::new();
    for size in [256, 32, 4, 1] {
        while rows.len() >= size {
            let (head, tail) = rows.split_at(size);
            chunks.push(head);
            rows = tail;
        }
    }
    chunks
}

/// The leader's own connection. It holds the leadership (a session-level advisory lock on
/// PostgreSQL, released by the server when the connection ends) and writes every batch, so a
/// replica that lost its connection can no longer write: its transaction fails.
pub enum Writer {
    /// PostgreSQL.
    Pg(sqlx::PgConnection),
    /// SQLite (one process owns an embedded database).
    Lite(sqlx::SqliteConnection),
}

/// Writes a batch on SQLite with multi-row statements of a few fixed sizes.
async fn write_sqlite(conn: &mut sqlx::SqliteConnection, batch: &Batch) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    for rows in sized_chunks(&batch.tasks) {
        let mut q =
            sqlx::QueryBuilder::<sqlx::Sqlite>::new(format!("INSERT INTO tasks ({TASK_COLUMNS}) "));
        q.push_values(rows, |mut b, t| {
            b.push_bind(t.task_id.clone())
                .push_bind(t.task_name.clone())
                .push_bind(t.state.clone())
                .push_bind(t.request.clone())
                .push_bind(t.data.clone())
                .push_bind(t.requester_kind.clone())
                .push_bind(t.requester_id.clone())
                .push_bind(t.requester_type.clone())
                .push_bind(t.executor_id.clone())
                .push_bind(t.executor_platform.clone())
                .push_bind(t.required_capabilities.clone())
                .push_bind(t.planner.clone())
                .push_bind(t.steps.clone())
                .push_bind(t.step)
                .push_bind(t.pending_response_id.clone())
                .push_bind(t.needs_plan)
                .push_bind(t.ufo_dispatch)
                .push_bind(t.awaiting_echo)
                .push_bind(t.history.clone())
                .push_bind(t.priority)
                .push_bind(t.result.clone())
                .push_bind(t.error.clone())
                .push_bind(t.error_code.clone())
                .push_bind(t.callback_url.clone())
                .push_bind(t.task_deadline_ms)
                .push_bind(t.deadline_ms)
                .push_bind(t.created_ms)
                .push_bind(t.updated_ms)
                .push_bind(t.next_seq);
        });
        q.push(
                " ON CONFLICT (task_id) DO UPDATE SET state = excluded.state, executor_id = excluded.executor_id, \
                 executor_platform = excluded.executor_platform, step = excluded.step, \
                 pending_response_id = excluded.pending_response_id, needs_plan = excluded.needs_plan, \
                 awaiting_echo = excluded.awaiting_echo, history = excluded.history, result = excluded.result, \
                 error = excluded.error, error_code = excluded.error_code, deadline_ms = excluded.deadline_ms, \
                 updated_ms = excluded.updated_ms, next_seq = excluded.next_seq",
            );
        q.build().execute(&mut *tx).await?;
    }
    for rows in sized_chunks(&batch.events) {
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
            "INSERT INTO task_events (task_id, seq, at_ms, kind, state, data) ",
        );
        q.push_values(rows, |mut b, e| {
            b.push_bind(e.task_id.clone())
                .push_bind(e.seq)
                .push_bind(e.at_ms)
                .push_bind(e.kind.clone())
                .push_bind(e.state.clone())
                .push_bind(e.data.clone().map(Json));
        });
        q.build().execute(&mut *tx).await?;
    }
    let now = now_ms();
    for ids in sized_chunks(&batch.processed) {
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
            "INSERT INTO processed_messages (msg_id, at_ms) ",
        );
        q.push_values(ids, |mut b, id| {
            b.push_bind(id.clone()).push_bind(now);
        });
        q.push(" ON CONFLICT (msg_id) DO NOTHING");
        q.build().execute(&mut *tx).await?;
    }
    for rows in sized_chunks(&batch.outbox) {
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
            "INSERT INTO task_outbox (msg_id, subject, payload, created_ms) ",
        );
        q.push_values(rows, |mut b, f| {
            b.push_bind(f.msg_id.clone())
                .push_bind(f.subject.clone())
                .push_bind(f.payload.clone())
                .push_bind(now);
        });
        q.build().execute(&mut *tx).await?;
    }
    for ids in sized_chunks(&batch.published) {
        let mut q =
            sqlx::QueryBuilder::<sqlx::Sqlite>::new("DELETE FROM task_outbox WHERE msg_id IN (");
        let mut list = q.separated(", ");
        for id in ids {
            list.push_bind(id.clone());
        }
        q.push(")");
        q.build().execute(&mut *tx).await?;
    }
    if let Some(before) = batch.prune_processed_before {
        sqlx::query("DELETE FROM processed_messages WHERE at_ms < ?1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// JSON as text, for binding into a `text[]` that the statement casts to `jsonb`.
fn json_text<T: serde::Serialize>(value: Option<&T>) -> Option<String> {
    value.map(|v| serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned()))
}

/// Upserts every changed task in one statement: each column travels as one array.
const PG_UPSERT_TASKS: &str = "INSERT INTO tasks (task_id, task_name, state, request, data, requester_kind, \
    requester_id, requester_type, executor_id, executor_platform, required_capabilities, planner, steps, step, \
    pending_response_id, needs_plan, ufo_dispatch, awaiting_echo, history, priority, result, error, error_code, \
    callback_url, task_deadline_ms, deadline_ms, created_ms, updated_ms, next_seq) \
    SELECT task_id, task_name, state, request, data::jsonb, requester_kind, requester_id, requester_type, \
    executor_id, executor_platform, required_capabilities::jsonb, planner, steps::jsonb, step, pending_response_id, \
    needs_plan, ufo_dispatch, awaiting_echo, history::jsonb, priority, result::jsonb, error, error_code, \
    callback_url, task_deadline_ms, deadline_ms, created_ms, updated_ms, next_seq \
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], \
    $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::int4[], $15::text[], $16::bool[], \
    $17::bool[], $18::bool[], $19::text[], $20::int4[], $21::text[], $22::text[], $23::text[], $24::text[], \
    $25::int8[], $26::int8[], $27::int8[], $28::int8[], $29::int8[]) \
    AS u(task_id, task_name, state, request, data, requester_kind, requester_id, requester_type, executor_id, \
    executor_platform, required_capabilities, planner, steps, step, pending_response_id, needs_plan, ufo_dispatch, \
    awaiting_echo, history, priority, result, error, error_code, callback_url, task_deadline_ms, deadline_ms, \
    created_ms, updated_ms, next_seq) \
    ON CONFLICT (task_id) DO UPDATE SET state = excluded.state, executor_id = excluded.executor_id, \
    executor_platform = excluded.executor_platform, step = excluded.step, \
    pending_response_id = excluded.pending_response_id, needs_plan = excluded.needs_plan, \
    awaiting_echo = excluded.awaiting_echo, history = excluded.history, result = excluded.result, \
    error = excluded.error, error_code = excluded.error_code, deadline_ms = excluded.deadline_ms, \
    updated_ms = excluded.updated_ms, next_seq = excluded.next_seq";

/// Writes a batch on PostgreSQL with one statement per table, whatever its size: columns
/// travel as arrays and `UNNEST` turns them back into rows. One statement text per table
/// stays prepared, and a batch costs a handful of round trips.
async fn write_pg(conn: &mut sqlx::PgConnection, batch: &Batch) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    if !batch.tasks.is_empty() {
        let t = &batch.tasks;
        fn col<T>(t: &[TaskRow], f: impl Fn(&TaskRow) -> T) -> Vec<T> {
            t.iter().map(f).collect()
        }
        sqlx::query(PG_UPSERT_TASKS)
            .bind(col(t, |r| r.task_id.clone()))
            .bind(col(t, |r| r.task_name.clone()))
            .bind(col(t, |r| r.state.clone()))
            .bind(col(t, |r| r.request.clone()))
            .bind(col(t, |r| json_text(r.data.as_ref().map(|j| &j.0))))
            .bind(col(t, |r| r.requester_kind.clone()))
            .bind(col(t, |r| r.requester_id.clone()))
            .bind(col(t, |r| r.requester_type.clone()))
            .bind(col(t, |r| r.executor_id.clone()))
            .bind(col(t, |r| r.executor_platform.clone()))
            .bind(col(t, |r| json_text(Some(&r.required_capabilities.0))))
            .bind(col(t, |r| r.planner.clone()))
            .bind(col(t, |r| json_text(r.steps.as_ref().map(|j| &j.0))))
            .bind(col(t, |r| r.step))
            .bind(col(t, |r| r.pending_response_id.clone()))
            .bind(col(t, |r| r.needs_plan))
            .bind(col(t, |r| r.ufo_dispatch))
            .bind(col(t, |r| r.awaiting_echo))
            .bind(col(t, |r| json_text(Some(&r.history.0))))
            .bind(col(t, |r| r.priority))
            .bind(col(t, |r| json_text(r.result.as_ref().map(|j| &j.0))))
            .bind(col(t, |r| r.error.clone()))
            .bind(col(t, |r| r.error_code.clone()))
            .bind(col(t, |r| r.callback_url.clone()))
            .bind(col(t, |r| r.task_deadline_ms))
            .bind(col(t, |r| r.deadline_ms))
            .bind(col(t, |r| r.created_ms))
            .bind(col(t, |r| r.updated_ms))
            .bind(col(t, |r| r.next_seq))
            .execute(&mut *tx)
            .await?;
    }
    if !batch.events.is_empty() {
        let e = &batch.events;
        sqlx::query(
            "INSERT INTO task_events (task_id, seq, at_ms, kind, state, data) \
             SELECT task_id, seq, at_ms, kind, state, data::jsonb \
             FROM UNNEST($1::text[], $2::int8[], $3::int8[], $4::text[], $5::text[], $6::text[]) \
             AS u(task_id, seq, at_ms, kind, state, data)",
        )
        .bind(e.iter().map(|e| e.task_id.clone()).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.seq).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.at_ms).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.kind.clone()).collect::<Vec<_>>())
        .bind(e.iter().map(|e| e.state.clone()).collect::<Vec<_>>())
        .bind(
            e.iter()
                .map(|e| json_text(e.data.as_ref()))
                .collect::<Vec<_>>(),
        )
        .execute(&mut *tx)
        .await?;
    }
    let now = now_ms();
    if !batch.processed.is_empty() {
        sqlx::query(
            "INSERT INTO processed_messages (msg_id, at_ms) SELECT id, $2 FROM UNNEST($1::text[]) AS u(id) \
             ON CONFLICT (msg_id) DO NOTHING",
        )
        .bind(&batch.processed)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    }
    if !batch.outbox.is_empty() {
        let o = &batch.outbox;
        sqlx::query(
            "INSERT INTO task_outbox (msg_id, subject, payload, created_ms) \
             SELECT msg_id, subject, payload, $4 FROM UNNEST($1::text[], $2::text[], $3::bytea[]) \
             AS u(msg_id, subject, payload)",
        )
        .bind(o.iter().map(|f| f.msg_id.clone()).collect::<Vec<_>>())
        .bind(o.iter().map(|f| f.subject.clone()).collect::<Vec<_>>())
        .bind(o.iter().map(|f| f.payload.clone()).collect::<Vec<_>>())
        .bind(now)
        .execute(&mut *tx)
        .await?;
    }
    if !batch.published.is_empty() {
        sqlx::query("DELETE FROM task_outbox WHERE msg_id = ANY($1)")
            .bind(&batch.published)
            .execute(&mut *tx)
            .await?;
    }
    if let Some(before) = batch.prune_processed_before {
        sqlx::query("DELETE FROM processed_messages WHERE at_ms < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

impl Writer {
    /// Writes a batch in one transaction: all of it, or (on error) none of it.
    pub async fn write(&mut self, batch: &Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        match self {
            Writer::Pg(conn) => Ok(write_pg(conn, batch).await?),
            Writer::Lite(conn) => Ok(write_sqlite(conn, batch).await?),
        }
    }

    /// Every task that has not ended, oldest first (what a new leader takes over).
    pub async fn load_live(&mut self) -> Result<Vec<TaskRow>, StoreError> {
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM tasks WHERE state IN ('submitted', 'dispatched', 'working', 'input_required') \
             ORDER BY created_ms, task_id"
        );
        Ok(match self {
            Writer::Pg(conn) => {
                sqlx::query_as::<_, TaskRow>(sqlx::AssertSqlSafe(sql))
                    .fetch_all(&mut *conn)
                    .await?
            }
            Writer::Lite(conn) => {
                sqlx::query_as::<_, TaskRow>(sqlx::AssertSqlSafe(sql))
                    .fetch_all(&mut *conn)
                    .await?
            }
        })
    }
}
impl TaskStore {
    /// A store over an open (migrated) database.
    pub fn new(db: Database) -> Self {
        TaskStore { db }
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Tries to become the leader: the one replica that applies changes. On PostgreSQL this
    /// takes a session-level advisory lock named after `name` on a connection of its own, and
    /// returns `None` while another replica holds it, keeping that connection in `spare` for
    /// the next try (a standby does not open a connection per try). On SQLite (one process)
    /// it always succeeds.
    pub async fn try_lead(
        &self,
        name: &str,
        spare: &mut Option<sqlx::PgConnection>,
    ) -> Result<Option<Writer>, StoreError> {
        Ok(match &self.db {
            Database::Postgres(pool) => {
                let mut conn = match spare.take() {
                    Some(conn) => conn,
                    None => pool.acquire().await?.detach(),
                };
                let (locked,): (bool,) =
                    sqlx::query_as("SELECT pg_try_advisory_lock(hashtext($1))")
                        .bind(name)
                        .fetch_one(&mut conn)
                        .await?;
                if locked {
                    Some(Writer::Pg(conn))
                } else {
                    *spare = Some(conn);
                    None
                }
            }
            Database::Sqlite(pool) => Some(Writer::Lite(pool.acquire().await?.detach())),
        })
    }

    /// Runs a read on a pooled connection.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: for<'c> FnOnce(Target<'c>) -> futures::future::BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        Ok(match &self.db {
            Database::Postgres(pool) => {
                let mut conn = pool.acquire().await?;
                f(Target::Pg(&mut conn)).await?
            }
            Database::Sqlite(pool) => {
                let mut conn = pool.acquire().await?;
                f(Target::Lite(&mut conn)).await?
            }
        })
    }

    /// One task by id.
    pub async fn get(&self, task_id: &str) -> Result<Option<TaskRow>, StoreError> {
        let task_id = task_id.to_owned();
        self.read(move |t| {
            Box::pin(async move {
                let sql = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = $1");
                fetch!(t, TaskRow, &sql, [task_id], fetch_optional)
            })
        })
        .await
    }

    /// The newest task with a name.
    pub async fn get_by_name(&self, task_name: &str) -> Result<Option<TaskRow>, StoreError> {
        let task_name = task_name.to_owned();
        self.read(move |t| {
            Box::pin(async move {
                let sql = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_name = $1 ORDER BY created_ms DESC LIMIT 1");
                fetch!(t, TaskRow, &sql, [task_name], fetch_optional)
            })
        })
        .await
    }

    /// Tasks, newest first, after a cursor (`created_ms:task_id` of the last row seen).
    pub async fn list(&self, filter: ListFilter) -> Result<Vec<TaskRow>, StoreError> {
        self.read(move |t| {
            Box::pin(async move {
                let (cursor_ms, cursor_id) = filter.cursor.unwrap_or((i64::MAX, String::new()));
                let sql = format!(
                    "SELECT {TASK_COLUMNS} FROM tasks WHERE ($1 = '' OR state = $1) AND ($2 = '' OR executor_id = $2) \
                     AND ($3 = '' OR requester_id = $3) AND ($4 = '' OR task_name = $4) \
                     AND (created_ms < $5 OR (created_ms = $5 AND task_id < $6)) \
                     ORDER BY created_ms DESC, task_id DESC LIMIT $7"
                );
                fetch!(
                    t,
                    TaskRow,
                    &sql,
                    [
                        filter.state.unwrap_or_default(),
                        filter.executor.unwrap_or_default(),
                        filter.requester.unwrap_or_default(),
                        filter.task_name.unwrap_or_default(),
                        cursor_ms,
                        cursor_id,
                        filter.limit,
                    ],
                    fetch_all
                )
            })
        })
        .await
    }

    /// A task's events after a sequence number, at most `limit`.
    pub async fn events(
        &self,
        task_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<TaskEvent>, StoreError> {
        let task_id = task_id.to_owned();
        let rows = self
            .read(move |t| {
                Box::pin(async move {
                    let sql = "SELECT task_id, seq, at_ms, kind, state, data FROM task_events \
                        WHERE task_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";
                    fetch!(t, EventRow, sql, [task_id, after, limit], fetch_all)
                })
            })
            .await?;
        Ok(rows.into_iter().map(EventRow::into_event).collect())
    }

    /// The requester of the task with this id, if it exists.
    pub async fn owner(&self, task_id: &str) -> Result<Option<String>, StoreError> {
        let task_id = task_id.to_owned();
        self.read(move |t| {
            Box::pin(async move {
                let row: Option<(String,)> = fetch!(
                    t,
                    (String,),
                    "SELECT requester_id FROM tasks WHERE task_id = $1",
                    [task_id],
                    fetch_optional
                )?;
                Ok(row.map(|r| r.0))
            })
        })
        .await
    }

    /// The requesters of those of these task ids that exist, in one query.
    pub async fn owners(
        &self,
        task_ids: &[String],
    ) -> Result<std::collections::HashMap<String, String>, StoreError> {
        let mut owners = std::collections::HashMap::new();
        for chunk in task_ids.chunks(ROWS_PER_STATEMENT) {
            let rows: Vec<(String, String)> = match &self.db {
                Database::Postgres(pool) => {
                    sqlx::query_as(
                        "SELECT task_id, requester_id FROM tasks WHERE task_id = ANY($1)",
                    )
                    .bind(chunk)
                    .fetch_all(pool)
                    .await?
                }
                Database::Sqlite(pool) => {
                    let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
                        "SELECT task_id, requester_id FROM tasks WHERE task_id IN (",
                    );
                    let mut list = q.separated(", ");
                    for id in chunk {
                        list.push_bind(id.clone());
                    }
                    q.push(")");
                    q.build_query_as().fetch_all(pool).await?
                }
            };
            owners.extend(rows);
        }
        Ok(owners)
    }

    /// Whether the frame with this id was applied.
    pub async fn processed(&self, msg_id: &str) -> Result<bool, StoreError> {
        let msg_id = msg_id.to_owned();
        self.read(move |t| {
            Box::pin(async move {
                let row: Option<(i64,)> = fetch!(
                    t,
                    (i64,),
                    "SELECT 1 FROM processed_messages WHERE msg_id = $1",
                    [msg_id],
                    fetch_optional
                )?;
                Ok(row.is_some())
            })
        })
        .await
    }

    /// Outbox rows older than `older_than`: frames whose publish failed, or that a crash
    /// left unsent.
    pub async fn stale_outbox(
        &self,
        older_than: i64,
        limit: i64,
    ) -> Result<Vec<OutFrame>, StoreError> {
        let rows: Vec<(String, String, Vec<u8>)> = self
            .read(move |t| {
                Box::pin(async move {
                    let sql = "SELECT msg_id, subject, payload FROM task_outbox WHERE created_ms < $1 \
                        ORDER BY created_ms LIMIT $2";
                    fetch!(t, (String, String, Vec<u8>), sql, [older_than, limit], fetch_all)
                })
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(msg_id, subject, payload)| OutFrame {
                msg_id,
                subject,
                payload,
            })
            .collect())
    }
}

/// Filters of `GET /api/tasks`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this state.
    pub state: Option<String>,
    /// Only this executor.
    pub executor: Option<String>,
    /// Only this requester id.
    pub requester: Option<String>,
    /// Only this task name.
    pub task_name: Option<String>,
    /// After this position.
    pub cursor: Option<(i64, String)>,
    /// At most this many.
    pub limit: i64,
}

#[cfg(test)]
mod tests {
    use super::sized_chunks;

    #[test]
    fn rows_are_split_into_a_few_fixed_sizes_and_none_is_lost() {
        for n in [0usize, 1, 3, 4, 5, 31, 32, 33, 100, 255, 256, 257, 1000] {
            let rows: Vec<usize> = (0..n).collect();
            let chunks = sized_chunks(&rows);
            let joined: Vec<usize> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(joined, rows, "n = {n}");
            assert!(
                chunks.iter().all(|c| [256, 32, 4, 1].contains(&c.len())),
                "n = {n}"
            );
        }
        assert_eq!(sized_chunks(&[0u8; 100]).len(), 4, "32 × 3 + 4");
    }
}
