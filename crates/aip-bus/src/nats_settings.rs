//! The NATS settings every service shares beside `nats_url`: how a service proves who it is
//! to NATS and checks the server (credentials and TLS), the size caps of the streams, and the
//! URL as it may be shown (password hidden).
//!
//! Every service reads the same top-level settings (`AIP_NATS_CREDS_FILE`, `AIP_NATS_USER`,
//! `AIP_NATS_PASSWORD`, `AIP_NATS_TOKEN`, `AIP_NATS_TLS_CA_FILE`, `AIP_NATS_TLS_CERT_FILE`,
//! `AIP_NATS_TLS_KEY_FILE`, `AIP_NATS_REQUIRE_TLS`) into one [`NatsSettings`]; the files it
//! names are checked before connecting, so a missing one is a start error that names the
//! setting, not a handshake failure.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

/// Credentials and TLS for the NATS connection. Flattened into each service's settings, so
/// the keys sit at the top beside `nats_url`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NatsSettings {
    /// A NATS credentials file (user JWT and nkey seed, as `nsc` writes it), for servers run
    /// with accounts in operator mode.
    pub nats_creds_file: Option<PathBuf>,
    /// User name, with `nats_password` (instead of `nats://user:password@host` in the URL).
    #[serde(deserialize_with = "optional_text")]
    pub nats_user: Option<String>,
    /// Password of `nats_user`.
    #[serde(deserialize_with = "optional_text")]
    pub nats_password: Option<String>,
    /// An authentication token (a server with `authorization { token: … }`).
    #[serde(deserialize_with = "optional_text")]
    pub nats_token: Option<String>,
    /// PEM file of the certificate authorities to trust for the server's certificate (in
    /// addition to the system's). Setting it turns TLS on.
    pub nats_tls_ca_file: Option<PathBuf>,
    /// PEM client certificate, for a server that verifies clients (`verify: true`); needs
    /// `nats_tls_key_file`.
    pub nats_tls_cert_file: Option<PathBuf>,
    /// PEM private key of `nats_tls_cert_file`.
    pub nats_tls_key_file: Option<PathBuf>,
    /// Refuse to talk to the server without TLS (also implied by a `tls://` URL).
    pub nats_require_tls: bool,
    /// Size cap of the frames stream in bytes (-1: none). When full, the stream refuses new
    /// frames (the gateway answers UNAVAILABLE) instead of dropping stored ones. NATS
    /// reserves the cap on its JetStream storage when the stream is created.
    pub nats_frames_max_bytes: i64,
    /// Size cap of the blob stream in bytes (-1: none); full, it refuses new large bodies.
    pub nats_blobs_max_bytes: i64,
}

/// Default cap of the frames stream: 1 GiB.
pub const DEFAULT_FRAMES_MAX_BYTES: i64 = 1 << 30;

/// Default cap of the blob stream: 2 GiB (bodies live there one hour; twenty of UFO's
/// largest frames at once).
pub const DEFAULT_BLOBS_MAX_BYTES: i64 = 2 << 30;

impl Default for NatsSettings {
    fn default() -> Self {
        NatsSettings {
            nats_creds_file: None,
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_tls_ca_file: None,
            nats_tls_cert_file: None,
            nats_tls_key_file: None,
            nats_require_tls: false,
            nats_frames_max_bytes: DEFAULT_FRAMES_MAX_BYTES,
            nats_blobs_max_bytes: DEFAULT_BLOBS_MAX_BYTES,
        }
    }
}

/// Shows which settings are present, never the secrets themselves.
impl std::fmt::Debug for NatsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |s: &Option<String>| s.as_ref().map(|_| "***");
        f.debug_struct("NatsSettings")
            .field("nats_creds_file", &self.nats_creds_file)
            .field("nats_user", &self.nats_user)
            .field("nats_password", &hidden(&self.nats_password))
            .field("nats_token", &hidden(&self.nats_token))
            .field("nats_tls_ca_file", &self.nats_tls_ca_file)
            .field("nats_tls_cert_file", &self.nats_tls_cert_file)
            .field("nats_tls_key_file", &self.nats_tls_key_file)
            .field("nats_require_tls", &self.nats_require_tls)
            .field("nats_frames_max_bytes", &self.nats_frames_max_bytes)
            .field("nats_blobs_max_bytes", &self.nats_blobs_max_bytes)
            .finish()
    }
}

/// Why NATS access settings cannot work. Checked before connecting.
#[derive(Debug, thiserror::Error)]
pub enum NatsSettingsError {
    /// A file a setting names cannot be read.
    #[error("{setting} = {}: cannot read the file: {source}", path.display())]
    Unreadable {
        /// The setting, as written in the configuration (`nats_creds_file`).
        setting: &'static str,
        /// The file it names.
        path: PathBuf,
        source: std::io::Error,
    },
    /// Two ways of authenticating are given at once.
    #[error(
        "NATS credentials are given twice ({first} and {second}): use one of nats_creds_file, \
         nats_user with nats_password, nats_token, or a user in nats_url"
    )]
    Conflicting {
        /// One of the two.
        first: &'static str,
        /// The other.
        second: &'static str,
    },
    /// A stream size cap that is neither -1 (none) nor positive.
    #[error("{setting} = {value}: give a size in bytes, or -1 for none")]
    InvalidCap {
        /// The setting.
        setting: &'static str,
        /// Its value.
        value: i64,
    },
    /// A setting that needs a partner is given without it.
    #[error("{present} is set without {missing}")]
    Incomplete {
        /// The one given.
        present: &'static str,
        /// The one missing.
        missing: &'static str,
    },
}

/// How the connection authenticates, once the settings are checked.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Auth {
    /// Nothing beside what the URL may carry.
    None,
    /// A JWT and nkey from a credentials file.
    CredsFile(PathBuf),
    /// User and password.
    UserPassword { user: String, password: String },
    /// A token.
    Token(String),
}

impl NatsSettings {
    /// Checks the combination and that every named file can be read; answers how the
    /// connection authenticates. `url` is the server URL (a user in it counts as credentials).
    pub(crate) fn check(&self, url: &str) -> Result<Auth, NatsSettingsError> {
        let mut given: Vec<&'static str> = Vec::new();
        if self.nats_creds_file.is_some() {
            given.push("nats_creds_file");
        }
        if self.nats_user.is_some() || self.nats_password.is_some() {
            given.push("nats_user");
        }
        if self.nats_token.is_some() {
            given.push("nats_token");
        }
        if url_has_userinfo(url) {
            given.push("a user in nats_url");
        }
        if let [first, second, ..] = given[..] {
            return Err(NatsSettingsError::Conflicting { first, second });
        }
        match (&self.nats_tls_cert_file, &self.nats_tls_key_file) {
            (Some(_), None) => {
                return Err(NatsSettingsError::Incomplete {
                    present: "nats_tls_cert_file",
                    missing: "nats_tls_key_file",
                });
            }
            (None, Some(_)) => {
                return Err(NatsSettingsError::Incomplete {
                    present: "nats_tls_key_file",
                    missing: "nats_tls_cert_file",
                });
            }
            _ => {}
        }
        for (setting, value) in [
            ("nats_frames_max_bytes", self.nats_frames_max_bytes),
            ("nats_blobs_max_bytes", self.nats_blobs_max_bytes),
        ] {
            if value == 0 || value < -1 {
                return Err(NatsSettingsError::InvalidCap { setting, value });
            }
        }
        for (setting, path) in [
            ("nats_creds_file", &self.nats_creds_file),
            ("nats_tls_ca_file", &self.nats_tls_ca_file),
            ("nats_tls_cert_file", &self.nats_tls_cert_file),
            ("nats_tls_key_file", &self.nats_tls_key_file),
        ] {
            if let Some(path) = path {
                readable(setting, path)?;
            }
        }
        Ok(
            match (&self.nats_creds_file, &self.nats_user, &self.nats_token) {
                (Some(path), _, _) => Auth::CredsFile(path.clone()),
                (None, Some(user), _) => Auth::UserPassword {
                    user: user.clone(),
                    password: self
                        .nats_password
                        .clone()
                        .ok_or(NatsSettingsError::Incomplete {
                            present: "nats_user",
                            missing: "nats_password",
                        })?,
                },
                (None, None, Some(token)) => Auth::Token(token.clone()),
                (None, None, None) if self.nats_password.is_some() => {
                    return Err(NatsSettingsError::Incomplete {
                        present: "nats_password",
                        missing: "nats_user",
                    });
                }
                (None, None, None) => Auth::None,
            },
        )
    }

    /// Whether TLS is asked for (a CA, a client certificate, or `nats_require_tls`).
    pub(crate) fn wants_tls(&self) -> bool {
        self.nats_require_tls
            || self.nats_tls_ca_file.is_some()
            || self.nats_tls_cert_file.is_some()
    }

    /// The secrets these settings hold, to scrub from error texts of the client library.
    pub(crate) fn secrets(&self) -> impl Iterator<Item = &str> {
        [&self.nats_password, &self.nats_token]
            .into_iter()
            .filter_map(|s| s.as_deref())
            .filter(|s| !s.is_empty())
    }
}

/// Opens `path` for reading, as the client will later, to fail early with the setting's name.
fn readable(setting: &'static str, path: &Path) -> Result<(), NatsSettingsError> {
    let unreadable = |source| NatsSettingsError::Unreadable {
        setting,
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let metadata = file.metadata().map_err(unreadable)?;
    if metadata.is_dir() {
        return Err(unreadable(std::io::Error::other("it is a directory")));
    }
    Ok(())
}

/// Whether a URL (or a comma-separated list of them) carries a user, password or token.
fn url_has_userinfo(urls: &str) -> bool {
    urls.split(',').any(|url| split_userinfo(url).1.is_some())
}

/// Splits a URL into (scheme with `://`, userinfo, host and the rest).
fn split_userinfo(url: &str) -> (&str, Option<&str>, &str) {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => (scheme, Some(&rest[..at]), &rest[at + 1..]),
        None => (scheme, None, rest),
    }
}

/// A NATS URL as it may be printed: a password becomes `***` (`nats://user:***@host:4222`),
/// and so does a token (`nats://***@host:4222`). A comma-separated list is redacted entry by
/// entry. Use it wherever a URL reaches a log line, an error or a banner.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|url| match split_userinfo(url) {
            (_, None, _) => url.to_owned(),
            (scheme, Some(userinfo), host) => match userinfo.split_once(':') {
                Some((user, _password)) => format!("{scheme}{user}:***@{host}"),
                None => format!("{scheme}***@{host}"),
            },
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The password or token in a URL, to scrub from texts that might echo it.
pub(crate) fn url_secrets(urls: &str) -> Vec<String> {
    urls.split(',')
        .filter_map(|url| split_userinfo(url).1)
        .map(|userinfo| match userinfo.split_once(':') {
            Some((_, password)) => password.to_owned(),
            None => userinfo.to_owned(),
        })
        .filter(|s| !s.is_empty())
        .collect()
}

/// Accepts text, and values the environment loader already took for a number or a boolean
/// (`AIP_NATS_PASSWORD=123456` arrives as an integer).
fn optional_text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    struct Text;

    impl<'de> serde::de::Visitor<'de> for Text {
        type Value = Option<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }

        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok(Some(s.to_owned()))
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }

        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }

        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(Text)
        }
    }

    deserializer.deserialize_any(Text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_and_tokens_in_urls_are_hidden() {
        assert_eq!(
            redact_url("nats://user:s3cret@host:4222"),
            "nats://user:***@host:4222"
        );
        assert_eq!(redact_url("nats://tok@host:4222"), "nats://***@host:4222");
        assert_eq!(redact_url("tls://u:p@a:1/x"), "tls://u:***@a:1/x");
        assert_eq!(redact_url("u:p@a:4222"), "u:***@a:4222");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_url("nats://a:x@h1:4222,nats://b:y@h2:4222"),
            "nats://a:***@h1:4222,nats://b:***@h2:4222"
        );
        // A password holding `@` or `:` is hidden whole.
        assert_eq!(redact_url("nats://u:p@ss:w@h:4222"), "nats://u:***@h:4222");
        assert_eq!(url_secrets("nats://u:p@ss:w@h:4222"), vec!["p@ss:w"]);
    }

    #[test]
    fn debug_output_hides_secrets() {
        let access = NatsSettings {
            nats_user: Some("gateway".into()),
            nats_password: Some("hunter2".into()),
            nats_token: Some("t0ken".into()),
            ..NatsSettings::default()
        };
        let text = format!("{access:?}");
        assert!(
            !text.contains("hunter2") && !text.contains("t0ken"),
            "{text}"
        );
        assert!(text.contains("gateway"), "{text}");
    }

    #[test]
    fn combinations_are_checked() {
        let url = "nats://127.0.0.1:4222";
        assert!(matches!(NatsSettings::default().check(url), Ok(Auth::None)));
        let user = NatsSettings {
            nats_user: Some("u".into()),
            nats_password: Some("p".into()),
            ..NatsSettings::default()
        };
        assert!(matches!(user.check(url), Ok(Auth::UserPassword { .. })));
        assert!(matches!(
            user.check("nats://x:y@127.0.0.1:4222"),
            Err(NatsSettingsError::Conflicting { .. })
        ));
        let both = NatsSettings {
            nats_token: Some("t".into()),
            ..user.clone()
        };
        assert!(matches!(
            both.check(url),
            Err(NatsSettingsError::Conflicting {
                first: "nats_user",
                second: "nats_token"
            })
        ));
        let no_password = NatsSettings {
            nats_user: Some("u".into()),
            ..NatsSettings::default()
        };
        assert!(matches!(
            no_password.check(url),
            Err(NatsSettingsError::Incomplete {
                missing: "nats_password",
                ..
            })
        ));
        let cert_only = NatsSettings {
            nats_tls_cert_file: Some("/etc/hostname".into()),
            ..NatsSettings::default()
        };
        assert!(matches!(
            cert_only.check(url),
            Err(NatsSettingsError::Incomplete {
                missing: "nats_tls_key_file",
                ..
            })
        ));
    }

    #[test]
    fn a_missing_file_names_its_setting() {
        let access = NatsSettings {
            nats_creds_file: Some("/nonexistent/aip.creds".into()),
            ..NatsSettings::default()
        };
        let error = access
            .check("nats://127.0.0.1:4222")
            .err()
            .expect("missing file");
        let text = error.to_string();
        assert!(
            text.starts_with("nats_creds_file = /nonexistent/aip.creds: cannot read the file"),
            "{text}"
        );
        let dir = NatsSettings {
            nats_tls_ca_file: Some(std::env::temp_dir()),
            ..NatsSettings::default()
        };
        assert!(matches!(
            dir.check("nats://127.0.0.1:4222"),
            Err(NatsSettingsError::Unreadable {
                setting: "nats_tls_ca_file",
                ..
            })
        ));
    }
}
