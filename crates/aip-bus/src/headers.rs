//! Message headers.

/// Header names used across aip.
pub mod names {
    /// W3C trace context, so one task is one trace across services.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace state.
    pub const TRACESTATE: &str = "tracestate";
    /// JetStream de-duplication id.
    pub const MSG_ID: &str = "Nats-Msg-Id";
    /// An [`proto_schemas::ErrorCode`] on error replies.
    pub const ERROR_CODE: &str = "Aip-Error-Code";
    /// A control instruction on a delivery subject (`disconnect`, or [`DEVICE_INFO`]); on the
    /// answer to a device-info request, [`NOT_HELD`].
    pub const CONTROL: &str = "Aip-Control";
    /// On a gateway's delivery subject: the client a message is for (the gateway writes it to
    /// that client's connection, or asks about that device).
    pub const CLIENT: &str = "Aip-Client";
    /// [`CONTROL`] of the answer to a [`DEVICE_INFO`] request from a gateway that does not hold
    /// the device: the asker asks the registry.
    pub const NOT_HELD: &str = "not-held";
    /// [`CONTROL`] of a request on a gateway's delivery subject about the device named in
    /// [`CLIENT`]: the gateway holding the device answers with the system information it
    /// registered with (the JSON as the payload), or with [`ERROR_CODE`] `DEVICE_NOT_FOUND`
    /// and the reason as the payload; a gateway not holding it, with [`NOT_HELD`]. Nothing
    /// reaches the device.
    pub const DEVICE_INFO: &str = "device-info";
    /// [`CONTROL`] of the answer to a [`DEVICE_INFO`] request that named several devices in a
    /// `DeviceInfoRequest` payload: a `DeviceInfoReply` with an answer per device. An answer
    /// without it is for the device in [`CLIENT`] alone (a gateway of an earlier version).
    pub const DEVICE_INFO_BATCH: &str = "device-info-batch";
    /// [`CONTROL`] of a message on a gateway's delivery subject whose payload is a
    /// `DeliveryBatch`: frames for several of its clients, each handled as the message it
    /// stands for.
    pub const BATCH: &str = "batch";
    /// The connection a control instruction is about; on a frame for a client, the one
    /// connection of it that may receive the frame (another connection drops it).
    pub const CONNECTION: &str = "Aip-Connection";
    /// On a frame for a client: the subject its gateway answers once the frame is written to
    /// the client's socket (the frame's `Nats-Msg-Id` as the payload). The sender keeps the
    /// frame until then and sends it again otherwise.
    pub const ACK: &str = "Aip-Ack";
    /// On a frame for a client from the session service: what the session service reads in
    /// the frames stream beyond one event per message ([`FRAMES_MANY`]). A gateway gathers
    /// its clients' frames only while the frames it is sent say so, so a session service of
    /// an earlier version is never sent an event it cannot read.
    pub const READS: &str = "Aip-Reads";
    /// [`READS`] of a session service that reads `frames_many` events.
    pub const FRAMES_MANY: &str = "frames-many";
}

/// An ordered list of header name/value pairs (names compared case-sensitively, like NATS).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// Adds a header, replacing an earlier one of the same name.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        let name = name.into();
        self.0.retain(|(n, _)| *n != name);
        self.0.push((name, value.into()));
        self
    }

    /// Builder form of [`Headers::insert`].
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.insert(name, value);
        self
    }

    /// The value of a header.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// All pairs, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    pub(crate) fn to_nats(&self) -> async_nats::HeaderMap {
        let mut map = async_nats::HeaderMap::new();
        for (n, v) in &self.0 {
            map.insert(n.as_str(), v.as_str());
        }
        map
    }

    pub(crate) fn from_nats(map: Option<&async_nats::HeaderMap>) -> Self {
        let mut headers = Headers::new();
        if let Some(map) = map {
            for (name, values) in map.iter() {
                if let Some(v) = values.first() {
                    headers.0.push((name.to_string(), v.as_str().to_owned()));
                }
            }
        }
        headers
    }
}
