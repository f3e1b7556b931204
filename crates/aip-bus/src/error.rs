//! Errors of the bus.

/// Why a bus operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Nobody is subscribed to the request's subject: the service is not running.
    #[error("no service answers on `{subject}`: is the service that handles it running?")]
    NoResponders {
        /// The request subject.
        subject: String,
    },
    /// A responder exists but did not answer in time.
    #[error("no answer on `{subject}` within {timeout:?}: the service is overloaded or stuck")]
    Timeout {
        /// The request subject.
        subject: String,
        /// How long we waited.
        timeout: std::time::Duration,
    },
    /// The payload is larger than the bus carries.
    #[error("payload of {size} bytes exceeds the bus limit of {limit} bytes")]
    PayloadTooLarge {
        /// The payload's size.
        size: usize,
        limit: usize,
    },
    /// Replying to a message that is not a request.
    #[error("message on `{subject}` has no reply subject")]
    NoReplySubject {
        /// The message's subject.
        subject: String,
    },
    /// The connection to the bus failed.
    #[error("cannot connect to NATS at {url}: {source}; is nats-server running (with -js)?")]
    Connect {
        /// The server URL, its password hidden ([`crate::redact_url`]).
        url: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No durable stream captures the subject (the service that creates it has not started).
    #[error(
        "no durable stream captures `{subject}`: start the service that creates it (aip-sessions)"
    )]
    NoStream { subject: String },
    /// The NATS credentials or TLS settings cannot work (a file missing, two kinds of
    /// credentials at once).
    #[error("invalid NATS settings: {0}")]
    Access(#[from] crate::NatsSettingsError),
    /// An `Aip-Blob` reference that is not one of this deployment's blobs, or does not add
    /// up: refused before anything is reserved for it.
    #[error("refused blob reference on `{subject}`: {problem}")]
    BadBlobRef {
        /// The subject of the message carrying it.
        subject: String,
        /// What is wrong with it.
        problem: crate::BlobRefProblem,
    },
    /// The stream refused to store the message: it is full (its `max_bytes` cap, or the
    /// server's storage). Stored messages are kept; trying again helps only once the stream
    /// has room (messages age out or are consumed).
    #[error("the stream capturing `{subject}` is full and refused the message")]
    StreamFull {
        /// The subject published to.
        subject: String,
    },
    /// A stream of the expected name exists and captures other subjects: it belongs to
    /// something else (another deployment, an older layout), and using it would mix their
    /// messages with ours.
    #[error(
        "stream {stream} exists and captures {found:?}, not {expected:?}: it belongs to another \
         deployment or an older version; delete it (nats stream rm {stream}) or choose another \
         subject prefix"
    )]
    StreamConflict {
        /// The stream's name.
        stream: String,
        /// The subjects we need it to capture.
        expected: Vec<String>,
        /// The subjects it captures.
        found: Vec<String>,
    },
    /// The bus has been shut down.
    #[error("the bus is closed")]
    Closed,
    /// Any other failure from the NATS client.
    #[error("NATS {operation} on `{subject}` failed: {source}")]
    Nats {
        /// What we tried.
        operation: &'static str,
        /// The subject involved.
        subject: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A header or body the bus itself writes could not be encoded.
    #[error("cannot encode {what}: {source}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        source: serde_json::Error,
    },
}
