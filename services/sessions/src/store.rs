//! The session service's tables, on PostgreSQL or SQLite.
//!
//! Every state change happens in one transaction ([`Tx`]) that locks the task row, appends
//! its events with the next gap-free sequence numbers, records the frame that caused it (so a
//! redelivered frame changes nothing twice) and queues the frames it sends in the outbox.
//! SQL is written once with `$N` placeholders; for SQLite they become `?N`. On SQLite, writers
//! are serialised by a process-wide lock (one process owns an embedded database).

use std::sync::Arc;

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

/// A queued outgoing frame.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    /// Row id.
    pub id: i64,
    /// Subject to publish on.
    pub subject: String,
    /// Body.
    pub payload: Vec<u8>,
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
    sqlite_writer: Arc<tokio::sync::Mutex<()>>,
}

/// An open transaction.
pub enum Tx {
    /// PostgreSQL.
    Pg(sqlx::Transaction<'static, sqlx::Postgres>),
    /// SQLite, holding the writer lock.
    Lite(
        sqlx::Transaction<'static, sqlx::Sqlite>,
        tokio::sync::OwnedMutexGuard<()>,
    ),
}

macro_rules! run {
    ($target:expr, $sql:expr, [$($arg:expr),* $(,)?], $method:ident) => {
        match $target {
            Target::Pg(c) => sqlx::query(sqlx::AssertSqlSafe(($sql).to_string()))$(.bind($arg))*.$method(c).await.map(|r| r.rows_affected()),
            Target::Lite(c) => sqlx::query(sqlx::AssertSqlSafe(lite($sql)))$(.bind($arg))*.$method(c).await.map(|r| r.rows_affected()),
        }
    };
}

macro_rules! fetch {
    ($target:expr, $ty:ty, $sql:expr, [$($arg:expr),* $(,)?], $method:ident) => {
        match $target {
            Target::Pg(c) => sqlx::query_as::<_, $ty>(sqlx::AssertSqlSafe(($sql).to_string()))$(.bind($arg))*.$method(c).await,
            Target::Lite(c) => sqlx::query_as::<_, $ty>(sqlx::AssertSqlSafe(lite($sql)))$(.bind($arg))*.$method(c).await,
        }
    };
}

/// Where a query runs: a transaction or the pool.
enum Target<'a> {
    Pg(&'a mut sqlx::PgConnection),
    Lite(&'a mut sqlx::SqliteConnection),
}

impl Tx {
    fn target(&mut self) -> Target<'_> {
        match self {
            Tx::Pg(t) => Target::Pg(&mut *t),
            Tx::Lite(t, _) => Target::Lite(&mut *t),
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), StoreError> {
        match self {
            Tx::Pg(t) => t.commit().await?,
            Tx::Lite(t, _guard) => t.commit().await?,
        }
        Ok(())
    }

    /// Whether this frame was applied already; if not, records it as applied (the record
    /// commits with the transaction).
    pub async fn first_time(&mut self, msg_id: &str) -> Result<bool, StoreError> {
        let sql = "INSERT INTO processed_messages (msg_id, at_ms) VALUES ($1, $2) ON CONFLICT (msg_id) DO NOTHING";
        let inserted = run!(self.target(), sql, [msg_id, now_ms()], execute)?;
        Ok(inserted == 1)
    }

    /// Locks a task row for the rest of the transaction.
    pub async fn lock_task(&mut self, task_id: &str) -> Result<Option<TaskRow>, StoreError> {
        let pg = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = $1 FOR UPDATE");
        let sqlite = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = $1");
        Ok(match self {
            Tx::Pg(t) => {
                sqlx::query_as::<_, TaskRow>(sqlx::AssertSqlSafe(pg))
                    .bind(task_id)
                    .fetch_optional(&mut **t)
                    .await?
            }
            Tx::Lite(t, _) => {
                sqlx::query_as::<_, TaskRow>(sqlx::AssertSqlSafe(lite(&sqlite)))
                    .bind(task_id)
                    .fetch_optional(&mut **t)
                    .await?
            }
        })
    }

    /// Serialises dispatch decisions for one executor across replicas (PostgreSQL advisory
    /// lock; SQLite is serialised already).
    pub async fn lock_executor(&mut self, executor_id: &str) -> Result<(), StoreError> {
        if let Tx::Pg(t) = self {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                .bind(executor_id)
                .execute(&mut **t)
                .await?;
        }
        Ok(())
    }

    /// Inserts a new task (its first event is appended separately).
    pub async fn insert_task(&mut self, t: &TaskRow) -> Result<bool, StoreError> {
        let sql = format!(
            "INSERT INTO tasks ({TASK_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
             $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29) ON CONFLICT (task_id) DO NOTHING"
        );
        let n = run!(
            self.target(),
            &sql,
            [
                &t.task_id,
                &t.task_name,
                &t.state,
                &t.request,
                t.data.clone(),
                &t.requester_kind,
                &t.requester_id,
                t.requester_type.clone(),
                t.executor_id.clone(),
                t.executor_platform.clone(),
                t.required_capabilities.clone(),
                &t.planner,
                t.steps.clone(),
                t.step,
                t.pending_response_id.clone(),
                t.needs_plan,
                t.ufo_dispatch,
                t.awaiting_echo,
                t.history.clone(),
                t.priority,
                t.result.clone(),
                t.error.clone(),
                t.error_code.clone(),
                t.callback_url.clone(),
                t.task_deadline_ms,
                t.deadline_ms,
                t.created_ms,
                t.updated_ms,
                t.next_seq,
            ],
            execute
        )?;
        Ok(n == 1)
    }

    /// Writes back the mutable fields of a task.
    pub async fn update_task(&mut self, t: &TaskRow) -> Result<(), StoreError> {
        let sql = "UPDATE tasks SET state = $1, executor_id = $2, executor_platform = $3, step = $4, \
            pending_response_id = $5, needs_plan = $6, awaiting_echo = $7, history = $8, result = $9, error = $10, \
            error_code = $11, deadline_ms = $12, updated_ms = $13, next_seq = $14 WHERE task_id = $15";
        run!(
            self.target(),
            sql,
            [
                &t.state,
                t.executor_id.clone(),
                t.executor_platform.clone(),
                t.step,
                t.pending_response_id.clone(),
                t.needs_plan,
                t.awaiting_echo,
                t.history.clone(),
                t.result.clone(),
                t.error.clone(),
                t.error_code.clone(),
                t.deadline_ms,
                t.updated_ms,
                t.next_seq,
                &t.task_id,
            ],
            execute
        )?;
        Ok(())
    }

    /// Appends an event with the task's next sequence number (and advances it in `task`;
    /// [`Tx::update_task`] persists the counter in the same transaction).
    pub async fn append_event(
        &mut self,
        task: &mut TaskRow,
        kind: &str,
        data: Option<Value>,
    ) -> Result<i64, StoreError> {
        let seq = task.next_seq;
        task.next_seq += 1;
        let sql = "INSERT INTO task_events (task_id, seq, at_ms, kind, state, data) VALUES ($1, $2, $3, $4, $5, $6)";
        run!(
            self.target(),
            sql,
            [
                &task.task_id,
                seq,
                now_ms(),
                kind,
                &task.state,
                data.map(Json)
            ],
            execute
        )?;
        Ok(seq)
    }

    /// Queues a frame to publish after commit; returns its outbox id.
    pub async fn enqueue(&mut self, subject: &str, payload: &[u8]) -> Result<i64, StoreError> {
        let sql =
            "INSERT INTO outbox (subject, payload, created_ms) VALUES ($1, $2, $3) RETURNING id";
        let row: (i64,) = fetch!(
            self.target(),
            (i64,),
            sql,
            [subject, payload, now_ms()],
            fetch_one
        )?;
        Ok(row.0)
    }

    /// Tasks of an executor that are running (dispatched, working, input_required).
    pub async fn count_active(&mut self, executor_id: &str) -> Result<i64, StoreError> {
        let sql = "SELECT COUNT(*) FROM tasks WHERE executor_id = $1 AND state IN ('dispatched', 'working', 'input_required')";
        let row: (i64,) = fetch!(self.target(), (i64,), sql, [executor_id], fetch_one)?;
        Ok(row.0)
    }

    /// The next queued task for an executor: highest priority, then oldest.
    pub async fn next_queued(&mut self, executor_id: &str) -> Result<Option<String>, StoreError> {
        let sql = "SELECT task_id FROM tasks WHERE executor_id = $1 AND state = 'submitted' \
            ORDER BY priority DESC, created_ms ASC LIMIT 1";
        let row: Option<(String,)> =
            fetch!(self.target(), (String,), sql, [executor_id], fetch_optional)?;
        Ok(row.map(|r| r.0))
    }

    /// Live tasks in which a client takes part (as requester or executor).
    pub async fn live_tasks_of(&mut self, client_id: &str) -> Result<Vec<String>, StoreError> {
        let sql = "SELECT task_id FROM tasks WHERE state IN ('submitted', 'dispatched', 'working', 'input_required') \
            AND ((requester_kind = 'client' AND requester_id = $1) OR executor_id = $2)";
        let rows: Vec<(String,)> = fetch!(
            self.target(),
            (String,),
            sql,
            [client_id, client_id],
            fetch_all
        )?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// A UFO dispatch of this device and task name still waiting for the echo.
    pub async fn awaiting_echo(
        &mut self,
        client_id: &str,
        task_name: &str,
    ) -> Result<Option<String>, StoreError> {
        let sql = "SELECT task_id FROM tasks WHERE executor_id = $1 AND task_name = $2 AND awaiting_echo = $3 \
            AND state IN ('submitted', 'dispatched') ORDER BY created_ms ASC LIMIT 1";
        let row: Option<(String,)> = fetch!(
            self.target(),
            (String,),
            sql,
            [client_id, task_name, true],
            fetch_optional
        )?;
        Ok(row.map(|r| r.0))
    }
}

impl TaskStore {
    /// A store over an open (migrated) database.
    pub fn new(db: Database) -> Self {
        TaskStore {
            db,
            sqlite_writer: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Begins a write transaction.
    pub async fn begin(&self) -> Result<Tx, StoreError> {
        Ok(match &self.db {
            Database::Postgres(pool) => Tx::Pg(pool.begin().await?),
            Database::Sqlite(pool) => {
                let guard = self.sqlite_writer.clone().lock_owned().await;
                Tx::Lite(pool.begin_with("BEGIN IMMEDIATE").await?, guard)
            }
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

    /// Tasks past their deadline.
    pub async fn due_deadlines(&self, now: i64, limit: i64) -> Result<Vec<String>, StoreError> {
        self.read(move |t| {
            Box::pin(async move {
                let sql = "SELECT task_id FROM tasks WHERE state IN ('submitted', 'dispatched', 'working', 'input_required') \
                    AND deadline_ms < $1 ORDER BY deadline_ms LIMIT $2";
                let rows: Vec<(String,)> = fetch!(t, (String,), sql, [now, limit], fetch_all)?;
                Ok(rows.into_iter().map(|r| r.0).collect())
            })
        })
        .await
    }

    /// Tasks whose next step should have been planned by now (a crash in between).
    pub async fn due_plans(&self, older_than: i64, limit: i64) -> Result<Vec<String>, StoreError> {
        self.read(move |t| {
            Box::pin(async move {
                let sql = "SELECT task_id FROM tasks WHERE needs_plan = $1 AND updated_ms < $2 \
                    AND state IN ('dispatched', 'working') LIMIT $3";
                let rows: Vec<(String,)> =
                    fetch!(t, (String,), sql, [true, older_than, limit], fetch_all)?;
                Ok(rows.into_iter().map(|r| r.0).collect())
            })
        })
        .await
    }

    /// Outbox rows older than `older_than` (left behind by a crash).
    pub async fn stale_outbox(
        &self,
        older_than: i64,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        self.read(move |t| {
            Box::pin(async move {
                let sql = "SELECT id, subject, payload FROM outbox WHERE created_ms < $1 ORDER BY id LIMIT $2";
                fetch!(t, OutboxRow, sql, [older_than, limit], fetch_all)
            })
        })
        .await
    }

    /// Removes published outbox rows.
    pub async fn delete_outbox(&self, ids: &[i64]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let sql = format!("DELETE FROM outbox WHERE id IN ({list})");
        match &self.db {
            Database::Postgres(pool) => {
                sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                    .execute(pool)
                    .await?;
            }
            Database::Sqlite(pool) => {
                let _guard = self.sqlite_writer.lock().await;
                sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                    .execute(pool)
                    .await?;
            }
        }
        Ok(())
    }

    /// Forgets processed-frame ids older than `before` (the stream's de-duplication window
    /// has long passed by then).
    pub async fn prune_processed(&self, before: i64) -> Result<u64, StoreError> {
        let sql = "DELETE FROM processed_messages WHERE at_ms < $1";
        Ok(match &self.db {
            Database::Postgres(pool) => sqlx::query(sql)
                .bind(before)
                .execute(pool)
                .await?
                .rows_affected(),
            Database::Sqlite(pool) => {
                let _guard = self.sqlite_writer.lock().await;
                sqlx::query(sqlx::AssertSqlSafe(lite(sql)))
                    .bind(before)
                    .execute(pool)
                    .await?
                    .rows_affected()
            }
        })
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
