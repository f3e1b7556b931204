//! Large command results kept apart from their task's row (PostgreSQL).
//!
//! A device's `command_results` can carry a 90 MiB screenshot. Written inside the group
//! commit, as part of the task's `history`, it held every other change of the group for
//! seconds: the value went through the statement's arrays, `UNNEST` and a `json` cast. Now a
//! history entry whose results are larger than [`APART_BYTES`] is written before the group,
//! as raw bytes in `task_results`, in parts of [`PART_BYTES`] on pooled connections side by
//! side ([`PARTS_AT_ONCE`] at a time), each committed on its own. The group then writes the entry with a [`Marker`] in
//! place of its results, so the task's row never holds a part that is not committed, and the
//! readers put the results back. Nothing is acknowledged before both are committed: the
//! frame that brought the results is acknowledged after the group.
//!
//! Parts are keyed by task, history entry and the leader's term, so a leader that lost its
//! lease and still writes cannot overwrite what the new one wrote. Writing the same key again
//! (the group failed and is retried) overwrites it with the same results; the marker names
//! how many parts and bytes make the value, so parts left from a longer earlier write are
//! never read.

use std::collections::HashMap;

use aip_store::text::json_text;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store::StoreError;
use crate::task::Task;

/// Results larger than this (as JSON) are kept apart from their task's row.
pub const APART_BYTES: usize = 1 << 20;

/// The size of the parts a kept-apart value is written in. 8 MiB parts took PostgreSQL 40–50 %
/// longer for the same 90 MiB (each part's protocol message, parameter and value are
/// buffers of the part's size, allocated and faulted in again for each part; sqlx's buffers
/// here the same); 256 and 512 KiB parts cost more commits than they save. The marker names
/// how many parts make a value, so values written in parts of another size read back as
/// they are.
pub const PART_BYTES: usize = 1 << 20;

/// Parts written at once (each on a pooled connection of its own).
const PARTS_AT_ONCE: usize = 6;

/// The key of the object that stands for a history entry's results in the stored row.
/// (`results` is otherwise an array, so an object with this key is never a device's.)
pub const MARKER_KEY: &str = "$apart";

/// Where a history entry's results are: written by the leader of `term`, in `parts` parts
/// of `bytes` bytes in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub term: i64,
    pub parts: i32,
    pub bytes: i64,
}

/// Results to write before a group: one history entry's, as JSON bytes.
#[derive(Debug)]
pub struct Body {
    pub task_id: String,
    pub entry: i32,
    pub marker: Marker,
    pub json: bytes::Bytes,
}

/// What the leader has written apart under its term: the marker of each (task, entry), so
/// a task written again (its next step, its end) refers to its results without writing them
/// again. Entries go when their task ends; the map is bounded, and a task it forgot has its
/// results written once more (under the same key).
#[derive(Debug, Default)]
pub struct Written {
    /// Task id → history entry → marker.
    markers: HashMap<String, HashMap<i32, Marker>>,
    /// Markers held (to bound the map).
    count: usize,
}

/// Markers remembered at most.
const WRITTEN_KEPT: usize = 16_384;

impl Written {
    /// Remembers the markers of a committed group, and forgets those of tasks that ended.
    pub fn committed(&mut self, bodies: Vec<Body>, tasks: &[std::sync::Arc<Task>]) {
        for body in bodies {
            self.remember(body.task_id, body.entry, body.marker);
        }
        for task in tasks.iter().filter(|t| t.state.is_terminal()) {
            if let Some(gone) = self.markers.remove(&task.task_id) {
                self.count -= gone.len();
            }
        }
    }

    /// Remembers the markers found in a task read back (a new leader's live tasks).
    pub fn found(&mut self, task_id: &str, markers: Vec<(i32, Marker)>) {
        for (entry, marker) in markers {
            self.remember(task_id.to_owned(), entry, marker);
        }
    }

    fn remember(&mut self, task_id: String, entry: i32, marker: Marker) {
        if self.count >= WRITTEN_KEPT {
            self.markers.clear();
            self.count = 0;
        }
        if self
            .markers
            .entry(task_id)
            .or_default()
            .insert(entry, marker)
            .is_none()
        {
            self.count += 1;
        }
    }

    /// The marker of a task's history entry written apart, if any.
    fn get(&self, task_id: &str, entry: i32) -> Option<Marker> {
        self.markers.get(task_id)?.get(&entry).copied()
    }
}

/// The text of a task's `history` column, with the results larger than [`APART_BYTES`]
/// replaced by markers, and the results not yet written apart (to write before the group).
pub fn stored_history(
    task: &Task,
    term: i64,
    written: &Written,
) -> Result<(String, Vec<Body>), StoreError> {
    let encode = |source| StoreError::Encode {
        task_id: task.task_id.clone(),
        source,
    };
    let mut bodies = Vec::new();
    let mut entries = Vec::with_capacity(task.history.len());
    for (index, entry) in task.history.iter().enumerate() {
        let Some((results, rest)) = split_results(entry) else {
            entries.push(json_text(entry).map_err(encode)?);
            continue;
        };
        // Each part is encoded once: the other fields, then the results (or their marker).
        let kept = task.encoded_results.get(index);
        let index = i32::try_from(index).unwrap_or(i32::MAX);
        let rest = json_text(&rest).map_err(encode)?;
        let results = match written.get(&task.task_id, index) {
            Some(marker) => marker_text(marker),
            None => {
                // Large results were encoded once, when they came.
                let json = match kept.filter(|text| text.len() > APART_BYTES) {
                    Some(text) => text.clone(),
                    None => {
                        let json = json_text(results).map_err(encode)?;
                        if json.len() <= APART_BYTES {
                            entries.push(with_results(&rest, &json));
                            continue;
                        }
                        bytes::Bytes::from(json)
                    }
                };
                let marker = Marker {
                    term,
                    parts: i32::try_from(json.len().div_ceil(PART_BYTES)).unwrap_or(i32::MAX),
                    bytes: json.len() as i64,
                };
                bodies.push(Body {
                    task_id: task.task_id.clone(),
                    entry: index,
                    marker,
                    json,
                });
                marker_text(marker)
            }
        };
        entries.push(with_results(&rest, &results));
    }
    Ok((format!("[{}]", entries.join(",")), bodies))
}

/// What stands for results kept apart.
fn marker_text(marker: Marker) -> String {
    serde_json::json!({ MARKER_KEY: marker }).to_string()
}

/// An entry's text from the text of its other fields (an object) and of its results.
fn with_results(rest: &str, results: &str) -> String {
    let head = rest.strip_suffix('}').unwrap_or(rest);
    let comma = if head == "{" { "" } else { "," };
    format!("{head}{comma}\"results\":{results}}}")
}

/// A history entry's results and its other fields, when it is an object with results.
fn split_results(entry: &Value) -> Option<(&Value, serde_json::Map<String, Value>)> {
    let fields = entry.as_object()?;
    let results = fields.get("results")?;
    if !results.is_array() {
        return None;
    }
    let rest = fields
        .iter()
        .filter(|(k, _)| *k != "results")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Some((results, rest))
}

/// Writes bodies before their group: every part committed, or an error.
pub async fn write(pool: &sqlx::PgPool, bodies: &[Body]) -> Result<(), StoreError> {
    let parts: Vec<(&Body, i32, &[u8])> = bodies
        .iter()
        .flat_map(|body| {
            body.json
                .chunks(PART_BYTES)
                .enumerate()
                .map(move |(i, part)| (body, i as i32, part))
        })
        .collect();
    let mut parts = parts.into_iter();
    // A window of parts in flight: as one is committed, the next starts.
    let mut writing = futures::stream::FuturesUnordered::new();
    loop {
        while writing.len() < PARTS_AT_ONCE
            && let Some((body, part, bytes)) = parts.next()
        {
            writing.push(write_part(pool, body, part, bytes));
        }
        match writing.next().await {
            Some(written) => written?,
            None => return Ok(()),
        }
    }
}

/// Writes one part, committed on its own.
async fn write_part(
    pool: &sqlx::PgPool,
    body: &Body,
    part: i32,
    bytes: &[u8],
) -> Result<(), StoreError> {
    let mut conn = pool.acquire().await?;
    sqlx::query(WRITE_PART)
        .bind(&body.task_id)
        .bind(body.entry)
        .bind(body.marker.term)
        .bind(part)
        .bind(bytes)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

const WRITE_PART: &str = "INSERT INTO task_results (task_id, entry, term, part, body) \
     VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (task_id, entry, term, part) DO UPDATE SET body = excluded.body";

const READ_PARTS: &str = "SELECT body FROM task_results \
     WHERE task_id = $1 AND entry = $2 AND term = $3 AND part < $4 ORDER BY part";

/// The markers in a stored history: (entry, marker) for each entry whose results are apart.
pub fn markers(history: &[Value]) -> Vec<(i32, Marker)> {
    history
        .iter()
        .enumerate()
        .filter_map(|(index, entry)| {
            let marker = entry.get("results")?.get(MARKER_KEY)?;
            let marker: Marker = serde_json::from_value(marker.clone()).ok()?;
            Some((i32::try_from(index).ok()?, marker))
        })
        .collect()
}

/// Puts back the results a stored history refers to; returns the markers found.
pub async fn restore(
    pool: &sqlx::PgPool,
    task_id: &str,
    history: &mut [Value],
) -> Result<Vec<(i32, Marker)>, StoreError> {
    let found = markers(history);
    for (entry, marker) in &found {
        let corrupt = |value: String| StoreError::Corrupt {
            task_id: task_id.to_owned(),
            column: "task_results.body",
            value,
        };
        let parts: Vec<(Vec<u8>,)> = sqlx::query_as(READ_PARTS)
            .bind(task_id)
            .bind(entry)
            .bind(marker.term)
            .bind(marker.parts)
            .fetch_all(pool)
            .await?;
        let size: usize = parts.iter().map(|(p,)| p.len()).sum();
        if parts.len() != marker.parts as usize || size as i64 != marker.bytes {
            return Err(corrupt(format!(
                "{} parts of {size} bytes for history entry {entry}, not the {} parts of {} bytes its marker names",
                parts.len(),
                marker.parts,
                marker.bytes
            )));
        }
        let mut json = Vec::with_capacity(size);
        for (part,) in parts {
            json.extend_from_slice(&part);
        }
        let results: Value = serde_json::from_slice(&json)
            .map_err(|e| corrupt(format!("history entry {entry}: {e}")))?;
        if let Some(slot) = history
            .get_mut(*entry as usize)
            .and_then(|e| e.get_mut("results"))
        {
            *slot = results;
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_entry_is_put_together_from_its_fields_and_its_results() {
        let entry = json!({ "step": 0, "status": "continue", "results": [{ "result": "x" }] });
        let (results, rest) = split_results(&entry).expect("an entry with results");
        let text = with_results(
            &json_text(&rest).expect("fields"),
            &json_text(results).expect("results"),
        );
        assert_eq!(serde_json::from_str::<Value>(&text).expect("JSON"), entry);
        // An entry with nothing but its results.
        let alone = with_results("{}", "[1]");
        assert_eq!(
            serde_json::from_str::<Value>(&alone).expect("JSON"),
            json!({ "results": [1] })
        );
        // Results that are not an array are not a device's: kept in the entry as they are.
        assert!(split_results(&json!({ "results": { MARKER_KEY: 1 } })).is_none());
    }
}
