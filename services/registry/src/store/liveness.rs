//! Liveness: presence flushes and the reaper.

use std::sync::LazyLock;
use std::time::Duration;

use aip_store::{Backend, Database, SQLITE_BEGIN_WRITE, Sql};
use sqlx::Row;
use sqlx::types::Json;

use proto_schemas::ClientType;

use super::{Ended, PresenceApplied, PresenceFlush, SqlAgentStore, StoreError, Windows, millis};

/// SQLite: gateways reported (`$1`, a JSON array of `[gateway_id, interval_ms]`).
static SQLITE_GATEWAYS_REPORTED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO gateways (gateway_id, last_seen, interval_ms) \
         SELECT value ->> 0, {now}, value ->> 1 FROM json_each($1) WHERE true \
         ON CONFLICT (gateway_id) DO UPDATE \
             SET last_seen = excluded.last_seen, interval_ms = excluded.interval_ms",
        now = Backend::Sqlite.now(),
    )
});

/// SQLite: connections that showed life (`$1`, a JSON array of `[agent_id, connection_id,
/// gateway_id]`): each agent is refreshed if that connection on that gateway still holds it,
/// revived if it only expired. One statement whatever the count: a flush after a burst of
/// registrations lists every new connection, and a statement per agent held the database's
/// write lock for hundreds of milliseconds at 10,000.
static SQLITE_AGENTS_ALIVE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE agents SET last_seen = {now}, \
             status = CASE WHEN status = 'offline' THEN 'available' ELSE status END, \
             offline_reason = NULL \
         FROM (SELECT value ->> 0 AS agent_id, value ->> 1 AS connection_id, \
                      value ->> 2 AS gateway_id FROM json_each($1)) AS p \
         WHERE agents.agent_id = p.agent_id AND agents.connection_id = p.connection_id \
           AND agents.gateway_id = p.gateway_id \
           AND (agents.status <> 'offline' OR agents.offline_reason = 'liveness_expired')",
        now = Backend::Sqlite.now(),
    )
});

/// SQLite: the agents of the stopping gateways (`$1`, a JSON array) go offline.
const SQLITE_GATEWAYS_STOPPING: &str = "UPDATE agents \
     SET status = 'offline', offline_reason = 'gateway_stopped' \
     WHERE gateway_id IN (SELECT value FROM json_each($1)) AND status <> 'offline'";

/// Marks offline the agents not live by the agent (`$1`) and gateway (`$2`) windows, and
/// returns their ids. On PostgreSQL, candidates are read first, then locked in id order and
/// updated only if untouched since (same connection, same last_seen): a registration or
/// presence write racing with the reaper of another replica wins, and rows locked by others
/// are skipped until the next round. SQLite has one writer: one statement, nothing changes
/// between check and write.
static REAP: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| match b {
        aip_store::Backend::Postgres => format!(
            "WITH stale AS ( \
                 SELECT a.agent_id, a.connection_id, a.last_seen FROM agents a \
                 LEFT JOIN gateways g ON g.gateway_id = a.gateway_id \
                 WHERE a.status <> 'offline' \
                   AND (a.last_seen < {agent} OR g.last_seen IS NULL OR g.last_seen < {gateway}) \
             ), locked AS ( \
                 SELECT a.agent_id FROM agents a \
                 JOIN stale s ON a.agent_id = s.agent_id AND a.connection_id = s.connection_id \
                  AND a.last_seen = s.last_seen \
                 WHERE a.status <> 'offline' \
                 ORDER BY a.agent_id FOR UPDATE OF a SKIP LOCKED \
             ) \
             UPDATE agents a SET status = 'offline', offline_reason = 'liveness_expired' \
             FROM locked l WHERE a.agent_id = l.agent_id \
             RETURNING a.agent_id, a.client_type, a.gateway_id, a.connection_id",
            agent = b.ago(1),
            gateway = b.ago(2),
        ),
        aip_store::Backend::Sqlite => format!(
            "UPDATE agents SET status = 'offline', offline_reason = 'liveness_expired' \
             WHERE status <> 'offline' AND (last_seen < {agent} OR NOT EXISTS ( \
                 SELECT 1 FROM gateways g WHERE g.gateway_id = agents.gateway_id \
                 AND g.last_seen >= {gateway})) \
             RETURNING agent_id, client_type, gateway_id, connection_id",
            agent = b.ago(1),
            gateway = b.ago(2),
        ),
    })
});

/// Gateway `$1` started again: the agents its previous process held go offline for good, as
/// when a gateway stops (`gateway_stopped`: a late presence report revives nothing).
static GATEWAY_RESTARTED: Sql = Sql::same(
    "UPDATE agents SET status = 'offline', offline_reason = 'gateway_stopped' \
     WHERE gateway_id = $1 AND status <> 'offline' \
     RETURNING agent_id, client_type, gateway_id, connection_id",
);

/// Forgets the gateways silent for `$1` milliseconds that hold no live agent.
static FORGET_GATEWAYS: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "DELETE FROM gateways WHERE last_seen < {silent} AND NOT EXISTS ( \
                 SELECT 1 FROM agents a WHERE a.gateway_id = gateways.gateway_id \
                 AND a.status <> 'offline')",
            silent = b.ago(1),
        )
    })
});

/// Deletes at most `$2` agents offline and unseen for `$1` milliseconds. On PostgreSQL the
/// rows are locked first, skipping those a registration holds (and re-checked once locked,
/// so an agent that registered again meanwhile stays); SQLite has one writer.
static FORGET_OFFLINE: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "DELETE FROM agents WHERE agent_id IN ( \
                 SELECT agent_id FROM agents \
                 WHERE status = 'offline' AND last_seen < {unseen} LIMIT $2{skip_locked})",
            unseen = b.ago(1),
            skip_locked = match b {
                Backend::Postgres => " FOR UPDATE SKIP LOCKED",
                Backend::Sqlite => "",
            },
        )
    })
});

impl SqlAgentStore {
    pub(super) async fn forget_offline_agents(
        &self,
        unseen_for: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        Ok(self
            .db
            .query(&FORGET_OFFLINE)
            .bind(millis(unseen_for))
            .bind(i64::from(limit))
            .execute()
            .await?)
    }

    /// One statement on PostgreSQL (a round trip per flush); on SQLite one transaction of
    /// three statements, whatever the number of agents.
    pub(super) async fn presence(
        &self,
        flush: &PresenceFlush,
    ) -> Result<PresenceApplied, StoreError> {
        match &self.db {
            Database::Postgres(pool) => presence_at_once(pool, flush).await,
            Database::Sqlite(pool) => presence_sqlite(pool, flush).await,
        }
    }

    pub(super) async fn expire(
        &self,
        windows: &Windows,
        forget_gateways_after: Duration,
    ) -> Result<Vec<Ended>, StoreError> {
        let reaped: Vec<EndedRow> = self
            .db
            .query(&REAP)
            .bind(millis(windows.agent))
            .bind(millis(windows.gateway))
            .fetch_all()
            .await?;
        self.db
            .query(&FORGET_GATEWAYS)
            .bind(millis(forget_gateways_after))
            .execute()
            .await?;
        reaped.into_iter().map(EndedRow::ended).collect()
    }

    pub(super) async fn gateway_restarted(
        &self,
        gateway_id: &str,
    ) -> Result<Vec<Ended>, StoreError> {
        let ended: Vec<EndedRow> = self
            .db
            .query(&GATEWAY_RESTARTED)
            .bind(gateway_id.to_owned())
            .fetch_all()
            .await?;
        ended.into_iter().map(EndedRow::ended).collect()
    }
}

/// A connection marked offline, as a statement returns it.
#[derive(sqlx::FromRow)]
struct EndedRow {
    agent_id: String,
    client_type: String,
    gateway_id: String,
    connection_id: String,
}

impl EndedRow {
    fn ended(self) -> Result<Ended, StoreError> {
        let client_type =
            ClientType::from_wire(&self.client_type).ok_or_else(|| StoreError::Corrupt {
                agent_id: self.agent_id.clone(),
                detail: format!("unknown client_type `{}`", self.client_type),
            })?;
        Ok(Ended {
            agent_id: self.agent_id,
            client_type,
            gateway_id: self.gateway_id,
            connection_id: self.connection_id,
        })
    }
}

/// A gateway's reporting interval as stored (an interval beyond `i64` is as good as never).
fn interval(interval_ms: u64) -> i64 {
    i64::try_from(interval_ms).unwrap_or(i64::MAX)
}

/// A presence flush on SQLite: one write transaction (the whole database is locked, so no
/// order is needed), a statement for each of its three lists, each list bound as JSON.
async fn presence_sqlite(
    pool: &sqlx::SqlitePool,
    flush: &PresenceFlush,
) -> Result<PresenceApplied, StoreError> {
    let gateways: Vec<(&str, i64)> = flush
        .gateways
        .iter()
        .map(|(id, interval_ms)| (id.as_str(), interval(*interval_ms)))
        .collect();
    let mut tx = pool.begin_with(SQLITE_BEGIN_WRITE).await?;
    if !gateways.is_empty() {
        sqlx::query(&SQLITE_GATEWAYS_REPORTED)
            .bind(Json(&gateways))
            .execute(&mut *tx)
            .await?;
    }
    let mut applied = PresenceApplied::default();
    if !flush.alive.is_empty() {
        applied.refreshed = sqlx::query(&SQLITE_AGENTS_ALIVE)
            .bind(Json(&flush.alive))
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    if !flush.stopping.is_empty() {
        applied.stopped = sqlx::query(SQLITE_GATEWAYS_STOPPING)
            .bind(Json(&flush.stopping))
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    tx.commit().await?;
    Ok(applied)
}

/// A presence flush in one PostgreSQL statement over arrays. Rows are locked in id order
/// (`ORDER BY … FOR UPDATE`) before they are updated, so flushes of two replicas covering the
/// same agents cannot deadlock. A stopping gateway's agents are never listed as alive in the
/// same flush.
async fn presence_at_once(
    pool: &sqlx::PgPool,
    flush: &PresenceFlush,
) -> Result<PresenceApplied, StoreError> {
    let (gateway_ids, intervals): (Vec<&str>, Vec<i64>) = flush
        .gateways
        .iter()
        .map(|(id, interval_ms)| (id.as_str(), interval(*interval_ms)))
        .unzip();
    let mut agent_ids = Vec::with_capacity(flush.alive.len());
    let mut connection_ids = Vec::with_capacity(flush.alive.len());
    let mut alive_gateways = Vec::with_capacity(flush.alive.len());
    for (agent, connection, gateway) in &flush.alive {
        agent_ids.push(agent.as_str());
        connection_ids.push(connection.as_str());
        alive_gateways.push(gateway.as_str());
    }
    let stopping: Vec<&str> = flush.stopping.iter().map(String::as_str).collect();
    let row = sqlx::query(
        "WITH gw AS ( \
             INSERT INTO gateways (gateway_id, last_seen, interval_ms) \
             SELECT g, now(), i FROM unnest($1::text[], $2::bigint[]) AS t(g, i) ORDER BY g \
             ON CONFLICT (gateway_id) DO UPDATE \
                 SET last_seen = EXCLUDED.last_seen, interval_ms = EXCLUDED.interval_ms \
         ), seen AS ( \
             SELECT a.agent_id FROM agents a \
             JOIN unnest($3::text[], $4::text[], $5::text[]) AS p(agent_id, connection_id, gateway_id) \
               ON a.agent_id = p.agent_id AND a.connection_id = p.connection_id \
              AND a.gateway_id = p.gateway_id \
             WHERE a.status <> 'offline' OR a.offline_reason = 'liveness_expired' \
             ORDER BY a.agent_id FOR UPDATE OF a \
         ), alive AS ( \
             UPDATE agents a SET last_seen = now(), \
                 status = CASE WHEN a.status = 'offline' THEN 'available' ELSE a.status END, \
                 offline_reason = NULL \
             FROM seen s WHERE a.agent_id = s.agent_id \
             RETURNING 1 \
         ), doomed AS ( \
             SELECT a.agent_id FROM agents a \
             WHERE a.gateway_id = ANY($6::text[]) AND a.status <> 'offline' \
             ORDER BY a.agent_id FOR UPDATE \
         ), stopped AS ( \
             UPDATE agents a SET status = 'offline', offline_reason = 'gateway_stopped' \
             FROM doomed d WHERE a.agent_id = d.agent_id \
             RETURNING 1 \
         ) \
         SELECT (SELECT count(*) FROM alive) AS refreshed, (SELECT count(*) FROM stopped) AS stopped",
    )
    .bind(&gateway_ids)
    .bind(&intervals)
    .bind(&agent_ids)
    .bind(&connection_ids)
    .bind(&alive_gateways)
    .bind(&stopping)
    .fetch_one(pool)
    .await?;
    let refreshed: i64 = row.try_get("refreshed")?;
    let stopped: i64 = row.try_get("stopped")?;
    Ok(PresenceApplied {
        refreshed: u64::try_from(refreshed).unwrap_or(0),
        stopped: u64::try_from(stopped).unwrap_or(0),
    })
}
