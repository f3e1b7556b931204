//! The NATS implementation.

use std::time::Duration;

use async_nats::RequestErrorKind;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use crate::{Bus, BusError, Headers, Message, Subscription};

/// A bus on a NATS server.
#[derive(Clone)]
pub struct NatsBus {
    client: async_nats::Client,
}

impl NatsBus {
    /// Connects to `url` (e.g. `nats://127.0.0.1:4222`), naming the connection `name` in the
    /// server's monitoring.
    pub async fn connect(url: &str, name: &str) -> Result<Self, BusError> {
        let client = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .subscription_capacity(65_536)
            .connect(url);
        let client = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .map_err(|_| BusError::Connect {
                url: url.to_owned(),
                source: "timed out after 10 s".into(),
            })?
            .map_err(|e| BusError::Connect {
                url: url.to_owned(),
                source: Box::new(e),
            })?;
        Ok(NatsBus { client })
    }

    /// The underlying client, for JetStream.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }
}

fn convert(message: async_nats::Message) -> Message {
    Message {
        subject: message.subject.to_string(),
        reply: message.reply.map(|r| r.to_string()),
        headers: Headers::from_nats(message.headers.as_ref()),
        payload: message.payload,
    }
}

impl Bus for NatsBus {
    fn publish(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let limit = self.client.server_info().max_payload;
            if payload.len() > limit {
                return Err(BusError::PayloadTooLarge {
                    size: payload.len(),
                    limit,
                });
            }
            let result = if headers.is_empty() {
                self.client.publish(subject.clone(), payload).await
            } else {
                self.client
                    .publish_with_headers(subject.clone(), headers.to_nats(), payload)
                    .await
            };
            result.map_err(|e| BusError::Nats {
                operation: "publish",
                subject,
                source: Box::new(e),
            })
        }
        .boxed()
    }

    fn request(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Message, BusError>> {
        async move {
            let request = async_nats::Request::new()
                .payload(payload)
                .headers(headers.to_nats())
                .timeout(Some(timeout));
            match self.client.send_request(subject.clone(), request).await {
                Ok(message) => Ok(convert(message)),
                Err(e) => Err(match e.kind() {
                    RequestErrorKind::NoResponders => BusError::NoResponders { subject },
                    RequestErrorKind::TimedOut => BusError::Timeout { subject, timeout },
                    _ => BusError::Nats {
                        operation: "request",
                        subject,
                        source: Box::new(e),
                    },
                }),
            }
        }
        .boxed()
    }

    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Subscription, BusError>> {
        async move {
            let sub = self
                .client
                .subscribe(subject.clone())
                .await
                .map_err(|e| BusError::Nats {
                    operation: "subscribe",
                    subject,
                    source: Box::new(e),
                })?;
            Ok(sub.map(convert).boxed())
        }
        .boxed()
    }

    fn queue_subscribe(
        &self,
        subject: String,
        group: String,
    ) -> BoxFuture<'_, Result<Subscription, BusError>> {
        async move {
            let sub = self
                .client
                .queue_subscribe(subject.clone(), group)
                .await
                .map_err(|e| BusError::Nats {
                    operation: "queue_subscribe",
                    subject,
                    source: Box::new(e),
                })?;
            Ok(sub.map(convert).boxed())
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            self.client.flush().await.map_err(|e| BusError::Nats {
                operation: "flush",
                subject: String::new(),
                source: Box::new(e),
            })
        }
        .boxed()
    }

    fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }
}
