//! Blobs on a NATS server whose `max_payload` is raised to 8 MiB, as `deploy/nats/` allows:
//! chunks are then 8 MiB each. A throwaway nats-server runs with that limit and its default
//! `max_pending` (64 MiB); a 90 MiB body is stored, then read back by three readers at once,
//! as a gateway delivering a large `task_end` and a session service reading a large result do.
//! Every reader gets the body whole, and the server never cuts the connection off as a slow
//! consumer (asking for 8 chunks of 8 MiB per read did: the reads then waited for timeouts
//! and a reconnection, about 30 s for one 90 MiB result).

use std::sync::Arc;
use std::time::Duration;

use aip_bus::{BlobStore, Bus, NatsBus};
use aip_testkit::OwnNatsServer;
use proto_schemas::Subjects;

#[tokio::test]
async fn a_large_blob_in_8_mib_chunks_is_read_by_several_readers_without_a_slow_consumer() {
    let server = OwnNatsServer::start("large-chunks", "max_payload: 8MB", |_| {}, &[]).await;
    let bus: Arc<dyn Bus> = Arc::new(
        NatsBus::connect(&server.url, "aip-bus-large-chunks")
            .await
            .expect("connect"),
    );
    assert_eq!(bus.max_payload(), 8 << 20, "the server's raised limit");
    let subjects = Subjects::new(&format!("t{}", uuid::Uuid::new_v4().simple())).expect("prefix");
    let blobs = BlobStore::for_subjects(&subjects);
    bus.ensure_stream(blobs.stream_spec(-1))
        .await
        .expect("blob stream");

    // 90 MiB that is not one byte repeated, so a chunk out of place would show.
    let body = aip_testkit::blobs::patterned(90 << 20, 251);
    let message =
        aip_testkit::blobs::stored(bus.as_ref(), &blobs, subjects.frames_all(), body.clone()).await;

    let readers = (0..3).map(|_| {
        let bus = bus.clone();
        let blobs = blobs.clone();
        let message = message.clone();
        tokio::spawn(async move {
            // A bound so that a stalled read fails the test instead of hanging it.
            tokio::time::timeout(
                Duration::from_secs(120),
                blobs.payload_of(bus.as_ref(), &message),
            )
            .await
        })
    });
    for read in futures::future::join_all(readers).await {
        let read = read
            .expect("reader task")
            .expect("read within 120 s")
            .expect("read back");
        assert!(read == body, "the body comes back whole and in order");
    }
    let log = server.log_text();
    assert!(
        !log.contains("Slow Consumer"),
        "the server cut the reader off as a slow consumer:\n{log}"
    );
}
