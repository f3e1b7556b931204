//! Prometheus metrics: one recorder per process, served at `GET /metrics` by every service
//! (and `aip dev`) beside the probes.
//!
//! Code records through the `metrics` facade (`metrics::counter!`, `gauge!`, `histogram!`);
//! names follow Prometheus conventions (`aip_<service>_<what>_<unit>`, `_total` for counters,
//! seconds for durations). Histograms get [`DURATION_BUCKETS`] (seconds) or, for sizes,
//! [`SIZE_BUCKETS`]. Services embedded in one process (`aip dev`, tests) share the recorder,
//! so each one's `/metrics` shows all of them.

use std::sync::OnceLock;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Buckets of every `*_seconds` histogram: 0.5 ms to 60 s.
pub const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
/// Buckets of the histograms that count things (`*_tasks`, `*_changes`): 1 to 5,000.
pub const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
];

/// What a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric of every service: name, kind, help text (labels in the text). The one
/// reference; the README's table follows it.
pub const CATALOGUE: &[(&str, Kind, &str)] = &[
    (
        "aip_gateway_connections",
        Kind::Gauge,
        "WebSocket connections open now.",
    ),
    (
        "aip_gateway_connections_total",
        Kind::Counter,
        "WebSocket connections accepted.",
    ),
    (
        "aip_gateway_frames_received_total",
        Kind::Counter,
        "Valid frames received from clients, by `type`.",
    ),
    (
        "aip_gateway_frames_refused_total",
        Kind::Counter,
        "Frames refused before handling, by `reason` (invalid, rate_limited).",
    ),
    (
        "aip_gateway_frames_sent_total",
        Kind::Counter,
        "Frames the gateway itself sent to clients, by `type`.",
    ),
    (
        "aip_gateway_errors_total",
        Kind::Counter,
        "ERROR frames sent to clients, by error `code`.",
    ),
    (
        "aip_gateway_deliveries_total",
        Kind::Counter,
        "Frames from the session service for clients, by `outcome` (written; duplicate and other_connection: dropped; not_held: for a client this gateway does not hold, dropped unanswered; queue_full: the connection's queue of 256 was full).",
    ),
    (
        "aip_gateway_peer_device_info_requests_total",
        Kind::Counter,
        "Device-info requests sent to the gateways holding devices, one per bus message, by `form` (single: one device; batch: the requests that gathered while one was on its way).",
    ),
    (
        "aip_gateway_peer_device_info_devices_total",
        Kind::Counter,
        "Devices named in those requests (divided by the requests: devices per bus message).",
    ),
    (
        "aip_gateway_registry_write_requests_total",
        Kind::Counter,
        "Registrations and unregistrations sent to the registry, one per bus request, by `form` (single: one write on its own subject; batch: the writes that gathered while one was on its way, on `registry.write`).",
    ),
    (
        "aip_gateway_registry_writes_total",
        Kind::Counter,
        "Writes carried by those requests (divided by the requests: writes per bus request).",
    ),
    (
        "aip_gateway_connection_end_events_total",
        Kind::Counter,
        "Events reporting the ends of registered connections to the session service, one per frames-stream message (a `closed` event, or a `closed_many` with the ends that gathered while one was on its way).",
    ),
    (
        "aip_gateway_connection_ends_total",
        Kind::Counter,
        "Ends of registered connections carried by those events (divided by the events: ends per stream message).",
    ),
    (
        "aip_gateway_connection_ends_unannounced_total",
        Kind::Counter,
        "Ends of registered connections not announced to the session service: the connection sent it no frame and none was queued for it.",
    ),
    (
        "aip_gateway_connection_ends_found_total",
        Kind::Counter,
        "Ends announced because a frame came for a connection the gateway no longer holds (its end had not been announced, or not yet).",
    ),
    (
        "aip_gateway_frame_events_total",
        Kind::Counter,
        "Frames-stream messages carrying client frames for the session service (a `frame` event, or a `frames_many` with the frames that gathered while one was on its way).",
    ),
    (
        "aip_gateway_frames_stored_total",
        Kind::Counter,
        "Client frames carried by those messages (divided by the messages: frames per stream message).",
    ),
    (
        "aip_gateway_reads_paused_total",
        Kind::Counter,
        "Times a connection's reading paused, by `reason` (byte_rate: over `bytes_per_second`).",
    ),
    (
        "aip_gateway_inbound_bytes_in_flight",
        Kind::Gauge,
        "Bytes of client frames read and not yet handled (bounded by `max_inbound_bytes_in_flight`).",
    ),
    (
        "aip_gateway_inbound_budget_waits_total",
        Kind::Counter,
        "Client frames that waited for room in the inbound budget.",
    ),
    (
        "aip_gateway_outbound_bytes_queued",
        Kind::Gauge,
        "Bytes of frames queued for clients and not yet written, all connections together (bounded by `max_outbound_bytes_queued`); set every second.",
    ),
    (
        "aip_gateway_slow_clients_closed_total",
        Kind::Counter,
        "Clients disconnected (1008) for not reading what they are sent, by the `bound` they passed (frames: `outbound_queue`; bytes: `outbound_queue_bytes`; gateway_bytes: `max_outbound_bytes_queued`).",
    ),
    (
        "aip_listener_connections_refused_total",
        Kind::Counter,
        "Sockets closed at accept, over a connection limit, by `reason` (per_address, total); every service's listener.",
    ),
    (
        "aip_registry_registrations_total",
        Kind::Counter,
        "REGISTERs answered, by `outcome` (registered, refused).",
    ),
    (
        "aip_registry_agents_forgotten_total",
        Kind::Counter,
        "Agents deleted after being offline and unseen for `forget_offline_after_ms`.",
    ),
    (
        "aip_registry_group_commit_seconds",
        Kind::Histogram,
        "Time to write one batch of registrations and unregistrations (one transaction, or one by one after a batch failed).",
    ),
    (
        "aip_registry_group_commit_changes",
        Kind::Histogram,
        "Registrations and unregistrations in one group commit.",
    ),
    (
        "aip_sessions_tasks_started_total",
        Kind::Counter,
        "Tasks accepted, by `planner`.",
    ),
    (
        "aip_sessions_tasks_ended_total",
        Kind::Counter,
        "Tasks ended, by `state` and `error_code`.",
    ),
    (
        "aip_sessions_task_duration_seconds",
        Kind::Histogram,
        "From acceptance to the end of a task.",
    ),
    (
        "aip_sessions_live_tasks",
        Kind::Gauge,
        "Tasks not ended, held by the leader.",
    ),
    (
        "aip_sessions_frames_unrouted_total",
        Kind::Counter,
        "Outbox frames not published because the registry knows no connection of their client (they wait in the outbox and are sent again).",
    ),
    (
        "aip_sessions_frames_published_total",
        Kind::Counter,
        "Outbox frames published to their gateways, by `form` (alone: one message each; batched: inside a delivery batch).",
    ),
    (
        "aip_sessions_delivery_batches_total",
        Kind::Counter,
        "Delivery batches published (divide the batched frames by them: frames per message).",
    ),
    (
        "aip_sessions_task_id_lookups_total",
        Kind::Counter,
        "New tasks' ids checked for being taken, by `outcome` (asked: looked up in the database; skipped: the leader's filter has never seen the id).",
    ),
    (
        "aip_sessions_group_commit_seconds",
        Kind::Histogram,
        "Time to write one group of changes.",
    ),
    (
        "aip_sessions_group_commit_changes",
        Kind::Histogram,
        "Task rows and events in one group commit.",
    ),
    (
        "aip_sessions_group_commit_failures_total",
        Kind::Counter,
        "Group commits that failed (the leader gives up its term).",
    ),
    (
        "aip_sessions_planner_requests_total",
        Kind::Counter,
        "Steps asked of planners, by `planner` and `outcome`.",
    ),
    (
        "aip_sessions_planner_request_seconds",
        Kind::Histogram,
        "Time a planner took for one step, by `planner`.",
    ),
    (
        "aip_sessions_clarifications_total",
        Kind::Counter,
        "Questions, by `event` (asked, answered).",
    ),
    (
        "aip_sessions_handoffs_total",
        Kind::Counter,
        "Tasks handed to another agent.",
    ),
    (
        "aip_sessions_callback_attempts_total",
        Kind::Counter,
        "Callback delivery attempts, by the `outcome` they left (delivered, pending, gone, dead).",
    ),
];

fn describe_all() {
    for (name, kind, help) in CATALOGUE {
        match kind {
            Kind::Counter => metrics::describe_counter!(*name, *help),
            Kind::Gauge => metrics::describe_gauge!(*name, *help),
            Kind::Histogram => metrics::describe_histogram!(*name, *help),
        }
    }
}

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process's recorder (once; later calls return the same handle). `None` if
/// another recorder was installed first: then `/metrics` says so.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), DURATION_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_changes".to_owned()), SIZE_BUCKETS)
                });
            let recorder = match builder {
                Ok(builder) => builder.build_recorder(),
                Err(e) => {
                    tracing::error!("metrics are off: {e}");
                    return None;
                }
            };
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    describe_all();
                    Some(handle)
                }
                Err(e) => {
                    tracing::error!("metrics are off: another recorder is installed: {e}");
                    None
                }
            }
        })
        .clone()
}

/// `GET /metrics`: the Prometheus text format.
pub fn routes() -> Router {
    Router::new().route("/metrics", get(render))
}

/// The `GET /metrics` handler, for a router that cannot merge [`routes`].
pub async fn render() -> axum::response::Response {
    match install() {
        Some(handle) => {
            handle.run_upkeep();
            (
                [(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                handle.render(),
            )
                .into_response()
        }
        None => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "metrics are off in this process (see its log)\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut seen = std::collections::HashSet::new();
        for (name, kind, help) in CATALOGUE {
            assert!(seen.insert(*name), "{name} twice");
            assert!(name.starts_with("aip_"), "{name}");
            assert!(!help.is_empty(), "{name} needs help text");
            match kind {
                Kind::Counter => assert!(name.ends_with("_total"), "{name}"),
                Kind::Gauge | Kind::Histogram => assert!(!name.ends_with("_total"), "{name}"),
            }
            // `aip_listener_`: the listener every service (and `aip dev`) shares.
            let service = [
                "aip_gateway_",
                "aip_registry_",
                "aip_sessions_",
                "aip_listener_",
            ];
            assert!(service.iter().any(|s| name.starts_with(s)), "{name}");
        }
    }
}
