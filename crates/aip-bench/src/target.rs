//! Where the broker is: the URLs checked (loopback unless allowed), the token put into the
//! WebSocket URLs, which gateway each client uses, and reachability probes whose errors say
//! how to start a broker.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite;

use crate::args::RunOptions;

/// Why the run could not start.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// A URL that cannot be used.
    #[error("invalid {flag} `{url}`: {reason} (expected e.g. {example})")]
    InvalidUrl {
        /// `--url` or `--rest`.
        flag: &'static str,
        /// What was given.
        url: String,
        /// What is wrong with it.
        reason: String,
        /// A good one.
        example: &'static str,
    },
    /// The same gateway named twice: clients spread over "two" gateways would all be on one.
    #[error(
        "--url `{url}` is given twice: name each gateway once (one --url per gateway, or \
         AIP_URL=URL1,URL2)"
    )]
    DuplicateUrl {
        /// The URL given twice.
        url: String,
    },
    /// The broker is not on this machine and --allow-remote was not given.
    #[error(
        "{flag} `{url}` is not a loopback address: aip bench loads only brokers on this machine \
         (127.0.0.0/8, ::1, localhost) unless --allow-remote is given"
    )]
    NotLoopback {
        /// `--url` or `--rest`.
        flag: &'static str,
        /// What was given.
        url: String,
    },
    /// Nothing answers at the address.
    #[error(
        "cannot reach the broker at {url} ({reason}): it is not running there. Start one with \
         `aip dev` (see the README) in another terminal, or point {flag} at a running broker"
    )]
    Unreachable {
        /// `--url` or `--rest`.
        flag: &'static str,
        /// The address tried.
        url: String,
        /// What the connection attempt said.
        reason: String,
    },
    /// The gateway refused the WebSocket handshake.
    #[error("the broker at {url} refused the WebSocket handshake with HTTP {status}{hint}")]
    HandshakeRefused {
        /// The URL (without its token).
        url: String,
        /// The HTTP status.
        status: u16,
        /// What to do.
        hint: &'static str,
    },
    /// The REST API refused the probe.
    #[error("the broker's REST API at {url} answered HTTP {status}: {detail}{hint}")]
    RestRefused {
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The body's `detail` (or its beginning).
        detail: String,
        /// What to do.
        hint: &'static str,
    },
    /// A --server-pid that is not a readable process.
    #[error("--server-pid {pid}: cannot read /proc/{pid} ({reason}); is the broker running?")]
    NoSuchProcess {
        /// The pid given.
        pid: u32,
        /// What reading it said.
        reason: String,
    },
    /// Not enough file descriptors for the sockets of the run.
    #[error(
        "this run opens about {needed} sockets but this process may open only {limit} files: \
         raise the limit (e.g. `ulimit -n {needed}`) or use fewer clients"
    )]
    TooFewFiles {
        /// About how many are needed.
        needed: u64,
        /// The soft limit.
        limit: u64,
    },
}

/// The broker a run loads.
///
/// Clients are spread over its gateways round robin: the `i`th client of a kind (device,
/// heartbeat client, …) uses [`Target::gateway`]`(i)`. A constellation talking to one of the
/// bench's devices uses [`Target::peer_gateway`], which is never its device's gateway when
/// there are two or more.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The gateways (`--url`, in the order given); never empty.
    pub gateways: Vec<Gateway>,
    /// REST base URL (no trailing slash in its path).
    pub rest: Url,
    /// Headers of every REST request (the API key).
    pub rest_headers: HeaderMap,
}

/// One gateway's WebSocket endpoint.
#[derive(Debug, Clone)]
pub(crate) struct Gateway {
    /// WebSocket URL with the token, for connecting.
    pub ws: String,
    /// WebSocket URL as shown in reports (no token).
    pub shown: String,
    /// Where to open TCP connections for the WebSocket.
    pub addr: ConnectAddr,
}

/// A host and port to connect to.
#[derive(Debug, Clone)]
pub(crate) enum ConnectAddr {
    /// An IP literal.
    Ip(SocketAddr),
    /// A name, resolved at connect time.
    Name(String, u16),
}

impl ConnectAddr {
    /// Opens a TCP connection with Nagle off (small frames, latency matters), from `source`
    /// if given (else the address the kernel picks).
    pub async fn connect(&self, source: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
        let stream = match (self, source) {
            (ConnectAddr::Ip(addr), None) => TcpStream::connect(addr).await?,
            (ConnectAddr::Name(host, port), None) => {
                TcpStream::connect((host.as_str(), *port)).await?
            }
            (ConnectAddr::Ip(addr), Some(source)) => connect_from(*addr, source).await?,
            (ConnectAddr::Name(host, port), Some(source)) => {
                let addr = tokio::net::lookup_host((host.as_str(), *port))
                    .await?
                    .find(|a| a.is_ipv4() == source.is_ipv4())
                    .ok_or_else(|| {
                        std::io::Error::other(format!("{host} has no address like {source}"))
                    })?;
                connect_from(addr, source).await?
            }
        };
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

/// A TCP connection to `addr` from `source` (any free port of it).
async fn connect_from(addr: SocketAddr, source: std::net::IpAddr) -> std::io::Result<TcpStream> {
    let socket = match source {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(addr).await
}

impl Gateway {
    /// Checks one `--url` (ws://, loopback unless allowed) and adds the token.
    fn parse(url: &str, options: &RunOptions) -> Result<Gateway, TargetError> {
        let invalid = |reason: &str| TargetError::InvalidUrl {
            flag: "--url",
            url: url.to_owned(),
            reason: reason.to_owned(),
            example: crate::args::DEFAULT_WS_URL,
        };
        let mut ws = Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
        match ws.scheme() {
            "ws" => {}
            "wss" => {
                return Err(invalid(
                    "wss:// is not supported: bench a broker on this machine over ws://",
                ));
            }
            other => return Err(invalid(&format!("scheme `{other}` is not ws://"))),
        }
        let addr = connect_addr(&ws).ok_or_else(|| invalid("no host"))?;
        if !options.allow_remote && !is_loopback(&ws) {
            return Err(TargetError::NotLoopback {
                flag: "--url",
                url: url.to_owned(),
            });
        }
        ws.set_fragment(None);
        let shown = ws.to_string();
        if let Some(token) = &options.token {
            ws.query_pairs_mut().append_pair("token", token);
        }
        Ok(Gateway {
            ws: ws.to_string(),
            shown,
            addr,
        })
    }

    /// Whether it is on this machine's loopback interface.
    pub fn is_loopback(&self) -> bool {
        Url::parse(&self.shown).is_ok_and(|url| is_loopback(&url))
    }

    /// Opens one WebSocket and closes it without registering: the gateway is there and
    /// accepts this run's token.
    async fn probe(&self) -> Result<(), TargetError> {
        let unreachable = |reason: String| TargetError::Unreachable {
            flag: "--url",
            url: self.shown.clone(),
            reason,
        };
        let stream = self
            .addr
            .connect(None)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        match tokio_tungstenite::client_async(self.ws.as_str(), stream).await {
            Ok((mut ws, _)) => {
                let _ = ws.close(None).await;
                Ok(())
            }
            Err(tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                Err(TargetError::HandshakeRefused {
                    url: self.shown.clone(),
                    status,
                    hint: match status {
                        401 | 403 => ": the gateway wants a token: pass --token or AIP_TOKEN",
                        404 => ": is the path right (usually /ws)?",
                        503 => ": the gateway is at its connection limit",
                        _ => "",
                    },
                })
            }
            Err(e) => Err(unreachable(format!("WebSocket handshake failed: {e}"))),
        }
    }
}

impl Target {
    /// Checks the URLs of `options` (every `--url`, then `--rest`); no connection is made.
    /// Blank entries of a comma-separated list (`AIP_URL=a,b,`) are skipped.
    pub fn from_options(options: &RunOptions) -> Result<Target, TargetError> {
        let mut gateways: Vec<Gateway> = Vec::with_capacity(options.urls.len());
        for url in options
            .urls
            .iter()
            .map(|u| u.trim())
            .filter(|u| !u.is_empty())
        {
            let gateway = Gateway::parse(url, options)?;
            if gateways.iter().any(|g| g.shown == gateway.shown) {
                return Err(TargetError::DuplicateUrl {
                    url: url.to_owned(),
                });
            }
            gateways.push(gateway);
        }
        if gateways.is_empty() {
            return Err(TargetError::InvalidUrl {
                flag: "--url",
                url: options.urls.join(","),
                reason: "no URL given".to_owned(),
                example: crate::args::DEFAULT_WS_URL,
            });
        }

        let invalid_rest = |reason: &str| TargetError::InvalidUrl {
            flag: "--rest",
            url: options.rest.clone(),
            reason: reason.to_owned(),
            example: crate::args::DEFAULT_REST_URL,
        };
        let mut rest = Url::parse(&options.rest).map_err(|e| invalid_rest(&e.to_string()))?;
        if rest.scheme() != "http" && rest.scheme() != "https" {
            return Err(invalid_rest("expected http:// or https://"));
        }
        if rest.cannot_be_a_base() || rest.host().is_none() {
            return Err(invalid_rest("no host"));
        }
        if !options.allow_remote && !is_loopback(&rest) {
            return Err(TargetError::NotLoopback {
                flag: "--rest",
                url: options.rest.clone(),
            });
        }
        rest.set_query(None);
        rest.set_fragment(None);
        let mut rest_headers = HeaderMap::new();
        if let Some(key) = &options.api_key {
            let value = HeaderValue::from_str(key).map_err(|_| TargetError::InvalidUrl {
                flag: "--api-key",
                url: "…".to_owned(),
                reason: "not a valid header value".to_owned(),
                example: "a printable key",
            })?;
            rest_headers.insert(HeaderName::from_static("x-api-key"), value);
        }
        Ok(Target {
            gateways,
            rest,
            rest_headers,
        })
    }

    /// `rest` with these path segments added (each percent-encoded).
    pub fn rest_url(&self, segments: &[&str]) -> Url {
        let mut url = self.rest.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty();
            path.extend(segments);
        }
        url
    }

    /// The gateway of the `i`th client of a kind: round robin over the gateways.
    pub fn gateway(&self, i: usize) -> &Gateway {
        &self.gateways[i % self.gateways.len()]
    }

    /// The gateway of a constellation whose device is the bench's device `d` (which is on
    /// [`Target::gateway`]`(d)`): with one gateway that one; with more, never the device's,
    /// so every request crosses gateways. `turn` numbers the constellations of one device
    /// (0, 1, …): they take the other gateways in turn.
    pub fn peer_gateway(&self, d: usize, turn: usize) -> &Gateway {
        let n = self.gateways.len();
        if n == 1 {
            return &self.gateways[0];
        }
        &self.gateways[(d + 1 + turn % (n - 1)) % n]
    }

    /// The WebSocket URLs as shown in reports (no token), in the order given.
    pub fn urls_shown(&self) -> Vec<String> {
        self.gateways.iter().map(|g| g.shown.clone()).collect()
    }

    /// Probes every gateway (see [`Gateway::probe`]); the first that fails is the error.
    pub async fn probe_ws(&self) -> Result<(), TargetError> {
        for gateway in &self.gateways {
            gateway.probe().await?;
        }
        Ok(())
    }

    /// Lists one task over REST: the session service is there and accepts this run's key.
    pub async fn probe_rest(&self, http: &reqwest::Client) -> Result<(), TargetError> {
        let mut url = self.rest_url(&["api", "tasks"]);
        url.set_query(Some("limit=1"));
        let response =
            http.get(url.clone())
                .send()
                .await
                .map_err(|e| TargetError::Unreachable {
                    flag: "--rest",
                    url: self.rest.to_string(),
                    reason: error_chain(&e),
                })?;
        let status = response.status().as_u16();
        if response.status().is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["detail"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.chars().take(200).collect());
        Err(TargetError::RestRefused {
            url: url.to_string(),
            status,
            detail,
            hint: match status {
                401 | 403 => ". Pass the broker's key with --api-key or AIP_API_KEY",
                404 => ". Is --rest the session service (or `aip dev`)?",
                _ => "",
            },
        })
    }
}

/// The host of a URL: an IP literal or a name.
enum HostOf {
    Ip(IpAddr),
    Name(String),
}

fn host_of(url: &Url) -> Option<HostOf> {
    let host = url.host_str()?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Some(match bare.parse::<IpAddr>() {
        Ok(ip) => HostOf::Ip(ip),
        Err(_) => HostOf::Name(bare.trim_end_matches('.').to_ascii_lowercase()),
    })
}

/// Whether the URL's host is this machine (decided on the URL alone: no name lookup).
fn is_loopback(url: &Url) -> bool {
    match host_of(url) {
        Some(HostOf::Ip(IpAddr::V4(ip))) => ip.is_loopback(),
        Some(HostOf::Ip(IpAddr::V6(ip))) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Some(HostOf::Name(name)) => name == "localhost" || name.ends_with(".localhost"),
        None => false,
    }
}

fn connect_addr(url: &Url) -> Option<ConnectAddr> {
    let port = url.port_or_known_default()?;
    Some(match host_of(url)? {
        HostOf::Ip(ip) => ConnectAddr::Ip(SocketAddr::new(ip, port)),
        HostOf::Name(name) if name == "localhost" => {
            ConnectAddr::Ip(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port))
        }
        HostOf::Name(name) => ConnectAddr::Name(name, port),
    })
}

/// The text of an error and its causes (`… : Connection refused`).
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// The soft limit on open files, from /proc/self/limits.
pub(crate) fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line.split_whitespace().nth(3)?;
    if soft == "unlimited" {
        return Some(u64::MAX);
    }
    soft.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{DEFAULT_REST_URL, DEFAULT_WS_URL};

    fn options(url: &str, rest: &str) -> RunOptions {
        RunOptions {
            urls: vec![url.to_owned()],
            rest: rest.to_owned(),
            token: Some("a b&c".to_owned()),
            api_key: None,
            allow_remote: false,
            max_seconds: 1,
            timeout_secs: 1,
            verify_seconds: 1,
            server_pids: Vec::new(),
            id_prefix: None,
            json: false,
            quiet: true,
        }
    }

    #[test]
    fn loopback_targets_are_accepted_and_the_token_goes_into_the_url() {
        for url in [
            DEFAULT_WS_URL,
            "ws://localhost:5000/ws",
            "ws://[::1]:5000/ws",
            "ws://127.8.9.10:1/ws",
        ] {
            let target = Target::from_options(&options(url, DEFAULT_REST_URL)).expect(url);
            let gateway = target.gateway(0);
            assert!(gateway.ws.ends_with("?token=a+b%26c"), "{}", gateway.ws);
            assert!(!gateway.shown.contains("token"), "{}", gateway.shown);
        }
    }

    #[test]
    fn remote_targets_are_refused_without_allow_remote() {
        // No connection and no name lookup happen: the check is on the URL alone.
        for (url, rest) in [
            ("ws://192.0.2.1:5000/ws", DEFAULT_REST_URL),
            ("ws://example.invalid:5000/ws", DEFAULT_REST_URL),
            (DEFAULT_WS_URL, "http://10.0.0.1:5000"),
        ] {
            let error = Target::from_options(&options(url, rest)).expect_err(url);
            assert!(
                matches!(error, TargetError::NotLoopback { .. }),
                "{url}: {error}"
            );
            assert!(error.to_string().contains("--allow-remote"), "{error}");
        }
        let mut allowed = options("ws://192.0.2.1:5000/ws", DEFAULT_REST_URL);
        allowed.allow_remote = true;
        assert!(Target::from_options(&allowed).is_ok());
    }

    #[test]
    fn bad_urls_say_what_is_expected() {
        let error = Target::from_options(&options("http://127.0.0.1:5000/ws", DEFAULT_REST_URL))
            .expect_err("not ws");
        assert!(
            error.to_string().contains("ws://127.0.0.1:5000/ws"),
            "{error}"
        );
        let error =
            Target::from_options(&options(DEFAULT_WS_URL, "nonsense")).expect_err("bad rest");
        assert!(error.to_string().contains("--rest"), "{error}");
    }

    fn several(urls: &[&str]) -> RunOptions {
        let mut options = options(DEFAULT_WS_URL, DEFAULT_REST_URL);
        options.urls = urls.iter().map(|u| (*u).to_owned()).collect();
        options
    }

    #[test]
    fn every_url_is_checked() {
        let target = Target::from_options(&several(&[
            "ws://127.0.0.1:1/ws",
            " ws://127.0.0.1:2/ws",
            "",
        ]))
        .expect("two loopback gateways (blank entries skipped)");
        assert_eq!(
            target.urls_shown(),
            ["ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws"]
        );
        assert!(target.gateways.iter().all(|g| g.ws.contains("token=")));

        let error = Target::from_options(&several(&[DEFAULT_WS_URL, "ws://192.0.2.1:5000/ws"]))
            .expect_err("the second is remote");
        assert!(
            matches!(&error, TargetError::NotLoopback { url, .. } if url.contains("192.0.2.1")),
            "{error}"
        );
        let error = Target::from_options(&several(&[DEFAULT_WS_URL, "wss://127.0.0.1:2/ws"]))
            .expect_err("the second is wss");
        assert!(
            error.to_string().contains("wss://127.0.0.1:2/ws"),
            "{error}"
        );
        let error =
            Target::from_options(&several(&["ws://127.0.0.1:1/ws", "ws://127.0.0.1:1/ws#x"]))
                .expect_err("the same gateway twice");
        assert!(error.to_string().contains("given twice"), "{error}");
        let error = Target::from_options(&several(&[" ", ""])).expect_err("nothing");
        assert!(error.to_string().contains("no URL given"), "{error}");
    }

    #[test]
    fn clients_go_round_robin_and_constellations_never_on_their_devices_gateway() {
        let urls = [
            "ws://127.0.0.1:1/ws",
            "ws://127.0.0.1:2/ws",
            "ws://127.0.0.1:3/ws",
        ];
        for n in 1..=urls.len() {
            let target = Target::from_options(&several(&urls[..n])).expect("target");
            let shown: Vec<&str> = (0..6).map(|i| target.gateway(i).shown.as_str()).collect();
            for (i, url) in shown.iter().enumerate() {
                assert_eq!(*url, urls[i % n]);
            }
            for d in 0..5 {
                let mut peers = std::collections::BTreeSet::new();
                for turn in 0..6 {
                    let peer = target.peer_gateway(d, turn).shown.as_str();
                    if n > 1 {
                        assert_ne!(peer, target.gateway(d).shown, "n={n} d={d} turn={turn}");
                    }
                    peers.insert(peer);
                }
                // The constellations of one device use every other gateway.
                assert_eq!(peers.len(), (n - 1).max(1), "n={n} d={d}");
            }
        }
    }

    #[test]
    fn rest_paths_are_percent_encoded() {
        let target = Target::from_options(&options(DEFAULT_WS_URL, "http://127.0.0.1:5000/"))
            .expect("target");
        let url = target.rest_url(&["api", "tasks", "a@b c/d", "events"]);
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:5000/api/tasks/a@b%20c%2Fd/events"
        );
    }
}
