//! `/healthz` and `/readyz`: one body shape on every service and on `aip dev`.
//!
//! - `GET /healthz` → 200 `{"status":"ok"}`: the process answers (liveness).
//! - `GET /readyz` → 200 or 503 with a [`Readiness`]: every dependency checked, each with its
//!   state, e.g. `{"status":"not_ready","checks":{"bus":{"ok":true},"database":{"ok":false,
//!   "detail":"…"}}}`; the session service adds `"role":"leader"|"standby"|"starting"` and its
//!   `leadership` check. 200 only when every check is ok.

use std::collections::BTreeMap;
use std::time::Duration;

use aip_bus::SharedBus;
use aip_store::Database;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// How long `/readyz` waits for each dependency: a probe must answer well within a load
/// balancer's or Kubernetes' probe timeout (1 s by default there, often raised to a few).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The `/healthz` body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    /// Always [`LiveStatus::Ok`]: an answer at all is the information.
    pub status: LiveStatus,
}

/// The process answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LiveStatus {
    /// `"ok"`.
    Ok,
}

/// The `/readyz` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// Ready when every check is ok.
    pub status: ReadyStatus,
    /// Each dependency and its state.
    pub checks: BTreeMap<CheckName, Check>,
    /// The session service's place among its replicas; absent on the other services.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
}

/// Whether the service takes work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadyStatus {
    /// 200: every check is ok.
    Ready,
    /// 503: at least one check failed.
    NotReady,
}

/// What a check is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckName {
    /// The server is not shutting down (a gateway drains its sockets before it exits).
    Accepting,
    /// The bus answers a flush (NATS, or the in-process bus of `aip dev`).
    Bus,
    /// The database answers `SELECT 1`.
    Database,
    /// This session replica leads (only the leader takes changes).
    Leadership,
    /// The leader's frames consumer makes progress: frames it holds are acknowledged, rather
    /// than retried forever while the stream stalls behind them.
    Frames,
}

/// One dependency's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// Whether it is usable.
    pub ok: bool,
    /// Why not, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Check {
    /// A usable dependency.
    pub fn ok() -> Self {
        Check {
            ok: true,
            detail: None,
        }
    }

    /// An unusable one, and why.
    pub fn failed(detail: impl Into<String>) -> Self {
        Check {
            ok: false,
            detail: Some(detail.into()),
        }
    }
}

/// A session replica's place: only the leader is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// This replica applies changes.
    Leader,
    /// Another replica leads; this one serves reads and takes over when the leader goes.
    Standby,
    /// This replica has not tried to lead yet.
    Starting,
}

impl Role {
    /// The leadership check this role amounts to.
    pub fn check(self) -> Check {
        match self {
            Role::Leader => Check::ok(),
            Role::Standby => Check::failed(
                "standby: another replica leads (this one serves reads and takes over when the \
                 leader goes)",
            ),
            Role::Starting => {
                Check::failed("starting: this replica has not taken the leadership yet")
            }
        }
    }
}

impl Readiness {
    /// Ready when every check is ok.
    pub fn from_checks(checks: BTreeMap<CheckName, Check>) -> Self {
        let status = if checks.values().all(|c| c.ok) {
            ReadyStatus::Ready
        } else {
            ReadyStatus::NotReady
        };
        Readiness {
            status,
            checks,
            role: None,
        }
    }

    /// Adds a check of the service's own (the status follows).
    pub fn with_check(mut self, name: CheckName, check: Check) -> Self {
        self.checks.insert(name, check);
        Readiness {
            role: self.role,
            ..Readiness::from_checks(self.checks)
        }
    }

    /// Adds a session replica's role and its leadership check.
    pub fn with_role(mut self, role: Role) -> Self {
        self.checks.insert(CheckName::Leadership, role.check());
        let role = Some(role);
        Readiness {
            role,
            ..Readiness::from_checks(self.checks)
        }
    }

    /// Whether every check is ok.
    pub fn is_ready(&self) -> bool {
        self.status == ReadyStatus::Ready
    }
}

impl IntoResponse for Readiness {
    fn into_response(self) -> Response {
        let status = if self.is_ready() {
            StatusCode::OK
        } else {
            tracing::debug!(?self.checks, "not ready");
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, Json(self)).into_response()
    }
}

/// What a service's `/readyz` checks. Each part is optional: the gateway has no database, the
/// registry and the session service stop their listener at once on shutdown (no draining state).
#[derive(Clone, Default)]
pub struct Probes {
    bus: Option<SharedBus>,
    database: Option<Database>,
    stopping: Option<CancellationToken>,
}

impl Probes {
    /// Checks nothing yet.
    pub fn new() -> Self {
        Probes::default()
    }

    /// Checks that `bus` answers a flush.
    pub fn bus(mut self, bus: SharedBus) -> Self {
        self.bus = Some(bus);
        self
    }

    /// Checks that `database` answers.
    pub fn database(mut self, database: Database) -> Self {
        self.database = Some(database);
        self
    }

    /// Not ready once `stopping` is cancelled (the service is draining).
    pub fn stopping(mut self, stopping: CancellationToken) -> Self {
        self.stopping = Some(stopping);
        self
    }

    /// Runs every check at once, each within [`CHECK_TIMEOUT`].
    pub async fn check(&self) -> Readiness {
        let bus = async {
            let bus = self.bus.as_ref()?;
            Some(
                match tokio::time::timeout(CHECK_TIMEOUT, bus.flush()).await {
                    Ok(Ok(())) => Check::ok(),
                    Ok(Err(e)) => {
                        // The probe is open to all: the cause (addresses, names) goes to the log.
                        tracing::warn!("readiness: the bus check failed: {e}");
                        Check::failed("the bus does not answer (the service's log says why)")
                    }
                    Err(_) => Check::failed(format!("no answer within {CHECK_TIMEOUT:?}")),
                },
            )
        };
        let database = async {
            let database = self.database.as_ref()?;
            Some(
                match tokio::time::timeout(CHECK_TIMEOUT, database.ping()).await {
                    Ok(Ok(())) => Check::ok(),
                    Ok(Err(e)) => {
                        tracing::warn!("readiness: the database check failed: {e}");
                        Check::failed("the database does not answer (the service's log says why)")
                    }
                    Err(_) => Check::failed(format!("no answer within {CHECK_TIMEOUT:?}")),
                },
            )
        };
        let (bus, database) = tokio::join!(bus, database);
        let accepting = self.stopping.as_ref().map(|stopping| {
            if stopping.is_cancelled() {
                Check::failed("shutting down")
            } else {
                Check::ok()
            }
        });
        let checks = [
            (CheckName::Accepting, accepting),
            (CheckName::Bus, bus),
            (CheckName::Database, database),
        ]
        .into_iter()
        .filter_map(|(name, check)| check.map(|c| (name, c)))
        .collect();
        Readiness::from_checks(checks)
    }

    /// `GET /healthz` and `GET /readyz` over these probes, and `GET /metrics`, to merge into a
    /// service's router.
    pub fn routes(self) -> Router {
        crate::metrics::install();
        Router::new()
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(self)
            .merge(crate::metrics::routes())
    }
}

/// `GET /healthz`.
pub async fn healthz() -> Json<Liveness> {
    Json(Liveness {
        status: LiveStatus::Ok,
    })
}

async fn readyz(State(probes): State<Probes>) -> Readiness {
    probes.check().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_body_lists_each_check_and_the_role() {
        let ready = Readiness::from_checks(BTreeMap::from([
            (CheckName::Bus, Check::ok()),
            (CheckName::Database, Check::ok()),
        ]));
        assert_eq!(
            serde_json::to_value(&ready).expect("json"),
            json!({"status": "ready", "checks": {"bus": {"ok": true}, "database": {"ok": true}}})
        );
        let standby = ready.with_role(Role::Standby);
        assert!(!standby.is_ready());
        let body = serde_json::to_value(&standby).expect("json");
        assert_eq!(body["status"], "not_ready");
        assert_eq!(body["role"], "standby");
        assert_eq!(body["checks"]["leadership"]["ok"], false);
        let leader = standby.with_role(Role::Leader);
        assert!(leader.is_ready());
        assert_eq!(
            serde_json::to_value(Liveness {
                status: LiveStatus::Ok
            })
            .expect("json"),
            json!({"status": "ok"})
        );
    }

    #[tokio::test]
    async fn a_stopping_service_is_not_ready() {
        let stopping = CancellationToken::new();
        let probes = Probes::new()
            .bus(std::sync::Arc::new(aip_bus::LocalBus::new()))
            .stopping(stopping.clone());
        assert!(probes.check().await.is_ready());
        stopping.cancel();
        let readiness = probes.check().await;
        assert_eq!(readiness.status, ReadyStatus::NotReady);
        assert_eq!(
            readiness.checks[&CheckName::Accepting],
            Check::failed("shutting down")
        );
        assert!(readiness.checks[&CheckName::Bus].ok);
    }

    /// Issue 21: the probe is open to all, so a failed check says what failed, not the
    /// driver's error (a path, an address, a user name).
    #[tokio::test]
    async fn a_failed_check_does_not_tell_its_cause() {
        let dir = std::env::temp_dir().join(format!("aip-health-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let url = format!("sqlite://{}", dir.join("probe.db").display());
        let database = aip_store::Database::connect(&url).await.expect("sqlite");
        database.close().await;
        let probes = Probes::new().database(database);
        let readiness = probes.check().await;
        assert_eq!(readiness.status, ReadyStatus::NotReady);
        let check = &readiness.checks[&CheckName::Database];
        assert_eq!(
            check,
            &Check::failed("the database does not answer (the service's log says why)")
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
