//! The session service's REST API as the bench uses it: submit a task, read it, read its
//! event log page by page. Errors are one line of text for the report.

use std::time::Duration;

use proto_schemas::sessions::{TaskEvent, TaskView};
use serde::Deserialize;

use crate::target::{Target, error_chain};

/// A REST client of one broker (connection pooling, the API key on every request).
#[derive(Debug, Clone)]
pub(crate) struct Rest {
    http: reqwest::Client,
    target: Target,
}

/// Most events asked for in one page.
const PAGE: usize = 1000;

#[derive(Debug, Deserialize)]
struct EventsPage {
    events: Vec<TaskEvent>,
}

impl Rest {
    /// A client whose requests give up after `timeout`.
    pub fn new(target: &Target, timeout: Duration, pool: usize) -> anyhow::Result<Rest> {
        let http = reqwest::Client::builder()
            .default_headers(target.rest_headers.clone())
            .timeout(timeout)
            .pool_max_idle_per_host(pool.max(1))
            .tcp_nodelay(true)
            .build()?;
        Ok(Rest {
            http,
            target: target.clone(),
        })
    }

    /// The underlying client (for the probe).
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// `POST /api/tasks` with a `TaskRequest` body: the created task, or why not.
    pub async fn submit(&self, request: &serde_json::Value) -> Result<TaskView, String> {
        let url = self.target.rest_url(&["api", "tasks"]);
        let response = self
            .http
            .post(url)
            .json(request)
            .send()
            .await
            .map_err(|e| format!("POST /api/tasks failed: {}", error_chain(&e)))?;
        read_json(response, "POST /api/tasks").await
    }

    /// `GET /api/tasks/{id}`.
    pub async fn task(&self, id: &str) -> Result<TaskView, String> {
        let url = self.target.rest_url(&["api", "tasks", id]);
        let response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| format!("GET /api/tasks/{{id}} failed: {}", error_chain(&e)))?;
        read_json(response, "GET /api/tasks/{id}").await
    }

    /// The whole event log of a task (`GET /api/tasks/{id}/events`, paged by `after`).
    pub async fn events(&self, id: &str) -> Result<Vec<TaskEvent>, String> {
        let mut all: Vec<TaskEvent> = Vec::new();
        loop {
            let mut url = self.target.rest_url(&["api", "tasks", id, "events"]);
            let after = all.last().map_or(0, |e| e.seq);
            url.set_query(Some(&format!("after={after}&limit={PAGE}")));
            let response =
                self.http.get(url).send().await.map_err(|e| {
                    format!("GET /api/tasks/{{id}}/events failed: {}", error_chain(&e))
                })?;
            let page: EventsPage = read_json(response, "GET /api/tasks/{id}/events").await?;
            let n = page.events.len();
            all.extend(page.events);
            if n < PAGE {
                return Ok(all);
            }
        }
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    what: &str,
) -> Result<T, String> {
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| format!("{what}: reading the answer failed: {}", error_chain(&e)))?;
    if !status.is_success() {
        let detail = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["detail"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.chars().take(200).collect());
        return Err(format!("{what}: HTTP {}: {detail}", status.as_u16()));
    }
    serde_json::from_str(&text).map_err(|e| format!("{what}: unreadable answer: {e}"))
}
