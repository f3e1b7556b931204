//! One read of a large body for every delivery that asks for it while it is read.
//!
//! A task's `task_end` goes to its requester and to its executor as one body in the blob
//! stream (the session service stores it once). When both are on this gateway, both deliveries
//! arrive together, and each read the 90 MiB back from JetStream: twice the time of the
//! gateway and of NATS, on the path of the task's end. Now the first delivery starts the read,
//! those that come while it runs wait for it, and all share the bytes (the sockets write
//! slices of them; nothing is copied). The body is checked to be UTF-8 once, in the read, not
//! by each delivery. A delivery that comes after the read ended reads again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aip_bus::{BLOB_HEADER, BlobStore, BusError, Message, SharedBus};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio_tungstenite::tungstenite::Utf8Bytes;

/// Why a delivery's body cannot be written to its client.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BodyError {
    /// The blob holding it could not be read back.
    #[error(transparent)]
    Bus(Arc<BusError>),
    /// It is not UTF-8, so it cannot go out as a text message.
    #[error("the body is not UTF-8")]
    NotUtf8,
}

/// A read under way, shared by whoever awaits it.
type Read = Shared<BoxFuture<'static, Result<Utf8Bytes, BodyError>>>;

/// The blob reads under way, by reference.
#[derive(Default, Clone)]
pub struct BlobReads {
    reading: Arc<Mutex<HashMap<String, Read>>>,
}

/// `bytes` as text, checked to be UTF-8.
fn text(bytes: bytes::Bytes) -> Result<Utf8Bytes, BodyError> {
    Utf8Bytes::try_from(bytes).map_err(|_| BodyError::NotUtf8)
}

impl BlobReads {
    /// The body of `message` ([`BlobStore::payload_of`]) as text, read and checked once for
    /// every caller that asks while it is read.
    pub async fn payload_of(
        &self,
        bus: &SharedBus,
        blobs: &BlobStore,
        message: &Message,
    ) -> Result<Utf8Bytes, BodyError> {
        let Some(reference) = message.headers.get(BLOB_HEADER) else {
            return text(message.payload.clone());
        };
        // Whoever is left when the others gave up forgets the read (nobody drives it any
        // more). Made before the caller's handle of the read, so dropped after it.
        let forget = Forget {
            reads: self,
            reference,
        };
        let read = {
            let mut reading = self.reading.lock().unwrap_or_else(|p| p.into_inner());
            match reading.get(reference) {
                Some(read) => read.clone(),
                None => {
                    let read = self.read(bus.clone(), blobs.clone(), message.clone(), reference);
                    reading.insert(reference.to_owned(), read.clone());
                    read
                }
            }
        };
        let body = read.await;
        drop(forget);
        body
    }

    /// A read that forgets itself once done.
    fn read(&self, bus: SharedBus, blobs: BlobStore, message: Message, reference: &str) -> Read {
        let reading = self.reading.clone();
        let reference = reference.to_owned();
        async move {
            let body = match blobs.payload_of(bus.as_ref(), &message).await {
                Ok(bytes) => text(bytes),
                Err(e) => Err(BodyError::Bus(Arc::new(e))),
            };
            reading
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&reference);
            body
        }
        .boxed()
        .shared()
    }

    /// Reads under way.
    pub fn under_way(&self) -> usize {
        self.reading.lock().map(|r| r.len()).unwrap_or_default()
    }
}

/// Removes a read nobody awaits any more (all its callers were dropped before it ended).
struct Forget<'a> {
    reads: &'a BlobReads,
    reference: &'a str,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        let mut reading = self.reads.reading.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map's handle left (this caller's own was dropped before this guard).
        if reading
            .get(self.reference)
            .is_some_and(|read| read.strong_count() == Some(1))
        {
            reading.remove(self.reference);
        }
    }
}
