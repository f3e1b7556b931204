//! The scripted steps of `aip dispatch`: `--step JSON` and `--tool NAME --args JSON`, in
//! command-line order, turned into the task's `steps` (lists of Commands).

use proto_schemas::{Command, JsonObject, ToolType};
use serde_json::Value;

use crate::UsageError;

/// One step as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepSource {
    /// `--step JSON`: a list of Commands, or one Command.
    Json(String),
    /// `--tool NAME [--args JSON]`: one Command.
    Tool {
        /// The tool.
        name: String,
        /// Its parameters (a JSON object), if given.
        args: Option<String>,
    },
}

/// Puts `--step`, `--tool` and `--args` values (each with its position on the command line)
/// into command-line order, giving each `--args` to the `--tool` just before it.
pub fn order(
    steps: Vec<(usize, String)>,
    tools: Vec<(usize, String)>,
    args: Vec<(usize, String)>,
) -> Result<Vec<StepSource>, UsageError> {
    let mut sources: Vec<(usize, StepSource)> = steps
        .into_iter()
        .map(|(i, json)| (i, StepSource::Json(json)))
        .chain(
            tools
                .into_iter()
                .map(|(i, name)| (i, StepSource::Tool { name, args: None })),
        )
        .collect();
    sources.sort_by_key(|(i, _)| *i);
    for (at, json) in args {
        let owner = sources
            .iter_mut()
            .rev()
            .find(|(i, _)| *i < at)
            .map(|(_, source)| source);
        match owner {
            Some(StepSource::Tool {
                args: slot @ None, ..
            }) => *slot = Some(json),
            Some(StepSource::Tool { name, .. }) => {
                return Err(UsageError(format!(
                    "--args given twice for --tool {name}; give each --tool at most one --args"
                )));
            }
            _ => {
                return Err(UsageError(
                    "--args must follow the --tool it belongs to (e.g. --tool echo --args '{\"text\":\"hi\"}')"
                        .to_owned(),
                ));
            }
        }
    }
    Ok(sources.into_iter().map(|(_, source)| source).collect())
}

/// Builds the task's steps. `None` when no step was given (the broker then asks a planner).
pub fn build(sources: &[StepSource]) -> Result<Option<Vec<Vec<Command>>>, UsageError> {
    if sources.is_empty() {
        return Ok(None);
    }
    sources
        .iter()
        .enumerate()
        .map(|(i, source)| match source {
            StepSource::Json(text) => {
                parse_step(text).map_err(|e| UsageError(format!("--step #{}: {e}", i + 1)))
            }
            StepSource::Tool { name, args } => {
                let parameters = match args {
                    None => None,
                    Some(text) => Some(
                        parse_object(text)
                            .map_err(|e| UsageError(format!("--args of --tool {name}: {e}")))?,
                    ),
                };
                Ok(vec![Command {
                    tool_name: name.clone(),
                    parameters,
                    tool_type: ToolType::Action,
                    call_id: None,
                }])
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn parse_step(text: &str) -> Result<Vec<Command>, String> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e}): {text}"))?;
    let commands = match value {
        Value::Array(_) => serde_json::from_value::<Vec<Command>>(value),
        Value::Object(_) => serde_json::from_value::<Command>(value).map(|c| vec![c]),
        _ => {
            return Err(
                "expected a list of Commands or one Command, e.g. [{\"tool_name\":\"echo\",\"tool_type\":\"action\",\"parameters\":{}}]"
                    .to_owned(),
            );
        }
    }
    .map_err(|e| {
        format!("not a Command list ({e}); a Command is {{\"tool_name\":…,\"tool_type\":\"action\"|\"data_collection\",\"parameters\":{{…}}}}")
    })?;
    if commands.is_empty() {
        return Err("a step needs at least one Command".to_owned());
    }
    Ok(commands)
}

/// Parses a JSON object argument.
pub fn parse_object(text: &str) -> Result<JsonObject, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(format!(
            "expected a JSON object such as {{\"text\":\"hi\"}}, got {text}"
        )),
        Err(e) => Err(format!("not valid JSON ({e}): {text}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_and_steps_become_commands() {
        let steps = build(&[
            StepSource::Tool {
                name: "echo".into(),
                args: Some(r#"{"text":"hi"}"#.into()),
            },
            StepSource::Json(r#"{"tool_name":"system_info","tool_type":"data_collection"}"#.into()),
            StepSource::Json(
                r#"[{"tool_name":"a","tool_type":"action"},{"tool_name":"b","tool_type":"action"}]"#
                    .into(),
            ),
        ])
        .expect("valid")
        .expect("some steps");
        assert_eq!(steps.len(), 3);
        assert_eq!(steps[0][0].tool_name, "echo");
        assert_eq!(
            steps[0][0].parameters.as_ref().and_then(|p| p.get("text")),
            Some(&Value::from("hi"))
        );
        assert_eq!(steps[1][0].tool_type, ToolType::DataCollection);
        assert_eq!(steps[2].len(), 2);
        assert_eq!(build(&[]).expect("valid"), None);
    }

    #[test]
    fn bad_json_says_where() {
        let err = build(&[StepSource::Tool {
            name: "echo".into(),
            args: Some("{text:hi}".into()),
        }])
        .expect_err("invalid");
        assert!(err.0.contains("--args of --tool echo"), "{err}");
        let err = build(&[StepSource::Json(
            r#"[{"tool_name":"x","tool_type":"click"}]"#.into(),
        )])
        .expect_err("bad tool_type");
        assert!(err.0.starts_with("--step #1"), "{err}");
        let err = build(&[StepSource::Json("[]".into())]).expect_err("empty");
        assert!(err.0.contains("at least one"), "{err}");
    }

    #[test]
    fn args_pair_with_the_tool_before_them() {
        let sources = order(
            vec![(3, "[]".into())],
            vec![(1, "a".into()), (5, "b".into())],
            vec![(2, "{}".into()), (6, "{\"x\":1}".into())],
        )
        .expect("valid");
        assert_eq!(
            sources,
            [
                StepSource::Tool {
                    name: "a".into(),
                    args: Some("{}".into())
                },
                StepSource::Json("[]".into()),
                StepSource::Tool {
                    name: "b".into(),
                    args: Some("{\"x\":1}".into())
                },
            ]
        );
        assert!(
            order(
                vec![],
                vec![(1, "a".into())],
                vec![(2, "{}".into()), (3, "{}".into())]
            )
            .is_err()
        );
        assert!(order(vec![(1, "[]".into())], vec![], vec![(2, "{}".into())]).is_err());
    }
}
