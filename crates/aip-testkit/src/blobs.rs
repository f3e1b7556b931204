//! Large bodies in a blob stream, for tests of how they are read back.

use aip_bus::{BLOB_HEADER, BlobStore, Bus, Headers, Message};
use bytes::Bytes;

/// `len` bytes counting up modulo `period`: not one byte repeated, so a chunk read back out
/// of place, or a byte lost, shows.
pub fn patterned(len: usize, period: u8) -> Bytes {
    (0..len)
        .map(|i| (i % usize::from(period)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

/// Stores `body` in `blobs` and returns a message on `subject` that refers to it, as a large
/// frame travels. Panics if the store fails or if `body` is small enough to travel inline.
pub async fn stored(bus: &dyn Bus, blobs: &BlobStore, subject: String, body: Bytes) -> Message {
    let reference = blobs
        .put(bus, body)
        .await
        .expect("stored")
        .expect("a body this large travels as a blob");
    Message {
        subject,
        reply: None,
        headers: Headers::new().with(BLOB_HEADER, reference),
        payload: Bytes::new(),
    }
}
