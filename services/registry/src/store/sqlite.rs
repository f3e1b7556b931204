//! [`AgentStore`] on SQLite (the embedded mode).
//!
//! Times are INTEGER milliseconds since the Unix epoch from this process's clock (one process
//! owns the file). Writes that read first run in `BEGIN IMMEDIATE` transactions, which take
//! SQLite's single write lock up front, so a registration's check and write are atomic.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use futures::future::BoxFuture;
use proto_schemas::registry::{AgentRecord, AgentStatus, RegisterAgent, Registered};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row};

use super::{
    AGENT_COLUMNS, Admit, AgentFilter, AgentRow, AgentStore, BatchOutcome, Holder, LookupQuery,
    PresenceApplied, PresenceFlush, RETURNING_COLUMNS, RegisterOutcome, StoreError, Windows,
    WriteBatch, extension_names, millis,
};

/// Agents in SQLite (tables from `migrations/sqlite`).
#[derive(Debug, Clone)]
pub struct SqliteAgentStore {
    pool: SqlitePool,
}

impl SqliteAgentStore {
    /// A store on `pool` (migrated).
    pub fn new(pool: SqlitePool) -> Self {
        SqliteAgentStore { pool }
    }
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

fn cutoff(window: Duration) -> i64 {
    now_ms().saturating_sub(millis(window))
}

fn time(ms: i64) -> Result<DateTime<Utc>, sqlx::Error> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| sqlx::Error::Decode(format!("timestamp {ms} out of range").into()))
}

fn agent_row(row: &SqliteRow) -> Result<AgentRow, sqlx::Error> {
    Ok(AgentRow {
        agent_id: row.try_get("agent_id")?,
        client_type: row.try_get("client_type")?,
        platform: row.try_get("platform")?,
        status: row.try_get("status")?,
        capabilities: row.try_get::<Json<Vec<String>>, _>("capabilities")?.0,
        tools: row.try_get::<Json<serde_json::Value>, _>("tools")?.0,
        system_info: row
            .try_get::<Option<Json<serde_json::Value>>, _>("system_info")?
            .map(|j| j.0),
        metadata: row
            .try_get::<Option<Json<serde_json::Value>>, _>("metadata")?
            .map(|j| j.0),
        extensions: row.try_get::<Json<Vec<String>>, _>("extensions")?.0,
        target_id: row.try_get("target_id")?,
        gateway_id: row.try_get("gateway_id")?,
        connection_id: row.try_get("connection_id")?,
        load: row.try_get("load")?,
        connected_at: time(row.try_get("connected_at")?)?,
        last_seen: time(row.try_get("last_seen")?)?,
    })
}

fn record(row: &SqliteRow) -> Result<AgentRecord, StoreError> {
    agent_row(row)?.into_record()
}

/// `a.capabilities` contains every element of the JSON array bound at `?{n}`.
macro_rules! has_all_capabilities {
    ($n:literal) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM json_each(?",
            $n,
            ") r WHERE NOT EXISTS (SELECT 1 FROM json_each(a.capabilities) c WHERE c.value = r.value))"
        )
    };
}

type SqliteTx = sqlx::Transaction<'static, sqlx::Sqlite>;

impl SqliteAgentStore {
    /// One `BEGIN IMMEDIATE` transaction for the whole batch, statement by statement (SQLite
    /// is in this process: there are no round trips to save). A failed statement fails the
    /// batch (the transaction is rolled back); a stored row that cannot be read fails only
    /// its write.
    async fn write_batch_inner(
        &self,
        batch: &WriteBatch,
        windows: &Windows,
        admit: &Admit,
    ) -> Result<BatchOutcome, StoreError> {
        let now = now_ms();
        let mut outcome = BatchOutcome::default();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for u in &batch.unregisters {
            let went_offline = unregister_in(&mut tx, &u.agent_id, &u.connection_id).await?;
            outcome.unregistered.push(Ok(went_offline));
        }
        for request in &batch.registers {
            let registered = register_in(&mut tx, request, windows, admit, now).await?;
            outcome.registered.push(registered);
        }
        tx.commit().await?;
        Ok(outcome)
    }

    async fn apply_presence_inner(
        &self,
        flush: &PresenceFlush,
    ) -> Result<PresenceApplied, StoreError> {
        let now = now_ms();
        let mut applied = PresenceApplied::default();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        // The same SQL text each time: sqlx prepares it once per connection.
        for (gateway_id, interval_ms) in &flush.gateways {
            sqlx::query(
                "INSERT INTO gateways (gateway_id, last_seen, interval_ms) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (gateway_id) DO UPDATE SET last_seen = excluded.last_seen, interval_ms = excluded.interval_ms",
            )
            .bind(gateway_id)
            .bind(now)
            .bind(i64::try_from(*interval_ms).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
        }
        for (agent_id, connection_id, gateway_id) in &flush.alive {
            let done = sqlx::query(
                "UPDATE agents SET last_seen = ?4, \
                     status = CASE WHEN status = 'offline' THEN 'available' ELSE status END, \
                     offline_reason = NULL \
                 WHERE agent_id = ?1 AND connection_id = ?2 AND gateway_id = ?3 \
                   AND (status <> 'offline' OR offline_reason = 'liveness_expired')",
            )
            .bind(agent_id)
            .bind(connection_id)
            .bind(gateway_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            applied.refreshed += done.rows_affected();
        }
        for gateway_id in &flush.stopping {
            let done = sqlx::query(
                "UPDATE agents SET status = 'offline', offline_reason = 'gateway_stopped' \
                 WHERE gateway_id = ?1 AND status <> 'offline'",
            )
            .bind(gateway_id)
            .execute(&mut *tx)
            .await?;
            applied.stopped += done.rows_affected();
        }
        tx.commit().await?;
        Ok(applied)
    }
}

/// Registers `request` inside the batch's transaction. The inner error fails this write only
/// (its holder cannot be read; nothing was written); the outer one fails the batch.
async fn register_in(
    tx: &mut SqliteTx,
    request: &RegisterAgent,
    windows: &Windows,
    admit: &Admit,
    now: i64,
) -> Result<Result<RegisterOutcome, StoreError>, StoreError> {
    sqlx::query(
        "INSERT INTO gateways (gateway_id, last_seen) VALUES (?1, ?2) \
         ON CONFLICT (gateway_id) DO UPDATE SET last_seen = excluded.last_seen",
    )
    .bind(&request.gateway_id)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    let row = sqlx::query(
        "SELECT a.connection_id, a.principal, a.status, \
                (a.status <> 'offline' AND a.last_seen >= ?2 \
                 AND g.last_seen IS NOT NULL AND g.last_seen >= ?3) AS live \
         FROM agents a LEFT JOIN gateways g ON g.gateway_id = a.gateway_id \
         WHERE a.agent_id = ?1",
    )
    .bind(&request.agent_id)
    .bind(now.saturating_sub(millis(windows.agent)))
    .bind(now.saturating_sub(millis(windows.gateway)))
    .fetch_optional(&mut **tx)
    .await?;
    let holder = match row {
        None => None,
        Some(row) => {
            let status: String = row.try_get("status")?;
            let Some(status) = AgentStatus::from_wire(&status) else {
                return Ok(Err(StoreError::Corrupt {
                    agent_id: request.agent_id.clone(),
                    detail: format!("unknown status `{status}`"),
                }));
            };
            Some(Holder {
                connection_id: row.try_get("connection_id")?,
                principal: row.try_get("principal")?,
                status,
                live: row.try_get("live")?,
            })
        }
    };
    let replaced_connection = match admit(request, holder.as_ref()) {
        Ok(replaced) => replaced,
        Err(refusal) => return Ok(Ok(RegisterOutcome::Refused(refusal))),
    };
    // The write lock is held since BEGIN IMMEDIATE: nobody inserted the id meanwhile.
    let sql = AssertSqlSafe(if holder.is_some() {
        format!(
            "UPDATE agents SET client_type = ?2, platform = ?3, \
                 status = CASE WHEN connection_id = ?12 AND status = 'busy' THEN 'busy' ELSE 'available' END, \
                 offline_reason = NULL, capabilities = ?4, tools = ?5, system_info = ?6, metadata = ?7, \
                 extensions = ?8, target_id = ?9, principal = ?10, gateway_id = ?11, connection_id = ?12, \
                 load = CASE WHEN connection_id = ?12 AND status <> 'offline' THEN load ELSE 0 END, \
                 connected_at = CASE WHEN connection_id = ?12 AND status <> 'offline' THEN connected_at ELSE ?13 END, \
                 last_seen = ?13 \
             WHERE agent_id = ?1 RETURNING {RETURNING_COLUMNS}"
        )
    } else {
        format!(
            "INSERT INTO agents (agent_id, client_type, platform, status, capabilities, tools, system_info, \
                 metadata, extensions, target_id, principal, gateway_id, connection_id, load, connected_at, last_seen) \
             VALUES (?1, ?2, ?3, 'available', ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 0, ?13, ?13) \
             RETURNING {RETURNING_COLUMNS}"
        )
    });
    let row = sqlx::query(sql)
        .bind(&request.agent_id)
        .bind(request.client_type.as_str())
        .bind(request.platform.as_str())
        .bind(Json(&request.capabilities))
        .bind(Json(&request.tools))
        .bind(request.system_info.as_ref().map(Json))
        .bind(request.metadata.as_ref().map(Json))
        .bind(Json(extension_names(&request.extensions)))
        .bind(request.target_id.as_deref())
        .bind(&request.principal)
        .bind(&request.gateway_id)
        .bind(&request.connection_id)
        .bind(now)
        .fetch_one(&mut **tx)
        .await?;
    // Written: a row that cannot be read back fails the batch, so that it is rolled back.
    let agent = record(&row)?;
    Ok(Ok(RegisterOutcome::Registered(Box::new(Registered {
        agent,
        replaced_connection,
    }))))
}

/// Marks `agent_id` offline inside the batch's transaction, if `connection_id` holds it.
async fn unregister_in(
    tx: &mut SqliteTx,
    agent_id: &str,
    connection_id: &str,
) -> Result<bool, StoreError> {
    let old: Option<String> =
        sqlx::query_scalar("SELECT status FROM agents WHERE agent_id = ?1 AND connection_id = ?2")
            .bind(agent_id)
            .bind(connection_id)
            .fetch_optional(&mut **tx)
            .await?;
    if old.is_some() {
        sqlx::query(
            "UPDATE agents SET status = 'offline', offline_reason = 'unregistered' \
             WHERE agent_id = ?1 AND connection_id = ?2",
        )
        .bind(agent_id)
        .bind(connection_id)
        .execute(&mut **tx)
        .await?;
    }
    Ok(old.is_some_and(|s| s != AgentStatus::Offline.as_str()))
}

impl AgentStore for SqliteAgentStore {
    fn write_batch<'a>(
        &'a self,
        batch: &'a WriteBatch,
        windows: &'a Windows,
        admit: &'a Admit,
    ) -> BoxFuture<'a, Result<BatchOutcome, StoreError>> {
        self.write_batch_inner(batch, windows, admit).boxed()
    }

    fn is_live_device<'a>(
        &'a self,
        agent_id: &'a str,
        windows: &'a Windows,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        async move {
            let live: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM agents a JOIN gateways g ON g.gateway_id = a.gateway_id \
                 WHERE a.agent_id = ?1 AND a.client_type = 'device' AND a.status <> 'offline' \
                   AND a.last_seen >= ?2 AND g.last_seen >= ?3)",
            )
            .bind(agent_id)
            .bind(cutoff(windows.agent))
            .bind(cutoff(windows.gateway))
            .fetch_one(&self.pool)
            .await?;
            Ok(live)
        }
        .boxed()
    }

    fn get<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<AgentRecord>, StoreError>> {
        async move {
            let sql = AssertSqlSafe(format!(
                "SELECT {AGENT_COLUMNS} FROM agents a WHERE a.agent_id = ?1"
            ));
            let row = sqlx::query(sql)
                .bind(agent_id)
                .fetch_optional(&self.pool)
                .await?;
            row.as_ref().map(record).transpose()
        }
        .boxed()
    }

    fn lookup<'a>(
        &'a self,
        query: &'a LookupQuery,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>> {
        async move {
            let sql = AssertSqlSafe(format!(
                "SELECT {AGENT_COLUMNS} FROM agents a JOIN gateways g ON g.gateway_id = a.gateway_id \
                 WHERE a.status = 'available' AND a.client_type = ?1 AND {} \
                   AND a.last_seen >= ?3 AND g.last_seen >= ?4 \
                 ORDER BY a.load ASC, a.last_seen DESC, a.agent_id ASC LIMIT ?5",
                has_all_capabilities!(2)
            ));
            let rows = sqlx::query(sql)
                .bind(query.client_type.as_str())
                .bind(Json(&query.capabilities))
                .bind(cutoff(query.windows.agent))
                .bind(cutoff(query.windows.gateway))
                .bind(i64::from(query.limit))
                .fetch_all(&self.pool)
                .await?;
            rows.iter().map(record).collect()
        }
        .boxed()
    }

    fn list<'a>(
        &'a self,
        filter: &'a AgentFilter,
    ) -> BoxFuture<'a, Result<Vec<AgentRecord>, StoreError>> {
        async move {
            let sql = AssertSqlSafe(format!(
                "SELECT {AGENT_COLUMNS} FROM agents a \
                 WHERE (?1 IS NULL OR a.status = ?1) AND (?2 IS NULL OR a.client_type = ?2) AND {} \
                 ORDER BY a.agent_id LIMIT ?4",
                has_all_capabilities!(3)
            ));
            let rows = sqlx::query(sql)
                .bind(filter.status.map(AgentStatus::as_str))
                .bind(filter.client_type.map(|t| t.as_str()))
                .bind(Json(&filter.capabilities))
                .bind(i64::from(filter.limit))
                .fetch_all(&self.pool)
                .await?;
            rows.iter().map(record).collect()
        }
        .boxed()
    }

    fn online_ids(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        async move {
            let ids = sqlx::query_scalar(
                "SELECT agent_id FROM agents WHERE status <> 'offline' ORDER BY agent_id",
            )
            .fetch_all(&self.pool)
            .await?;
            Ok(ids)
        }
        .boxed()
    }

    fn apply_presence<'a>(
        &'a self,
        flush: &'a PresenceFlush,
    ) -> BoxFuture<'a, Result<PresenceApplied, StoreError>> {
        self.apply_presence_inner(flush).boxed()
    }

    fn reap<'a>(
        &'a self,
        windows: &'a Windows,
        forget_gateways_after: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        async move {
            // One statement: SQLite has one writer, so nothing changes between check and write.
            let reaped: Vec<String> = sqlx::query_scalar(
                "UPDATE agents SET status = 'offline', offline_reason = 'liveness_expired' \
                 WHERE status <> 'offline' AND (last_seen < ?1 OR NOT EXISTS ( \
                     SELECT 1 FROM gateways g WHERE g.gateway_id = agents.gateway_id AND g.last_seen >= ?2)) \
                 RETURNING agent_id",
            )
            .bind(cutoff(windows.agent))
            .bind(cutoff(windows.gateway))
            .fetch_all(&self.pool)
            .await?;
            sqlx::query(
                "DELETE FROM gateways WHERE last_seen < ?1 AND NOT EXISTS ( \
                     SELECT 1 FROM agents a WHERE a.gateway_id = gateways.gateway_id AND a.status <> 'offline')",
            )
            .bind(cutoff(forget_gateways_after))
            .execute(&self.pool)
            .await?;
            Ok(reaped)
        }
        .boxed()
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        async move {
            sqlx::query("SELECT 1").execute(&self.pool).await?;
            Ok(())
        }
        .boxed()
    }
}
