//! `aip tasks …` and `aip agents …`: the REST API as tables for people and JSON for scripts.

use proto_schemas::registry::AgentRecord;
use proto_schemas::sessions::{TaskEvent, TaskView};
use serde::Deserialize;
use serde_json::json;

use crate::cli::{AgentsCommand, TasksCommand};
use crate::output::{self, Table, ToolNames};
use crate::rest::{Broker, path_segment};
use crate::sse;

/// `GET /api/tasks` body.
#[derive(Debug, Deserialize)]
struct TaskPage {
    tasks: Vec<TaskView>,
}

/// `GET /api/tasks/{id}/events` body.
#[derive(Debug, Deserialize)]
struct EventLog {
    events: Vec<TaskEvent>,
}

async fn events_of(broker: &Broker, id: &str) -> anyhow::Result<Vec<TaskEvent>> {
    let log: EventLog = broker
        .get(
            &format!("/api/tasks/{}/events", path_segment(id)),
            &[("limit", "10000".to_owned())],
        )
        .await?;
    Ok(log.events)
}

fn event_table(events: &[TaskEvent], tools: &ToolNames) -> Table {
    let mut table = Table::new(&["SEQ", "AT", "STATE", "EVENT"]);
    for event in events {
        table.row(vec![
            event.seq.to_string(),
            event.at.clone(),
            event.state.as_str().to_owned(),
            output::describe_event(event, tools),
        ]);
    }
    table
}

fn names(events: &[TaskEvent]) -> ToolNames {
    let mut tools = ToolNames::default();
    events.iter().for_each(|e| tools.learn(e));
    tools
}

/// Runs `aip tasks …`.
pub async fn tasks(command: TasksCommand) -> anyhow::Result<()> {
    match command {
        TasksCommand::List {
            state,
            executor,
            name,
            limit,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let mut query = vec![("limit", limit.to_string())];
            query.extend(state.map(|s| ("state", s)));
            query.extend(executor.map(|e| ("executor", e)));
            query.extend(name.map(|n| ("task_name", n)));
            if json {
                let page: serde_json::Value = broker.get("/api/tasks", &query).await?;
                output::print_json(&page);
                return Ok(());
            }
            let page: TaskPage = broker.get("/api/tasks", &query).await?;
            if page.tasks.is_empty() {
                println!("no tasks");
                return Ok(());
            }
            let mut table = Table::new(&["ID", "NAME", "STATE", "EXECUTOR", "CREATED", "REQUEST"]);
            for task in &page.tasks {
                table.row(vec![
                    task.task_id.clone(),
                    task.task_name.clone(),
                    task.state.as_str().to_owned(),
                    task.executor_id.clone().unwrap_or_else(|| "-".to_owned()),
                    task.created_at.clone(),
                    task.request.clone(),
                ]);
            }
            print!("{}", table.render());
        }
        TasksCommand::Get { id, json, rest } => {
            let broker = Broker::new(&rest)?;
            let task: TaskView = broker
                .get(&format!("/api/tasks/{}", path_segment(&id)), &[])
                .await?;
            if json {
                output::print_json(&task);
                return Ok(());
            }
            let events = events_of(&broker, &id).await?;
            let tools = names(&events);
            print!("{}", output::task_summary(&task, &tools));
            println!("events");
            print!("{}", indent(&event_table(&events, &tools).render()));
        }
        TasksCommand::Events {
            id,
            follow,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let events = events_of(&broker, &id).await?;
            if !follow {
                if json {
                    output::print_json(&json!({ "task_id": id, "events": events }));
                } else {
                    print!("{}", event_table(&events, &names(&events)).render());
                }
                return Ok(());
            }
            let mut tools = names(&events);
            let print = |event: &TaskEvent, tools: &ToolNames| {
                if json {
                    match serde_json::to_string(event) {
                        Ok(line) => println!("{line}"),
                        Err(e) => {
                            eprintln!("aip: event {} cannot be written as JSON: {e}", event.seq)
                        }
                    }
                } else {
                    println!(
                        "{:>4}  {}  {:<14}  {}",
                        event.seq,
                        event.at,
                        event.state.as_str(),
                        output::describe_event(event, tools)
                    );
                }
            };
            for event in &events {
                print(event, &tools);
            }
            if events.last().is_some_and(|e| e.state.is_terminal()) {
                return Ok(());
            }
            let after = events.last().map_or(0, |e| e.seq);
            sse::follow(&broker, &id, after, |event| {
                tools.learn(event);
                print(event, &tools);
            })
            .await?;
        }
        TasksCommand::Cancel {
            id,
            reason,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let body = match reason {
                Some(reason) => json!({ "reason": reason }),
                None => json!({}),
            };
            let task: TaskView = broker
                .post(&format!("/api/tasks/{}/cancel", path_segment(&id)), &body)
                .await?;
            if json {
                output::print_json(&task);
            } else {
                println!("task {} {}", task.task_id, task.state.as_str());
            }
        }
        TasksCommand::Answer {
            id,
            answer,
            question,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let question = match question {
                Some(question) => question,
                None => {
                    let task: TaskView = broker
                        .get(&format!("/api/tasks/{}", path_segment(&id)), &[])
                        .await?;
                    task.clarification
                        .map(|c| c.clarification_id)
                        .ok_or_else(|| {
                            anyhow::anyhow!(
                                "task {id} has no open question (it is {})",
                                task.state.as_str()
                            )
                        })?
                }
            };
            let path = format!(
                "/api/tasks/{}/clarifications/{}",
                path_segment(&id),
                path_segment(&question)
            );
            let task: TaskView = broker
                .post(
                    &path,
                    &json!({ "answer": answer, "provided_by": "aip-cli" }),
                )
                .await?;
            if json {
                output::print_json(&task);
            } else {
                println!("task {} {}", task.task_id, task.state.as_str());
            }
        }
        TasksCommand::Handoff {
            id,
            reason,
            target,
            capabilities,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let mut body = json!({ "reason": reason, "requested_by": "aip-cli" });
            match target {
                Some(target) => body["target_id"] = json!(target),
                None => body["required_capabilities"] = json!(capabilities),
            }
            let task: TaskView = broker
                .post(&format!("/api/tasks/{}/handoff", path_segment(&id)), &body)
                .await?;
            if json {
                output::print_json(&task);
            } else {
                println!(
                    "task {} {} on {}",
                    task.task_id,
                    task.state.as_str(),
                    task.executor_id.as_deref().unwrap_or("?")
                );
            }
        }
    }
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Runs `aip agents …`.
pub async fn agents(command: AgentsCommand) -> anyhow::Result<()> {
    match command {
        AgentsCommand::List {
            capabilities,
            status,
            json,
            rest,
        } => {
            let broker = Broker::new(&rest)?;
            let mut query: Vec<(&str, String)> = capabilities
                .into_iter()
                .map(|c| ("capability", c))
                .collect();
            query.extend(status.map(|s| ("status", s)));
            let agents: Vec<AgentRecord> = broker.get("/api/agents", &query).await?;
            if json {
                output::print_json(&agents);
                return Ok(());
            }
            if agents.is_empty() {
                println!("no agents (start one with: aip device --id demo-pc --capability demo)");
                return Ok(());
            }
            let mut table = Table::new(&[
                "ID",
                "TYPE",
                "STATUS",
                "PLATFORM",
                "LOAD",
                "CAPABILITIES",
                "LAST SEEN",
            ]);
            for agent in &agents {
                table.row(vec![
                    agent.agent_id.clone(),
                    agent.client_type.as_str().to_owned(),
                    agent.status.as_str().to_owned(),
                    agent.platform.as_str().to_owned(),
                    agent.load.to_string(),
                    agent.capabilities.join(","),
                    agent.last_seen.to_rfc3339(),
                ]);
            }
            print!("{}", table.render());
        }
        AgentsCommand::Get { id, json, rest } => {
            let broker = Broker::new(&rest)?;
            let agent: AgentRecord = broker
                .get(&format!("/api/agents/{}", path_segment(&id)), &[])
                .await?;
            if json {
                output::print_json(&agent);
                return Ok(());
            }
            println!("agent        {}", agent.agent_id);
            println!("type         {}", agent.client_type.as_str());
            println!("status       {}", agent.status.as_str());
            println!("platform     {}", agent.platform.as_str());
            println!("load         {}", agent.load);
            println!("capabilities {}", agent.capabilities.join(", "));
            println!("gateway      {}", agent.gateway_id);
            println!("connected    {}", agent.connected_at.to_rfc3339());
            println!("last seen    {}", agent.last_seen.to_rfc3339());
            if let Some(target) = &agent.target_id {
                println!("target       {target}");
            }
            if !agent.tools.is_empty() {
                println!("tools");
                let mut table = Table::new(&["  TOOL", "TYPE", "DESCRIPTION"]);
                for tool in &agent.tools {
                    table.row(vec![
                        format!("  {}", tool.tool_name),
                        tool.tool_type.clone(),
                        tool.description.clone().unwrap_or_default(),
                    ]);
                }
                print!("{}", table.render());
            }
            if let Some(info) = &agent.system_info {
                println!("system info  {}", output::compact(info, 200));
            }
        }
    }
    Ok(())
}
