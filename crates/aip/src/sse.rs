//! Server-Sent Events: an incremental parser of `text/event-stream` bodies, and following a
//! task's event log over `/api/tasks/{id}/events/stream` until the task ends.

use std::time::Duration;

use proto_schemas::sessions::{TaskEvent, TaskView};

use crate::rest::{Broker, RestError, path_segment};

/// One event of the stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// `id:` (the task event's sequence number).
    pub id: Option<String>,
    /// `event:` (the task event's kind).
    pub event: Option<String>,
    /// `data:` lines joined with `\n`.
    pub data: String,
}

/// Turns chunks of a `text/event-stream` body into events (WHATWG rules: lines end with `\n`,
/// `\r\n` or `\r`; a blank line ends an event; `:` starts a comment, e.g. keep-alives).
#[derive(Debug, Default)]
pub struct SseParser {
    buffer: Vec<u8>,
    current: SseEvent,
    has_data: bool,
}

impl SseParser {
    /// Feeds a chunk; returns the events it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = self.buffer.iter().position(|b| *b == b'\n' || *b == b'\r') {
            // A `\r` at the very end may be the first half of `\r\n`: wait for more.
            if self.buffer[end] == b'\r' && end + 1 == self.buffer.len() {
                break;
            }
            let skip = if self.buffer[end] == b'\r' && self.buffer.get(end + 1) == Some(&b'\n') {
                2
            } else {
                1
            };
            let line: Vec<u8> = self.buffer.drain(..end + skip).take(end).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(event) = self.line(&line) {
                events.push(event);
            }
        }
        events
    }

    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let event = std::mem::take(&mut self.current);
            let had_data = std::mem::take(&mut self.has_data);
            return had_data.then_some(event);
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.current.event = Some(value.to_owned()),
            "id" => self.current.id = Some(value.to_owned()),
            _ => {}
        }
        None
    }
}

/// How many times in a row a dropped stream is reopened before giving up.
const RECONNECTS: u32 = 5;

/// Follows a task's events from sequence number `after` until its terminal event, calling
/// `on_event` for each, and returns the task as it ended. A dropped stream is reopened where it
/// stopped; the broker being unreachable for several attempts is an error.
pub async fn follow<F>(
    broker: &Broker,
    task_id: &str,
    mut after: i64,
    mut on_event: F,
) -> Result<TaskView, RestError>
where
    F: FnMut(&TaskEvent),
{
    let mut failures = 0u32;
    loop {
        let before = after;
        let error = match read_stream(broker, task_id, &mut after, &mut on_event).await {
            Ok(true) => break,
            Ok(false) if after > before => None,
            Ok(false) => Some(RestError::Transport {
                url: format!("{}/api/tasks/{task_id}/events/stream", broker.base()),
                reason: "the event stream closed before the task ended".to_owned(),
            }),
            Err(e @ (RestError::Refused { .. } | RestError::InvalidBase(_))) => return Err(e),
            Err(e) => Some(e),
        };
        match error {
            None => failures = 0,
            Some(e) => {
                failures += 1;
                if failures > RECONNECTS {
                    return Err(e);
                }
                tracing::debug!("event stream interrupted ({e}); reopening");
            }
        }
        tokio::time::sleep(Duration::from_millis(250 * u64::from(failures.max(1)))).await;
    }
    broker
        .get(&format!("/api/tasks/{}", path_segment(task_id)), &[])
        .await
}

/// Reads one connection of the stream. `Ok(true)`: the task ended; `Ok(false)`: the stream
/// closed before that.
async fn read_stream<F>(
    broker: &Broker,
    task_id: &str,
    after: &mut i64,
    on_event: &mut F,
) -> Result<bool, RestError>
where
    F: FnMut(&TaskEvent),
{
    let mut response = broker.event_stream(task_id, *after).await?;
    let mut parser = SseParser::default();
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => return Ok(false),
            Err(e) => {
                return Err(RestError::Transport {
                    url: format!("{}/api/tasks/{task_id}/events/stream", broker.base()),
                    reason: e.to_string(),
                });
            }
        };
        for event in parser.feed(&chunk) {
            let Ok(task_event) = serde_json::from_str::<TaskEvent>(&event.data) else {
                tracing::debug!("skipping an event that is not a TaskEvent: {}", event.data);
                continue;
            };
            if task_event.seq <= *after {
                continue;
            }
            *after = task_event.seq;
            on_event(&task_event);
            if task_event.state.is_terminal() {
                return Ok(true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_and_line_endings() {
        let mut parser = SseParser::default();
        assert!(parser.feed(b": keep-alive\n\nid: 1\nevent: sub").is_empty());
        let events = parser.feed(b"mitted\r\ndata: {\"a\":\r");
        assert!(events.is_empty());
        let events = parser.feed(b"\ndata: 1}\r\n\r\nid: 2\ndata:x\n\n");
        assert_eq!(
            events,
            [
                SseEvent {
                    id: Some("1".into()),
                    event: Some("submitted".into()),
                    data: "{\"a\":\n1}".into()
                },
                SseEvent {
                    id: Some("2".into()),
                    event: None,
                    data: "x".into()
                }
            ]
        );
    }

    #[test]
    fn an_event_without_data_is_not_dispatched() {
        let mut parser = SseParser::default();
        assert!(parser.feed(b"event: ping\n\n").is_empty());
        assert_eq!(
            parser.feed(b"data\n\n").len(),
            1,
            "`data` alone is an empty data line"
        );
    }
}
