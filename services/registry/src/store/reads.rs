//! Reading agents: one statement each, the same on both databases but for their fragments.

use std::sync::LazyLock;

use aip_store::{List, Sql};
use proto_schemas::registry::{AgentRecord, AgentStatus};
use sqlx::types::Json;

use super::{
    AGENT_COLUMNS, AgentFilter, AgentRow, LookupQuery, SqlAgentStore, StoreError, Windows, millis,
};

/// Whether `$1` is a live device; `$2` and `$3` are the agent and gateway windows.
static LIVE_DEVICE: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT EXISTS (SELECT 1 FROM agents a JOIN gateways g ON g.gateway_id = a.gateway_id \
             WHERE a.agent_id = $1 AND a.client_type = 'device' AND a.status <> 'offline' \
               AND a.last_seen >= {agent} AND g.last_seen >= {gateway})",
            agent = b.ago(2),
            gateway = b.ago(3),
        )
    })
});

static AGENT: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|_| format!("SELECT {AGENT_COLUMNS} FROM agents a WHERE a.agent_id = $1"))
});

/// The agents whose ids are in the list `$1`.
static AGENTS_BY_ID: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT {AGENT_COLUMNS} FROM agents a WHERE {ids}",
            ids = b.in_list("a.agent_id", 1)
        )
    })
});

/// Live, available agents of type `$1` having every capability of `$2`; `$3` and `$4` are
/// the agent and gateway windows, `$5` the limit.
static LIVE_AGENTS: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT {AGENT_COLUMNS} FROM agents a JOIN gateways g ON g.gateway_id = a.gateway_id \
             WHERE a.status = 'available' AND a.client_type = $1 AND {capabilities} \
               AND a.last_seen >= {agent} AND g.last_seen >= {gateway} \
             ORDER BY a.load ASC, a.last_seen DESC, a.agent_id ASC LIMIT $5",
            capabilities = b.json_contains_all("a.capabilities", 2),
            agent = b.ago(3),
            gateway = b.ago(4),
        )
    })
});

/// Agents with status `$1` and type `$2` (either may be NULL: any) having every capability
/// of `$3`, at most `$4`.
static AGENTS: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT {AGENT_COLUMNS} FROM agents a \
             WHERE ($1 IS NULL OR a.status = $1) AND ($2 IS NULL OR a.client_type = $2) \
               AND {capabilities} \
             ORDER BY a.agent_id LIMIT $4",
            capabilities = b.json_contains_all("a.capabilities", 3),
        )
    })
});

static ONLINE_IDS: Sql =
    Sql::same("SELECT agent_id FROM agents WHERE status <> 'offline' ORDER BY agent_id");

impl SqlAgentStore {
    pub(super) async fn live_device(
        &self,
        agent_id: &str,
        windows: &Windows,
    ) -> Result<bool, StoreError> {
        let (live,): (bool,) = self
            .db
            .query(&LIVE_DEVICE)
            .bind(agent_id)
            .bind(millis(windows.agent))
            .bind(millis(windows.gateway))
            .fetch_one()
            .await?;
        Ok(live)
    }

    pub(super) async fn agent(&self, agent_id: &str) -> Result<Option<AgentRecord>, StoreError> {
        let row: Option<AgentRow> = self
            .db
            .query(&AGENT)
            .bind(agent_id)
            .fetch_optional()
            .await?;
        row.map(AgentRow::into_record).transpose()
    }

    pub(super) async fn agents_by_id(
        &self,
        agent_ids: &[String],
    ) -> Result<Vec<AgentRecord>, StoreError> {
        let rows: Vec<AgentRow> = self
            .db
            .query(&AGENTS_BY_ID)
            .bind(List(agent_ids))
            .planned_each_time()
            .fetch_all()
            .await?;
        rows.into_iter().map(AgentRow::into_record).collect()
    }

    pub(super) async fn live_agents(
        &self,
        query: &LookupQuery,
    ) -> Result<Vec<AgentRecord>, StoreError> {
        let rows: Vec<AgentRow> = self
            .db
            .query(&LIVE_AGENTS)
            .bind(query.client_type.as_str())
            .bind(Json(&query.capabilities))
            .bind(millis(query.windows.agent))
            .bind(millis(query.windows.gateway))
            .bind(i64::from(query.limit))
            .fetch_all()
            .await?;
        rows.into_iter().map(AgentRow::into_record).collect()
    }

    pub(super) async fn agents(
        &self,
        filter: &AgentFilter,
    ) -> Result<Vec<AgentRecord>, StoreError> {
        let rows: Vec<AgentRow> = self
            .db
            .query(&AGENTS)
            .bind(filter.status.map(AgentStatus::as_str))
            .bind(filter.client_type.map(|t| t.as_str()))
            .bind(Json(&filter.capabilities))
            .bind(i64::from(filter.limit))
            .fetch_all()
            .await?;
        rows.into_iter().map(AgentRow::into_record).collect()
    }

    pub(super) async fn online(&self) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = self.db.query(&ONLINE_IDS).fetch_all().await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }
}
