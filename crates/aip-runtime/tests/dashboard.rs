//! The Grafana dashboard (`deploy/grafana/aip-dashboard.json`) and the metric catalogue agree:
//! every metric a panel queries exists, and every metric has a panel.

use std::collections::BTreeSet;

use aip_runtime::metrics::{CATALOGUE, Kind};

#[test]
fn the_dashboard_queries_every_metric_and_only_those() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/aip-dashboard.json"
    );
    let text = std::fs::read_to_string(path).expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let expressions: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(!expressions.is_empty());
    let queried: BTreeSet<String> = expressions
        .iter()
        .flat_map(|e| {
            e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|t| t.starts_with("aip_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    // A histogram is queried through its series.
    let series = |name: &str, kind: Kind| -> Vec<String> {
        match kind {
            Kind::Histogram => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{name}{s}"))
                .collect(),
            Kind::Counter | Kind::Gauge => vec![name.to_owned()],
        }
    };
    let known: BTreeSet<String> = CATALOGUE
        .iter()
        .flat_map(|(name, kind, _)| series(name, *kind))
        .collect();
    let unknown: Vec<&String> = queried.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "panels query unknown metrics: {unknown:?}"
    );
    let missing: Vec<&str> = CATALOGUE
        .iter()
        .filter(|(name, kind, _)| !series(name, *kind).iter().any(|s| queried.contains(s)))
        .map(|(name, ..)| *name)
        .collect();
    assert!(missing.is_empty(), "metrics without a panel: {missing:?}");
}
