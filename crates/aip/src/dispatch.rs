//! `aip dispatch`: submit a task over REST, follow its events live (a spinner on a terminal,
//! plain lines otherwise) until it ends, print its result, and exit 0 only if it completed.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use proto_schemas::flow::TaskRequest;
use proto_schemas::sessions::{TaskEvent, TaskState, TaskView};
use serde_json::{Value, json};

use crate::cli::DispatchArgs;
use crate::output::{self, ToolNames};
use crate::rest::Broker;
use crate::{UsageError, exit, sse, steps};

/// Exit code when the user stops following with Ctrl-C (128 + SIGINT).
const INTERRUPTED: u8 = 130;

/// Builds the REST body from the arguments.
pub fn task_request(args: &DispatchArgs) -> Result<TaskRequest, UsageError> {
    let data: Option<Value> = match &args.data {
        None => None,
        Some(text) => Some(
            serde_json::from_str(text)
                .map_err(|e| UsageError(format!("--data is not valid JSON ({e}): {text}")))?,
        ),
    };
    // Built as JSON so that fields added to TaskRequest later keep their defaults.
    let mut body = json!({
        "version": 1,
        "description": args.request,
        "originating_agent_id": args.from,
        "required_capabilities": args.capabilities,
    });
    let optional = [
        ("target_id", args.target.clone().map(Value::from)),
        ("task_name", args.name.clone().map(Value::from)),
        ("data", data),
        ("priority", args.priority.map(Value::from)),
        ("timeout_secs", args.timeout.map(Value::from)),
        (
            "planner",
            args.planner.map(|p| Value::from(p.planner().as_str())),
        ),
        (
            "steps",
            steps::build(&args.step_sources)?
                .map(serde_json::to_value)
                .transpose()
                .map_err(|e| UsageError(format!("the steps cannot be written as JSON: {e}")))?,
        ),
    ];
    for (key, value) in optional {
        if let Some(value) = value {
            body[key] = value;
        }
    }
    serde_json::from_value(body).map_err(|e| UsageError(format!("invalid task: {e}")))
}

/// Runs `aip dispatch`; the result is the process's exit code.
pub async fn run(args: DispatchArgs) -> anyhow::Result<u8> {
    let request = task_request(&args)?;
    let broker = Broker::new(&args.rest)?;
    let started = Instant::now();
    let task: TaskView = broker.post("/api/tasks", &request).await?;
    if args.no_wait {
        if args.json {
            output::print_json(&task);
        } else {
            println!("task {} {}", task.task_id, task.state.as_str());
            println!("follow it with: aip tasks events {} --follow", task.task_id);
        }
        return Ok(exit::OK);
    }
    let progress = Progress::new(args.json);
    progress.line(&format!(
        "task {} submitted: {}",
        task.task_id,
        output::truncate(&task.request, 60)
    ));
    let mut tools = ToolNames::default();
    let follow = sse::follow(&broker, &task.task_id, 0, |event: &TaskEvent| {
        tools.learn(event);
        progress.event(&output::describe_event(event, &tools));
    });
    let ended = tokio::select! {
        ended = follow => ended,
        _ = tokio::signal::ctrl_c() => {
            progress.finish();
            eprintln!(
                "stopped following; the task goes on. Follow it again with: aip tasks events {} --follow",
                task.task_id
            );
            return Ok(INTERRUPTED);
        }
    };
    progress.finish();
    let ended = ended?;
    let took = started.elapsed();
    if args.json {
        output::print_json(&ended);
    } else {
        print_outcome(&ended, &tools, took);
    }
    Ok(if ended.state == TaskState::Completed {
        exit::OK
    } else {
        exit::TASK_NOT_COMPLETED
    })
}

fn print_outcome(task: &TaskView, tools: &ToolNames, took: Duration) {
    let executor = task.executor_id.as_deref().unwrap_or("no executor");
    let mut line = format!(
        "task {} {} on {executor} in {:.1} s",
        task.task_id,
        task.state.as_str(),
        took.as_secs_f64()
    );
    if let Some(error) = &task.error {
        line.push_str(&format!(": {error}"));
        if let Some(code) = task.error_code {
            line.push_str(&format!(" ({code})"));
        }
    }
    println!("{line}");
    if let Some(result) = &task.result {
        println!("result");
        print!("{}", output::result_lines(result, tools));
    }
    let failed = output::failed_results(task);
    if failed > 0 {
        println!(
            "warning: {failed} command(s) failed on the device (the scripted steps went on; see the result)"
        );
    }
}

/// Live display of a task's events: a spinner with a log above it on a terminal, plain lines
/// otherwise (on stderr when stdout is kept for `--json`).
enum Progress {
    Spinner(ProgressBar),
    Lines { to_stderr: bool },
}

impl Progress {
    fn new(json: bool) -> Self {
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed:>3} {msg}") {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(100));
            Progress::Spinner(bar)
        } else {
            Progress::Lines { to_stderr: json }
        }
    }

    /// A line that stays.
    fn line(&self, text: &str) {
        match self {
            Progress::Spinner(bar) => bar.println(text),
            Progress::Lines { to_stderr: true } => eprintln!("{text}"),
            Progress::Lines { to_stderr: false } => println!("{text}"),
        }
    }

    /// An event: logged, and shown next to the spinner.
    fn event(&self, text: &str) {
        self.line(&format!("  {text}"));
        if let Progress::Spinner(bar) = self {
            bar.set_message(text.to_owned());
        }
    }

    fn finish(&self) {
        if let Progress::Spinner(bar) = self {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Command, try_parse_from};

    #[test]
    fn the_walkthrough_command_becomes_a_scripted_task() {
        let cli = try_parse_from([
            "aip",
            "dispatch",
            "--capability",
            "demo",
            "--tool",
            "echo",
            "--args",
            r#"{"text":"hi"}"#,
            "say hi",
        ])
        .expect("parses");
        let Command::Dispatch(args) = cli.command else {
            panic!("dispatch expected")
        };
        let request = task_request(&args).expect("valid");
        let body = serde_json::to_value(&request).expect("serialises");
        assert_eq!(body["version"], 1);
        assert_eq!(body["description"], "say hi");
        assert_eq!(body["required_capabilities"], serde_json::json!(["demo"]));
        assert_eq!(body["steps"][0][0]["tool_name"], "echo");
        assert_eq!(body["steps"][0][0]["tool_type"], "action");
        assert_eq!(body["steps"][0][0]["parameters"]["text"], "hi");
        assert!(body.get("target_id").is_none());
    }
}
