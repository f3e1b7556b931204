//! [`AgentStore`] on PostgreSQL.
//!
//! Times come from the database clock (`now()`), so replicas on different machines judge
//! liveness alike. Registrations and unregistrations come in batches, one transaction each
//! (group commit) with multi-row statements over `unnest` arrays: the batch locks its ids'
//! rows (`SELECT … FOR UPDATE`, in id order), judges each registration against the holder it
//! read, then writes; a first registration inserts with `ON CONFLICT DO NOTHING`, and one
//! that a concurrent registration beat to it is judged again against the row that one wrote.
//! Registering gateways are recorded alive outside the batch's transaction.
//! Presence is one statement per flush (data-modifying CTEs over `unnest` arrays).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use proto_schemas::registry::{AgentRecord, AgentStatus, RegisterAgent, Registered};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row};

use super::{
    AGENT_COLUMNS, Admit, AgentFilter, AgentRow, AgentStore, BatchOutcome, Holder, LookupQuery,
    PresenceApplied, PresenceFlush, RegisterOutcome, StoreError, Windows, WriteBatch,
    extension_names, millis,
};

/// Agents in PostgreSQL (tables from `migrations/postgres`).
#[derive(Debug, Clone)]
pub struct PgAgentStore {
    pool: PgPool,
    /// When this store last recorded each registering gateway as alive.
    gateways_refreshed: Arc<Mutex<HashMap<String, Instant>>>,
}

impl PgAgentStore {
    /// A store on `pool` (migrated).
    pub fn new(pool: PgPool) -> Self {
        PgAgentStore {
            pool,
            gateways_refreshed: Arc::default(),
        }
    }
}

/// A registration records its gateway as alive (its presence reports may not have been
/// written yet) unless this store did so this recently: far below any liveness window, and
/// it saves a write per registration batch.
const GATEWAY_REFRESH: Duration = Duration::from_millis(500);

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

/// The current holder of an id, as read under its row lock.
struct HeldRow {
    connection_id: String,
    principal: String,
    /// The stored status, parsed only when a registration is judged against it.
    status: String,
    live: bool,
}

impl HeldRow {
    fn holder(&self, agent_id: &str) -> Result<Holder, StoreError> {
        Ok(Holder {
            connection_id: self.connection_id.clone(),
            principal: self.principal.clone(),
            status: AgentStatus::from_wire(&self.status).ok_or_else(|| StoreError::Corrupt {
                agent_id: agent_id.to_owned(),
                detail: format!("unknown status `{}`", self.status),
            })?,
            live: self.live,
        })
    }
}

/// How a registration is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Nobody holds the id: inserted (unless a concurrent registration creates it first).
    New,
    /// Over the existing row, locked by the batch.
    Existing,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::New => "new",
            Kind::Existing => "existing",
        }
    }
}

/// Registrations as column arrays, bound to the batch's write statement
/// ([`UNNEST_REGISTRATIONS`]). JSON travels as text and is cast to jsonb in SQL.
#[derive(Default)]
struct RegisterColumns<'r> {
    kind: Vec<&'static str>,
    agent_id: Vec<&'r str>,
    client_type: Vec<&'static str>,
    platform: Vec<&'static str>,
    capabilities: Vec<String>,
    tools: Vec<String>,
    system_info: Vec<Option<String>>,
    metadata: Vec<Option<String>>,
    extensions: Vec<String>,
    target_id: Vec<Option<&'r str>>,
    principal: Vec<&'r str>,
    gateway_id: Vec<&'r str>,
    connection_id: Vec<&'r str>,
}

/// The registrations as rows `r`, from parameters `$1` to `$13` in [`RegisterColumns`]' order.
const UNNEST_REGISTRATIONS: &str = "unnest($1::text[], $2::text[], $3::text[], $4::text[], \
     $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], \
     $12::text[], $13::text[]) \
     AS r(kind, agent_id, client_type, platform, capabilities, tools, system_info, metadata, \
          extensions, target_id, principal, gateway_id, connection_id)";

impl<'r> RegisterColumns<'r> {
    fn new(requests: &[(&'r RegisterAgent, Kind)]) -> Result<Self, StoreError> {
        let mut c = RegisterColumns::default();
        for (r, kind) in requests {
            let id = r.agent_id.as_str();
            c.kind.push(kind.as_str());
            c.agent_id.push(id);
            c.client_type.push(r.client_type.as_str());
            c.platform.push(r.platform.as_str());
            c.capabilities.push(json(id, &r.capabilities)?);
            c.tools.push(json(id, &r.tools)?);
            c.system_info
                .push(r.system_info.as_ref().map(|v| json(id, v)).transpose()?);
            c.metadata
                .push(r.metadata.as_ref().map(|v| json(id, v)).transpose()?);
            c.extensions
                .push(json(id, &extension_names(&r.extensions))?);
            c.target_id.push(r.target_id.as_deref());
            c.principal.push(&r.principal);
            c.gateway_id.push(&r.gateway_id);
            c.connection_id.push(&r.connection_id);
        }
        Ok(c)
    }

    fn bind<'q>(
        &'q self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        query
            .bind(&self.kind)
            .bind(&self.agent_id)
            .bind(&self.client_type)
            .bind(&self.platform)
            .bind(&self.capabilities)
            .bind(&self.tools)
            .bind(&self.system_info)
            .bind(&self.metadata)
            .bind(&self.extensions)
            .bind(&self.target_id)
            .bind(&self.principal)
            .bind(&self.gateway_id)
            .bind(&self.connection_id)
    }
}

/// `value` as JSON text, for a jsonb column of `agent_id`.
fn json<T: serde::Serialize + ?Sized>(agent_id: &str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt {
        agent_id: agent_id.to_owned(),
        detail: format!("cannot be written as JSON: {e}"),
    })
}

type PgTx = sqlx::Transaction<'static, sqlx::Postgres>;

/// One result per registration of a batch, filled in as they are decided.
type Results = Vec<Option<Result<RegisterOutcome, StoreError>>>;

impl PgAgentStore {
    /// Four round trips whatever the batch holds: `BEGIN`, one statement locking and reading
    /// every row the batch writes, one statement writing them all, `COMMIT` (two more for
    /// new ids that a concurrent registration created first).
    async fn write_batch_inner(
        &self,
        batch: &WriteBatch,
        windows: &Windows,
        admit: &Admit,
    ) -> Result<BatchOutcome, StoreError> {
        self.refresh_gateways(batch).await?;
        // The transaction locks agents only, all in one statement and in id order, so that
        // batches and presence flushes (which lock the same way) cannot deadlock.
        let mut tx = self.pool.begin().await?;
        let ids: Vec<&str> = batch.agent_ids().collect();
        let held = lock_holders(&mut tx, &ids, windows).await?;

        // Unregistrations come first: no registration of the batch names the same agent.
        let mut unregistered = Vec::with_capacity(batch.unregisters.len());
        let mut offline: Vec<&str> = Vec::new();
        for u in &batch.unregisters {
            let held = held
                .get(u.agent_id.as_str())
                .filter(|h| h.connection_id == u.connection_id);
            // Written even if already offline: `unregistered` is final, while an agent that
            // only expired may be revived by its connection's presence.
            if held.is_some() {
                offline.push(&u.agent_id);
            }
            unregistered.push(Ok(
                held.is_some_and(|h| h.status != AgentStatus::Offline.as_str())
            ));
        }
        let mut registered: Results = std::iter::repeat_with(|| None)
            .take(batch.registers.len())
            .collect();
        let candidates = batch.registers.iter().enumerate();
        let admitted = judge_all(candidates, &held, false, admit, &mut registered);
        let lost = write_rows(&mut tx, &offline, admitted, &mut registered).await?;

        // New ids created meanwhile by a concurrent registration (on another replica): judged
        // again, against the row it wrote, now locked.
        if !lost.is_empty() {
            let ids: Vec<&str> = lost.iter().map(|(_, r)| r.agent_id.as_str()).collect();
            let held = lock_holders(&mut tx, &ids, windows).await?;
            let admitted = judge_all(lost.into_iter(), &held, true, admit, &mut registered);
            write_rows(&mut tx, &[], admitted, &mut registered).await?;
        }
        tx.commit().await?;
        Ok(BatchOutcome {
            unregistered,
            registered: registered
                .into_iter()
                .zip(&batch.registers)
                .map(|(result, request)| {
                    result.unwrap_or_else(|| {
                        Err(StoreError::Contention {
                            agent_id: request.agent_id.clone(),
                        })
                    })
                })
                .collect(),
        })
    }
}

impl PgAgentStore {
    /// Records the batch's registering gateways as alive, in its own statement before the
    /// batch's transaction (which then holds no gateway row), unless done within
    /// [`GATEWAY_REFRESH`]. Idempotent.
    async fn refresh_gateways(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut stale: Vec<&str> = {
            let refreshed = self
                .gateways_refreshed
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            batch
                .registers
                .iter()
                .map(|r| r.gateway_id.as_str())
                .filter(|g| {
                    refreshed
                        .get(*g)
                        .is_none_or(|at| now.duration_since(*at) >= GATEWAY_REFRESH)
                })
                .collect()
        };
        if stale.is_empty() {
            return Ok(());
        }
        stale.sort_unstable();
        stale.dedup();
        sqlx::query(
            "INSERT INTO gateways (gateway_id, last_seen) \
             SELECT g, now() FROM unnest($1::text[]) AS t(g) ORDER BY g \
             ON CONFLICT (gateway_id) DO UPDATE SET last_seen = now()",
        )
        .bind(&stale)
        .execute(&self.pool)
        .await?;
        let mut refreshed = self
            .gateways_refreshed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Gateways come and go: forget the ones not refreshed for long.
        refreshed.retain(|_, at| now.duration_since(*at) < GATEWAY_REFRESH * 100);
        for gateway in stale {
            refreshed.insert(gateway.to_owned(), now);
        }
        Ok(())
    }
}

/// A registration admitted, to be written.
struct Admitted<'r> {
    /// Its place in the batch.
    index: usize,
    request: &'r RegisterAgent,
    kind: Kind,
    /// The connection it takes the id from, to be closed.
    replaced: Option<String>,
}

/// Judges registrations against the holders read for their ids, returning those admitted;
/// the others get their result: the refusal, or the error if the holder cannot be read.
/// After a lost insert race (`lost_race`), a missing row is an error, not a new id.
fn judge_all<'r>(
    candidates: impl Iterator<Item = (usize, &'r RegisterAgent)>,
    held: &HashMap<String, HeldRow>,
    lost_race: bool,
    admit: &Admit,
    registered: &mut Results,
) -> Vec<Admitted<'r>> {
    let mut admitted = Vec::new();
    for (index, request) in candidates {
        let held = held.get(request.agent_id.as_str());
        let holder = match held.map(|h| h.holder(&request.agent_id)).transpose() {
            Ok(holder) => holder,
            Err(e) => {
                registered[index] = Some(Err(e));
                continue;
            }
        };
        if lost_race && holder.is_none() {
            // The row that made the insert fail is not there (agents are never deleted, so
            // this does not happen): the client may try again.
            registered[index] = Some(Err(StoreError::Contention {
                agent_id: request.agent_id.clone(),
            }));
            continue;
        }
        match admit(request, holder.as_ref()) {
            Ok(replaced) => admitted.push(Admitted {
                index,
                request,
                kind: if holder.is_some() {
                    Kind::Existing
                } else {
                    Kind::New
                },
                replaced,
            }),
            Err(refusal) => registered[index] = Some(Ok(RegisterOutcome::Refused(refusal))),
        }
    }
    admitted
}

/// Locks the rows of `ids` in id order and reads their holders.
async fn lock_holders(
    tx: &mut PgTx,
    ids: &[&str],
    windows: &Windows,
) -> Result<HashMap<String, HeldRow>, StoreError> {
    let sql = AssertSqlSafe(format!(
        "SELECT a.agent_id, a.connection_id, a.principal, a.status, \
                (a.status <> 'offline' AND a.last_seen >= {agent} \
                 AND g.last_seen IS NOT NULL AND g.last_seen >= {gateway}) AS live \
         FROM agents a LEFT JOIN gateways g ON g.gateway_id = a.gateway_id \
         WHERE a.agent_id = ANY($1::text[]) ORDER BY a.agent_id FOR UPDATE OF a",
        agent = cutoff!(2),
        gateway = cutoff!(3),
    ));
    let rows = sqlx::query(sql)
        .bind(ids)
        .bind(ms(windows.agent))
        .bind(ms(windows.gateway))
        .fetch_all(&mut **tx)
        .await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get("agent_id")?,
                HeldRow {
                    connection_id: row.try_get("connection_id")?,
                    principal: row.try_get("principal")?,
                    status: row.try_get("status")?,
                    live: row.try_get("live")?,
                },
            ))
        })
        .collect()
}

/// Writes, in one statement, the unregistrations (`offline`: rows locked and held by the
/// connection that ended) and the admitted registrations, and puts each registration's
/// outcome in `registered`. Returns the new ids that a concurrent registration created
/// first (left alone by the insert).
async fn write_rows<'r>(
    tx: &mut PgTx,
    offline: &[&str],
    admitted: Vec<Admitted<'r>>,
    registered: &mut Results,
) -> Result<Vec<(usize, &'r RegisterAgent)>, StoreError> {
    if offline.is_empty() && admitted.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(&RegisterAgent, Kind)> = admitted.iter().map(|a| (a.request, a.kind)).collect();
    let columns = RegisterColumns::new(&rows)?;
    // In `updated`, `a.…` on the right-hand side is the row before the update: the same
    // connection registering again keeps its `busy` status, load and connection time.
    let sql = AssertSqlSafe(format!(
        "WITH offline AS ( \
             UPDATE agents SET status = 'offline', offline_reason = 'unregistered' \
             WHERE agent_id = ANY($14::text[]) \
         ), inserted AS ( \
             INSERT INTO agents AS a (agent_id, client_type, platform, status, capabilities, \
                 tools, system_info, metadata, extensions, target_id, principal, gateway_id, \
                 connection_id, load, connected_at, last_seen) \
             SELECT r.agent_id, r.client_type, r.platform, 'available', r.capabilities::jsonb, \
                 r.tools::jsonb, r.system_info::jsonb, r.metadata::jsonb, r.extensions::jsonb, \
                 r.target_id, r.principal, r.gateway_id, r.connection_id, 0, now(), now() \
             FROM {UNNEST_REGISTRATIONS} WHERE r.kind = 'new' ORDER BY r.agent_id \
             ON CONFLICT (agent_id) DO NOTHING RETURNING {AGENT_COLUMNS} \
         ), updated AS ( \
             UPDATE agents AS a SET client_type = r.client_type, platform = r.platform, \
                 status = CASE WHEN a.connection_id = r.connection_id AND a.status = 'busy' \
                     THEN 'busy' ELSE 'available' END, \
                 offline_reason = NULL, capabilities = r.capabilities::jsonb, \
                 tools = r.tools::jsonb, system_info = r.system_info::jsonb, \
                 metadata = r.metadata::jsonb, extensions = r.extensions::jsonb, \
                 target_id = r.target_id, principal = r.principal, gateway_id = r.gateway_id, \
                 connection_id = r.connection_id, \
                 load = CASE WHEN a.connection_id = r.connection_id AND a.status <> 'offline' \
                     THEN a.load ELSE 0 END, \
                 connected_at = CASE WHEN a.connection_id = r.connection_id \
                     AND a.status <> 'offline' THEN a.connected_at ELSE now() END, \
                 last_seen = now() \
             FROM {UNNEST_REGISTRATIONS} WHERE r.kind = 'existing' AND a.agent_id = r.agent_id \
             RETURNING {AGENT_COLUMNS} \
         ) \
         SELECT * FROM inserted UNION ALL SELECT * FROM updated"
    ));
    let rows = columns
        .bind(sqlx::query(sql))
        .bind(offline)
        .fetch_all(&mut **tx)
        .await?;
    // A written row that cannot be read back fails the batch, so that it is rolled back.
    let mut written: HashMap<String, AgentRecord> = rows
        .iter()
        .map(|row| Ok((row.try_get("agent_id")?, record(row)?)))
        .collect::<Result<_, StoreError>>()?;
    let mut lost = Vec::new();
    for a in admitted {
        match written.remove(a.request.agent_id.as_str()) {
            Some(agent) => {
                registered[a.index] = Some(Ok(RegisterOutcome::Registered(Box::new(Registered {
                    agent,
                    replaced_connection: a.replaced,
                }))));
            }
            None if a.kind == Kind::New => lost.push((a.index, a.request)),
            // A locked row is always updated.
            None => {
                registered[a.index] = Some(Err(StoreError::Contention {
                    agent_id: a.request.agent_id.clone(),
                }));
            }
        }
    }
    Ok(lost)
}

impl AgentStore for PgAgentStore {
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
