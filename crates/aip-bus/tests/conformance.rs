//! One behaviour, two buses: the same checks run against a real NATS server (`NATS_URL`,
//! default `nats://127.0.0.1:4222`) and the in-process bus, so the embedded mode cannot drift
//! from the distributed one. Each test uses its own random subject prefix.

use std::sync::Arc;
use std::time::Duration;

use aip_bus::{Bus, BusError, Headers, LocalBus, NatsBus, SharedBus, names, respond};
use aip_testkit::within;
use futures::StreamExt;

const WAIT: Duration = Duration::from_secs(5);

async fn nats() -> SharedBus {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    Arc::new(
        NatsBus::connect(&url, "aip-bus-tests")
            .await
            .expect("NATS must be running (scripts/ensure-services.sh)"),
    )
}

fn local() -> SharedBus {
    Arc::new(LocalBus::new())
}

fn prefix() -> String {
    format!("t_{}", uuid::Uuid::new_v4().simple())
}

macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[tokio::test]
            async fn nats() {
                super::$name(super::nats().await).await;
            }
            #[tokio::test]
            async fn local() {
                super::$name(super::local()).await;
            }
        }
    };
}

async fn publish_subscribe_with_headers_and_wildcards(bus: SharedBus) {
    let p = prefix();
    let mut exact = bus.subscribe(format!("{p}.a.b")).await.expect("subscribe");
    let mut star = bus.subscribe(format!("{p}.a.*")).await.expect("subscribe");
    let mut tail = bus.subscribe(format!("{p}.>")).await.expect("subscribe");
    bus.flush().await.expect("flush");
    let headers = Headers::new()
        .with(
            names::TRACEPARENT,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .with(names::MSG_ID, "m-1");
    bus.publish(format!("{p}.a.b"), headers.clone(), "hello".into())
        .await
        .expect("publish");
    for sub in [&mut exact, &mut star, &mut tail] {
        let m = within(WAIT, "the message", sub.next())
            .await
            .expect("a message");
        assert_eq!(m.subject, format!("{p}.a.b"));
        assert_eq!(&m.payload[..], b"hello");
        assert_eq!(
            m.headers.get(names::TRACEPARENT),
            headers.get(names::TRACEPARENT)
        );
        assert_eq!(m.headers.get(names::MSG_ID), Some("m-1"));
    }
    bus.publish(format!("{p}.a.b.c"), Headers::new(), "deep".into())
        .await
        .expect("publish");
    let m = within(WAIT, "the deep message", tail.next())
        .await
        .expect("a message");
    assert_eq!(&m.payload[..], b"deep");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), star.next())
            .await
            .is_err(),
        "`*` matches one token only"
    );
}
both!(publish_subscribe_with_headers_and_wildcards);

async fn request_reply_and_its_errors(bus: SharedBus) {
    let p = prefix();
    let err = bus
        .request(format!("{p}.nobody"), Headers::new(), "x".into(), WAIT)
        .await
        .expect_err("no responders");
    assert!(matches!(err, BusError::NoResponders { .. }), "{err:?}");

    let mut service = bus
        .queue_subscribe(format!("{p}.echo"), "svc".into())
        .await
        .expect("subscribe");
    let mut silent = bus
        .subscribe(format!("{p}.silent"))
        .await
        .expect("subscribe");
    bus.flush().await.expect("flush");
    let responder = {
        let bus = bus.clone();
        tokio::spawn(async move {
            while let Some(m) = service.next().await {
                let mut body = m.payload.to_vec();
                body.reverse();
                respond(
                    bus.as_ref(),
                    &m,
                    Headers::new().with(names::ERROR_CODE, "NONE"),
                    body.into(),
                )
                .await
                .expect("respond");
            }
        })
    };
    let reply = bus
        .request(format!("{p}.echo"), Headers::new(), "abc".into(), WAIT)
        .await
        .expect("reply");
    assert_eq!(&reply.payload[..], b"cba");
    assert_eq!(reply.headers.get(names::ERROR_CODE), Some("NONE"));

    let err = bus
        .request(
            format!("{p}.silent"),
            Headers::new(),
            "x".into(),
            Duration::from_millis(300),
        )
        .await
        .expect_err("timeout");
    assert!(matches!(err, BusError::Timeout { .. }), "{err:?}");
    assert!(
        within(WAIT, "the request at the silent responder", silent.next())
            .await
            .is_some(),
        "the silent responder got the request"
    );
    responder.abort();
}
both!(request_reply_and_its_errors);

async fn queue_group_delivers_each_message_once(bus: SharedBus) {
    let p = prefix();
    let mut a = bus
        .queue_subscribe(format!("{p}.work"), "workers".into())
        .await
        .expect("subscribe");
    let mut b = bus
        .queue_subscribe(format!("{p}.work"), "workers".into())
        .await
        .expect("subscribe");
    bus.flush().await.expect("flush");
    for i in 0..100 {
        bus.publish(format!("{p}.work"), Headers::new(), format!("{i}").into())
            .await
            .expect("publish");
    }
    bus.flush().await.expect("flush");
    let mut seen = Vec::new();
    while seen.len() < 100 {
        let m = tokio::select! {
            Some(m) = a.next() => m,
            Some(m) = b.next() => m,
            () = tokio::time::sleep(WAIT) => panic!("only {} of 100 messages arrived", seen.len()),
        };
        seen.push(String::from_utf8(m.payload.to_vec()).expect("utf8"));
    }
    seen.sort_by_key(|s| s.parse::<u32>().unwrap_or(0));
    seen.dedup();
    assert_eq!(
        seen.len(),
        100,
        "every message exactly once across the group"
    );
}
both!(queue_group_delivers_each_message_once);

async fn dropping_a_subscription_unsubscribes(bus: SharedBus) {
    let p = prefix();
    let sub = bus.subscribe(format!("{p}.x")).await.expect("subscribe");
    bus.flush().await.expect("flush");
    drop(sub);
    // Give the NATS client a moment to send UNSUB, then a request must find nobody.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match bus
            .request(
                format!("{p}.x"),
                Headers::new(),
                "x".into(),
                Duration::from_millis(200),
            )
            .await
        {
            Err(BusError::NoResponders { .. }) => break,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "still subscribed: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}
both!(dropping_a_subscription_unsubscribes);

#[tokio::test]
async fn local_bus_bounds_each_subscriber_queue() {
    let bus = LocalBus::with_limits(4, 1024);
    let mut sub = bus.subscribe("q".into()).await.expect("subscribe");
    for i in 0..10 {
        bus.publish("q".into(), Headers::new(), format!("{i}").into())
            .await
            .expect("publish");
    }
    let mut got = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
        got.push(m.payload);
    }
    assert_eq!(got.len(), 4, "a slow subscriber keeps at most its bound");
    assert_eq!(bus.max_payload(), 1024);
}

#[tokio::test]
async fn nats_refuses_payloads_over_its_limit() {
    let bus = nats().await;
    let limit = bus.max_payload();
    let err = bus
        .publish(
            format!("{}.big", prefix()),
            Headers::new(),
            vec![0u8; limit + 1].into(),
        )
        .await
        .expect_err("too large");
    assert!(matches!(err, BusError::PayloadTooLarge { .. }), "{err:?}");
    // A request too: refused before it is sent, with the sizes (the caller can tell it from
    // a failing server, and send less).
    let err = bus
        .request(
            format!("{}.big", prefix()),
            Headers::new(),
            vec![0u8; limit + 1].into(),
            Duration::from_secs(1),
        )
        .await
        .expect_err("too large");
    assert!(matches!(err, BusError::PayloadTooLarge { .. }), "{err:?}");
}

/// Stores `(message id, body)` pairs on `subject`, in order.
async fn store(bus: &SharedBus, subject: &str, messages: &[(&str, &str)]) {
    for (id, body) in messages {
        bus.publish_durable(
            subject.to_owned(),
            Headers::new().with(names::MSG_ID, *id),
            body.to_string().into(),
        )
        .await
        .expect("stored");
    }
}

async fn durable_streams_deduplicate_and_redeliver(bus: SharedBus) {
    use aip_bus::{StreamSpec, stream_name};
    let p = prefix();
    let stream = stream_name(&p, "frames");
    let err = bus
        .publish_durable(format!("{p}.frames.a"), Headers::new(), "x".into())
        .await
        .expect_err("no stream yet");
    assert!(matches!(err, BusError::NoStream { .. }), "{err:?}");

    let mut spec = StreamSpec::new(stream.clone(), vec![format!("{p}.frames.>")]);
    spec.max_age = Duration::from_secs(60);
    bus.ensure_stream(spec.clone())
        .await
        .expect("create stream");
    bus.ensure_stream(spec)
        .await
        .expect("creating it again keeps it");
    store(
        &bus,
        &format!("{p}.frames.a"),
        &[("m1", "one"), ("m1", "one again"), ("m2", "two")],
    )
    .await;
    let mut deliveries = bus
        .consume(stream.clone(), "sessions".into(), 16)
        .await
        .expect("consume");
    let first = next_delivery(&mut deliveries).await;
    assert_eq!(&first.message.payload[..], b"one");
    assert_eq!(first.delivered, 1);
    first.nak(Duration::from_millis(50)).await.expect("nak");
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let d = next_delivery(&mut deliveries).await;
        bodies.push((
            String::from_utf8(d.message.payload.to_vec()).expect("utf8"),
            d.delivered,
        ));
        d.ack().await.expect("ack");
    }
    bodies.sort();
    assert_eq!(
        bodies,
        [("one".to_owned(), 2), ("two".to_owned(), 1)],
        "the duplicate m1 was dropped; the nak'd one came back"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), deliveries.next())
            .await
            .is_err(),
        "acked messages are not delivered again"
    );
    bus.delete_stream(stream).await.expect("delete stream");
}
both!(durable_streams_deduplicate_and_redeliver);

async fn next_delivery(d: &mut aip_bus::DurableSubscription) -> aip_bus::Delivery {
    within(WAIT, "a delivery", d.next())
        .await
        .expect("open")
        .expect("delivery")
}

/// A fresh frames stream (a prefix of its own, a minute's age limit) with `retention`: its
/// prefix and name.
async fn fresh_frames_stream(bus: &SharedBus, retention: aip_bus::Retention) -> (String, String) {
    let p = prefix();
    let stream = aip_bus::stream_name(&p, "frames");
    let mut spec = aip_bus::StreamSpec::new(stream.clone(), vec![format!("{p}.frames.>")]);
    spec.max_age = Duration::from_secs(60);
    spec.retention = retention;
    bus.ensure_stream(spec).await.expect("create stream");
    (p, stream)
}

/// A consumer that died holding messages (a leader killed or frozen) strands them until the
/// ack wait (10 s) passes; `release_pending` makes them deliverable at once, and leaves a
/// consumer that holds nothing alone. On a work queue (the frames stream) and on a stream that
/// keeps what was consumed (one an older version made).
#[tokio::test]
async fn nats_releases_the_messages_a_dead_consumer_held() {
    releases_held_messages(aip_bus::Retention::WorkQueue).await;
    releases_held_messages(aip_bus::Retention::Limits).await;
}

async fn releases_held_messages(retention: aip_bus::Retention) {
    let bus = nats().await;
    let (p, stream) = fresh_frames_stream(&bus, retention).await;
    let released = bus
        .release_pending(stream.clone(), "sessions".into())
        .await
        .expect("no consumer yet");
    assert_eq!(released, 0);
    store(
        &bus,
        &format!("{p}.frames.a"),
        &[("m1", "one"), ("m2", "two"), ("m3", "three")],
    )
    .await;

    // The first leader acks "one", takes "two" and "three", and dies without acking them.
    let mut dead = bus
        .consume(stream.clone(), "sessions".into(), 16)
        .await
        .expect("consume");
    next_delivery(&mut dead).await.ack().await.expect("ack");
    let held = [
        next_delivery(&mut dead).await,
        next_delivery(&mut dead).await,
    ];
    drop(dead);
    std::mem::forget(held);
    let counted = aip_testkit::eventually_within(Duration::from_secs(3), "ack counted", || {
        let stream = stream.clone();
        async move { (ack_pending(&stream, "sessions").await == 2).then_some(()) }
    })
    .await;
    assert!(counted.is_ok(), "{retention:?}: the first ack counted");

    let released = bus
        .release_pending(stream.clone(), "sessions".into())
        .await
        .expect("released");
    assert_eq!(released, 2, "the two held messages");
    let mut next = bus
        .consume(stream.clone(), "sessions".into(), 16)
        .await
        .expect("consume again");
    let mut bodies = Vec::new();
    for _ in 0..2 {
        // Well within the 10 s ack wait.
        let d = within(Duration::from_secs(3), "a released message", next.next())
            .await
            .expect("open")
            .expect("delivery");
        bodies.push(String::from_utf8(d.message.payload.to_vec()).expect("utf8"));
        d.ack().await.expect("ack");
    }
    bodies.sort();
    assert_eq!(
        bodies,
        ["three", "two"],
        "{retention:?}: the acked one does not come back"
    );
    // An ack is a message the server counts a moment later: wait until it has.
    let counted = aip_testkit::eventually_within(Duration::from_secs(3), "acks counted", || {
        let stream = stream.clone();
        async move { (ack_pending(&stream, "sessions").await == 0).then_some(()) }
    })
    .await;
    assert!(counted.is_ok(), "{retention:?}: the two acks counted");
    assert_eq!(
        bus.release_pending(stream.clone(), "sessions".into())
            .await
            .expect("nothing held"),
        0
    );
    bus.delete_stream(stream).await.expect("delete stream");
}

/// Five frames; the consumer acks three, holds the fourth and acks the fifth. What the stream
/// holds afterwards (waiting for the server to count the acks), and the held one handed back.
async fn acks_three_holds_one(
    bus: &SharedBus,
    stream: &str,
    subject: &str,
) -> (aip_bus::DurableSubscription, aip_bus::Delivery) {
    store(
        bus,
        subject,
        &[
            ("m1", "m1"),
            ("m2", "m2"),
            ("m3", "m3"),
            ("m4", "m4"),
            ("m5", "m5"),
        ],
    )
    .await;
    let mut consumer = bus
        .consume(stream.to_owned(), "sessions".into(), 16)
        .await
        .expect("consume");
    for _ in 0..3 {
        next_delivery(&mut consumer).await.ack().await.expect("ack");
    }
    let held = next_delivery(&mut consumer).await;
    assert_eq!(&held.message.payload[..], b"m4");
    next_delivery(&mut consumer).await.ack().await.expect("ack");
    (consumer, held)
}

/// Waits until the stream holds `count` messages.
async fn holds(stream: &str, count: u64, what: &str) {
    let reached = aip_testkit::eventually_within(Duration::from_secs(3), what, || async {
        (stored(stream).await == count).then_some(())
    })
    .await;
    assert!(
        reached.is_ok(),
        "{what}: the stream holds {}",
        stored(stream).await
    );
}

/// The held frame, handed back, comes again (and nothing else does).
async fn comes_again(consumer: &mut aip_bus::DurableSubscription, held: aip_bus::Delivery) {
    held.nak(Duration::from_millis(50)).await.expect("nak");
    let again = within(
        Duration::from_secs(3),
        "the held frame again",
        consumer.next(),
    )
    .await
    .expect("open")
    .expect("delivery");
    assert_eq!(&again.message.payload[..], b"m4");
    assert_eq!(again.delivered, 2);
    again.ack().await.expect("ack");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), consumer.next())
            .await
            .is_err(),
        "nothing else comes again"
    );
}

/// The frames stream is a work queue: what its consumer acknowledges leaves it at once, so it
/// never fills with consumed frames; a frame held and handed back comes again; there is
/// nothing to trim.
#[tokio::test]
async fn nats_a_work_queue_drops_what_its_consumer_acknowledged() {
    use aip_bus::{Retention, Trimmed};
    let bus = nats().await;
    let (p, stream) = fresh_frames_stream(&bus, Retention::WorkQueue).await;
    let (mut consumer, held) = acks_three_holds_one(&bus, &stream, &format!("{p}.frames.a")).await;
    holds(&stream, 1, "only the held frame stays").await;
    assert_eq!(
        bus.trim_acknowledged(stream.clone(), "sessions".into())
            .await
            .expect("trim"),
        Trimmed::ByItself
    );
    comes_again(&mut consumer, held).await;
    holds(&stream, 0, "the queue is empty").await;
    bus.delete_stream(stream).await.expect("delete stream");
}

/// A stream made by an older version keeps what was consumed and would fill to its cap, then
/// refuse every new message: `trim_acknowledged` removes what the consumer acknowledged, up
/// to its ack floor, and leaves a message it holds (and everything after it) in place, which
/// handed back comes again. A server that would forget the held one when purging (nats-server
/// before 2.9.15: a nak after any purge was ignored, and the frame never came again) is not
/// trimmed at all.
#[tokio::test]
async fn nats_trims_a_stream_that_keeps_what_was_consumed_only_where_that_loses_nothing() {
    use aip_bus::{Retention, Trimmed};
    let bus = nats().await;
    let (p, stream) = fresh_frames_stream(&bus, Retention::Limits).await;
    assert_eq!(
        bus.trim_acknowledged(stream.clone(), "sessions".into())
            .await
            .expect("no consumer yet"),
        Trimmed::Removed(0)
    );
    let (mut consumer, held) = acks_three_holds_one(&bus, &stream, &format!("{p}.frames.a")).await;
    let version = server_version().await;
    let trimmed = |stream: String| {
        let bus = bus.clone();
        async move {
            // The acks reach the server a moment after they are sent.
            let removed = std::sync::atomic::AtomicU64::new(0);
            let reached = aip_testkit::eventually_within(
                Duration::from_secs(3),
                "the three before the held one",
                || async {
                    let now = match bus
                        .trim_acknowledged(stream.clone(), "sessions".into())
                        .await
                        .expect("trimmed")
                    {
                        Trimmed::Removed(n) => n,
                        other => panic!("{other:?}"),
                    };
                    let total = removed.fetch_add(now, std::sync::atomic::Ordering::Relaxed) + now;
                    (total >= 3).then_some(total)
                },
            )
            .await;
            assert_eq!(reached.ok(), Some(3));
        }
    };
    if old_purge(&version) {
        assert_eq!(
            bus.trim_acknowledged(stream.clone(), "sessions".into())
                .await
                .expect("trim"),
            Trimmed::Unsafe {
                server_version: version.clone()
            }
        );
        assert_eq!(stored(&stream).await, 5, "nothing removed on {version}");
    } else {
        trimmed(stream.clone()).await;
        assert_eq!(
            stored(&stream).await,
            2,
            "the held one and the one after it"
        );
    }
    comes_again(&mut consumer, held).await;
    bus.delete_stream(stream).await.expect("delete stream");
}

/// The version of the NATS server the tests use.
async fn server_version() -> String {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(url).await.expect("NATS");
    client.server_info().version
}

/// Whether `version` is a nats-server from before 2.9.15 (purges forget deliveries).
fn old_purge(version: &str) -> bool {
    let parts: Vec<u64> = version
        .split(['.', '-'])
        .take(3)
        .map(|p| p.parse().expect("a numeric version"))
        .collect();
    parts.as_slice() < [2, 9, 15].as_slice()
}

/// How many messages a stream holds, as the NATS server reports it.
async fn stored(stream: &str) -> u64 {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(url).await.expect("NATS");
    let mut handle = async_nats::jetstream::new(client)
        .get_stream(stream)
        .await
        .expect("the stream");
    handle.info().await.expect("stream info").state.messages
}

/// How many messages the server counts as delivered to `consumer` and not yet acknowledged.
async fn ack_pending(stream: &str, consumer: &str) -> usize {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(url).await.expect("NATS");
    let handle = async_nats::jetstream::new(client)
        .get_stream(stream)
        .await
        .expect("the stream");
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        handle.get_consumer(consumer).await.expect("the consumer");
    consumer
        .info()
        .await
        .expect("consumer info")
        .num_ack_pending
}

#[tokio::test]
async fn the_local_bus_has_nothing_to_trim() {
    let bus = local();
    assert_eq!(
        bus.trim_acknowledged("any".into(), "sessions".into())
            .await
            .expect("nothing to do"),
        aip_bus::Trimmed::ByItself
    );
}
