//! The reference device's built-in tools, all safe to run anywhere: `echo`, `sleep`,
//! `system_info`, `list_tools`. Executing a `command` frame's Commands follows UFO's device:
//! one Result per Command, in order, each with its Command's `call_id`; after a failure the
//! remaining Commands are `skipped`.

use std::time::Duration;

use proto_schemas::{ActionResult, Command, JsonObject, McpToolInfo, ResultStatus, SystemInfo};
use serde_json::{Value, json};

/// The MCP namespace the tools are announced under.
pub const NAMESPACE: &str = "aip_device";
/// The longest `sleep` allowed.
pub const MAX_SLEEP: Duration = Duration::from_secs(30);

/// What the tools know of the device.
#[derive(Debug, Clone)]
pub struct Toolbox {
    /// Returned by `system_info`.
    pub system_info: SystemInfo,
}

fn tool(name: &str, tool_type: &str, description: &str, input: Value) -> McpToolInfo {
    McpToolInfo {
        tool_key: format!("{tool_type}::{name}"),
        tool_name: name.to_owned(),
        title: None,
        namespace: NAMESPACE.to_owned(),
        tool_type: tool_type.to_owned(),
        description: Some(description.to_owned()),
        input_schema: input.as_object().cloned(),
        output_schema: None,
        meta: None,
        annotations: None,
    }
}

/// The tools, as announced at REGISTER (`metadata.tools`) and returned by `list_tools`.
pub fn catalogue() -> Vec<McpToolInfo> {
    vec![
        tool(
            "echo",
            "action",
            "Returns its parameters unchanged.",
            json!({ "type": "object", "additionalProperties": true }),
        ),
        tool(
            "sleep",
            "action",
            "Waits `seconds` (at most 30), then returns how long it slept.",
            json!({ "type": "object", "properties": { "seconds": { "type": "number", "minimum": 0, "maximum": 30 } } }),
        ),
        tool(
            "system_info",
            "data_collection",
            "Returns this device's system information.",
            json!({ "type": "object" }),
        ),
        tool(
            "list_tools",
            "action",
            "Lists these tools (MCPToolInfo); `tool_type` filters by type.",
            json!({ "type": "object", "properties": { "tool_type": { "type": "string" } } }),
        ),
    ]
}

/// Why one tool call failed.
type ToolError = String;

impl Toolbox {
    /// Runs one Command.
    pub async fn run(&self, command: &Command) -> Result<Value, ToolError> {
        let params = command.parameters.clone().unwrap_or_default();
        match command.tool_name.as_str() {
            "echo" => Ok(Value::Object(params)),
            "sleep" => sleep(&params).await,
            "system_info" => serde_json::to_value(&self.system_info).map_err(|e| e.to_string()),
            "list_tools" => {
                let wanted = params.get("tool_type").and_then(Value::as_str);
                let tools: Vec<McpToolInfo> = catalogue()
                    .into_iter()
                    .filter(|t| wanted.is_none_or(|w| t.tool_type == w))
                    .collect();
                serde_json::to_value(tools).map_err(|e| e.to_string())
            }
            other => {
                let names: Vec<String> = catalogue().into_iter().map(|t| t.tool_name).collect();
                Err(format!(
                    "unknown tool `{other}`: this device offers {}",
                    names.join(", ")
                ))
            }
        }
    }

    /// Runs a `command` frame's Commands in order: one Result each; after a failure the rest
    /// are `skipped`.
    pub async fn run_all(&self, commands: &[Command]) -> Vec<ActionResult> {
        let mut results = Vec::with_capacity(commands.len());
        let mut failed = false;
        for command in commands {
            let (status, result, error) = if failed {
                (
                    ResultStatus::Skipped,
                    None,
                    Some("skipped: an earlier command in this step failed".to_owned()),
                )
            } else {
                match self.run(command).await {
                    Ok(value) => (ResultStatus::Success, Some(value), None),
                    Err(error) => {
                        failed = true;
                        (ResultStatus::Failure, None, Some(error))
                    }
                }
            };
            results.push(ActionResult {
                status,
                error,
                result,
                namespace: Some(NAMESPACE.to_owned()),
                call_id: command.call_id.clone(),
            });
        }
        results
    }
}

async fn sleep(params: &JsonObject) -> Result<Value, ToolError> {
    let seconds = match params.get("seconds") {
        None | Some(Value::Null) => 1.0,
        Some(value) => value
            .as_f64()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| format!("`seconds` must be a number ≥ 0, got {value}"))?,
    };
    let capped = seconds.min(MAX_SLEEP.as_secs_f64());
    tokio::time::sleep(Duration::from_secs_f64(capped)).await;
    let mut answer = json!({ "slept_seconds": capped });
    if capped < seconds {
        answer["capped_from"] = json!(seconds);
    }
    Ok(answer)
}

/// This machine's system information, as UFO's device reports it at REGISTER.
pub fn system_info(device_id: &str, platform: &str) -> SystemInfo {
    SystemInfo {
        device_id: Some(device_id.to_owned()),
        platform: Some(platform.to_owned()),
        os_version: os_version(),
        cpu_count: std::thread::available_parallelism()
            .ok()
            .and_then(|n| u32::try_from(n.get()).ok()),
        memory_total_gb: memory_total_gb(),
        hostname: Some(hostname()),
        ip_address: None,
        supported_features: Some(vec!["cli".to_owned()]),
        platform_type: Some("computer".to_owned()),
        schema_version: Some("1.0".to_owned()),
        custom_metadata: Some(
            [
                ("agent".to_owned(), json!("aip device")),
                ("version".to_owned(), json!(env!("CARGO_PKG_VERSION"))),
                ("os".to_owned(), json!(std::env::consts::OS)),
                ("arch".to_owned(), json!(std::env::consts::ARCH)),
            ]
            .into_iter()
            .collect(),
        ),
        extra: JsonObject::new(),
    }
}

/// The host name: the kernel's on Linux, else the usual environment variables.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .or_else(|| std::env::var("COMPUTERNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "localhost".to_owned())
}

fn os_version() -> Option<String> {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_owned())
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|k| k.trim().to_owned());
    match (pretty, kernel) {
        (Some(p), Some(k)) => Some(format!("{p} (kernel {k})")),
        (p, k) => p.or(k).or_else(|| Some(std::env::consts::OS.to_owned())),
    }
}

fn memory_total_gb() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some((kib / 1024.0 / 1024.0 * 10.0).round() / 10.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::ToolType;

    fn command(tool: &str, parameters: Value, call: &str) -> Command {
        Command {
            tool_name: tool.to_owned(),
            parameters: parameters.as_object().cloned(),
            tool_type: ToolType::Action,
            call_id: Some(call.to_owned()),
        }
    }

    fn toolbox() -> Toolbox {
        Toolbox {
            system_info: system_info("pc", "linux"),
        }
    }

    #[tokio::test]
    async fn one_result_per_command_and_skipped_after_a_failure() {
        let results = toolbox()
            .run_all(&[
                command("echo", json!({ "text": "hi" }), "c1"),
                command("rm_rf", json!({}), "c2"),
                command("echo", json!({}), "c3"),
            ])
            .await;
        let statuses: Vec<_> = results.iter().map(|r| r.status).collect();
        assert_eq!(
            statuses,
            [
                ResultStatus::Success,
                ResultStatus::Failure,
                ResultStatus::Skipped
            ]
        );
        let calls: Vec<_> = results.iter().map(|r| r.call_id.as_deref()).collect();
        assert_eq!(calls, [Some("c1"), Some("c2"), Some("c3")]);
        assert_eq!(results[0].result, Some(json!({ "text": "hi" })));
        let error = results[1].error.as_deref().unwrap_or_default();
        assert!(
            error.contains("unknown tool `rm_rf`") && error.contains("echo"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn sleep_is_capped_and_checked() {
        tokio::time::pause();
        let toolbox = toolbox();
        let answer = toolbox
            .run(&command("sleep", json!({ "seconds": 3600 }), "c"))
            .await
            .expect("sleeps");
        assert_eq!(answer["slept_seconds"], 30.0);
        assert_eq!(answer["capped_from"], 3600.0);
        assert!(
            toolbox
                .run(&command("sleep", json!({ "seconds": "x" }), "c"))
                .await
                .is_err()
        );
        assert!(
            toolbox
                .run(&command("sleep", json!({ "seconds": -1 }), "c"))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn list_tools_returns_mcp_tool_infos_filtered_by_type() {
        let toolbox = toolbox();
        let all = toolbox
            .run(&command("list_tools", json!({}), "c"))
            .await
            .expect("lists");
        let all: Vec<McpToolInfo> = serde_json::from_value(all).expect("MCPToolInfo list");
        assert_eq!(all.len(), 4);
        assert!(
            all.iter()
                .all(|t| t.tool_key == format!("{}::{}", t.tool_type, t.tool_name))
        );
        let actions = toolbox
            .run(&command(
                "list_tools",
                json!({ "tool_type": "action" }),
                "c",
            ))
            .await
            .expect("lists");
        assert!(
            actions
                .as_array()
                .is_some_and(|a| a.len() == 3 && a.iter().all(|t| t["tool_type"] == "action"))
        );
        let info = toolbox
            .run(&command("system_info", json!({}), "c"))
            .await
            .expect("info");
        assert_eq!(info["device_id"], "pc");
        assert!(info["cpu_count"].as_u64().is_some_and(|n| n >= 1));
    }
}
