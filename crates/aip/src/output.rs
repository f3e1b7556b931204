//! Human output of the client commands: tables, one-line descriptions of task events, task
//! summaries. `--json` output bypasses all of this and prints what the API returned.

use std::collections::HashMap;
use std::fmt::Write as _;

use proto_schemas::ActionResult;
use proto_schemas::sessions::{TaskEvent, TaskView};
use serde::Serialize;
use serde_json::Value;

/// Prints a value as pretty JSON on stdout.
pub fn print_json<T: Serialize>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(text) => println!("{text}"),
        Err(e) => eprintln!("error: cannot print JSON: {e}"),
    }
}

/// A plain text table: a header row and aligned columns, long cells cut with `…`.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

/// The widest a cell is shown.
const MAX_CELL: usize = 60;

impl Table {
    /// A table with these column titles.
    pub fn new(headers: &[&'static str]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells are blank).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Whether no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, one line per row, trailing spaces trimmed.
    pub fn render(&self) -> String {
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| {
                (0..self.headers.len())
                    .map(|i| truncate(row.get(i).map(String::as_str).unwrap_or(""), MAX_CELL))
                    .collect()
            })
            .collect();
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|row| row[i].chars().count())
                    .chain([self.headers[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&header).chain(cells.iter()) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                let pad = widths[i].saturating_sub(cell.chars().count());
                let _ = write!(line, "{cell}{}  ", " ".repeat(pad));
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Cuts `text` to `max` characters (the last one `…`), on one line.
pub fn truncate(text: &str, max: usize) -> String {
    let one_line = text.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= max {
        return one_line;
    }
    let mut cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Compact JSON, cut to `max` characters.
pub fn compact(value: &Value, max: usize) -> String {
    truncate(&value.to_string(), max)
}

/// The tool name of each Command seen so far, by `call_id`, so results (which carry only the
/// `call_id`) can be shown with the tool that produced them.
#[derive(Debug, Default)]
pub struct ToolNames(HashMap<String, String>);

impl ToolNames {
    /// Learns the Commands of a `command_sent` event.
    pub fn learn(&mut self, event: &TaskEvent) {
        if event.kind != "command_sent" {
            return;
        }
        let actions = event
            .data
            .as_ref()
            .and_then(|d| d.get("actions"))
            .and_then(Value::as_array);
        for action in actions.into_iter().flatten() {
            if let (Some(call), Some(tool)) = (
                action.get("call_id").and_then(Value::as_str),
                action.get("tool_name").and_then(Value::as_str),
            ) {
                self.0.insert(call.to_owned(), tool.to_owned());
            }
        }
    }

    /// The tool of a call, if known.
    pub fn get(&self, call_id: Option<&str>) -> Option<&str> {
        call_id.and_then(|c| self.0.get(c)).map(String::as_str)
    }
}

fn step_number(data: &Value) -> String {
    data.get("step")
        .and_then(Value::as_i64)
        .map(|s| (s + 1).to_string())
        .unwrap_or_else(|| "?".to_owned())
}

/// One line saying what a task event means.
pub fn describe_event(event: &TaskEvent, tools: &ToolNames) -> String {
    let data = event.data.clone().unwrap_or(Value::Null);
    let text = |key: &str| {
        data.get(key)
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned()
    };
    match event.kind.as_str() {
        "submitted" => format!(
            "submitted (executor {}, planner {})",
            text("executor_id"),
            text("planner")
        ),
        "dispatched" => format!("dispatched to {}", text("executor_id")),
        "echoed" => format!("{} took the task", text("client_id")),
        "command_sent" => {
            let actions: Vec<String> = data
                .get("actions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|a| {
                    let tool = a.get("tool_name").and_then(Value::as_str).unwrap_or("?");
                    match a.get("parameters") {
                        Some(p) if !p.is_null() => format!("{tool} {}", compact(p, 60)),
                        _ => tool.to_owned(),
                    }
                })
                .collect();
            format!("step {}: sent {}", step_number(&data), actions.join(", "))
        }
        "results_received" => {
            let results: Vec<String> = results_of(&data)
                .iter()
                .map(|r| {
                    let tool = tools.get(r.call_id.as_deref()).unwrap_or("command");
                    format!("{tool} {}", r.status.as_str())
                })
                .collect();
            format!("step {}: {}", step_number(&data), results.join(", "))
        }
        "planned" => describe_turn(&data),
        "clarification_requested" => format!(
            "asked the requester: {} (answer: aip tasks answer {} \"…\")",
            text("question"),
            event.task_id
        ),
        "clarification_answered" => format!("{} answered: {}", text("provided_by"), text("answer")),
        "handoff_requested" => format!(
            "handoff asked by {}: {}",
            text("requested_by"),
            text("reason")
        ),
        "handoff_accepted" => format!(
            "handed off from {} to {}",
            text("current_agent_id"),
            text("new_agent_id")
        ),
        kind if event.state.is_terminal() => match data.get("error").and_then(Value::as_str) {
            Some(error) => {
                let code = data.get("error_code").and_then(Value::as_str);
                match code {
                    Some(code) => format!("{kind}: {error} ({code})"),
                    None => format!("{kind}: {error}"),
                }
            }
            None => kind.to_owned(),
        },
        kind => match &event.data {
            Some(d) => format!("{kind} {}", compact(d, 100)),
            None => kind.to_owned(),
        },
    }
}

/// A planner's turn (the built-in agent's `planned` event): what the model did.
fn describe_turn(data: &Value) -> String {
    let planner = data
        .get("planner")
        .and_then(Value::as_str)
        .unwrap_or("planner");
    let turn = data.get("turn").and_then(Value::as_u64).unwrap_or(0);
    let reply = data
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "assistant"));
    let what = match reply {
        None => "no answer".to_owned(),
        Some(reply) => match reply.get("tool_calls").and_then(Value::as_array) {
            Some(calls) if !calls.is_empty() => {
                let names: Vec<&str> = calls
                    .iter()
                    .filter_map(|c| c["function"]["name"].as_str())
                    .collect();
                format!("called {}", names.join(", "))
            }
            _ => format!(
                "answered {}",
                compact(reply.get("content").unwrap_or(&Value::Null), 80)
            ),
        },
    };
    let tokens = data
        .get("usage")
        .and_then(|u| u.get("total_tokens"))
        .and_then(Value::as_u64)
        .map(|t| format!(" ({t} tokens)"))
        .unwrap_or_default();
    format!("{planner} turn {turn}: {what}{tokens}")
}

fn results_of(entry: &Value) -> Vec<ActionResult> {
    entry
        .get("results")
        .cloned()
        .and_then(|r| serde_json::from_value(r).ok())
        .unwrap_or_default()
}

/// Failed results in a task's result (for a warning: the scripted planner goes on after a
/// failed command, and the task still completes).
pub fn failed_results(task: &TaskView) -> usize {
    task.result
        .as_ref()
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(results_of)
        .filter(|r| r.status == proto_schemas::ResultStatus::Failure)
        .count()
}

/// A task as a few lines: state, executor, error, and its result (each command's outcome when
/// the result is the usual list of steps, pretty JSON otherwise).
pub fn task_summary(task: &TaskView, tools: &ToolNames) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "task      {}", task.task_id);
    let _ = writeln!(out, "name      {}", task.task_name);
    let _ = writeln!(out, "state     {}", task.state.as_str());
    let _ = writeln!(out, "request   {}", task.request);
    let _ = writeln!(out, "requester {}", task.requester);
    if let Some(executor) = &task.executor_id {
        let _ = writeln!(out, "executor  {executor}");
    }
    let _ = writeln!(out, "created   {}", task.created_at);
    let _ = writeln!(out, "updated   {}", task.updated_at);
    if let Some(error) = &task.error {
        match task.error_code {
            Some(code) => {
                let _ = writeln!(out, "error     {error} ({code})");
            }
            None => {
                let _ = writeln!(out, "error     {error}");
            }
        }
    }
    if let Some(result) = &task.result {
        out.push_str("result\n");
        out.push_str(&result_lines(result, tools));
    }
    out
}

/// The result of a task: one line per command result for the step-list shape.
pub fn result_lines(result: &Value, tools: &ToolNames) -> String {
    let steps = result.as_array().filter(|steps| {
        !steps.is_empty()
            && steps
                .iter()
                .all(|s| s.get("results").is_some_and(Value::is_array))
    });
    let Some(steps) = steps else {
        let pretty = format!("{result:#}");
        return pretty.lines().map(|l| format!("  {l}\n")).collect();
    };
    let mut table = Table::new(&["  STEP", "TOOL", "STATUS", "OUTPUT"]);
    for (i, step) in steps.iter().enumerate() {
        let number = step
            .get("step")
            .and_then(Value::as_i64)
            .map(|s| s + 1)
            .unwrap_or(i as i64 + 1);
        for r in results_of(step) {
            let output = match (&r.error, &r.result) {
                (Some(error), _) => error.clone(),
                (None, Some(value)) => compact(value, MAX_CELL),
                (None, None) => String::new(),
            };
            table.row(vec![
                format!("  {number}"),
                tools.get(r.call_id.as_deref()).unwrap_or("-").to_owned(),
                r.status.as_str().to_owned(),
                output,
            ]);
        }
    }
    table.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::sessions::TaskState;
    use serde_json::json;

    fn event(kind: &str, state: TaskState, data: Value) -> TaskEvent {
        TaskEvent {
            task_id: "t".into(),
            seq: 1,
            at: "2026-01-01T00:00:00Z".into(),
            kind: kind.into(),
            state,
            data: Some(data),
        }
    }

    #[test]
    fn tables_align_and_cut() {
        let mut table = Table::new(&["ID", "STATE"]);
        table.row(vec!["a".into(), "completed".into()]);
        table.row(vec!["x".repeat(80), "failed".into()]);
        let text = table.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], format!("ID{}STATE", " ".repeat(MAX_CELL)));
        assert!(lines[2].contains('…'));
        assert_eq!(lines[1].find("completed"), lines[0].find("STATE"));
    }

    #[test]
    fn events_read_like_sentences() {
        let mut tools = ToolNames::default();
        let sent = event(
            "command_sent",
            TaskState::Working,
            json!({"step": 0, "actions": [{"tool_name": "echo", "tool_type": "action", "call_id": "c1", "parameters": {"text": "hi"}}]}),
        );
        tools.learn(&sent);
        assert_eq!(
            describe_event(&sent, &tools),
            r#"step 1: sent echo {"text":"hi"}"#
        );
        let got = event(
            "results_received",
            TaskState::Working,
            json!({"step": 0, "results": [{"status": "success", "call_id": "c1", "result": {"text": "hi"}}]}),
        );
        assert_eq!(describe_event(&got, &tools), "step 1: echo success");
        let failed = event(
            "failed",
            TaskState::Failed,
            json!({"error": "no planner", "error_code": "UNAVAILABLE"}),
        );
        assert_eq!(
            describe_event(&failed, &tools),
            "failed: no planner (UNAVAILABLE)"
        );
        let turn = event(
            "planned",
            TaskState::Working,
            json!({"planner": "llm", "turn": 1, "messages": [{"role": "system", "content": "s"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "echo", "arguments": "{}"}}]}], "usage": {"total_tokens": 42}}),
        );
        assert_eq!(
            describe_event(&turn, &tools),
            "llm turn 1: called echo (42 tokens)"
        );
        let answer = event(
            "planned",
            TaskState::Working,
            json!({"planner": "llm", "turn": 2, "messages": [{"role": "assistant", "content": "done"}]}),
        );
        assert_eq!(
            describe_event(&answer, &tools),
            r#"llm turn 2: answered "done""#
        );
        let asked = event(
            "clarification_requested",
            TaskState::InputRequired,
            json!({"clarification_id": "q", "question": "Which file?"}),
        );
        assert_eq!(
            describe_event(&asked, &tools),
            r#"asked the requester: Which file? (answer: aip tasks answer t "…")"#
        );
        let moved = event(
            "handoff_accepted",
            TaskState::Dispatched,
            json!({"current_agent_id": "a", "new_agent_id": "b", "reason": "r"}),
        );
        assert_eq!(describe_event(&moved, &tools), "handed off from a to b");
        let result = json!([{"step": 0, "results": [{"status": "success", "call_id": "c1", "result": {"text": "hi"}}]}]);
        let lines = result_lines(&result, &tools);
        assert!(
            lines.contains("echo") && lines.contains(r#"{"text":"hi"}"#),
            "{lines}"
        );
        assert!(result_lines(&json!({"answer": 42}), &tools).contains("\"answer\": 42"));
    }
}
