//! `/api/agents`: the registry's own listing, richer than UFO's.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use proto_schemas::ClientType;
use proto_schemas::registry::{AgentRecord, AgentStatus};

use super::AppState;
use super::error::ApiError;
use crate::registry::not_found;
use crate::store::AgentFilter;

/// Listing answers at most this many agents unless asked for fewer.
pub const DEFAULT_LIST_LIMIT: u32 = 1000;
/// Listing never answers more than this many agents.
pub const MAX_LIST_LIMIT: u32 = 10_000;

/// `GET /api/agents?capability=a&capability=b,c&status=available&type=device&limit=100`:
/// agents with every capability given, the stored status and the type given, by id.
pub async fn list(
    State(state): State<AppState>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Json<Vec<AgentRecord>>, ApiError> {
    let Query(pairs) =
        query.map_err(|e| ApiError::InvalidRequest(format!("invalid query string: {e}")))?;
    let filter = parse_filter(&pairs)?;
    Ok(Json(state.store.list(&filter).await?))
}

/// `GET /api/agents/{id}`: one agent, 404 if never registered.
pub async fn get(
    State(state): State<AppState>,
    Path(agent_id): Path<String>,
) -> Result<Json<AgentRecord>, ApiError> {
    match state.store.get(&agent_id).await? {
        Some(agent) => Ok(Json(agent)),
        None => Err(ApiError::NotFound(not_found(&agent_id).detail)),
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
                    ApiError::InvalidRequest(format!(
                        "invalid status `{value}`: expected `available`, `busy` or `offline`"
                    ))
                })?);
            }
            "type" | "client_type" => {
                filter.client_type = Some(ClientType::from_wire(value).ok_or_else(|| {
                    ApiError::InvalidRequest(format!(
                        "invalid type `{value}`: expected {}",
                        ClientType::expected()
                    ))
                })?);
            }
            "limit" => {
                let limit: u32 = value.parse().map_err(|_| {
                    ApiError::InvalidRequest(format!(
                        "invalid limit `{value}`: expected a whole number"
                    ))
                })?;
                filter.limit = limit.min(MAX_LIST_LIMIT);
            }
            other => {
                return Err(ApiError::InvalidRequest(format!(
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
