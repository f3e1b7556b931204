//! The NATS subject catalogue.
//!
//! Every subject starts with one configurable prefix (default `aip`), so tests and tenants
//! share a NATS server without seeing each other. Ids that come from clients (`client_id`,
//! `session_id`, `task_name`, gateway ids) can contain `.`, `*`, `>`, spaces and anything else,
//! so they are never put into a subject raw: [`encode_token`] turns any string into one safe
//! subject token, and [`decode_token`] turns it back.
//!
//! The subjects themselves, with their payloads, publishers and consumers, are listed in
//! [`CATALOGUE`], from which the AsyncAPI document is generated.

/// The default subject prefix.
pub const DEFAULT_PREFIX: &str = "aip";

/// Escape character of [`encode_token`].
const ESCAPE: u8 = b'~';

/// Encodes any string as one NATS subject token, reversibly.
///
/// Bytes `A-Z a-z 0-9 _ -` stay as they are; every other byte of the UTF-8 form (including the
/// escape character `~`) becomes `~` and two upper-case hex digits. The empty string becomes
/// a lone `~`, which nothing else encodes to. The result is never empty and contains no `.`,
/// `*`, `>`, whitespace or non-ASCII character.
///
/// ```
/// use proto_schemas::subjects::{encode_token, decode_token};
/// assert_eq!(encode_token("pc-1"), "pc-1");
/// assert_eq!(encode_token("task.1@pc 2"), "task~2E1~40pc~202");
/// assert_eq!(decode_token("task~2E1~40pc~202").as_deref(), Some("task.1@pc 2"));
/// ```
pub fn encode_token(id: &str) -> String {
    if id.is_empty() {
        return "~".to_owned();
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(id.len());
    for &b in id.as_bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b as char);
        } else {
            out.push(ESCAPE as char);
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0xF) as usize] as char);
        }
    }
    out
}

/// Decodes a token made by [`encode_token`]; `None` if it is not one (only canonical
/// encodings are accepted, so every id has exactly one token).
pub fn decode_token(token: &str) -> Option<String> {
    if token == "~" {
        return Some(String::new());
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == ESCAPE {
            let hi = hex_digit(*bytes.get(i + 1)?)?;
            let lo = hex_digit(*bytes.get(i + 2)?)?;
            let decoded = (hi << 4) | lo;
            if decoded.is_ascii_alphanumeric() || decoded == b'_' || decoded == b'-' {
                return None; // not canonical: this byte is never escaped
            }
            out.push(decoded);
            i += 3;
        } else if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b);
            i += 1;
        } else {
            return None;
        }
    }
    if out.is_empty() {
        return None;
    }
    String::from_utf8(out).ok()
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Whether `token` is a valid single NATS subject token: non-empty, printable ASCII, without
/// `.`, `*`, `>` or whitespace.
pub fn is_valid_token(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'.' && b != b'*' && b != b'>')
}

/// Why a subject prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid subject prefix `{prefix}`: {reason}")]
pub struct InvalidPrefix {
    /// The refused prefix.
    pub prefix: String,
    /// What is wrong with it.
    pub reason: PrefixProblem,
}

/// What is wrong with a refused subject prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PrefixProblem {
    /// Not dot-separated tokens of the allowed characters.
    #[error(
        "use one or more dot-separated tokens of A-Z a-z 0-9 _ - (for example `aip` or `tenant1.aip`)"
    )]
    Syntax,
    /// A token is the first word of a subject family (`frames`, `deliver`, …): such a prefix
    /// would overlap another deployment's subjects (`aip.frames` lies inside `aip`'s frames
    /// stream).
    #[error(
        "its token `{0}` names a subject family (deliver, sessions, registry, presence, frames,          blobs, planner), so its subjects would overlap those of a shorter prefix; choose other          words (for example `tenant1.aip`)"
    )]
    ReservedToken(&'static str),
    /// It starts with `_INBOX`, where every client's replies arrive.
    #[error("`_INBOX` is where NATS replies arrive; choose another first token")]
    Inbox,
}

/// The first token of every subject family after the prefix (`deliver`, `frames`, …), from
/// [`CATALOGUE`]. No prefix may contain one as a token: then no deployment's subjects can lie
/// inside another's (see [`Subjects::new`]).
pub fn reserved_tokens() -> impl Iterator<Item = &'static str> {
    let mut seen: Vec<&'static str> = Vec::new();
    CATALOGUE.iter().filter_map(move |spec| {
        let first = spec.template.split('.').next().unwrap_or(spec.template);
        if seen.contains(&first) {
            None
        } else {
            seen.push(first);
            Some(first)
        }
    })
}

/// Encodes a prefix for a JetStream stream or consumer name, injectively: `.` becomes `_`,
/// `_` becomes `-_` and `-` becomes `--`; letters and digits stay. Stream names may not hold
/// `.`, and the plain replacement of `.` by `_` made `t1.aip` and `t1_aip` share streams;
/// this code is prefix-free, so two prefixes never give the same name. `aip` and `t1.aip` keep
/// the names they had (`aip`, `t1_aip`).
///
/// ```
/// use proto_schemas::subjects::name_token;
/// assert_eq!(name_token("aip"), "aip");
/// assert_eq!(name_token("t1.aip"), "t1_aip");
/// assert_eq!(name_token("t1_aip"), "t1-_aip");
/// assert_eq!(name_token("a-b"), "a--b");
/// ```
pub fn name_token(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        match c {
            '.' => out.push('_'),
            '_' => out.push_str("-_"),
            '-' => out.push_str("--"),
            c => out.push(c),
        }
    }
    out
}

/// How a subject is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Fire-and-forget publish on core NATS.
    Publish,
    /// Request/reply on core NATS; the service subscribes in a queue group.
    RequestReply,
    /// Published into a JetStream stream and consumed by a durable consumer with explicit acks.
    JetStream,
}

/// One entry of the subject catalogue.
#[derive(Debug, Clone, Copy)]
pub struct SubjectSpec {
    /// Stable name (AsyncAPI channel id).
    pub name: &'static str,
    /// The subject after the prefix; `{client}`-style parts are encoded tokens.
    pub template: &'static str,
    /// How it is used.
    pub pattern: Pattern,
    /// The payload's schema name (a file under `proto-schemas/schemas/`).
    pub payload: &'static str,
    /// The reply's schema name, for request/reply subjects.
    pub reply: Option<&'static str>,
    /// Who publishes.
    pub publishers: &'static [&'static str],
    /// Who consumes (and the queue group, where there is one).
    pub consumers: &'static [&'static str],
    /// What it carries and why.
    pub description: &'static str,
}

/// Every subject the broker uses.
pub const CATALOGUE: &[SubjectSpec] = &[
    SubjectSpec {
        name: "deliver",
        template: "deliver.{gateway}",
        pattern: Pattern::Publish,
        payload: "ServerMessage",
        reply: None,
        publishers: &["aip-sessions", "aip-gateway"],
        consumers: &["aip-gateway (the one holding the client's socket)"],
        description: "Frames for the clients one gateway holds: the gateway subscribes to its own \
            subject once, and writes each message to the WebSocket of the client named in its \
            `Aip-Client` header (a message for a client it does not hold is dropped, unanswered). \
            Publishers find the gateway in the registry's record of the client (`gateway_id`), or \
            in the frames the client sent (`InboundFrame.gateway_id`). A message with header \
            `Aip-Control: disconnect` and `Aip-Connection: <connection id>` closes that connection \
            instead (used when a credential takes over its own stale registration). A frame from \
            the session service's outbox carries `Nats-Msg-Id` and `Aip-Ack: <subject>`: the \
            gateway answers on that subject once it wrote the frame (a copy it already wrote is \
            dropped and answered again), and the session service sends the frame again, to the \
            gateway the registry then names, until it hears so. A frame for a task's executor \
            also carries `Aip-Connection: <connection id>`, the connection the task is bound to: \
            another connection of the client drops it (and answers), so a command sent again \
            after a gateway's crash never runs twice. A request with header \
            `Aip-Control: device-info` (empty payload) is answered by the gateway for the device \
            named in `Aip-Client`, for a constellation on another gateway: the device's \
            registered system information as JSON, `Aip-Error-Code: DEVICE_NOT_FOUND` with the \
            reason as text, or `Aip-Control: not-held` when the gateway does not hold the device \
            (the asker then asks the registry); nothing reaches the client. The same request \
            with a `DeviceInfoRequest` as its payload asks about several devices at once (the \
            requests of many constellations to the same gateway, gathered while earlier ones are \
            on their way; `Aip-Client` names the first): it is answered with \
            `Aip-Control: device-info-batch` and a `DeviceInfoReply`, one answer per device in \
            the request's order. A message with `Aip-Control: batch` carries a `DeliveryBatch`: \
            outbox frames for several of the gateway's clients (those of one group commit), each \
            handled as the message it stands for; the session service sends them only to a \
            gateway whose frames say it reads them (`InboundFrame.delivery_batches`), and sends \
            frames again one by one. Every frame from the session service carries \
            `Aip-Reads: frames-many`: the gateway may then gather its clients' frames into \
            `frames_many` events on the frames stream.",
    },
    SubjectSpec {
        name: "sessions.acks",
        template: "sessions.acks.{replica}",
        pattern: Pattern::Publish,
        payload: "DeliveryAck",
        reply: None,
        publishers: &["aip-gateway"],
        consumers: &["aip-sessions (the replica named in the frame's `Aip-Ack` header)"],
        description: "Delivery confirmations: a frame from the session service's outbox reached the \
            client's socket. Unconfirmed frames are sent again every second after five seconds, for \
            at most `outbox_retention_ms`.",
    },
    SubjectSpec {
        name: "registry.register",
        template: "registry.register",
        pattern: Pattern::RequestReply,
        payload: "RegisterAgent",
        reply: Some("RegisterReply"),
        publishers: &["aip-gateway"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "Register a connected client. Refused (REGISTRATION_FAILED, UFO's text) when the id \
            is live on another connection; an entry left by a dead gateway is replaced.",
    },
    SubjectSpec {
        name: "registry.unregister",
        template: "registry.unregister",
        pattern: Pattern::RequestReply,
        payload: "UnregisterAgent",
        reply: Some("UnregisterReply"),
        publishers: &["aip-gateway"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "A client's connection ended: mark it offline (only if that connection still holds it).",
    },
    SubjectSpec {
        name: "registry.write",
        template: "registry.write",
        pattern: Pattern::RequestReply,
        payload: "RegistryWrites",
        reply: Some("RegistryWritesReply"),
        publishers: &["aip-gateway"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "Registrations and unregistrations one gateway had waiting at once, in one \
            request: each judged and written as on `registry.register` or `registry.unregister`, \
            and answered in its order. A gateway sends a lone write on its own subject, and \
            falls back to those when no registry answers here (one of an earlier version).",
    },
    SubjectSpec {
        name: "registry.gateway_started",
        template: "registry.gateway_started",
        pattern: Pattern::RequestReply,
        payload: "GatewayStarted",
        reply: Some("GatewayStartedReply"),
        publishers: &["aip-gateway"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "A gateway started and holds no connection yet: every agent still registered \
            under its id belonged to its previous process and goes offline, and the end of each such \
            connection goes into the frames stream. Sent before the gateway accepts registrations.",
    },
    SubjectSpec {
        name: "registry.get",
        template: "registry.get",
        pattern: Pattern::RequestReply,
        payload: "GetAgent",
        reply: Some("GetAgentReply"),
        publishers: &["aip-gateway", "aip-sessions"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "One agent by id (device info for a device connected nowhere; the target of \
            a task submitted over REST or NATS).",
    },
    SubjectSpec {
        name: "registry.get_many",
        template: "registry.get_many",
        pattern: Pattern::RequestReply,
        payload: "GetAgents",
        reply: Some("GetAgentsReply"),
        publishers: &["aip-sessions"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "Several agents by id: the explicit targets of the tasks a session replica \
            read together, resolved in one request.",
    },
    SubjectSpec {
        name: "registry.lookup",
        template: "registry.lookup",
        pattern: Pattern::RequestReply,
        payload: "LookupAgents",
        reply: Some("LookupReply"),
        publishers: &["aip-sessions"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "Available, live agents with all the given capabilities, least loaded first.",
    },
    SubjectSpec {
        name: "registry.agents",
        template: "registry.agents",
        pattern: Pattern::RequestReply,
        payload: "ManageAgents",
        reply: Some("ManageAgentsReply"),
        publishers: &["aip-sessions"],
        consumers: &["aip-registry (queue group `aip-registry`)"],
        description: "Seed 004's agent management, read by the session service from a TaskRequest: \
            register an agent reached at an address (refused with REGISTRATION_FAILED when the id is \
            taken, by such an agent or by a WebSocket client not offline), or find the available \
            agents with all the given capabilities, addressed agents and connected devices alike \
            (refused with NOT_FOUND when there is none).",
    },
    SubjectSpec {
        name: "presence",
        template: "presence.{gateway}",
        pattern: Pattern::Publish,
        payload: "PresenceBatch",
        reply: None,
        publishers: &["aip-gateway"],
        consumers: &["aip-registry"],
        description: "Liveness in batches: every interval each gateway lists the clients it holds that \
            showed life. The batch is also the gateway's own heartbeat: a gateway silent past the \
            liveness window is taken as dead and its agents go offline.",
    },
    SubjectSpec {
        name: "frames",
        template: "frames.{client}",
        pattern: Pattern::JetStream,
        payload: "GatewayEvent",
        reply: None,
        publishers: &["aip-gateway"],
        consumers: &["aip-sessions (durable consumer `aip-sessions` on stream `<prefix>_frames`)"],
        description: "Client frames the session service handles (task, command_results, task_end, \
            extension frames) with the identity the gateway pinned to the connection, and the end of \
            each registered connection the session service may know: one that sent a frame on or \
            was sent one (the end of any other connection is stored when a frame comes for it \
            after it ended). `Nats-Msg-Id` is `<connection id>:<frame number>`, so a \
            re-sent frame is stored once. Frames that came while one was on its way travel \
            together as one `frames_many` event (`Nats-Msg-Id` `<first frame's id>:many`, on the \
            subject of the first frame's client), each with its own id, by which the session \
            service applies it once; ends likewise as `closed_many`. A gateway gathers frames only \
            while the session service's frames to it carry `Aip-Reads: frames-many`.",
    },
    SubjectSpec {
        name: "blobs",
        template: "blobs.{blob}",
        pattern: Pattern::JetStream,
        payload: "BlobChunk",
        reply: None,
        publishers: &["aip-gateway", "aip-sessions"],
        consumers: &["aip-gateway", "aip-sessions (read back by stream sequence)"],
        description: "Bodies larger than a NATS message (UFO frames reach 100 MiB): stored in chunks in \
            stream `<prefix>_blobs` (kept one hour); the message that would have carried the body has \
            an empty payload and an `Aip-Blob` header with `{\"stream\", \"sequences\", \"size\"}`, and \
            the receiver reads the chunks back in order and joins them.",
    },
    SubjectSpec {
        name: "sessions.submit",
        template: "sessions.submit",
        pattern: Pattern::RequestReply,
        payload: "TaskRequest",
        reply: Some("SubmitReply"),
        publishers: &["any NATS client (an LLM agent, another service)"],
        consumers: &["aip-sessions (queue group `aip-sessions`)"],
        description: "Submit a task over NATS; the reply says which executor got it, or why none did. A request that is seed 004's agent management (\"register me as an agent\", \"find an agent\") creates no task: the reply is its TaskResponse.",
    },
    SubjectSpec {
        name: "sessions.clarify",
        template: "sessions.clarify",
        pattern: Pattern::RequestReply,
        payload: "ClarificationResponse",
        reply: Some("ClarifyReply"),
        publishers: &["any NATS client acting for a task's requester"],
        consumers: &["aip-sessions (queue group `aip-sessions`)"],
        description: "Answer a task's open question; the reply is the task, going on, or why the answer was refused.",
    },
    SubjectSpec {
        name: "sessions.handoff",
        template: "sessions.handoff",
        pattern: Pattern::RequestReply,
        payload: "HandoffRequest",
        reply: Some("HandoffReply"),
        publishers: &["any NATS client (a planner, an orchestrator)"],
        consumers: &["aip-sessions (queue group `aip-sessions`)"],
        description: "Hand a task to another agent; the reply is the task on its new executor, or why nobody took it.",
    },
    SubjectSpec {
        name: "planner.next",
        template: "planner.next",
        pattern: Pattern::RequestReply,
        payload: "PlanRequest",
        reply: Some("PlanReply"),
        publishers: &["aip-sessions"],
        consumers: &["a remote planner (queue group of your choice)"],
        description: "The remote planner: for each step of a server-driven task the session service \
            sends the task and the last results, and the planner answers with the next commands, \
            `complete` or `fail`. Write one in any language with a NATS client.",
    },
];

/// Builds subjects under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Default for Subjects {
    fn default() -> Self {
        Subjects {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

impl Subjects {
    /// Subjects under `prefix`, which must be dot-separated tokens of `A-Z a-z 0-9 _ -`.
    ///
    /// Tenants sharing a NATS server must not see each other's subjects. Two prefixes of which
    /// neither extends the other (`t1.aip`, `t2.aip`) have disjoint subjects; one extending the
    /// other (`aip` and `aip.frames`) overlaps when the token after the shorter one is a
    /// subject family (`aip.frames.registry.get` is inside `aip.frames.>`, the frames stream of
    /// `aip`). So no token may be a family's word ([`reserved_tokens`]), and `_INBOX` may not
    /// come first: then any two valid prefixes have disjoint subjects.
    pub fn new(prefix: &str) -> Result<Self, InvalidPrefix> {
        let refuse = |reason| InvalidPrefix {
            prefix: prefix.to_owned(),
            reason,
        };
        let syntax = !prefix.is_empty()
            && prefix.split('.').all(|t| {
                !t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
        if !syntax {
            return Err(refuse(PrefixProblem::Syntax));
        }
        if let Some(token) = prefix
            .split('.')
            .find_map(|t| reserved_tokens().find(|r| *r == t))
        {
            return Err(refuse(PrefixProblem::ReservedToken(token)));
        }
        if prefix.split('.').next() == Some("_INBOX") {
            return Err(refuse(PrefixProblem::Inbox));
        }
        Ok(Subjects {
            prefix: prefix.to_owned(),
        })
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn join(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }

    /// `deliver.{gateway}`: frames for the clients one gateway holds (each message names its
    /// client in `Aip-Client`).
    pub fn deliver(&self, gateway_id: &str) -> String {
        self.join(&format!("deliver.{}", encode_token(gateway_id)))
    }

    /// `registry.register`.
    pub fn registry_register(&self) -> String {
        self.join("registry.register")
    }

    /// `registry.unregister`.
    pub fn registry_unregister(&self) -> String {
        self.join("registry.unregister")
    }

    /// `registry.write`.
    pub fn registry_write(&self) -> String {
        self.join("registry.write")
    }

    /// `registry.get`.
    pub fn registry_get(&self) -> String {
        self.join("registry.get")
    }

    /// `registry.get_many`.
    pub fn registry_get_many(&self) -> String {
        self.join("registry.get_many")
    }

    /// `registry.lookup`.
    pub fn registry_lookup(&self) -> String {
        self.join("registry.lookup")
    }

    /// `registry.gateway_started`.
    pub fn registry_gateway_started(&self) -> String {
        self.join("registry.gateway_started")
    }

    /// `registry.agents`.
    pub fn registry_agents(&self) -> String {
        self.join("registry.agents")
    }

    /// `sessions.acks.{replica}`: delivery confirmations for one session replica.
    pub fn sessions_acks(&self, replica: &str) -> String {
        self.join(&format!("sessions.acks.{}", encode_token(replica)))
    }

    /// `presence.{gateway}`: one gateway's presence batches.
    pub fn presence(&self, gateway_id: &str) -> String {
        self.join(&format!("presence.{}", encode_token(gateway_id)))
    }

    /// `presence.*`: every gateway's presence batches.
    pub fn presence_all(&self) -> String {
        self.join("presence.*")
    }

    /// `frames.{client}`: frames from one client, into the frames stream.
    pub fn frames(&self, client_id: &str) -> String {
        self.join(&format!("frames.{}", encode_token(client_id)))
    }

    /// `frames.>`: what the frames stream captures.
    pub fn frames_all(&self) -> String {
        self.join("frames.>")
    }

    /// The frames stream's name: the prefix as [`name_token`] encodes it, then `_frames`
    /// (`aip_frames`). Different prefixes never share it.
    pub fn frames_stream(&self) -> String {
        format!("{}_frames", name_token(&self.prefix))
    }

    /// The session service's durable consumer on the frames stream: the prefix as
    /// [`name_token`] encodes it, then `-sessions` (`aip-sessions`).
    pub fn sessions_consumer(&self) -> String {
        format!("{}-sessions", name_token(&self.prefix))
    }

    /// `blobs`: the subject prefix of stored large bodies.
    pub fn blobs(&self) -> String {
        self.join("blobs")
    }

    /// The blob stream's name: the prefix as [`name_token`] encodes it, then `_blobs`
    /// (`aip_blobs`). Different prefixes never share it.
    pub fn blobs_stream(&self) -> String {
        format!("{}_blobs", name_token(&self.prefix))
    }

    /// `sessions.submit`.
    pub fn sessions_submit(&self) -> String {
        self.join("sessions.submit")
    }

    /// `sessions.clarify`.
    pub fn sessions_clarify(&self) -> String {
        self.join("sessions.clarify")
    }

    /// `sessions.handoff`.
    pub fn sessions_handoff(&self) -> String {
        self.join("sessions.handoff")
    }

    /// `planner.next`.
    pub fn planner_next(&self) -> String {
        self.join("planner.next")
    }

    /// The full subject of a catalogue entry, with `{…}` parts left as written (for docs).
    pub fn documented(&self, spec: &SubjectSpec) -> String {
        self.join(spec.template)
    }

    /// `subject` with its id token as a placeholder (`aip.frames.dev1` → `aip.frames.{client}`),
    /// as messaging spans are named; a subject without an id comes back as it is.
    pub fn template(&self, subject: &str) -> String {
        let Some(rest) = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('.'))
        else {
            return subject.to_owned();
        };
        for (family, placeholder) in [
            ("frames.", "{client}"),
            ("deliver.", "{gateway}"),
            ("presence.", "{gateway}"),
            ("sessions.acks.", "{replica}"),
        ] {
            if rest.starts_with(family) {
                return self.join(&format!("{family}{placeholder}"));
            }
        }
        subject.to_owned()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn templates_hide_ids_only() {
        let subjects = super::Subjects::new("t1.aip").expect("prefix");
        assert_eq!(
            subjects.template(&subjects.frames("dev 1")),
            "t1.aip.frames.{client}"
        );
        assert_eq!(
            subjects.template(&subjects.deliver("g@dev")),
            "t1.aip.deliver.{gateway}"
        );
        assert_eq!(
            subjects.template(&subjects.registry_get_many()),
            "t1.aip.registry.get_many"
        );
        assert_eq!(subjects.template("other.frames.x"), "other.frames.x");
    }

    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn any_string_round_trips_as_one_valid_token(s in any::<String>()) {
            let token = encode_token(&s);
            prop_assert!(is_valid_token(&token), "{token:?} is not a valid token");
            prop_assert_eq!(decode_token(&token), Some(s));
        }

        #[test]
        fn tricky_strings_round_trip(s in "[.*> /@~\\t😀a-z]{0,40}") {
            let token = encode_token(&s);
            prop_assert!(is_valid_token(&token));
            prop_assert_eq!(decode_token(&token), Some(s));
        }

        #[test]
        fn decoding_garbage_never_panics(s in any::<String>()) {
            if let Some(id) = decode_token(&s) {
                prop_assert_eq!(encode_token(&id), s);
            }
        }
    }

    #[test]
    fn named_tricky_ids() {
        for id in [
            "a.b",
            "*",
            ">",
            "a b",
            "a/b",
            "task@device",
            "😀",
            "~",
            "~41",
            "",
            &"x".repeat(10_000),
        ] {
            let token = encode_token(id);
            assert!(is_valid_token(&token));
            assert_eq!(decode_token(&token).as_deref(), Some(id));
        }
        assert_eq!(decode_token("~41"), None, "A is never escaped");
        assert_eq!(decode_token("~2e"), None, "lower-case hex is not canonical");
    }

    #[test]
    fn subjects_use_the_prefix_and_encode_ids() {
        let s = Subjects::new("t1.aip").expect("valid prefix");
        assert_eq!(s.deliver("a.b"), "t1.aip.deliver.a~2Eb");
        assert_eq!(s.registry_register(), "t1.aip.registry.register");
        assert!(Subjects::new("a..b").is_err());
        assert!(Subjects::new("a/b").is_err());
        assert!(Subjects::new("a.*").is_err());
        assert!(Subjects::new("").is_err());
    }

    #[test]
    fn prefixes_that_would_overlap_are_refused() {
        for (prefix, token) in [
            ("aip.frames", "frames"),
            ("aip.deliver", "deliver"),
            ("t1.sessions.x", "sessions"),
            ("registry", "registry"),
            ("a.blobs", "blobs"),
            ("a.presence", "presence"),
            ("a.planner", "planner"),
        ] {
            let error = Subjects::new(prefix).expect_err(prefix);
            assert_eq!(
                error.reason,
                PrefixProblem::ReservedToken(token),
                "{prefix}"
            );
        }
        assert_eq!(
            Subjects::new("_INBOX.aip").expect_err("inbox").reason,
            PrefixProblem::Inbox
        );
        for prefix in ["aip", "t1.aip", "t1_aip", "aip.t1", "frames_x", "x-frames"] {
            Subjects::new(prefix).expect(prefix);
        }
        assert_eq!(
            reserved_tokens().collect::<Vec<_>>(),
            [
                "deliver", "sessions", "registry", "presence", "frames", "blobs", "planner"
            ]
        );
    }

    #[test]
    fn stream_and_consumer_names_keep_tenants_apart() {
        let names = |p: &str| {
            let s = Subjects::new(p).expect(p);
            (s.frames_stream(), s.blobs_stream(), s.sessions_consumer())
        };
        assert_eq!(
            names("aip"),
            (
                "aip_frames".into(),
                "aip_blobs".into(),
                "aip-sessions".into()
            ),
            "the default prefix keeps the names existing deployments have"
        );
        assert_eq!(names("t1.aip").0, "t1_aip_frames");
        assert_eq!(names("t1_aip").0, "t1-_aip_frames");
        assert_ne!(names("t1.aip"), names("t1_aip"));
        // The pair a plain `_`-for-`.` code would also confuse both ways.
        assert_ne!(names("a._b"), names("a_.b"));
    }

    proptest! {
        #[test]
        fn different_prefixes_never_share_a_name(
            a in "[a-c_.-]{1,6}",
            b in "[a-c_.-]{1,6}",
        ) {
            let (Ok(sa), Ok(sb)) = (Subjects::new(&a), Subjects::new(&b)) else {
                return Ok(());
            };
            if a != b {
                prop_assert_ne!(sa.frames_stream(), sb.frames_stream());
                prop_assert_ne!(sa.blobs_stream(), sb.blobs_stream());
                prop_assert_ne!(sa.sessions_consumer(), sb.sessions_consumer());
                prop_assert_ne!(sa.frames_stream(), sb.blobs_stream());
            }
            for name in [sa.frames_stream(), sa.blobs_stream(), sa.sessions_consumer()] {
                prop_assert!(name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-'));
            }
        }
    }
}
