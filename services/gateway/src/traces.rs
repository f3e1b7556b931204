//! What a connection remembers to keep one task in one trace: a device's `command_results`
//! carries no trace context (UFO clients know nothing of traces), so its spans are made
//! children of the span that wrote the command it answers, found by session id. Empty, and
//! never touched, while tracing is off.

use std::collections::{HashMap, VecDeque};

use aip_bus::trace::Context;
use proto_schemas::ClientMessage;

/// Sessions remembered per connection at most; the oldest is forgotten first.
const REMEMBERED: usize = 64;

/// The trace context of the last command written for each recent session.
#[derive(Default)]
pub(crate) struct CommandTraces {
    by_session: HashMap<String, Context>,
    order: VecDeque<String>,
}

impl CommandTraces {
    /// Remembers `cx` as the context of the command just written for `session_id`.
    pub(crate) fn remember(&mut self, session_id: &str, cx: Context) {
        if self.by_session.insert(session_id.to_owned(), cx).is_none() {
            self.order.push_back(session_id.to_owned());
            if self.order.len() > REMEMBERED
                && let Some(oldest) = self.order.pop_front()
            {
                self.by_session.remove(&oldest);
            }
        }
    }

    /// The parent of a frame's spans: the client's own `metadata.traceparent` (a client
    /// joining its trace, an extension), else the command the frame answers.
    pub(crate) fn parent_of(&self, frame: &ClientMessage) -> Option<Context> {
        if !aip_bus::trace::enabled() {
            return None;
        }
        let own = frame
            .metadata
            .as_ref()
            .and_then(|m| m.get("traceparent"))
            .and_then(|v| v.as_str())
            .and_then(aip_bus::trace::from_traceparent);
        own.or_else(|| {
            frame
                .session_id
                .as_deref()
                .and_then(|id| self.by_session.get(id).cloned())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_session_is_forgotten_first() {
        let mut traces = CommandTraces::default();
        for i in 0..=REMEMBERED {
            traces.remember(&format!("s{i}"), Context::new());
        }
        assert_eq!(traces.by_session.len(), REMEMBERED);
        assert!(!traces.by_session.contains_key("s0"));
        assert!(traces.by_session.contains_key(&format!("s{REMEMBERED}")));
    }
}
