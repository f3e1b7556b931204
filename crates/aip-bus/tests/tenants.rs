//! Tenants on one NATS server: prefixes that a plain `.`→`_` code confused (`t1.aip` and
//! `t1_aip`) get streams and consumers of their own and never see each other's frames; a
//! stream of the expected name that captures other subjects is refused; stream size caps are
//! set (and reach existing streams), and a full stream refuses new messages while keeping the
//! stored ones. Against the real NATS at `NATS_URL`.

use std::time::Duration;

use aip_bus::{Bus, BusError, Headers, NatsBus, Retention, StreamSpec, names};
use futures::StreamExt;
use proto_schemas::Subjects;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

async fn bus() -> NatsBus {
    NatsBus::connect(&nats_url(), "aip-bus-tenants-test")
        .await
        .expect("NATS at NATS_URL")
}

/// The frames stream as the session service makes it.
fn frames_spec(subjects: &Subjects) -> StreamSpec {
    let mut spec = StreamSpec::new(subjects.frames_stream(), vec![subjects.frames_all()]);
    spec.max_age = Duration::from_secs(60);
    spec.max_bytes = 1 << 20;
    spec.retention = Retention::WorkQueue;
    spec
}

/// Deletes the named streams when dropped, also when the test fails (on a connection of its
/// own: the test's runtime is not running while it is dropped).
struct Cleanup(Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let names = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let bus = bus().await;
                for name in names {
                    let _ = bus.delete_stream(name).await;
                }
            });
        })
        .join();
    }
}

/// Everything one consumer receives within a short while.
async fn drain(bus: &NatsBus, subjects: &Subjects) -> Vec<String> {
    let mut deliveries = bus
        .consume(subjects.frames_stream(), subjects.sessions_consumer(), 64)
        .await
        .expect("consume");
    let mut bodies = Vec::new();
    while let Ok(Some(Ok(delivery))) =
        tokio::time::timeout(Duration::from_millis(700), deliveries.next()).await
    {
        bodies.push(String::from_utf8_lossy(&delivery.message.payload).into_owned());
        delivery.ack().await.expect("ack");
    }
    bodies.sort();
    bodies
}

#[tokio::test]
async fn prefixes_with_dot_and_underscore_keep_their_frames_apart() {
    let bus = bus().await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dotted = Subjects::new(&format!("t{id}.aip")).expect("prefix");
    let underscored = Subjects::new(&format!("t{id}_aip")).expect("prefix");
    assert_ne!(dotted.frames_stream(), underscored.frames_stream());
    let _cleanup = Cleanup(vec![dotted.frames_stream(), underscored.frames_stream()]);
    let js = async_nats::jetstream::new(bus.client().clone());
    for subjects in [&dotted, &underscored] {
        bus.ensure_stream(frames_spec(subjects))
            .await
            .expect("each tenant gets its own stream");
        let mut handle = js
            .get_stream(subjects.frames_stream())
            .await
            .expect("stream");
        assert_eq!(
            handle.info().await.expect("info").config.retention,
            async_nats::jetstream::stream::RetentionPolicy::WorkQueue,
            "a new frames stream is a work queue"
        );
    }
    for (subjects, body) in [
        (&dotted, "dotted-1"),
        (&underscored, "underscored-1"),
        (&dotted, "dotted-2"),
    ] {
        bus.publish_durable(
            subjects.frames("dev1"),
            Headers::new().with(names::MSG_ID, body),
            body.to_owned().into(),
        )
        .await
        .expect("stored");
    }
    assert_eq!(drain(&bus, &dotted).await, ["dotted-1", "dotted-2"]);
    assert_eq!(drain(&bus, &underscored).await, ["underscored-1"]);
}

#[tokio::test]
async fn a_stream_of_our_name_capturing_other_subjects_is_refused() {
    let bus = bus().await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let subjects = Subjects::new(&format!("t{id}")).expect("prefix");
    let _cleanup = Cleanup(vec![subjects.frames_stream()]);
    // Someone else's stream under our name (an older layout, another deployment).
    let mut foreign = frames_spec(&subjects);
    foreign.subjects = vec![format!("other{id}.>")];
    bus.ensure_stream(foreign).await.expect("foreign stream");
    let error = bus
        .ensure_stream(frames_spec(&subjects))
        .await
        .expect_err("not ours");
    match &error {
        BusError::StreamConflict {
            stream,
            expected,
            found,
        } => {
            assert_eq!(stream, &subjects.frames_stream());
            assert_eq!(expected, &[subjects.frames_all()]);
            assert_eq!(found, &[format!("other{id}.>")]);
        }
        other => panic!("expected a stream conflict, got {other}"),
    }
    assert!(error.to_string().contains("nats stream rm"), "{error}");
}

#[tokio::test]
async fn streams_get_their_size_cap_and_a_full_one_refuses_new_messages() {
    let bus = bus().await;
    let js = async_nats::jetstream::new(bus.client().clone());
    let id = uuid::Uuid::new_v4().simple().to_string();
    let subjects = Subjects::new(&format!("t{id}")).expect("prefix");
    let stream = subjects.frames_stream();
    let _cleanup = Cleanup(vec![stream.clone()]);

    // An existing stream made without a cap and keeping what was consumed (as before caps
    // and work queues existed) gets the configured cap, and keeps its retention (a server
    // cannot change it in place): starting does not fail on it.
    let mut uncapped = frames_spec(&subjects);
    uncapped.max_bytes = -1;
    uncapped.retention = Retention::Limits;
    bus.ensure_stream(uncapped).await.expect("uncapped");
    let mut capped = frames_spec(&subjects);
    capped.max_bytes = 4096;
    bus.ensure_stream(capped).await.expect("cap applied");
    let mut handle = js.get_stream(&stream).await.expect("stream");
    let config = handle.info().await.expect("info").config.clone();
    assert_eq!(config.max_bytes, 4096);
    assert_eq!(
        config.retention,
        async_nats::jetstream::stream::RetentionPolicy::Limits
    );
    assert_eq!(
        config.discard,
        async_nats::jetstream::stream::DiscardPolicy::New
    );

    let mut stored = 0u64;
    let refusal = loop {
        match bus
            .publish_durable(
                subjects.frames("dev1"),
                Headers::new().with(names::MSG_ID, stored.to_string()),
                vec![b'x'; 500].into(),
            )
            .await
        {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        assert!(
            stored < 100,
            "a 4 KiB stream took {stored} messages of 500 bytes"
        );
    };
    assert!(
        matches!(refusal, BusError::StreamFull { .. }),
        "a full stream is a typed refusal: {refusal}"
    );
    assert!(stored >= 1, "nothing was stored before the cap: {refusal}");
    let messages = handle.info().await.expect("info").state.messages;
    assert_eq!(
        messages, stored,
        "the full stream kept what it had (discard new): {refusal}"
    );
    let first = handle.get_raw_message(1).await.expect("the first is kept");
    assert_eq!(first.payload.len(), 500);
}

#[tokio::test]
async fn the_default_caps_fit_on_this_server() {
    let bus = bus().await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let subjects = Subjects::new(&format!("t{id}")).expect("prefix");
    let blobs = aip_bus::BlobStore::for_subjects(&subjects);
    let _cleanup = Cleanup(vec![subjects.frames_stream(), subjects.blobs_stream()]);
    let defaults = aip_bus::NatsSettings::default();
    let mut frames = StreamSpec::new(subjects.frames_stream(), vec![subjects.frames_all()]);
    frames.max_bytes = defaults.nats_frames_max_bytes;
    bus.ensure_stream(frames)
        .await
        .expect("frames stream with the default cap");
    bus.ensure_stream(blobs.stream_spec(defaults.nats_blobs_max_bytes))
        .await
        .expect("blob stream with the default cap");
}
