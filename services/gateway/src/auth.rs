//! Per-client credentials.
//!
//! A credentials file lists who may connect and as what:
//!
//! ```toml
//! [[credential]]
//! name = "lab-devices"
//! # sha256 of the token, hex; make one with `printf %s "$TOKEN" | sha256sum`
//! token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! client_ids = ["lab-pc-*", "printer"]   # exact ids, or a prefix ending in `*`
//! roles = ["device"]                      # device, constellation
//! # optional: the devices its constellations may target (exact ids, prefixes, or
//! # `capability:<name>` for any device with that capability); absent: any device, as UFO
//! # allows
//! targets = ["lab-pc-*", "capability:lab"]
//! ```
//!
//! Tokens are never stored in clear. A client presents its token as `?token=` in the URL
//! (UFO style) or as `Authorization: Bearer`.

use std::path::Path;

use aip_bus::registry::RegistryClient;
use aip_runtime::patterns::{Targets, matches_any};
use proto_schemas::ClientType;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Who authenticated a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The credential's name (`anonymous` without authentication).
    pub name: String,
    client_ids: Vec<String>,
    roles: Vec<ClientType>,
    /// The devices it may target; `None`: any (UFO's rule).
    targets: Option<Targets>,
}

impl Principal {
    /// The principal of a gateway without credentials: may register as anything.
    pub fn anonymous() -> Self {
        Principal {
            name: "anonymous".to_owned(),
            client_ids: vec!["*".to_owned()],
            roles: vec![ClientType::Device, ClientType::Constellation],
            targets: None,
        }
    }

    /// Whether this principal may send tasks to (or register a constellation for) the
    /// device `device_id`: by its id, or, when the targets name capabilities, by the
    /// capabilities the registry knows the device has (an unknown device has none).
    pub async fn may_target(&self, registry: &RegistryClient, device_id: &str) -> bool {
        let Some(targets) = &self.targets else {
            return true;
        };
        if targets.allows_id(device_id) {
            return true;
        }
        if !targets.by_capability() {
            return false;
        }
        match registry.get(device_id).await {
            Ok(record) => targets.allows_capabilities(&record.capabilities),
            Err(e) => {
                tracing::debug!(
                    device = device_id,
                    "no capabilities to judge a target by: {e}"
                );
                false
            }
        }
    }

    /// Whether this principal's targets are limited (then a task must name its device).
    pub fn targets_limited(&self) -> bool {
        self.targets.is_some()
    }

    /// Whether this principal may register `client_id` as `client_type`.
    pub fn may_register(&self, client_id: &str, client_type: ClientType) -> bool {
        self.roles.contains(&client_type) && matches_any(&self.client_ids, client_id)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialFile {
    #[serde(default)]
    credential: Vec<CredentialEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialEntry {
    name: String,
    token_sha256: String,
    client_ids: Vec<String>,
    roles: Vec<ClientType>,
    #[serde(default)]
    targets: Option<Vec<String>>,
}

/// The configured credentials; `None` inside means authentication is off.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    entries: Option<Vec<(String, Principal)>>,
}

/// Why the credentials file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The file could not be read.
    #[error("cannot read credentials file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// The file is not valid.
    #[error("invalid credentials file {path}: {message}")]
    Invalid {
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl Credentials {
    /// No authentication: every connection is [`Principal::anonymous`].
    pub fn disabled() -> Self {
        Credentials { entries: None }
    }

    /// Whether authentication is on.
    pub fn enabled(&self) -> bool {
        self.entries.is_some()
    }

    /// Reads a credentials file.
    pub fn load(path: &Path) -> Result<Self, CredentialsError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|message| CredentialsError::Invalid {
            path: shown,
            message,
        })
    }

    /// Parses credentials from TOML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: CredentialFile = toml_from_str(text)?;
        let mut entries = Vec::new();
        for entry in file.credential {
            let hash = entry.token_sha256.to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "credential `{}`: token_sha256 must be 64 hex digits (the sha256 of the token)",
                    entry.name
                ));
            }
            if entry.client_ids.is_empty() || entry.roles.is_empty() {
                return Err(format!(
                    "credential `{}`: client_ids and roles must not be empty",
                    entry.name
                ));
            }
            if entries
                .iter()
                .any(|(_, p): &(String, Principal)| p.name == entry.name)
            {
                return Err(format!(
                    "credential `{}` is listed twice: names must be unique (logs and the registry tell principals apart by them)",
                    entry.name
                ));
            }
            let targets = match &entry.targets {
                None => None,
                Some(list) => Some(
                    Targets::parse(list)
                        .map_err(|e| format!("credential `{}`: {e}", entry.name))?,
                ),
            };
            let principal = Principal {
                name: entry.name,
                client_ids: entry.client_ids,
                roles: entry.roles,
                targets,
            };
            entries.push((hash, principal));
        }
        Ok(Credentials {
            entries: Some(entries),
        })
    }

    /// The principal a token authenticates, if any. Without authentication, anyone is
    /// [`Principal::anonymous`].
    pub fn authenticate(&self, token: Option<&str>) -> Option<Principal> {
        let Some(entries) = &self.entries else {
            return Some(Principal::anonymous());
        };
        let hash = hex::encode(Sha256::digest(token?.as_bytes()));
        entries
            .iter()
            .find(|(h, _)| constant_time_eq(h.as_bytes(), hash.as_bytes()))
            .map(|(_, p)| p.clone())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn toml_from_str(text: &str) -> Result<CredentialFile, String> {
    let config = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml))
        .build()
        .map_err(|e| e.to_string())?;
    config.try_deserialize().map_err(|e| e.to_string())
}

/// The sha256 of a token, hex, as written in credentials files.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_principals_and_their_ids() {
        let text = format!(
            "[[credential]]\nname = \"lab\"\ntoken_sha256 = \"{}\"\nclient_ids = [\"lab-*\", \"printer\"]\nroles = [\"device\"]\n",
            hash_token("s3cret")
        );
        let creds = Credentials::parse(&text).expect("valid");
        assert!(creds.authenticate(Some("wrong")).is_none());
        assert!(creds.authenticate(None).is_none());
        let p = creds.authenticate(Some("s3cret")).expect("known token");
        assert_eq!(p.name, "lab");
        assert!(p.may_register("lab-pc-1", ClientType::Device));
        assert!(p.may_register("printer", ClientType::Device));
        assert!(!p.may_register("printer2", ClientType::Device));
        assert!(!p.may_register("lab-pc-1", ClientType::Constellation));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let err = Credentials::parse("[[credential]]\nname=\"x\"\ntoken_sha256=\"abc\"\nclient_ids=[\"*\"]\nroles=[\"device\"]\n")
            .expect_err("short hash");
        assert!(err.contains("64 hex digits"), "{err}");
        assert!(Credentials::parse("[[credential]]\nname=\"x\"\ntoken=\"abc\"\n").is_err());
    }
}
