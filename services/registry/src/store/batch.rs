//! Registrations and unregistrations, a batch at a time (group commit).
//!
//! On PostgreSQL, unregistrations and registrations of ids nobody has go first, in one
//! statement that is its own transaction (the common case: one round trip). What is left,
//! registrations of ids that exist, and on SQLite the whole batch, is written as follows.
//! The batch locks its ids' rows and reads their holders in one statement (in id order, so
//! that batches and presence flushes, which lock the same way, cannot deadlock), judges each
//! registration against the holder it read, then writes. A first registration inserts with
//! `ON CONFLICT DO NOTHING`; on PostgreSQL one that a concurrent registration (on another
//! replica) beat to it is judged again against the row that one wrote. SQLite's write
//! transaction holds the whole database, so nobody gets in between there.
//! Registering gateways are recorded alive before the batch's transaction.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use aip_store::{Database, List, Sql, Timestamp, Tx};
use proto_schemas::registry::{AgentRecord, AgentStatus, RegisterAgent, Registered};
use sqlx::FromRow;
use sqlx::types::Json;

use super::{
    AGENT_COLUMNS, Admit, AgentRow, BatchOutcome, Holder, RETURNING_COLUMNS, RegisterOutcome,
    SqlAgentStore, StoreError, Unregister, Windows, WriteBatch, extension_names, millis,
    new_record,
};

/// A registration records its gateway as alive (its presence reports may not have been
/// written yet) unless this store did so this recently: far below any liveness window, and
/// it saves a write per registration batch.
pub(super) const GATEWAY_REFRESH: Duration = Duration::from_millis(500);

/// Gateways not refreshed for this many [`GATEWAY_REFRESH`] periods are forgotten by the
/// store's memory (gateways come and go; the map must not grow without end).
const GATEWAY_MEMORY_PERIODS: u32 = 100;

/// Records gateways (the [`List`] at `$1`) as alive, in id order.
static GATEWAYS_ALIVE: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        // `WHERE true` keeps SQLite from reading `ON CONFLICT` as a join constraint.
        format!(
            "INSERT INTO gateways (gateway_id, last_seen) \
             SELECT g.value, {now} FROM {gateways} WHERE true ORDER BY g.value \
             ON CONFLICT (gateway_id) DO UPDATE SET last_seen = excluded.last_seen",
            now = b.now(),
            gateways = b.list_rows(1, "g"),
        )
    })
});

/// Locks the rows of the ids at `$1` in id order and reads their holders; `$2` and `$3`
/// are the agent and gateway windows.
static LOCK_HOLDERS: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT a.agent_id, a.connection_id, a.gateway_id, a.principal, a.status, \
                    (a.status <> 'offline' AND a.last_seen >= {agent} \
                     AND g.last_seen IS NOT NULL AND g.last_seen >= {gateway}) AS live \
             FROM agents a LEFT JOIN gateways g ON g.gateway_id = a.gateway_id \
             WHERE {ids} ORDER BY a.agent_id{lock}",
            agent = b.ago(2),
            gateway = b.ago(3),
            ids = b.in_list("a.agent_id", 1),
            lock = b.lock_rows("a"),
        )
    })
});

/// Unregisters the agents at `$1` (rows locked, held by the connections that ended).
/// Written even if already offline: `unregistered` is final, while an agent that only
/// expired may be revived by its connection's presence.
static TAKE_OFFLINE: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "UPDATE agents SET status = 'offline', offline_reason = 'unregistered' WHERE {}",
            b.in_list("agent_id", 1)
        )
    })
});

/// Inserts one new agent (parameters in [`bind_registration`]'s order).
static INSERT_AGENT: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "INSERT INTO agents (agent_id, client_type, platform, status, capabilities, tools, \
                 system_info, metadata, extensions, target_id, principal, gateway_id, connection_id, \
                 load, connected_at, last_seen) \
             VALUES ($1, $2, $3, 'available', $4, $5, $6, $7, $8, $9, $10, $11, $12, 0, {now}, {now}) \
             ON CONFLICT (agent_id) DO NOTHING RETURNING {RETURNING_COLUMNS}",
            now = b.now(),
        )
    })
});

/// Writes a registration over its agent's row (parameters in [`bind_registration`]'s
/// order). On the right-hand side, columns are the row before the update: the same
/// connection registering again keeps its `busy` status, load and connection time.
static UPDATE_AGENT: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "UPDATE agents SET client_type = $2, platform = $3, \
                 status = CASE WHEN connection_id = $12 AND status = 'busy' THEN 'busy' ELSE 'available' END, \
                 offline_reason = NULL, capabilities = $4, tools = $5, system_info = $6, metadata = $7, \
                 extensions = $8, target_id = $9, principal = $10, gateway_id = $11, connection_id = $12, \
                 load = CASE WHEN connection_id = $12 AND status <> 'offline' THEN load ELSE 0 END, \
                 connected_at = CASE WHEN connection_id = $12 AND status <> 'offline' \
                     THEN connected_at ELSE {now} END, \
                 last_seen = {now} \
             WHERE agent_id = $1 RETURNING {RETURNING_COLUMNS}",
            now = b.now(),
        )
    })
});

/// The current holder of an id, as read under its row lock.
#[derive(FromRow)]
struct HeldRow {
    agent_id: String,
    connection_id: String,
    gateway_id: String,
    principal: String,
    /// The stored status, parsed only when a registration is judged against it.
    status: String,
    live: bool,
}

impl HeldRow {
    fn holder(&self) -> Result<Holder, StoreError> {
        Ok(Holder {
            connection_id: self.connection_id.clone(),
            gateway_id: self.gateway_id.clone(),
            principal: self.principal.clone(),
            status: AgentStatus::from_wire(&self.status).ok_or_else(|| StoreError::Corrupt {
                agent_id: self.agent_id.clone(),
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

/// One result per registration of a batch, filled in as they are decided.
type Results = Vec<Option<Result<RegisterOutcome, StoreError>>>;

/// A registration admitted, to be written.
struct Admitted<'r> {
    /// Its place in the batch.
    index: usize,
    request: &'r RegisterAgent,
    kind: Kind,
    /// The connection it takes the id from, to be closed, and its gateway.
    replaced: Option<(String, String)>,
}

impl SqlAgentStore {
    /// Writes the batch: on PostgreSQL new ids and unregistrations first, in one statement
    /// ([`Self::write_new_first`]); on SQLite all of it in one locked transaction.
    pub(super) async fn write(
        &self,
        batch: &WriteBatch,
        windows: &Windows,
        admit: &Admit,
    ) -> Result<BatchOutcome, StoreError> {
        self.refresh_gateways(batch).await?;
        match &self.db {
            Database::Postgres(pool) => self.write_new_first(pool, batch, windows, admit).await,
            Database::Sqlite(_) => {
                let registers: Vec<&RegisterAgent> = batch.registers.iter().collect();
                self.write_locked(&batch.unregisters, &registers, windows, admit)
                    .await
            }
        }
    }

    /// PostgreSQL: one statement without a transaction of its own takes the
    /// unregistrations' agents offline and inserts every registration whose id nobody has
    /// (judged by `admit` against no holder): one round trip and one commit, where the
    /// locked transaction takes four. Registrations of ids that exist (a device registering
    /// again) are then judged against their holders and written by [`Self::write_locked`].
    ///
    /// Both parts are safe to write again: an unregistration written twice finds its agent
    /// offline already, and a new id written twice finds itself the holder (same connection,
    /// accepted). So when the second part fails for another reason than the database being
    /// unavailable, the whole batch fails and the group commit writes its requests again one
    /// by one; otherwise only the second part's registrations fail.
    async fn write_new_first(
        &self,
        pool: &sqlx::PgPool,
        batch: &WriteBatch,
        windows: &Windows,
        admit: &Admit,
    ) -> Result<BatchOutcome, StoreError> {
        let mut registered: Results = std::iter::repeat_with(|| None)
            .take(batch.registers.len())
            .collect();
        let candidates = batch.registers.iter().enumerate();
        let new = judge_all(candidates, &HashMap::new(), false, admit, &mut registered);
        let mut written = postgres::write_new_at_once(pool, &batch.unregisters, &new).await?;
        let unregistered = batch
            .unregisters
            .iter()
            .map(|u| Ok(written.went_offline.contains(u.agent_id.as_str())))
            .collect();
        let mut existing: Vec<(usize, &RegisterAgent)> = Vec::new();
        for a in new {
            match written.inserted.remove(a.request.agent_id.as_str()) {
                Some(agent) => {
                    registered[a.index] =
                        Some(Ok(RegisterOutcome::Registered(Box::new(Registered {
                            agent,
                            replaced_connection: None,
                            replaced_gateway: None,
                        }))));
                }
                None => existing.push((a.index, a.request)),
            }
        }
        if !existing.is_empty() {
            let requests: Vec<&RegisterAgent> = existing.iter().map(|(_, r)| *r).collect();
            let results = match self.write_locked(&[], &requests, windows, admit).await {
                Ok(outcome) => outcome.registered,
                Err(e) if requests.len() > 1 && !e.is_unavailable() => return Err(e),
                Err(e) => {
                    let e = Arc::new(e);
                    requests
                        .iter()
                        .map(|_| Err(StoreError::Batch(e.clone())))
                        .collect()
                }
            };
            for ((index, _), result) in existing.into_iter().zip(results) {
                registered[index] = Some(result);
            }
        }
        Ok(BatchOutcome {
            unregistered,
            registered: settled(registered, &batch.registers),
        })
    }

    /// Four round trips on PostgreSQL whatever it holds: `BEGIN`, one statement locking and
    /// reading every row it writes, one statement writing them all, `COMMIT` (two more for
    /// new ids that a concurrent registration created first).
    async fn write_locked(
        &self,
        unregisters: &[Unregister],
        registers: &[&RegisterAgent],
        windows: &Windows,
        admit: &Admit,
    ) -> Result<BatchOutcome, StoreError> {
        // The transaction locks agents only, so that it cannot deadlock with presence flushes.
        let mut tx = self.db.begin().await?;
        let ids: Vec<&str> = unregisters
            .iter()
            .map(|u| u.agent_id.as_str())
            .chain(registers.iter().map(|r| r.agent_id.as_str()))
            .collect();
        let held = lock_holders(&mut tx, &ids, windows).await?;

        // Unregistrations come first: no registration of the batch names the same agent.
        let mut unregistered = Vec::with_capacity(unregisters.len());
        let mut offline: Vec<&str> = Vec::new();
        for u in unregisters {
            let held = held
                .get(u.agent_id.as_str())
                .filter(|h| h.connection_id == u.connection_id);
            if held.is_some() {
                offline.push(&u.agent_id);
            }
            unregistered.push(Ok(
                held.is_some_and(|h| h.status != AgentStatus::Offline.as_str())
            ));
        }
        let mut registered: Results = std::iter::repeat_with(|| None)
            .take(registers.len())
            .collect();
        let candidates = registers.iter().copied().enumerate();
        let admitted = judge_all(candidates, &held, false, admit, &mut registered);
        let lost = write_rows(&mut tx, &offline, admitted, &mut registered).await?;

        // New ids created meanwhile by a concurrent registration: judged again, against the
        // row it wrote, now locked.
        if !lost.is_empty() {
            let ids: Vec<&str> = lost.iter().map(|(_, r)| r.agent_id.as_str()).collect();
            let held = lock_holders(&mut tx, &ids, windows).await?;
            let admitted = judge_all(lost.into_iter(), &held, true, admit, &mut registered);
            write_rows(&mut tx, &[], admitted, &mut registered).await?;
        }
        tx.commit().await?;
        Ok(BatchOutcome {
            unregistered,
            registered: settled(registered, registers),
        })
    }

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
        self.db
            .query(&GATEWAYS_ALIVE)
            .bind(List(&stale))
            .execute()
            .await?;
        let mut refreshed = self
            .gateways_refreshed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        refreshed
            .retain(|_, at| now.duration_since(*at) < GATEWAY_REFRESH * GATEWAY_MEMORY_PERIODS);
        for gateway in stale {
            refreshed.insert(gateway.to_owned(), now);
        }
        Ok(())
    }
}

/// Every registration's result; one left undecided (which does not happen) is contention,
/// which the client may try again.
fn settled<R: std::borrow::Borrow<RegisterAgent>>(
    registered: Results,
    requests: &[R],
) -> Vec<Result<RegisterOutcome, StoreError>> {
    registered
        .into_iter()
        .zip(requests)
        .map(|(result, request)| {
            result.unwrap_or_else(|| {
                Err(StoreError::Contention {
                    agent_id: request.borrow().agent_id.clone(),
                })
            })
        })
        .collect()
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
        let holder = match held.map(HeldRow::holder).transpose() {
            Ok(holder) => holder,
            Err(e) => {
                registered[index] = Some(Err(e));
                continue;
            }
        };
        if lost_race && holder.is_none() {
            // The row that made the insert fail is not there. This does not happen: a row a
            // concurrent registration just wrote is live, and only agents offline and unseen
            // for long are ever deleted (`forget_offline`). The client may try again.
            registered[index] = Some(Err(StoreError::Contention {
                agent_id: request.agent_id.clone(),
            }));
            continue;
        }
        match admit(request, holder.as_ref()) {
            Ok(replaced) => admitted.push(Admitted {
                replaced: replaced.map(|connection| {
                    let gateway = holder.as_ref().map(|h| h.gateway_id.clone());
                    (connection, gateway.unwrap_or_default())
                }),
                index,
                request,
                kind: if holder.is_some() {
                    Kind::Existing
                } else {
                    Kind::New
                },
            }),
            Err(refusal) => registered[index] = Some(Ok(RegisterOutcome::Refused(refusal))),
        }
    }
    admitted
}

/// Locks the rows of `ids` in id order and reads their holders.
async fn lock_holders(
    tx: &mut Tx<'_>,
    ids: &[&str],
    windows: &Windows,
) -> Result<HashMap<String, HeldRow>, StoreError> {
    let rows: Vec<HeldRow> = tx
        .query(&LOCK_HOLDERS)
        .bind(List(ids))
        .bind(millis(windows.agent))
        .bind(millis(windows.gateway))
        .fetch_all()
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.agent_id.clone(), row))
        .collect())
}

/// Writes the unregistrations (`offline`) and the admitted registrations, and puts each
/// registration's outcome in `registered`. Returns the new ids that a concurrent
/// registration created first (left alone by the insert).
async fn write_rows<'r>(
    tx: &mut Tx<'_>,
    offline: &[&str],
    admitted: Vec<Admitted<'r>>,
    registered: &mut Results,
) -> Result<Vec<(usize, &'r RegisterAgent)>, StoreError> {
    if offline.is_empty() && admitted.is_empty() {
        return Ok(Vec::new());
    }
    let mut written = match tx {
        Tx::Postgres(pg) => postgres::write_rows_at_once(pg, offline, &admitted).await?,
        Tx::Sqlite(_) => write_rows_each(tx, offline, &admitted).await?,
    };
    let mut lost = Vec::new();
    for a in admitted {
        match written.remove(a.request.agent_id.as_str()) {
            Some(agent) => {
                registered[a.index] = Some(Ok(RegisterOutcome::Registered(Box::new(Registered {
                    agent,
                    replaced_connection: a.replaced.as_ref().map(|(c, _)| c.clone()),
                    replaced_gateway: a.replaced.map(|(_, g)| g),
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

/// The agents written, by id. A written row that cannot be read back fails the batch, so
/// that it is rolled back.
fn written(rows: Vec<AgentRow>) -> Result<HashMap<String, AgentRecord>, StoreError> {
    rows.into_iter()
        .map(|row| row.into_record().map(|r| (r.agent_id.clone(), r)))
        .collect()
}

/// Writes row by row: SQLite is in this process, a statement costs no round trip, and each
/// is prepared once per connection.
async fn write_rows_each(
    tx: &mut Tx<'_>,
    offline: &[&str],
    admitted: &[Admitted<'_>],
) -> Result<HashMap<String, AgentRecord>, StoreError> {
    if !offline.is_empty() {
        tx.query(&TAKE_OFFLINE)
            .bind(List(offline))
            .execute()
            .await?;
    }
    let mut rows = Vec::with_capacity(admitted.len());
    for a in admitted {
        let sql = match a.kind {
            Kind::New => &INSERT_AGENT,
            Kind::Existing => &UPDATE_AGENT,
        };
        let r = a.request;
        let row: Option<AgentRow> = tx
            .query(sql)
            .bind(&r.agent_id)
            .bind(r.client_type.as_str())
            .bind(r.platform.as_str())
            .bind(Json(&r.capabilities))
            .bind(Json(&r.tools))
            .bind(r.system_info.as_ref().map(Json))
            .bind(r.metadata.as_ref().map(Json))
            .bind(Json(extension_names(&r.extensions)))
            .bind(r.target_id.as_deref())
            .bind(&r.principal)
            .bind(&r.gateway_id)
            .bind(&r.connection_id)
            .fetch_optional()
            .await?;
        rows.extend(row);
    }
    written(rows)
}

/// The batch in one statement on PostgreSQL, over arrays: one round trip per batch.
mod postgres {
    use sqlx::postgres::PgArguments;
    use sqlx::query::QueryAs;

    use super::*;

    /// Registrations as column arrays, bound to [`UNNEST_REGISTRATIONS`]. JSON travels as
    /// text and is cast to jsonb in SQL.
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

    /// The registrations as rows `r`, from parameters `$1` to `$13` in [`RegisterColumns`]'
    /// order.
    const UNNEST_REGISTRATIONS: &str = "unnest($1::text[], $2::text[], $3::text[], $4::text[], \
         $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], \
         $12::text[], $13::text[]) \
         AS r(kind, agent_id, client_type, platform, capabilities, tools, system_info, metadata, \
              extensions, target_id, principal, gateway_id, connection_id)";

    impl<'r> RegisterColumns<'r> {
        fn new(admitted: &[Admitted<'r>]) -> Result<Self, StoreError> {
            let mut c = RegisterColumns::default();
            for a in admitted {
                let r = a.request;
                let id = r.agent_id.as_str();
                c.kind.push(match a.kind {
                    Kind::New => "new",
                    Kind::Existing => "existing",
                });
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
    }

    impl RegisterColumns<'_> {
        /// Binds the columns as `$1` to `$13` of [`UNNEST_REGISTRATIONS`].
        fn bind<'q, O>(
            &'q self,
            query: QueryAs<'q, sqlx::Postgres, O, PgArguments>,
        ) -> QueryAs<'q, sqlx::Postgres, O, PgArguments> {
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

    /// Inserts the registrations of [`UNNEST_REGISTRATIONS`] of kind `new`, in id order,
    /// returning `returning` of the rows written; an id that exists by then is left alone.
    fn insert_new(returning: &str) -> String {
        format!(
            "INSERT INTO agents AS a (agent_id, client_type, platform, status, capabilities, \
                 tools, system_info, metadata, extensions, target_id, principal, gateway_id, \
                 connection_id, load, connected_at, last_seen) \
             SELECT r.agent_id, r.client_type, r.platform, 'available', r.capabilities::jsonb, \
                 r.tools::jsonb, r.system_info::jsonb, r.metadata::jsonb, r.extensions::jsonb, \
                 r.target_id, r.principal, r.gateway_id, r.connection_id, 0, now(), now() \
             FROM {UNNEST_REGISTRATIONS} WHERE r.kind = 'new' ORDER BY r.agent_id \
             ON CONFLICT (agent_id) DO NOTHING RETURNING {returning}"
        )
    }

    /// Takes the agents at `$14` offline where the connections at `$15` still hold them
    /// (their rows locked in id order, as everywhere) and inserts the new ids, in one
    /// statement. Each row returned is an agent written: `registration` says which part
    /// wrote it, `connected_at` when it was inserted (a registration's), `went_offline`
    /// whether an unregistration's agent was not offline before. Only ids and these come
    /// back: the caller has the rest (a new agent's record is its request's fields).
    static WRITE_NEW: LazyLock<String> = LazyLock::new(|| {
        format!(
            "WITH ended AS ( \
                 SELECT a.agent_id, a.status FROM agents a \
                 JOIN unnest($14::text[], $15::text[]) AS u(agent_id, connection_id) \
                     ON a.agent_id = u.agent_id AND a.connection_id = u.connection_id \
                 ORDER BY a.agent_id FOR UPDATE OF a \
             ), offline AS ( \
                 UPDATE agents AS a SET status = 'offline', offline_reason = 'unregistered' \
                 FROM ended e WHERE a.agent_id = e.agent_id \
                 RETURNING a.agent_id, e.status <> 'offline' AS went_offline \
             ), inserted AS ({inserted}) \
             SELECT true AS registration, i.agent_id, i.connected_at, false AS went_offline \
                 FROM inserted i \
             UNION ALL SELECT false, o.agent_id, NULL, o.went_offline FROM offline o",
            inserted = insert_new("a.agent_id, a.connected_at"),
        )
    });

    /// A row of [`WRITE_NEW`].
    #[derive(FromRow)]
    struct WrittenRow {
        registration: bool,
        agent_id: String,
        connected_at: Option<Timestamp>,
        went_offline: bool,
    }

    /// What [`write_new_at_once`] wrote.
    pub(super) struct WrittenNew {
        /// The new agents, by id.
        pub(super) inserted: HashMap<String, AgentRecord>,
        /// The agents taken offline that were not offline before.
        pub(super) went_offline: HashSet<String>,
    }

    /// Writes `unregisters` and the new ids of `new` in one statement ([`WRITE_NEW`]) on its
    /// own (the statement is its transaction). A registration missing from
    /// [`WrittenNew::inserted`] names an id that exists.
    pub(super) async fn write_new_at_once(
        pool: &sqlx::PgPool,
        unregisters: &[Unregister],
        new: &[Admitted<'_>],
    ) -> Result<WrittenNew, StoreError> {
        let c = RegisterColumns::new(new)?;
        let ids: Vec<&str> = unregisters.iter().map(|u| u.agent_id.as_str()).collect();
        let connections: Vec<&str> = unregisters
            .iter()
            .map(|u| u.connection_id.as_str())
            .collect();
        let rows: Vec<WrittenRow> = c
            .bind(sqlx::query_as(WRITE_NEW.as_str()))
            .bind(&ids)
            .bind(&connections)
            .fetch_all(pool)
            .await?;
        let mut written = WrittenNew {
            inserted: HashMap::with_capacity(new.len()),
            went_offline: HashSet::with_capacity(unregisters.len()),
        };
        let requests: HashMap<&str, &RegisterAgent> = new
            .iter()
            .map(|a| (a.request.agent_id.as_str(), a.request))
            .collect();
        for row in rows {
            if row.registration {
                let (Some(request), Some(at)) =
                    (requests.get(row.agent_id.as_str()), row.connected_at)
                else {
                    return Err(StoreError::Corrupt {
                        detail: "the insert returned an agent not asked for, or no time".into(),
                        agent_id: row.agent_id,
                    });
                };
                written
                    .inserted
                    .insert(row.agent_id, new_record(request, at));
            } else if row.went_offline {
                written.went_offline.insert(row.agent_id);
            }
        }
        Ok(written)
    }

    /// Takes the agents at `$14` offline, inserts the new ids and updates the existing rows
    /// (all locked by the caller's transaction), in one statement. In `updated`, `a.…` on
    /// the right-hand side is the row before the update.
    static WRITE_LOCKED: LazyLock<String> = LazyLock::new(|| {
        format!(
            "WITH offline AS ( \
                 UPDATE agents SET status = 'offline', offline_reason = 'unregistered' \
                 WHERE agent_id = ANY($14::text[]) \
             ), inserted AS ({inserted}), updated AS ( \
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
             SELECT * FROM inserted UNION ALL SELECT * FROM updated",
            inserted = insert_new(AGENT_COLUMNS),
        )
    });

    /// Takes `offline` offline, inserts the new ids and updates the existing rows, in one
    /// statement.
    pub(super) async fn write_rows_at_once(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        offline: &[&str],
        admitted: &[Admitted<'_>],
    ) -> Result<HashMap<String, AgentRecord>, StoreError> {
        let c = RegisterColumns::new(admitted)?;
        let rows: Vec<AgentRow> = c
            .bind(sqlx::query_as(WRITE_LOCKED.as_str()))
            .bind(offline)
            .fetch_all(&mut **tx)
            .await?;
        written(rows)
    }
}
