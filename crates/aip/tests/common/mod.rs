//! Running `aip` as real processes in tests: start, read output, wait on conditions with
//! deadlines, and kill on drop so a failing test leaves nothing running. A process that
//! exits by itself while the test still counts on it (nobody waited for its exit) fails the
//! test when it is dropped.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long a test waits for something that should happen.
pub const WAIT: Duration = Duration::from_secs(30);

/// The `aip` binary under test.
pub fn aip_bin() -> &'static str {
    env!("CARGO_BIN_EXE_aip")
}

/// The workspace root (for `examples/` and `scripts/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("aip-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running process whose output is collected; killed when dropped.
pub struct Proc {
    name: String,
    child: Option<Child>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    /// The threads copying stdout and stderr; they end when the process closes its pipes.
    readers: Vec<std::thread::JoinHandle<()>>,
    /// Set once the test has waited for the exit ([`Proc::wait_exit`], [`Proc::terminate`]):
    /// an exit before that is a death.
    exit_expected: bool,
}

fn collect<R: Read + Send + 'static>(
    from: R,
    into: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = String::new();
        while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            into.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&line);
            line.clear();
        }
    })
}

impl Proc {
    /// Starts `program args…` with `envs`, collecting stdout and stderr.
    pub fn spawn(name: &str, program: &str, args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let mut command = Command::new(program);
        command
            .args(args)
            // A developer's model endpoint would make the built-in agent every test's planner.
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .envs(envs.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({program}): {e}"));
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(collect(out, stdout.clone()));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(collect(err, stderr.clone()));
        }
        Proc {
            name: name.to_owned(),
            child: Some(child),
            stdout,
            stderr,
            readers,
            exit_expected: false,
        }
    }

    /// Starts `aip args…`.
    pub fn aip(name: &str, args: &[&str]) -> Proc {
        Proc::spawn(name, aip_bin(), args, &[])
    }

    pub fn stdout(&self) -> String {
        self.stdout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until `check` finds something in stdout; panics with the output otherwise.
    pub fn wait_for_stdout<T>(&mut self, what: &str, check: impl Fn(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(found) = check(&self.stdout()) {
                return found;
            }
            if let Some(status) = self.try_status() {
                panic!(
                    "{} exited ({status}) before {what}\n--- stdout\n{}\n--- stderr\n{}",
                    self.name,
                    self.stdout(),
                    self.stderr()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what} from {}\n--- stdout\n{}\n--- stderr\n{}",
                    self.name,
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its exit status, if it has exited.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends SIGTERM (as Kubernetes or `kill` would) and waits for the exit, at most `WAIT`.
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.as_ref().map(Child::id).expect("running");
        let sent = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -TERM {pid} failed");
        self.wait_exit()
    }

    /// Waits for the process to exit by itself, at most `WAIT`.
    pub fn wait_exit(&mut self) -> ExitStatus {
        self.exit_expected = true;
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.try_status() {
                // The process has closed its pipes: the readers finish with its last lines.
                for reader in self.readers.drain(..) {
                    let _ = reader.join();
                }
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "{} did not exit within {WAIT:?}\n--- stdout\n{}\n--- stderr\n{}",
                    self.name,
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What it printed, for assertion messages.
    pub fn output(&self) -> String {
        format!(
            "--- {} stdout\n{}\n--- {} stderr\n{}",
            self.name,
            self.stdout(),
            self.name,
            self.stderr()
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            if std::thread::panicking() {
                eprintln!("{}", self.output());
            } else if let Some(status) = exited
                && !self.exit_expected
            {
                panic!(
                    "{} exited by itself during the test ({status})\n{}",
                    self.name,
                    self.output()
                );
            }
        }
    }
}

/// A finished `aip …` run.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Stdout as JSON (for `--json`).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{self:?}"))
    }
}

/// Runs `aip args…` to completion (killed after `WAIT`).
pub fn aip(args: &[&str]) -> Run {
    let mut proc = Proc::aip(&format!("aip {}", args.first().unwrap_or(&"")), args);
    let status = proc.wait_exit();
    Run {
        code: status.code(),
        stdout: proc.stdout(),
        stderr: proc.stderr(),
    }
}

/// `aip dev` on a free port with its data in `data_dir` (plus `extra` flags); returns the
/// process and its REST and WebSocket URLs, read from its banner.
pub fn start_dev(data_dir: &Path, extra: &[&str]) -> (Proc, String, String) {
    start_dev_with(data_dir, extra, &[])
}

/// As [`start_dev`], with environment variables.
pub fn start_dev_with(
    data_dir: &Path,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> (Proc, String, String) {
    let data = data_dir.to_str().expect("utf-8 path");
    let mut args = vec!["dev", "--listen", "127.0.0.1:0", "--data-dir", data];
    args.extend_from_slice(extra);
    let mut dev = Proc::spawn("aip dev", aip_bin(), &args, envs);
    let ws = dev.wait_for_stdout("the WebSocket URL", |out| {
        out.lines()
            .find_map(|l| l.trim().strip_prefix("WebSocket"))
            .map(|rest| rest.trim().to_owned())
    });
    let rest = dev.wait_for_stdout("the REST URL", |out| {
        out.lines()
            .find_map(|l| l.trim().strip_prefix("REST"))
            .and_then(|rest| rest.split_whitespace().next())
            .map(|u| u.trim_end_matches("/api").to_owned())
    });
    (dev, rest, ws)
}

/// `aip device --id <id> --capability <capability>` on `ws`, registered and available (as
/// `aip agents list` on `rest` shows it).
pub fn start_device(ws: &str, rest: &str, id: &str, capability: &str) -> Proc {
    let mut device = Proc::aip(
        "aip device",
        &[
            "device",
            "--url",
            ws,
            "--id",
            id,
            "--capability",
            capability,
        ],
    );
    let registered = format!("registered as {id}");
    device.wait_for_stdout("registration", |out| {
        out.contains(&registered).then_some(())
    });
    wait_available(rest, id);
    device
}

/// Waits until `aip tasks get --json <id>` shows the task as `done` says; returns it.
pub fn task_until(rest: &str, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let task = aip(&["tasks", "get", "--rest", rest, "--json", id]).json();
        if done(&task) {
            return task;
        }
        assert!(Instant::now() < deadline, "task {id} never {what}: {task}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until `aip agents list --json` shows `id` available.
pub fn wait_available(rest: &str, id: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let run = aip(&["agents", "list", "--json", "--rest", rest]);
        if run.code == Some(0) {
            let agents = run.json();
            let available = agents.as_array().is_some_and(|list| {
                list.iter()
                    .any(|a| a["agent_id"] == id && a["status"] == "available")
            });
            if available {
                return;
            }
        }
        if Instant::now() > deadline {
            panic!("{id} never became available: {run:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The requests a scripted model endpoint received.
pub type Seen = Arc<Mutex<Vec<Value>>>;

/// Answers like a chat-completions endpoint: first a call of the device's `echo` tool (or, for
/// a request that says "ask me", of `ask_user`), then, once the call's result is in the
/// conversation, a final answer quoting it.
async fn complete(
    axum::extract::State(seen): axum::extract::State<Seen>,
    axum::Json(body): axum::Json<Value>,
) -> axum::Json<Value> {
    seen.lock().expect("lock").push(body.clone());
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let echoed = messages
        .iter()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .and_then(|c| serde_json::from_str::<Value>(c).ok());
    let asking = messages.iter().any(|m| {
        m["role"] == "user" && m["content"].as_str().is_some_and(|c| c.contains("ask me"))
    });
    let message = match echoed {
        None if asking => json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "call_ask", "type": "function",
              "function": { "name": "ask_user", "arguments": "{\"question\":\"Which file?\"}" } }
        ] }),
        Some(result) if asking => json!({ "role": "assistant",
            "content": format!("Opened {}", result["result"]["answer"].as_str().unwrap_or("?")) }),
        None => json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "call_echo", "type": "function",
              "function": { "name": "echo", "arguments": "{\"text\":\"hi from the model\"}" } }
        ] }),
        Some(result) => json!({ "role": "assistant",
            "content": format!("The device echoed: {}", result["result"]["text"].as_str().unwrap_or("?")) }),
    };
    axum::Json(json!({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": body["model"],
        "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15 }
    }))
}

/// The scripted endpoint on a free port, served from its own thread; its base URL.
pub fn model_server(seen: Seen) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr")).expect("send");
            let app = axum::Router::new()
                .route("/v1/chat/completions", axum::routing::post(complete))
                .with_state(seen);
            let _ = axum::serve(listener, app).await;
        });
    });
    let addr = rx.recv().expect("the model server's address");
    format!("http://{addr}/v1")
}
