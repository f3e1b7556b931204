//! After `tasks` and `rest`: every task the clients saw complete is looked up over REST, and
//! its event log must be complete (its last state `completed`, K `command_sent` and K
//! `results_received`) and gap-free (`seq` 1..n).

use futures::StreamExt;
use proto_schemas::sessions::{TaskEvent, TaskState};
use tokio::time::Instant;

use crate::progress::Progress;
use crate::report::Verification;
use crate::rest::Rest;

/// Most problems listed in the report.
const MAX_PROBLEMS: usize = 10;
/// Logs read at once.
const CONCURRENCY: usize = 16;

/// What is wrong with a task's log, if anything.
pub(crate) fn check_log(events: &[TaskEvent], commands: usize) -> Result<(), String> {
    if events.is_empty() {
        return Err("no events".to_owned());
    }
    for (i, event) in events.iter().enumerate() {
        let expected = i as i64 + 1;
        if event.seq != expected {
            return Err(format!("gap: event {} has seq {}", expected, event.seq));
        }
    }
    let last = events.last().map(|e| e.state);
    if last != Some(TaskState::Completed) {
        return Err(format!(
            "last state is {} instead of completed",
            last.map_or("none", TaskState::as_str)
        ));
    }
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count();
    for kind in ["command_sent", "results_received"] {
        let n = count(kind);
        if n != commands {
            return Err(format!("{n} `{kind}` events instead of {commands}"));
        }
    }
    Ok(())
}

/// Checks the logs of `ids`, `CONCURRENCY` at a time, until `deadline`.
pub(crate) async fn verify(
    rest: &Rest,
    ids: Vec<String>,
    commands: usize,
    deadline: Instant,
    progress: &Progress,
) -> Verification {
    progress.phase("checking event logs", ids.len() as u64);
    let total = ids.len() as u64;
    let outcomes: Vec<(String, Option<Result<(), String>>)> = futures::stream::iter(ids)
        .map(|id| async move {
            if Instant::now() >= deadline {
                return (id, None);
            }
            let outcome = match tokio::time::timeout_at(deadline, rest.events(&id)).await {
                Err(_) => None,
                Ok(Err(e)) => Some(Err(format!("not readable: {e}"))),
                Ok(Ok(events)) => Some(check_log(&events, commands)),
            };
            match &outcome {
                Some(Ok(())) => progress.done(),
                _ => progress.failed(),
            }
            (id, outcome)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut v = Verification {
        checked: 0,
        complete: 0,
        incomplete: 0,
        not_checked: 0,
        problems: Vec::new(),
    };
    for (id, outcome) in outcomes {
        match outcome {
            None => v.not_checked += 1,
            Some(Ok(())) => {
                v.checked += 1;
                v.complete += 1;
            }
            Some(Err(problem)) if problem.starts_with("not readable") => {
                v.not_checked += 1;
                if v.problems.len() < MAX_PROBLEMS {
                    v.problems.push(format!("{id}: {problem}"));
                }
            }
            Some(Err(problem)) => {
                v.checked += 1;
                v.incomplete += 1;
                if v.problems.len() < MAX_PROBLEMS {
                    v.problems.push(format!("{id}: {problem}"));
                }
            }
        }
    }
    debug_assert_eq!(v.checked + v.not_checked, total);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: i64, kind: &str, state: TaskState) -> TaskEvent {
        TaskEvent {
            task_id: "t".into(),
            seq,
            at: "2026-01-01T00:00:00Z".into(),
            kind: kind.into(),
            state,
            data: None,
        }
    }

    fn good() -> Vec<TaskEvent> {
        vec![
            event(1, "submitted", TaskState::Submitted),
            event(2, "dispatched", TaskState::Dispatched),
            event(3, "command_sent", TaskState::Working),
            event(4, "results_received", TaskState::Working),
            event(5, "completed", TaskState::Completed),
        ]
    }

    #[test]
    fn a_complete_log_passes() {
        assert_eq!(check_log(&good(), 1), Ok(()));
    }

    #[test]
    fn gaps_missing_rounds_and_other_ends_are_found() {
        let mut gap = good();
        gap.remove(2);
        assert!(check_log(&gap, 1).expect_err("gap").contains("gap"));
        assert!(
            check_log(&good(), 2)
                .expect_err("rounds")
                .contains("command_sent")
        );
        let mut failed = good();
        failed[4].state = TaskState::Failed;
        assert!(
            check_log(&failed, 1)
                .expect_err("failed")
                .contains("failed")
        );
        assert!(check_log(&[], 1).is_err());
    }
}
