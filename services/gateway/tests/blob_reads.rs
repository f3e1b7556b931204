//! Large bodies read back for several deliveries at once are read once
//! (`aip_gateway::blob_reads`). Against the real NATS at `NATS_URL`, where a read takes
//! round trips, so the second delivery asks while the first one's read is under way.

use std::sync::Arc;

use aip_bus::{BlobStore, NatsBus, SharedBus};
use aip_gateway::blob_reads::{BlobReads, BodyError};
use proto_schemas::Subjects;

#[tokio::test]
async fn deliveries_asking_together_share_one_read_and_it_is_forgotten_after() {
    let nats = NatsBus::connect(&aip_testkit::nats_url(), "aip-gateway-blob-reads")
        .await
        .expect("NATS at NATS_URL");
    let bus: SharedBus = Arc::new(nats);
    let subjects = Subjects::new(&aip_testkit::prefix()).expect("prefix");
    let blobs = BlobStore::for_subjects(&subjects);
    bus.ensure_stream(blobs.stream_spec(64 << 20))
        .await
        .expect("blob stream");
    // Several chunks of a NATS message each.
    let body = aip_testkit::blobs::patterned(3 << 20, 26);
    let message =
        aip_testkit::blobs::stored(bus.as_ref(), &blobs, subjects.blobs(), body.clone()).await;

    let reads = BlobReads::default();
    let (a, b) = tokio::join!(
        reads.payload_of(&bus, &blobs, &message),
        reads.payload_of(&bus, &blobs, &message)
    );
    let (a, b) = (a.expect("read"), b.expect("read"));
    assert_eq!(a.as_bytes(), body);
    assert_eq!(a.as_ptr(), b.as_ptr(), "one read, its bytes shared");
    assert_eq!(reads.under_way(), 0, "a read is forgotten once done");

    // Asked again later: read again.
    let c = reads
        .payload_of(&bus, &blobs, &message)
        .await
        .expect("read");
    assert_eq!(c.as_bytes(), body);
    assert_ne!(c.as_ptr(), a.as_ptr(), "a new read");

    // A delivery that gives up while its read is under way leaves nothing behind.
    {
        let mut started = Box::pin(reads.payload_of(&bus, &blobs, &message));
        assert!(futures::poll!(started.as_mut()).is_pending());
        assert_eq!(reads.under_way(), 1);
    }
    assert_eq!(reads.under_way(), 0, "an abandoned read is forgotten");

    // A body that is not UTF-8 cannot be written as text: refused, for every delivery of it.
    let garbled = bytes::Bytes::from(vec![0xFF_u8; 3 << 20]);
    let message = aip_testkit::blobs::stored(bus.as_ref(), &blobs, subjects.blobs(), garbled).await;
    let (a, b) = tokio::join!(
        reads.payload_of(&bus, &blobs, &message),
        reads.payload_of(&bus, &blobs, &message)
    );
    assert!(matches!(a, Err(BodyError::NotUtf8)), "{a:?}");
    assert!(matches!(b, Err(BodyError::NotUtf8)), "{b:?}");

    bus.delete_stream(blobs.stream.clone())
        .await
        .expect("blob stream deleted");
}
