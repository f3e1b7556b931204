//! One task, one trace (issue 18): the registry, the session service and two gateways run as
//! their own processes, exporting over OTLP to a receiver inside this test (a real OTLP gRPC
//! endpoint on a free port). A Galaxy-format constellation on gateway A runs a task on a UFO
//! device on gateway B; every span of the task, from every process, is in one trace and
//! parented as the task travelled, also when its frames travel in a delivery batch (a
//! constellation and its device on one gateway). A frame's `metadata.traceparent` joins the
//! client's own trace. The group commit's span links the tasks it wrote.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{Backend, Client, eventually_within, nats_url, test_database};
use common::{Process, free_port};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use serde_json::json;

/// One span as the receiver got it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    links: Vec<String>,
    /// The string attributes.
    attributes: HashMap<String, String>,
}

/// The OTLP trace service: keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut kept = self.spans.lock().expect("lock");
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    AnyValue::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    kept.push(Received {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent: hex(&span.parent_span_id),
                        kind: span.kind,
                        links: span.links.iter().map(|l| hex(&l.trace_id)).collect(),
                        attributes: span
                            .attributes
                            .iter()
                            .filter_map(|a| match a.value.as_ref()?.value.as_ref()? {
                                AnyValue::StringValue(v) => Some((a.key.clone(), v.clone())),
                                _ => None,
                            })
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// OTLP span kinds.
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;

/// A binary of the workspace, built beside this test's (`cargo test --workspace` builds them
/// all; alone: `cargo build -p aip-gateway -p aip-registry`).
fn binary(name: &str) -> PathBuf {
    let deps = std::env::current_exe().expect("test path");
    let path = deps
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join(name);
    assert!(
        path.exists(),
        "{} missing: cargo build -p {name}",
        path.display()
    );
    path
}

fn start(program: PathBuf, envs: &[(String, String)]) -> Process {
    let child = Command::new(program)
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env(
            "RUST_LOG",
            std::env::var("AIP_TEST_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start");
    Process(child)
}

async fn ready(url: String) {
    eventually_within(Duration::from_secs(30), &url, || async {
        let response = reqwest::get(&url).await.ok()?;
        response.status().is_success().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test]
async fn one_task_is_one_trace_across_processes() {
    let database = test_database(Backend::NatsPostgres)
        .await
        .expect("database");
    let prefix = aip_testkit::prefix();
    let receiver = Receiver::default();
    let otlp_port = free_port();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve(([127, 0, 0, 1], otlp_port).into());
    let server = tokio::spawn(server);

    let common = vec![
        ("AIP_NATS_URL".to_owned(), nats_url()),
        ("AIP_DATABASE_URL".to_owned(), database.url().to_owned()),
        ("AIP_SUBJECT_PREFIX".to_owned(), prefix.clone()),
        (
            "AIP_NATS_FRAMES_MAX_BYTES".to_owned(),
            aip_testkit::TEST_FRAMES_MAX_BYTES.to_string(),
        ),
        (
            "AIP_NATS_BLOBS_MAX_BYTES".to_owned(),
            aip_testkit::TEST_BLOBS_MAX_BYTES.to_string(),
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            format!("http://127.0.0.1:{otlp_port}"),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ];
    let with = |extra: &[(&str, String)]| {
        let mut envs = common.clone();
        envs.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        envs
    };
    let (registry_port, sessions_port) = (free_port(), free_port());
    let registry = start(
        binary("aip-registry"),
        &with(&[("AIP_REGISTRY__LISTEN", format!("127.0.0.1:{registry_port}"))]),
    );
    ready(format!("http://127.0.0.1:{registry_port}/readyz")).await;
    let sessions = start(
        PathBuf::from(env!("CARGO_BIN_EXE_aip-sessions")),
        &with(&[("AIP_SESSIONS__LISTEN", format!("127.0.0.1:{sessions_port}"))]),
    );
    ready(format!("http://127.0.0.1:{sessions_port}/readyz")).await;
    let mut gateways = Vec::new();
    let mut ws = Vec::new();
    for id in ["gw-a", "gw-b"] {
        let port = free_port();
        gateways.push(start(
            binary("aip-gateway"),
            &with(&[
                ("AIP_GATEWAY__LISTEN", format!("127.0.0.1:{port}")),
                ("AIP_GATEWAY__GATEWAY_ID", id.to_owned()),
            ]),
        ));
        ready(format!("http://127.0.0.1:{port}/readyz")).await;
        ws.push(format!("ws://127.0.0.1:{port}/ws"));
    }

    // A UFO device on gateway B, a Galaxy constellation on gateway A.
    let mut device = Client::registered(&ws[1], device_register("dev", "linux")).await;
    let mut galaxy =
        Client::registered(&ws[0], constellation_register("galaxy@dev", Some("dev"))).await;
    let run = |session: &'static str, traceparent: Option<&'static str>| {
        let mut task = constellation_task(
            "galaxy@dev",
            "dev",
            session,
            session,
            Some(one_step("echo", json!({ "text": "hello" }))),
        );
        if let Some(traceparent) = traceparent {
            task["metadata"]["traceparent"] = json!(traceparent);
        }
        task
    };
    for (session, traceparent) in [
        ("plain", None),
        (
            "joined",
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ),
    ] {
        galaxy.send(&run(session, traceparent)).await.expect("sent");
        let command = device.recv_type("command").await.expect("a command");
        device
            .send(&command_results_for("dev", &command))
            .await
            .expect("answered");
        let end = galaxy.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["status"], "completed", "{end}");
    }
    // A constellation and its device on the same gateway: the frames one group releases for
    // both travel in one delivery batch, and each still continues the task's trace.
    let mut near_device = Client::registered(&ws[0], device_register("dev-a", "linux")).await;
    let mut near =
        Client::registered(&ws[0], constellation_register("near@dev-a", Some("dev-a"))).await;
    let mut task = constellation_task(
        "near@dev-a",
        "dev-a",
        "batched",
        "batched",
        Some(one_step("echo", json!({ "text": "together" }))),
    );
    task["metadata"]["traceparent"] =
        json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    near.send(&task).await.expect("sent");
    let command = near_device.recv_type("command").await.expect("a command");
    near_device
        .send(&command_results_for("dev-a", &command))
        .await
        .expect("answered");
    let end = near.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "completed", "{end}");
    let sessions_base = format!("http://127.0.0.1:{sessions_port}");
    assert!(
        common::metric(&sessions_base, "aip_sessions_delivery_batches_total").await >= 1.0,
        "frames for the same gateway went in a batch"
    );

    let frames = format!("{prefix}.frames.{{client}}");
    let deliver = format!("{prefix}.deliver.{{gateway}}");
    let get_many = format!("{prefix}.registry.get_many");
    // (service, name, kind, parent's (service, name) or none for the root), in the order the
    // task travelled.
    let expected: Vec<(&str, String, i32, Option<usize>)> = vec![
        ("aip-gateway", "receive task".into(), SERVER, None),
        (
            "aip-gateway",
            format!("publish {frames}"),
            PRODUCER,
            Some(0),
        ),
        (
            "aip-sessions",
            format!("process {frames}"),
            CONSUMER,
            Some(1),
        ),
        ("aip-sessions", format!("send {get_many}"), CLIENT, Some(2)),
        (
            "aip-registry",
            format!("process {get_many}"),
            SERVER,
            Some(3),
        ),
        (
            "aip-sessions",
            format!("publish {deliver}"),
            PRODUCER,
            Some(2),
        ),
        (
            "aip-gateway",
            format!("process {deliver}"),
            CONSUMER,
            Some(5),
        ),
        (
            "aip-gateway",
            "receive command_results".into(),
            SERVER,
            Some(6),
        ),
        (
            "aip-gateway",
            format!("publish {frames}"),
            PRODUCER,
            Some(7),
        ),
        (
            "aip-sessions",
            format!("process {frames}"),
            CONSUMER,
            Some(8),
        ),
        (
            "aip-sessions",
            format!("publish {deliver}"),
            PRODUCER,
            Some(9),
        ),
        (
            "aip-gateway",
            format!("process {deliver}"),
            CONSUMER,
            Some(10),
        ),
    ];
    // The second task to the same device: the session service kept the registry's record of
    // its target (`targets.rs`), so its trace has no registry request.
    let registry_spans = [3, 4];
    let kept: Vec<(&str, String, i32, Option<usize>)> = expected
        .iter()
        .enumerate()
        .filter(|(i, _)| !registry_spans.contains(i))
        .map(|(_, (service, name, kind, parent))| {
            let parent = parent.map(|p| p - registry_spans.iter().filter(|r| **r < p).count());
            (*service, name.clone(), *kind, parent)
        })
        .collect();
    // Follows the chain from the root: each expected span is the child of the one named (a
    // span may have several children of one name, e.g. two frames published: tried in turn).
    let chain = |expected: &[(&str, String, i32, Option<usize>)],
                 spans: &[Received],
                 root_parent: &str|
     -> Option<Vec<Received>> {
        fn search(
            expected: &[(&str, String, i32, Option<usize>)],
            spans: &[Received],
            root_parent: &str,
            found: &mut Vec<Received>,
        ) -> bool {
            let Some((service, name, kind, parent)) = expected.get(found.len()) else {
                return true;
            };
            let parent_id = match parent {
                None => root_parent.to_owned(),
                Some(i) => found[*i].span_id.clone(),
            };
            for span in spans.iter().filter(|s| {
                s.service == *service && s.name == *name && s.kind == *kind && s.parent == parent_id
            }) {
                found.push(span.clone());
                if search(expected, spans, root_parent, found) {
                    return true;
                }
                found.pop();
            }
            false
        }
        let mut found = Vec::new();
        search(expected, spans, root_parent, &mut found).then_some(found)
    };

    let plain = eventually_within(
        Duration::from_secs(20),
        "the plain task's trace",
        || async {
            let spans = receiver.spans.lock().expect("lock").clone();
            // The root: a `receive task` span without a parent.
            spans
                .iter()
                .filter(|s| s.name == "receive task" && s.parent.is_empty())
                .find_map(|root| {
                    let same: Vec<Received> = spans
                        .iter()
                        .filter(|s| s.trace_id == root.trace_id)
                        .cloned()
                        .collect();
                    chain(&expected, &same, "")
                })
        },
    )
    .await
    .unwrap_or_else(|e| {
        let spans = receiver.spans.lock().expect("lock").clone();
        panic!("{e}; spans received: {spans:#?}")
    });
    let trace = plain[0].trace_id.clone();
    // Found in Jaeger by the task's session id.
    for i in [0, 2, 6, 7, 9] {
        assert_eq!(
            plain[i]
                .attributes
                .get("aip.session_id")
                .map(String::as_str),
            Some("plain"),
            "{:#?}",
            plain[i]
        );
    }
    assert!(plain.iter().all(|s| s.trace_id == trace), "{plain:#?}");
    let services: std::collections::BTreeSet<&str> =
        plain.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services.into_iter().collect::<Vec<_>>(),
        ["aip-gateway", "aip-registry", "aip-sessions"]
    );
    // The two gateway ends are on different gateways: a task frame on A, the command on B.
    // (Both export as `aip-gateway`; the chain's parenting already crosses them.)

    // A trace a client started, found whole under its root span: the spans of `trace_id`
    // chained as `expected` from the client's span `root`.
    let client_trace =
        |what: &'static str,
         trace_id: &'static str,
         root: &'static str,
         expected: Vec<(&'static str, String, i32, Option<usize>)>| {
            let receiver = receiver.clone();
            let chain = &chain;
            async move {
                let found = eventually_within(Duration::from_secs(20), what, || async {
                    let spans: Vec<Received> = receiver
                        .spans
                        .lock()
                        .expect("lock")
                        .iter()
                        .filter(|s| s.trace_id == trace_id)
                        .cloned()
                        .collect();
                    chain(&expected, &spans, root)
                })
                .await
                .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(found.len(), expected.len());
            }
        };
    // The client's own trace is joined: the gateway's first span is its child.
    client_trace(
        "the joined task's trace",
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        kept.clone(),
    )
    .await;
    // The batched task's trace is whole too (its device is new to the session service, so
    // the registry is asked, as for the first task).
    client_trace(
        "the batched task's trace",
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
        expected.clone(),
    )
    .await;

    // A group commit that wrote the task links its trace.
    let linked = eventually_within(Duration::from_secs(20), "a linked group commit", || async {
        let spans = receiver.spans.lock().expect("lock").clone();
        spans
            .iter()
            .find(|s| s.name == "group commit" && s.links.contains(&trace))
            .cloned()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(linked.service, "aip-sessions");
    assert_ne!(linked.trace_id, trace, "a commit is its own trace, linked");

    let by_service = receiver.spans.lock().expect("lock").iter().fold(
        HashMap::<String, usize>::new(),
        |mut m, s| {
            *m.entry(s.service.clone()).or_default() += 1;
            m
        },
    );
    assert!(by_service.len() >= 3, "{by_service:?}");

    // The processes stop before their database goes.
    drop(gateways);
    drop(sessions);
    drop(registry);
    server.abort();
    database.cleanup().await;
}
