//! Agents reached at an address (seed 004's "register me as an agent"): one row each in
//! `addressed_agents`, one statement per request, the same on both databases but for their
//! fragments.

use std::sync::LazyLock;

use aip_store::{Sql, Timestamp};
use proto_schemas::registry::{AddressedAgent, AgentRegistration, AgentStatus};
use sqlx::types::Json;

use super::{SqlAgentStore, StoreError};

/// Inserts `$1` (capabilities `$2`, address `$3`, status `$4`, registered by `$5`) unless
/// an addressed agent or a WebSocket client not offline holds the id; returns the row, or
/// nothing when the id is taken. One statement, so two registrations of one id cannot both
/// succeed.
static REGISTER: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "INSERT INTO addressed_agents \
               (agent_id, capabilities, address, status, registered_by, registered_at) \
             SELECT $1, $2, $3, $4, $5, {now} \
             WHERE NOT EXISTS (SELECT 1 FROM agents a WHERE a.agent_id = $1 AND a.status <> 'offline') \
             ON CONFLICT (agent_id) DO NOTHING \
             RETURNING {ADDRESSED_COLUMNS}",
            now = b.now(),
        )
    })
});

/// Available addressed agents having every capability of `$1`, by id, at most `$2`.
static FIND: LazyLock<Sql> = LazyLock::new(|| {
    Sql::render(|b| {
        format!(
            "SELECT {ADDRESSED_COLUMNS} FROM addressed_agents a \
             WHERE a.status = 'available' AND {capabilities} \
             ORDER BY a.agent_id LIMIT $2",
            capabilities = b.json_contains_all("a.capabilities", 1),
        )
    })
});

const ADDRESSED_COLUMNS: &str =
    "agent_id, capabilities, address, status, registered_by, registered_at";

/// One `addressed_agents` row, before validation.
#[derive(sqlx::FromRow)]
struct AddressedRow {
    agent_id: String,
    capabilities: Json<Vec<String>>,
    address: String,
    status: String,
    registered_by: String,
    registered_at: Timestamp,
}

impl AddressedRow {
    fn into_agent(self) -> Result<AddressedAgent, StoreError> {
        let status = AgentStatus::from_wire(&self.status).ok_or_else(|| StoreError::Corrupt {
            agent_id: self.agent_id.clone(),
            detail: format!("unknown status `{}`", self.status),
        })?;
        Ok(AddressedAgent {
            agent_id: self.agent_id,
            capabilities: self.capabilities.0,
            address: self.address,
            status,
            registered_by: self.registered_by,
            registered_at: self.registered_at.0,
        })
    }
}

impl SqlAgentStore {
    pub(super) async fn insert_addressed(
        &self,
        registration: &AgentRegistration,
        registered_by: &str,
    ) -> Result<Option<AddressedAgent>, StoreError> {
        let row: Option<AddressedRow> = self
            .db
            .query(&REGISTER)
            .bind(registration.agent_id.as_str())
            .bind(Json(&registration.capabilities))
            .bind(registration.address.as_str())
            .bind(registration.status.as_str())
            .bind(registered_by)
            .fetch_optional()
            .await?;
        row.map(AddressedRow::into_agent).transpose()
    }

    pub(super) async fn available_addressed(
        &self,
        capabilities: &[String],
        limit: u32,
    ) -> Result<Vec<AddressedAgent>, StoreError> {
        let rows: Vec<AddressedRow> = self
            .db
            .query(&FIND)
            .bind(Json(capabilities))
            .bind(i64::from(limit))
            .fetch_all()
            .await?;
        rows.into_iter().map(AddressedRow::into_agent).collect()
    }
}
