//! What an environment says to a service binary: which variables it reads and what for, and
//! which ones it would silently ignore.
//!
//! The configuration loader turns every `AIP_…` variable into a key and ignores the keys no
//! setting has, so a misspelt `AIP_GATEWAY__LISTNE` would leave the gateway on its default
//! address without a word. [`Environment::read`] names every such variable; the binaries warn
//! about them at start and refuse them under `--check` (deployment files are checked against
//! the real binaries that way, see `deploy/tests/`).

use std::collections::BTreeSet;

use serde::Serialize;

use crate::service::ServiceSettings;

/// Variables the trace exporter reads (the OpenTelemetry SDK and its OTLP exporter, traces
/// only: the services export no OpenTelemetry logs or metrics). `OTEL_EXPORTER_OTLP_PROTOCOL`
/// is absent on purpose: the exporter speaks gRPC only, and another protocol would be ignored.
pub const TELEMETRY_VARIABLES: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SDK_DISABLED",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_MAX_CONCURRENT_EXPORTS",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT",
    "OTEL_SPAN_LINK_COUNT_LIMIT",
];

/// Variables every service binary reads besides its settings.
const PROCESS_VARIABLES: &[(&str, &str)] = &[
    ("AIP_CONFIG", "the configuration file (as --config)"),
    ("RUST_LOG", "the log filter"),
    (
        "_RJEM_MALLOC_CONF",
        "the memory allocator's options (jemalloc)",
    ),
];

/// What one variable means to the binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Meaning {
    /// It sets this setting (a dotted key, `gateway.listen`).
    Setting(String),
    /// The trace exporter reads it.
    Telemetry,
    /// The binary reads it for this purpose.
    Other(&'static str),
    /// `AIP_…` or `OTEL_…` naming nothing the binary reads: a mistake.
    Unknown {
        /// The known variable closest to it, when one is close.
        suggestion: Option<String>,
    },
}

/// A variable of the environment and what it means to the binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variable {
    /// Its name.
    pub name: String,
    /// What it does.
    pub meaning: Meaning,
}

/// The variables of an environment that concern a service: every `AIP_…` and `OTEL_…` one,
/// and the others it reads. Variables of neither kind (`PATH`, `HOME`) are left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// Sorted by name.
    pub variables: Vec<Variable>,
}

impl Environment {
    /// What `environment` means to the service whose settings are `S`.
    pub fn read<S: ServiceSettings>(
        environment: impl IntoIterator<Item = (String, String)>,
    ) -> Self {
        let keys = setting_keys(&S::default());
        let known: Vec<String> = keys
            .iter()
            .map(|key| variable_of(key))
            .chain(PROCESS_VARIABLES.iter().map(|(name, _)| (*name).to_owned()))
            .chain(TELEMETRY_VARIABLES.iter().map(|name| (*name).to_owned()))
            .collect();
        let mut variables: Vec<Variable> = environment
            .into_iter()
            .filter_map(|(name, _)| {
                let meaning = meaning_of::<S>(&name, &keys, &known)?;
                Some(Variable { name, meaning })
            })
            .collect();
        variables.sort_by(|a, b| a.name.cmp(&b.name));
        Environment { variables }
    }

    /// The variables that name nothing the binary reads.
    pub fn unknown(&self) -> impl Iterator<Item = &Variable> {
        self.variables
            .iter()
            .filter(|v| matches!(v.meaning, Meaning::Unknown { .. }))
    }
}

impl std::fmt::Display for Variable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.meaning {
            Meaning::Setting(key) => write!(f, "{}: sets {key}", self.name),
            Meaning::Telemetry => write!(f, "{}: read by the trace exporter", self.name),
            Meaning::Other(what) => write!(f, "{}: {what}", self.name),
            Meaning::Unknown { suggestion } => {
                write!(f, "{}: unknown: the binary does not read it", self.name)?;
                match suggestion {
                    Some(s) => write!(f, " (did you mean {s}?)"),
                    None => Ok(()),
                }
            }
        }
    }
}

fn meaning_of<S: ServiceSettings>(
    name: &str,
    keys: &BTreeSet<String>,
    known: &[String],
) -> Option<Meaning> {
    if let Some((_, what)) = PROCESS_VARIABLES
        .iter()
        .chain(S::VARIABLES)
        .find(|(n, _)| *n == name)
    {
        return Some(Meaning::Other(what));
    }
    if TELEMETRY_VARIABLES.contains(&name) {
        return Some(Meaning::Telemetry);
    }
    if let Some(rest) = name.strip_prefix("AIP_") {
        // The loader's mapping: lower case, `__` between levels.
        let key = rest.to_ascii_lowercase().replace("__", ".");
        if keys.contains(&key) {
            return Some(Meaning::Setting(key));
        }
    } else if !name.starts_with("OTEL_") {
        return None;
    }
    Some(Meaning::Unknown {
        suggestion: closest(name, known),
    })
}

/// Every key the settings have, dotted (`nats_url`, `gateway.listen`, `sessions.llm.model`):
/// the leaves of their defaults, serialised (an unset option is a `null` leaf).
pub fn setting_keys<S: Serialize>(defaults: &S) -> BTreeSet<String> {
    fn walk(prefix: &str, value: &serde_json::Value, keys: &mut BTreeSet<String>) {
        match value {
            serde_json::Value::Object(fields) if !fields.is_empty() => {
                for (name, value) in fields {
                    let key = if prefix.is_empty() {
                        name.clone()
                    } else {
                        format!("{prefix}.{name}")
                    };
                    walk(&key, value, keys);
                }
            }
            _ => {
                keys.insert(prefix.to_owned());
            }
        }
    }
    let mut keys = BTreeSet::new();
    // Settings are plain data: serialising them cannot fail; if it did, no key is known and
    // every variable is reported, which is seen at once.
    if let Ok(value) = serde_json::to_value(defaults) {
        walk("", &value, &mut keys);
    }
    keys
}

/// The variable of a dotted key: `gateway.listen` → `AIP_GATEWAY__LISTEN`.
pub fn variable_of(key: &str) -> String {
    format!("AIP_{}", key.replace('.', "__").to_ascii_uppercase())
}

/// The known name closest to `name`, if a few edits away (a typo, a missing underscore).
fn closest(name: &str, known: &[String]) -> Option<String> {
    known
        .iter()
        .map(|k| (edit_distance(name, k), k))
        .filter(|(d, _)| *d <= 3)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
}

/// Levenshtein distance over bytes (variable names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, x) in a.iter().enumerate() {
        let mut current = vec![i + 1];
        for (j, y) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(x != y);
            current.push(substitute.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances_count_edits() {
        assert_eq!(edit_distance("LISTEN", "LISTEN"), 0);
        assert_eq!(edit_distance("LISTNE", "LISTEN"), 2);
        assert_eq!(edit_distance("LISTEN", "LISTENS"), 1);
        assert_eq!(edit_distance("", "ABC"), 3);
    }

    #[derive(Default, Serialize)]
    struct Section {
        listen: String,
        file: Option<String>,
    }

    #[derive(Default, Serialize)]
    struct Top {
        nats_url: String,
        own: Section,
    }

    /// A service's settings as the services declare them: top-level keys, flattened NATS
    /// access, a section.
    #[derive(Debug, Default, Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Settings {
        nats_url: String,
        #[serde(flatten)]
        nats: aip_bus::NatsSettings,
        demo: Demo,
    }

    #[derive(Debug, Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Demo {
        listen: std::net::SocketAddr,
        credentials_file: Option<std::path::PathBuf>,
    }

    impl Default for Demo {
        fn default() -> Self {
            Demo {
                listen: "127.0.0.1:5000".parse().expect("addr"),
                credentials_file: None,
            }
        }
    }

    impl ServiceSettings for Settings {
        const SERVICE: crate::ServiceName = crate::ServiceName::Gateway;
        const GUARD: crate::service::Guard = crate::service::Guard::Credentials;
        const VARIABLES: &'static [(&'static str, &'static str)] = &[("HOSTNAME", "a name")];

        fn common(&self) -> crate::service::Common<'_> {
            crate::service::Common {
                nats_url: &self.nats_url,
                nats: &self.nats,
                database_url: None,
                subject_prefix: "aip",
                log_format: crate::telemetry::LogFormat::Pretty,
                worker_threads: None,
            }
        }

        fn exposure(&self) -> crate::service::Exposure {
            crate::service::Exposure {
                listen: self.demo.listen,
                secured: false,
                allow_no_auth: false,
            }
        }
    }

    fn read(names: &[&str]) -> Environment {
        Environment::read::<Settings>(names.iter().map(|n| ((*n).to_owned(), "x".to_owned())))
    }

    #[test]
    fn every_variable_the_binary_reads_is_named_with_its_purpose() {
        let environment = read(&[
            "AIP_DEMO__LISTEN",
            "AIP_DEMO__CREDENTIALS_FILE",
            "AIP_NATS_URL",
            "AIP_NATS_PASSWORD",
            "AIP_CONFIG",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "RUST_LOG",
            "HOSTNAME",
            "PATH",
        ]);
        assert_eq!(environment.unknown().count(), 0, "{environment:?}");
        let shown: Vec<String> = environment
            .variables
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            shown,
            [
                "AIP_CONFIG: the configuration file (as --config)",
                "AIP_DEMO__CREDENTIALS_FILE: sets demo.credentials_file",
                "AIP_DEMO__LISTEN: sets demo.listen",
                "AIP_NATS_PASSWORD: sets nats_password",
                "AIP_NATS_URL: sets nats_url",
                "HOSTNAME: a name",
                "OTEL_EXPORTER_OTLP_ENDPOINT: read by the trace exporter",
                "RUST_LOG: the log filter",
            ],
            "PATH concerns no setting and is left out"
        );
    }

    #[test]
    fn a_variable_no_setting_reads_is_unknown_with_the_closest_name() {
        let environment = read(&[
            "AIP_DEMO__LISTNE",
            "AIP_DEMO_LISTEN",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "AIP_SOMETHING_ELSE_ENTIRELY",
        ]);
        let unknown: Vec<String> = environment.unknown().map(ToString::to_string).collect();
        assert_eq!(
            unknown,
            [
                "AIP_DEMO_LISTEN: unknown: the binary does not read it (did you mean AIP_DEMO__LISTEN?)",
                "AIP_DEMO__LISTNE: unknown: the binary does not read it (did you mean AIP_DEMO__LISTEN?)",
                "AIP_SOMETHING_ELSE_ENTIRELY: unknown: the binary does not read it",
                "OTEL_EXPORTER_OTLP_PROTOCOL: unknown: the binary does not read it",
            ]
        );
    }

    #[test]
    fn keys_are_the_leaves_of_the_defaults_unset_options_included() {
        let keys: Vec<String> = setting_keys(&Top::default()).into_iter().collect();
        assert_eq!(keys, ["nats_url", "own.file", "own.listen"]);
        assert_eq!(variable_of("own.listen"), "AIP_OWN__LISTEN");
    }
}
