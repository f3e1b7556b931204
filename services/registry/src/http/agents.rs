//! `/api/agents`: the registry's own listing, richer than UFO's.

use aip_runtime::api_error::{Path, Query};
use axum::Json;
use axum::extract::State;
use proto_schemas::registry::{AgentRecord, AgentStatus};
use proto_schemas::{ClientType, ErrorBody};
use utoipa::IntoParams;

use super::AppState;
use super::error::ApiError;
use crate::registry::not_found;
use crate::store::AgentFilter;

/// Listing answers at most this many agents unless asked for fewer.
pub const DEFAULT_LIST_LIMIT: u32 = 1000;
/// Listing never answers more than this many agents.
pub const MAX_LIST_LIMIT: u32 = 10_000;
/// NUL (U+0000): PostgreSQL text cannot hold it, so no stored id or capability contains it,
/// and a query naming one is answered without asking the database.
const NUL: char = '\0';

/// The query of `GET /api/agents`, as documented. The handler reads the pairs itself
/// ([`parse_filter`]): a capability may repeat, and an unknown key is refused, not ignored.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct ListQuery {
    /// Only agents with every one of these capabilities; repeat the key or separate with
    /// commas (`capabilities` is the same).
    capability: Option<Vec<String>>,
    /// Only agents with this stored status.
    status: Option<AgentStatus>,
    /// Only agents of this type (`client_type` is the same).
    r#type: Option<ClientType>,
    /// At most this many agents (default 1000; more than 10000 answers 10000).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_u64)]
    limit: Option<u32>,
}

/// Agents with every capability given, the stored status and the type given, by id.
#[utoipa::path(
    get,
    path = "/agents",
    operation_id = "list_agents",
    tag = "agents",
    params(ListQuery),
    responses(
        (status = 200, description = "the agents, by id", body = Vec<AgentRecord>),
        (status = 400, description = "an unknown key, status or type, or a limit that is not a whole number", body = ErrorBody),
        (status = 503, description = "the database is unavailable; retry", body = ErrorBody),
    )
)]
pub async fn list(
    State(state): State<AppState>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Json<Vec<AgentRecord>>, ApiError> {
    let filter = parse_filter(&pairs)?;
    if filter.capabilities.iter().any(|c| c.contains(NUL)) {
        // No stored capability holds NUL: no agent matches.
        return Ok(Json(Vec::new()));
    }
    Ok(Json(state.store.list(&filter).await?))
}

/// One agent, online or not.
#[utoipa::path(
    get,
    path = "/agents/{id}",
    operation_id = "get_agent",
    tag = "agents",
    params(("id" = String, Path, description = "the agent's id (its AIP client_id)")),
    responses(
        (status = 200, description = "the agent", body = AgentRecord),
        (status = 404, description = "never registered", body = ErrorBody),
        (status = 503, description = "the database is unavailable; retry", body = ErrorBody),
    )
)]
pub async fn get(
    State(state): State<AppState>,
    Path(agent_id): Path<String>,
) -> Result<Json<AgentRecord>, ApiError> {
    if agent_id.contains(NUL) {
        return Err(ApiError::from(not_found(&agent_id)));
    }
    match state.store.get(&agent_id).await? {
        Some(agent) => Ok(Json(agent)),
        None => Err(ApiError::from(not_found(&agent_id))),
    }
}

fn parse_filter(pairs: &[(String, String)]) -> Result<AgentFilter, ApiError> {
    let mut filter = AgentFilter {
        limit: DEFAULT_LIST_LIMIT,
        ..AgentFilter::default()
    };
    for (key, value) in pairs {
        match key.as_str() {
            "capability" | "capabilities" => filter.capabilities.extend(
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned),
            ),
            "status" => {
                filter.status = Some(AgentStatus::from_wire(value).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "invalid status `{value}`: expected `available`, `busy` or `offline`"
                    ))
                })?);
            }
            "type" | "client_type" => {
                filter.client_type = Some(ClientType::from_wire(value).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "invalid type `{value}`: expected {}",
                        ClientType::expected()
                    ))
                })?);
            }
            "limit" => {
                let limit: u32 = value.parse().map_err(|_| {
                    ApiError::invalid(format!("invalid limit `{value}`: expected a whole number"))
                })?;
                filter.limit = limit.min(MAX_LIST_LIMIT);
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter `{other}`: use capability, status, type or limit"
                )));
            }
        }
    }
    Ok(filter)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn filters_parse() {
        let f = parse_filter(&pairs(&[
            ("capability", "a"),
            ("capability", "b, c"),
            ("status", "available"),
            ("type", "device"),
            ("limit", "99999"),
        ]))
        .expect("valid");
        assert_eq!(f.capabilities, ["a", "b", "c"]);
        assert_eq!(f.status, Some(AgentStatus::Available));
        assert_eq!(f.client_type, Some(ClientType::Device));
        assert_eq!(f.limit, MAX_LIST_LIMIT);
        assert!(parse_filter(&pairs(&[("status", "Available")])).is_err());
        assert!(parse_filter(&pairs(&[("colour", "red")])).is_err());
    }
}
