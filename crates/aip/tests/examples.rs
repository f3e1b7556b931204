//! The Python examples, run for real: `examples/python_device.py` answers a dispatched task
//! through `aip dev`, and `examples/python_planner.py` plans a task over NATS for `aip dev
//! --nats-url`.
//!
//! They need `python3` with the packages in `scripts/python-requirements.txt`. Without them
//! each test says so and passes as skipped, unless `AIP_REQUIRE_PYTHON_EXAMPLES=1` is set (then
//! a missing package fails the test). The planner test also needs NATS at `NATS_URL` (default
//! `nats://127.0.0.1:4222`), like the rest of the workspace's NATS tests.

mod common;

use common::{Proc, TempDir, aip, start_dev, wait_available, workspace_root};

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
    let mut device = Proc::aip(
        "aip device",
        &[
            "device",
            "--url",
            &ws,
            "--id",
            "planned-pc",
            "--capability",
            "plan",
        ],
    );
    device.wait_for_stdout("registration", |out| {
        out.contains("registered as planned-pc").then_some(())
    });
    wait_available(&rest, "planned-pc");

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
