//! [`AgentStore`] on PostgreSQL.
//!
//! Times come from the database clock (`now()`), so replicas on different machines judge
//! liveness alike. A registration locks the id's row (`SELECT … FOR UPDATE`); a first
//! registration inserts with `ON CONFLICT DO NOTHING` and retries if a concurrent one won.
//! Presence is one statement per flush (data-modifying CTEs over `unnest` arrays).

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use proto_schemas::registry::{AgentRecord, AgentStatus, RegisterAgent, Registered};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row};

use super::{
    AGENT_COLUMNS, Admit, AgentFilter, AgentRow, AgentStore, Holder, LookupQuery, PresenceApplied,
    PresenceFlush, REGISTER_ATTEMPTS, RegisterOutcome, StoreError, Windows, extension_names,
    millis,
};

/// Agents in PostgreSQL (tables from `migrations/postgres`).
#[derive(Debug, Clone)]
pub struct PgAgentStore {
    pool: PgPool,
}

impl PgAgentStore {
    /// A store on `pool` (migrated).
    pub fn new(pool: PgPool) -> Self {
        PgAgentStore { pool }
    }
}

/// `now()` minus `$n` milliseconds.
macro_rules! cutoff {
    ($n:literal) => {
        concat!("(now() - $", $n, "::float8 * interval '1 millisecond')")
    };
}

fn agent_row(row: &PgRow) -> Result<AgentRow, sqlx::Error> {
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
        connected_at: row.try_get("connected_at")?,
        last_seen: row.try_get("last_seen")?,
    })
}

fn record(row: &PgRow) -> Result<AgentRecord, StoreError> {
    agent_row(row)?.into_record()
}

fn ms(d: Duration) -> f64 {
    millis(d) as f64
}

impl PgAgentStore {
    async fn register_inner(
        &self,
        request: &RegisterAgent,
        windows: &Windows,
        admit: &Admit<'_>,
    ) -> Result<RegisterOutcome, StoreError> {
        // The registering gateway is alive. Outside the transaction: it is idempotent, and
        // holding the gateway's row for the whole transaction would serialise its clients.
        sqlx::query(
            "INSERT INTO gateways (gateway_id, last_seen) VALUES ($1, now()) \
             ON CONFLICT (gateway_id) DO UPDATE SET last_seen = now()",
        )
        .bind(&request.gateway_id)
        .execute(&self.pool)
        .await?;

        let select_holder = format!(
            "SELECT a.connection_id, a.principal, a.status, \
                    (a.status <> 'offline' AND a.last_seen >= {agent} \
                     AND g.last_seen IS NOT NULL AND g.last_seen >= {gateway}) AS live \
             FROM agents a LEFT JOIN gateways g ON g.gateway_id = a.gateway_id \
             WHERE a.agent_id = $1 FOR UPDATE OF a",
            agent = cutoff!(2),
            gateway = cutoff!(3),
        );
        let insert = format!(
            "INSERT INTO agents AS a (agent_id, client_type, platform, status, capabilities, tools, system_info, \
                 metadata, extensions, target_id, principal, gateway_id, connection_id, load, connected_at, last_seen) \
             VALUES ($1, $2, $3, 'available', $4, $5, $6, $7, $8, $9, $10, $11, $12, 0, now(), now()) \
             ON CONFLICT (agent_id) DO NOTHING RETURNING {AGENT_COLUMNS}"
        );
        let update = format!(
            "UPDATE agents AS a SET client_type = $2, platform = $3, \
                 status = CASE WHEN a.connection_id = $12 AND a.status = 'busy' THEN 'busy' ELSE 'available' END, \
                 offline_reason = NULL, capabilities = $4, tools = $5, system_info = $6, metadata = $7, \
                 extensions = $8, target_id = $9, principal = $10, gateway_id = $11, connection_id = $12, \
                 load = CASE WHEN a.connection_id = $12 AND a.status <> 'offline' THEN a.load ELSE 0 END, \
                 connected_at = CASE WHEN a.connection_id = $12 AND a.status <> 'offline' THEN a.connected_at ELSE now() END, \
                 last_seen = now() \
             WHERE a.agent_id = $1 RETURNING {AGENT_COLUMNS}"
        );

        for _ in 0..REGISTER_ATTEMPTS {
            let mut tx = self.pool.begin().await?;
            let holder = sqlx::query(AssertSqlSafe(select_holder.clone()))
                .bind(&request.agent_id)
                .bind(ms(windows.agent))
                .bind(ms(windows.gateway))
                .fetch_optional(&mut *tx)
                .await?
                .map(|row| -> Result<Holder, StoreError> {
                    let status: String = row.try_get("status")?;
                    Ok(Holder {
                        connection_id: row.try_get("connection_id")?,
                        principal: row.try_get("principal")?,
                        status: AgentStatus::from_wire(&status).ok_or_else(|| {
                            StoreError::Corrupt {
                                agent_id: request.agent_id.clone(),
                                detail: format!("unknown status `{status}`"),
                            }
                        })?,
                        live: row.try_get("live")?,
                    })
                })
                .transpose()?;
            let replaced_connection = match admit(holder.as_ref()) {
                Ok(replaced) => replaced,
                Err(refusal) => {
                    tx.rollback().await?;
                    return Ok(RegisterOutcome::Refused(refusal));
                }
            };
            let statement = AssertSqlSafe(if holder.is_some() {
                update.clone()
            } else {
                insert.clone()
            });
            let row = sqlx::query(statement)
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
                .fetch_optional(&mut *tx)
                .await?;
            match row {
                Some(row) => {
                    let agent = record(&row)?;
                    tx.commit().await?;
                    return Ok(RegisterOutcome::Registered(Box::new(Registered {
                        agent,
                        replaced_connection,
                    })));
                }
                // A concurrent first registration of the same id won the insert: start over,
                // now with a row to lock and judge.
                None => tx.rollback().await?,
            }
        }
        Err(StoreError::Contention {
            agent_id: request.agent_id.clone(),
        })
    }
}

impl AgentStore for PgAgentStore {
    fn register<'a>(
        &'a self,
        request: &'a RegisterAgent,
        windows: &'a Windows,
        admit: &'a Admit<'a>,
    ) -> BoxFuture<'a, Result<RegisterOutcome, StoreError>> {
        self.register_inner(request, windows, admit).boxed()
    }

    fn is_live_device<'a>(
        &'a self,
        agent_id: &'a str,
        windows: &'a Windows,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        async move {
            let sql = AssertSqlSafe(format!(
                "SELECT EXISTS (SELECT 1 FROM agents a JOIN gateways g ON g.gateway_id = a.gateway_id \
                 WHERE a.agent_id = $1 AND a.client_type = 'device' AND a.status <> 'offline' \
                   AND a.last_seen >= {} AND g.last_seen >= {})",
                cutoff!(2),
                cutoff!(3)
            ));
            let live: bool = sqlx::query_scalar(sql)
                .bind(agent_id)
                .bind(ms(windows.agent))
                .bind(ms(windows.gateway))
                .fetch_one(&self.pool)
                .await?;
            Ok(live)
        }
        .boxed()
    }

    fn unregister<'a>(
        &'a self,
        agent_id: &'a str,
        connection_id: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        async move {
            // One statement: read the old status (locked) and write the new one.
            let row = sqlx::query(
                "WITH old AS (SELECT status FROM agents WHERE agent_id = $1 AND connection_id = $2 FOR UPDATE) \
                 UPDATE agents a SET status = 'offline', offline_reason = 'unregistered' \
                 FROM old WHERE a.agent_id = $1 AND a.connection_id = $2 \
                 RETURNING old.status",
            )
            .bind(agent_id)
            .bind(connection_id)
            .fetch_optional(&self.pool)
            .await?;
            Ok(match row {
                Some(row) => row.try_get::<String, _>("status")? != AgentStatus::Offline.as_str(),
                None => false,
            })
        }
        .boxed()
    }

    fn get<'a>(
        &'a self,
        agent_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<AgentRecord>, StoreError>> {
        async move {
            let sql = AssertSqlSafe(format!(
                "SELECT {AGENT_COLUMNS} FROM agents a WHERE a.agent_id = $1"
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
                 WHERE a.status = 'available' AND a.client_type = $1 AND a.capabilities @> $2 \
                   AND a.last_seen >= {} AND g.last_seen >= {} \
                 ORDER BY a.load ASC, a.last_seen DESC, a.agent_id ASC LIMIT $5",
                cutoff!(3),
                cutoff!(4)
            ));
            let rows = sqlx::query(sql)
                .bind(query.client_type.as_str())
                .bind(Json(&query.capabilities))
                .bind(ms(query.windows.agent))
                .bind(ms(query.windows.gateway))
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
                 WHERE ($1::text IS NULL OR a.status = $1) AND ($2::text IS NULL OR a.client_type = $2) \
                   AND a.capabilities @> $3 \
                 ORDER BY a.agent_id LIMIT $4"
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
        async move {
            let (gateway_ids, intervals): (Vec<&str>, Vec<i64>) = flush
                .gateways
                .iter()
                .map(|(id, interval)| (id.as_str(), i64::try_from(*interval).unwrap_or(i64::MAX)))
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
            // One statement. Rows are locked in id order (`ORDER BY … FOR UPDATE`) before they
            // are updated, so flushes of two replicas covering the same agents cannot deadlock.
            // A stopping gateway's agents are never listed as alive in the same flush.
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
            .fetch_one(&self.pool)
            .await?;
            let refreshed: i64 = row.try_get("refreshed")?;
            let stopped: i64 = row.try_get("stopped")?;
            Ok(PresenceApplied {
                refreshed: u64::try_from(refreshed).unwrap_or(0),
                stopped: u64::try_from(stopped).unwrap_or(0),
            })
        }
        .boxed()
    }

    fn reap<'a>(
        &'a self,
        windows: &'a Windows,
        forget_gateways_after: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        async move {
            // Candidates are read first, then locked in id order and updated only if untouched
            // since (same connection, same last_seen): a registration or presence write racing
            // with the reaper wins. Rows locked by others are skipped until the next round.
            let sql = AssertSqlSafe(format!(
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
                 RETURNING a.agent_id",
                agent = cutoff!(1),
                gateway = cutoff!(2),
            ));
            let reaped: Vec<String> = sqlx::query_scalar(sql)
                .bind(ms(windows.agent))
                .bind(ms(windows.gateway))
                .fetch_all(&self.pool)
                .await?;
            sqlx::query(
                "DELETE FROM gateways g WHERE g.last_seen < (now() - $1::float8 * interval '1 millisecond') \
                 AND NOT EXISTS (SELECT 1 FROM agents a WHERE a.gateway_id = g.gateway_id AND a.status <> 'offline')",
            )
            .bind(ms(forget_gateways_after))
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
