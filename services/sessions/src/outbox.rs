//! Outbox frames of one group commit stored together, in one row.
//!
//! Every frame a change sends is written to the outbox in the change's transaction, and the
//! row is deleted once a gateway acknowledges writing the frame. One row per frame was four
//! rows inserted and deleted per task (a quarter of PostgreSQL's work at 100 clients). Now the
//! small frames of a group are stored as one row ([`group`]): a JSON array of the frames with
//! their ids, clients and connections (payload kind `frames`, key `<first frame's id>:frames`).
//! A frame of [`GROUPED_FRAME_MAX`] bytes or more, and the only small frame of a group, keep a
//! row of their own, as before.
//!
//! The leader counts the acknowledgements of each stored group ([`Groups`]): the row goes with
//! the next group commit once every frame in it is acknowledged. A group still in the outbox
//! when the sweeper finds it stale is **split**: the frames not acknowledged yet (all of them
//! when this replica does not know the group, after a takeover) are written again as rows of
//! their own and the group's row deleted, in one transaction ([`Split`]), so a frame waiting
//! for a client that is gone never keeps the others' row, nor has them sent again.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::store::OutFrame;

/// Frames smaller than this are stored together with the other small frames of their group.
pub const GROUPED_FRAME_MAX: usize = 16 * 1024;

/// The key of the row holding the frames whose first is `first_msg_id`.
fn group_key(first_msg_id: &str) -> String {
    format!("{first_msg_id}:frames")
}

/// One frame of a stored group, as the row's JSON holds it.
#[derive(Serialize, Deserialize)]
struct StoredFrame<'a> {
    #[serde(borrow)]
    msg_id: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    client_id: std::borrow::Cow<'a, str>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    connection_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    frame: &'a RawValue,
}

/// Which frames of a group commit are stored in one row: the row's key, and the indexes of
/// the frames (in the group's order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grouped {
    pub key: String,
    pub members: Vec<usize>,
}

/// The row holding the small frames of a group commit: which, and its payload.
#[derive(Debug)]
pub struct Group {
    pub grouped: Grouped,
    pub payload: Vec<u8>,
}

/// Whether `frame` may be stored with others: small, and one JSON value.
fn groupable(frame: &OutFrame) -> Option<&RawValue> {
    if frame.payload.len() >= GROUPED_FRAME_MAX {
        return None;
    }
    serde_json::from_slice(&frame.payload).ok()
}

/// The row holding the small frames of `frames`, or `None` when fewer than two are small (each
/// frame then has a row of its own).
pub fn group(frames: &[OutFrame]) -> Result<Option<Group>, serde_json::Error> {
    let mut members = Vec::new();
    let mut stored = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        if let Some(raw) = groupable(frame) {
            members.push(i);
            stored.push(StoredFrame {
                msg_id: frame.msg_id.as_str().into(),
                client_id: frame.client_id.as_str().into(),
                connection_id: frame.connection.as_deref().map(Into::into),
                frame: raw,
            });
        }
    }
    if members.len() < 2 {
        return Ok(None);
    }
    Ok(Some(Group {
        payload: serde_json::to_vec(&stored)?,
        grouped: Grouped {
            key: group_key(&frames[members[0]].msg_id),
            members,
        },
    }))
}

/// The frames of a stored group's payload, in their order.
pub fn frames_of(payload: &[u8]) -> Result<Vec<OutFrame>, serde_json::Error> {
    let stored: Vec<StoredFrame<'_>> = serde_json::from_slice(payload)?;
    Ok(stored
        .into_iter()
        .map(|f| OutFrame {
            msg_id: f.msg_id.into_owned(),
            client_id: f.client_id.into_owned(),
            connection: f.connection_id.map(|c| c.into_owned()),
            payload: bytes::Bytes::copy_from_slice(f.frame.get().as_bytes()),
            task_end_of: None,
            trace: None,
        })
        .collect())
}

/// A stored group the sweeper found stale: its frames not acknowledged yet are written again,
/// each as a row of its own, and the group's row (`key`) is deleted, in one transaction.
#[derive(Debug, Clone)]
pub struct Split {
    pub key: String,
    pub frames: Vec<OutFrame>,
}

/// What the outbox holds, as the sweeper reads it.
#[derive(Debug)]
pub enum Stored {
    /// A frame in a row of its own.
    Alone(OutFrame),
    /// A group's frames, in one row.
    Group { key: String, frames: Vec<OutFrame> },
}

/// What an acknowledgement settles.
#[derive(Debug, PartialEq, Eq)]
pub enum Acknowledged {
    /// A frame in a row of its own (or of a group this replica does not track): that row.
    Row,
    /// A frame of a group other frames of which are not acknowledged yet: no row yet.
    InGroup,
    /// The last frame of a group: the group's row, whose key this is.
    GroupDone(Arc<str>),
}

/// The groups this replica stored whose frames are not all acknowledged: bounded by what a
/// few seconds of traffic leaves unacknowledged, since the sweeper splits older groups.
#[derive(Debug, Default)]
pub struct Groups {
    /// Each unacknowledged grouped frame's group.
    group_of: HashMap<String, Arc<str>>,
    /// How many frames of each group are not acknowledged yet.
    waiting: HashMap<Arc<str>, usize>,
}

impl Groups {
    /// A group was committed; none of its frames is acknowledged yet.
    pub fn stored(&mut self, key: &str, msg_ids: impl IntoIterator<Item = String>) {
        let key: Arc<str> = key.into();
        let mut count = 0;
        for id in msg_ids {
            self.group_of.insert(id, key.clone());
            count += 1;
        }
        self.waiting.insert(key, count);
    }

    /// A gateway acknowledged writing the frame `msg_id`.
    pub fn acknowledged(&mut self, msg_id: &str) -> Acknowledged {
        let Some(key) = self.group_of.remove(msg_id) else {
            return Acknowledged::Row;
        };
        let Some(waiting) = self.waiting.get_mut(&key) else {
            return Acknowledged::Row;
        };
        *waiting = waiting.saturating_sub(1);
        if *waiting == 0 {
            self.waiting.remove(&key);
            return Acknowledged::GroupDone(key);
        }
        Acknowledged::InGroup
    }

    /// The stale group `key` with its stored `frames` is split: the frames not acknowledged
    /// yet (all when the group is not tracked here), and the group is forgotten.
    pub fn split(&mut self, key: &str, mut frames: Vec<OutFrame>) -> Split {
        if self.waiting.remove(key).is_some() {
            frames.retain(|f| self.group_of.remove(&f.msg_id).is_some());
        }
        Split {
            key: key.to_owned(),
            frames,
        }
    }

    /// A group's row is gone (dropped after the retention, which a tracked group reaches only
    /// when sweeps failed for that long): its frames are forgotten.
    pub fn forget(&mut self, key: &str) {
        if self.waiting.remove(key).is_some() {
            self.group_of.retain(|_, group| &**group != key);
        }
    }

    /// Forgets everything (a new term: what the last one stored is split when found stale).
    pub fn clear(&mut self) {
        self.group_of.clear();
        self.waiting.clear();
    }

    /// Whether no frame is tracked.
    pub fn is_empty(&self) -> bool {
        self.group_of.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: &str, client: &str, payload: &str) -> OutFrame {
        OutFrame {
            msg_id: id.to_owned(),
            client_id: client.to_owned(),
            connection: (client == "dev").then(|| "conn-1".to_owned()),
            payload: bytes::Bytes::copy_from_slice(payload.as_bytes()),
            task_end_of: None,
            trace: None,
        }
    }

    #[test]
    fn small_frames_are_stored_in_one_row_and_read_back_as_they_were() {
        let large = format!(
            "{{\"type\":\"task_end\",\"result\":\"{}\"}}",
            "x".repeat(GROUPED_FRAME_MAX)
        );
        let frames = vec![
            frame("m1", "con", r#"{"type":"heartbeat","status":"ok"}"#),
            frame("m2", "dev", &large),
            frame("m3", "dev", r#"{"type":"command","actions":[{"a":"é\n"}]}"#),
            frame("m4", "con", "not json"),
        ];
        let group = group(&frames).expect("encodes").expect("two small frames");
        assert_eq!(group.grouped.key, "m1:frames");
        assert_eq!(group.grouped.members, vec![0, 2]);
        let read = frames_of(&group.payload).expect("decodes");
        assert_eq!(read.len(), 2);
        for (read, original) in read.iter().zip([&frames[0], &frames[2]]) {
            assert_eq!(read.msg_id, original.msg_id);
            assert_eq!(read.client_id, original.client_id);
            assert_eq!(read.connection, original.connection);
            assert_eq!(read.payload, original.payload, "byte for byte");
        }
    }

    #[test]
    fn a_lone_small_frame_keeps_a_row_of_its_own() {
        let frames = vec![frame("m1", "con", "{}"), frame("m2", "con", "nope")];
        assert!(group(&frames).expect("encodes").is_none());
    }

    #[test]
    fn a_group_is_done_when_its_last_frame_is_acknowledged() {
        let mut groups = Groups::default();
        groups.stored("m1:frames", ["m1".to_owned(), "m2".to_owned()]);
        assert_eq!(groups.acknowledged("m9"), Acknowledged::Row);
        assert_eq!(groups.acknowledged("m2"), Acknowledged::InGroup);
        assert_eq!(groups.acknowledged("m2"), Acknowledged::Row, "counted once");
        assert_eq!(
            groups.acknowledged("m1"),
            Acknowledged::GroupDone("m1:frames".into())
        );
        assert!(groups.is_empty());
    }

    #[test]
    fn a_split_keeps_the_frames_not_acknowledged_or_all_of_an_unknown_group() {
        let mut groups = Groups::default();
        groups.stored("a:frames", ["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        assert_eq!(groups.acknowledged("b"), Acknowledged::InGroup);
        let stored = || {
            vec![
                frame("a", "x", "1"),
                frame("b", "x", "2"),
                frame("c", "y", "3"),
            ]
        };
        let split = groups.split("a:frames", stored());
        let ids: Vec<&str> = split.frames.iter().map(|f| f.msg_id.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert!(groups.is_empty(), "a split group is forgotten");
        assert_eq!(
            groups.acknowledged("a"),
            Acknowledged::Row,
            "now a row of its own"
        );
        let unknown = groups.split("a:frames", stored());
        assert_eq!(
            unknown.frames.len(),
            3,
            "after a takeover every frame is sent again"
        );
    }
}
