//! The Python examples, run for real: `examples/python_device.py` answers a dispatched task
//! through `aip dev`, `examples/python_planner.py` plans a task over NATS for `aip dev
//! --nats-url`, `examples/http_planner.py` plans a Galaxy task for `aip dev --planner-url`, and
//! `examples/langgraph_planner.py` drives a device through the broker with a LangGraph agent.
//!
//! They need `python3` with the packages in `scripts/python-requirements.txt`. Without them
//! each test says so and passes as skipped, unless `AIP_REQUIRE_PYTHON_EXAMPLES=1` is set (then
//! a missing package fails the test). The planner test also needs NATS at `NATS_URL` (default
//! `nats://127.0.0.1:4222`), like the rest of the workspace's NATS tests.

mod common;

use common::{
    Proc, Seen, TempDir, aip, model_server, start_dev, start_dev_with, start_device,
    wait_available, workspace_root,
};

/// Whether `python3` can import `module`; if not, explains and says whether to skip.
fn python_has(module: &str) -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return true;
    }
    let message = format!(
        "python3 cannot import `{module}`: install the examples' packages with \
         `python3 -m pip install -r scripts/python-requirements.txt`"
    );
    if std::env::var("AIP_REQUIRE_PYTHON_EXAMPLES").is_ok_and(|v| v == "1") {
        panic!("{message}");
    }
    eprintln!("SKIPPED: {message}");
    false
}

fn example(name: &str) -> String {
    workspace_root()
        .join("examples")
        .join(name)
        .to_str()
        .expect("utf-8 path")
        .to_owned()
}

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

#[test]
fn python_device_answers_dispatched_tasks() {
    if !python_has("websockets") {
        return;
    }
    let data = TempDir::new("pydevice");
    let (_dev, rest, ws) = start_dev(data.path(), &[]);
    let script = example("python_device.py");
    let mut device = Proc::spawn(
        "python_device.py",
        "python3",
        &[
            "-u",
            &script,
            "--url",
            &ws,
            "--id",
            "py-pc",
            "--capability",
            "py",
        ],
        &[],
    );
    device.wait_for_stdout("registration", |out| {
        out.contains("registered as py-pc").then_some(())
    });
    wait_available(&rest, "py-pc");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "py",
        "--tool",
        "upper",
        "--args",
        r#"{"text":"hi"}"#,
        "--json",
        "shout",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}\n{}", device.output());
    let task = run.json();
    assert_eq!(task["state"], "completed");
    assert_eq!(
        task["result"][0]["results"][0]["result"]["text"], "HI",
        "{task}"
    );

    // A failing Command makes the rest of its step `skipped`, as UFO's device does.
    let step =
        r#"[{"tool_name":"nope","tool_type":"action"},{"tool_name":"echo","tool_type":"action"}]"#;
    let run = aip(&[
        "dispatch", "--rest", &rest, "--target", "py-pc", "--step", step, "--json", "x",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let results = &run.json()["result"][0]["results"];
    assert_eq!(results[0]["status"], "failure", "{results}");
    assert!(
        results[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("unknown tool `nope`"))
    );
    assert_eq!(results[1]["status"], "skipped", "{results}");
    device.wait_for_stdout("the device's log of task_end", |out| {
        out.contains("task_end completed").then_some(())
    });
}

/// Deletes the JetStream streams `aip dev --subject-prefix <prefix>` created, when dropped (the
/// NATS server is shared with other tests and runs).
struct Streams {
    nats: String,
    prefix: String,
}

impl Drop for Streams {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            use aip_bus::Bus as _;
            let Ok(bus) = aip_bus::NatsBus::connect(&self.nats, "aip-test-cleanup").await else {
                return;
            };
            let subjects = proto_schemas::Subjects::new(&self.prefix).expect("valid prefix");
            for stream in [subjects.frames_stream(), subjects.blobs_stream()] {
                if let Err(e) = bus.delete_stream(stream).await {
                    eprintln!("test stream not deleted: {e}");
                }
            }
        });
    }
}

#[test]
fn python_planner_plans_a_task_over_nats() {
    if !python_has("nats") {
        return;
    }
    let data = TempDir::new("pyplanner");
    let prefix = format!("t_{}", uuid::Uuid::new_v4().simple());
    let nats = nats_url();
    let _streams = Streams {
        nats: nats.clone(),
        prefix: prefix.clone(),
    };
    let database = format!("sqlite://{}", data.path().join("planner.db").display());
    let (_dev, rest, ws) = start_dev(
        data.path(),
        &[
            "--nats-url",
            &nats,
            "--subject-prefix",
            &prefix,
            "--database-url",
            &database,
        ],
    );
    let script = example("python_planner.py");
    let mut planner = Proc::spawn(
        "python_planner.py",
        "python3",
        &["-u", &script, "--nats-url", &nats, "--prefix", &prefix],
        &[],
    );
    planner.wait_for_stdout("the planner", |out| {
        out.contains("planner ready").then_some(())
    });
    let device = start_device(&ws, &rest, "planned-pc", "plan");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "plan",
        "--json",
        "hello planner",
    ]);
    assert_eq!(
        run.code,
        Some(0),
        "{run:?}\n{}\n{}",
        planner.output(),
        device.output()
    );
    let task = run.json();
    assert_eq!(task["state"], "completed", "{task}");
    assert_eq!(task["result"]["planner"], "python", "{task}");
    assert_eq!(task["result"]["echoed"]["text"], "hello planner", "{task}");
    assert!(
        planner.stdout().contains("\"decision\": \"complete\""),
        "{}",
        planner.output()
    );
}

/// A secret in Standard Webhooks' form, shared by the broker and the planner.
const PLANNER_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[test]
fn http_planner_plans_a_galaxy_task_in_aip_dev() {
    if !python_has("standardwebhooks") {
        return;
    }
    let script = example("http_planner.py");
    let mut planner = Proc::spawn(
        "http_planner.py",
        "python3",
        &["-u", &script, "--port", "0", "--secret", PLANNER_SECRET],
        &[],
    );
    let url = planner.wait_for_stdout("the planner", |out| {
        out.lines()
            .find_map(|l| l.strip_prefix("planner ready on "))
            .map(|u| u.trim().to_owned())
    });
    let data = TempDir::new("httpplanner");
    let (_dev, rest, ws) = start_dev_with(
        data.path(),
        &["--planner-url", &url],
        &[("AIP_SESSIONS__PLANNER__SECRET", PLANNER_SECRET)],
    );

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        use aip_testkit::Client;
        use aip_testkit::frames::{
            command_results_for, constellation_register, constellation_task, device_register,
        };
        // A UFO device and a Galaxy constellation, as their own clients speak.
        let mut device = Client::registered(&ws, device_register("galaxy-pc", "windows")).await;
        wait_available(&rest, "galaxy-pc");
        let galaxy_id = "aip_constellation@galaxy-pc";
        let mut galaxy =
            Client::registered(&ws, constellation_register(galaxy_id, Some("galaxy-pc"))).await;
        galaxy
            .send(&constellation_task(
                galaxy_id,
                "galaxy-pc",
                "galaxy-s1",
                "t1",
                None,
            ))
            .await
            .expect("task");
        let command = device.recv_type("command").await.expect("command");
        assert_eq!(command["agent_name"], "HostAgent");
        assert_eq!(command["actions"][0]["tool_name"], "echo");
        device
            .send(&command_results_for("galaxy-pc", &command))
            .await
            .expect("results");
        let end = galaxy.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["status"], "completed", "{end}\n{}", planner.output());
        assert_eq!(end["session_id"], "galaxy-s1");
        assert_eq!(end["result"]["planner"], "python-http", "{end}");
        assert_eq!(
            end["result"]["echoed"]["echo"]["text"], "open notepad and type hello",
            "{end}"
        );
    });
    // The planner's output is read from its pipe by another thread: the second step's line
    // may arrive just after the `task_end`.
    let decisions = |out: &str| out.matches("\"decision\": ").count();
    planner.wait_for_stdout("the second planned step", |out| {
        (decisions(out) >= 2).then_some(())
    });
    assert_eq!(
        decisions(&planner.stdout()),
        2,
        "two signed steps were planned: {}",
        planner.output()
    );
}

#[test]
fn langgraph_planner_runs_its_tools_on_a_device_through_the_broker() {
    if !python_has("langgraph") || !python_has("langchain_openai") {
        return;
    }
    let seen = Seen::default();
    let base_url = model_server(seen.clone());
    let data = TempDir::new("langgraph");
    let (_dev, rest, ws) = start_dev(data.path(), &[]);
    let _device = start_device(&ws, &rest, "graph-pc", "graph");

    let script = example("langgraph_planner.py");
    let mut agent = Proc::spawn(
        "langgraph_planner.py",
        "python3",
        &[
            "-u",
            &script,
            "--rest",
            &rest,
            "--capability",
            "graph",
            "--model",
            "graph-model",
            "say hi",
        ],
        &[
            ("OPENAI_BASE_URL", &base_url),
            ("OPENAI_API_KEY", "sk-test"),
        ],
    );
    let status = agent.wait_exit();
    assert!(status.success(), "{}", agent.output());
    assert!(
        agent
            .stdout()
            .contains("completed: The device echoed: hi from the model"),
        "{}",
        agent.output()
    );
    let task_id = agent
        .stdout()
        .lines()
        .find_map(|l| {
            l.strip_prefix("task ")
                .and_then(|r| r.strip_suffix(" opened"))
        })
        .expect("the task id")
        .to_owned();
    let run = aip(&["tasks", "get", "--rest", &rest, "--json", &task_id]);
    let task = run.json();
    assert_eq!(task["state"], "completed", "{task}");
    assert_eq!(task["result"], "The device echoed: hi from the model");
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "two model calls");
    let functions: Vec<&str> = seen[0]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert!(functions.contains(&"echo"), "{functions:?}");
}
