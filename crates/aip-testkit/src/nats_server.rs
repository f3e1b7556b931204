//! A nats-server of a test's own, for what the machine's cannot show: a configuration the test
//! chooses (the deployment's users and permissions, a raised message limit) and a log it reads.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A `nats-server` from `PATH` on a free loopback port, with JetStream in a directory of its
/// own; killed and its directory removed when dropped.
pub struct OwnNatsServer {
    /// The running server; `None` while killed ([`Self::kill`]).
    child: Option<Child>,
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    port: u16,
    dir: PathBuf,
    log: PathBuf,
    env: Vec<(String, String)>,
}

impl OwnNatsServer {
    /// Starts a server configured with its listener, its JetStream store (room for the
    /// deployment's stream caps: 8 GB) and then `config`, more lines of nats-server's
    /// configuration (`max_payload: 8MB`, an `include`). `prepare` is given the server's
    /// directory first, for the files `config` includes; `env` is set for the server (the
    /// variables its configuration reads). Returns once the server listens ([`crate::WAIT`] at most).
    pub async fn start(
        name: &str,
        config: &str,
        prepare: impl FnOnce(&Path),
        env: &[(&str, &str)],
    ) -> OwnNatsServer {
        let dir =
            std::env::temp_dir().join(format!("aip-nats-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        prepare(&dir);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        std::fs::write(
            dir.join("server.conf"),
            format!(
                "host: 127.0.0.1\nport: {port}\njetstream {{\n  store_dir: \"{}\"\n  max_file_store: 8GB\n}}\n{config}\n",
                dir.join("js").display()
            ),
        )
        .expect("server.conf");
        let mut server = OwnNatsServer {
            child: None,
            url: format!("nats://127.0.0.1:{port}"),
            port,
            log: dir.join("nats-server.log"),
            dir,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        server.start_again().await;
        server
    }

    /// Starts the server, or starts it again after [`Self::kill`]: the same port,
    /// configuration and JetStream store (its streams come back). Returns once it listens
    /// ([`crate::WAIT`] at most).
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running already");
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(self.dir.join("server.conf"))
            .arg("-l")
            .arg(&self.log)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nats-server on PATH");
        self.child = Some(child);
        let port = self.port;
        let listening = crate::eventually("nats-server to listen", || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(drop)
        })
        .await;
        if let Err(e) = listening {
            panic!("{e}; log:\n{}", self.log_text());
        }
    }

    /// Kills the server, as a crash would; [`Self::start_again`] brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's log; if it cannot be read, a text that says so (an assertion on it then
    /// fails naming the cause instead of reading an empty log as a clean one).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| {
            format!(
                "(the server log {} cannot be read: {e})",
                self.log.display()
            )
        })
    }
}

impl Drop for OwnNatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
