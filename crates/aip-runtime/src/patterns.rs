//! Id patterns in credentials and principals: an exact id, or a prefix ending in `*`; and the
//! devices a credential or key may target, by id pattern or by capability.

/// Whether `id` matches one of `patterns` (exact ids, or prefixes ending in `*`; `*` alone
/// matches every id).
pub fn matches_any(patterns: &[String], id: &str) -> bool {
    patterns
        .iter()
        .any(|pattern| match pattern.strip_suffix('*') {
            Some(prefix) => id.starts_with(prefix),
            None => pattern == id,
        })
}

/// How a capability target is written: `capability:<name>`.
const CAPABILITY: &str = "capability:";

/// The devices a credential or API key may target: by id (exact or `prefix*`), or any device
/// with a capability (`capability:<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Targets {
    ids: Vec<String>,
    capabilities: Vec<String>,
}

impl Targets {
    /// From a configured list; an empty list, an empty entry or `capability:` without a
    /// name is refused (the message says which).
    pub fn parse(list: &[String]) -> Result<Self, String> {
        if list.is_empty() {
            return Err("targets must not be empty (leave it out to allow any device)".into());
        }
        let mut targets = Targets {
            ids: Vec::new(),
            capabilities: Vec::new(),
        };
        for entry in list {
            let entry = entry.trim();
            match entry.strip_prefix(CAPABILITY) {
                Some("") => {
                    return Err(format!("target `{entry}` names no capability"));
                }
                Some(capability) => targets.capabilities.push(capability.to_owned()),
                None if entry.is_empty() => {
                    return Err("targets must not hold an empty entry".into());
                }
                None => targets.ids.push(entry.to_owned()),
            }
        }
        Ok(targets)
    }

    /// Whether `device` is allowed by its id alone.
    pub fn allows_id(&self, device: &str) -> bool {
        matches_any(&self.ids, device)
    }

    /// Whether some devices are allowed by capability (then a device's capabilities decide
    /// what its id does not).
    pub fn by_capability(&self) -> bool {
        !self.capabilities.is_empty()
    }

    /// Whether a device with these capabilities is allowed by one of the capability targets.
    pub fn allows_capabilities(&self, capabilities: &[String]) -> bool {
        self.capabilities.iter().any(|c| capabilities.contains(c))
    }

    /// Whether a task placed by `required` capabilities only reaches allowed devices: it
    /// requires one of the capability targets, which every device it may land on has.
    pub fn covers_required(&self, required: &[String]) -> bool {
        self.capabilities.iter().any(|c| required.contains(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_ids_and_prefixes() {
        let patterns = ["lab-*".to_owned(), "printer".to_owned()];
        assert!(matches_any(&patterns, "lab-pc-1"));
        assert!(matches_any(&patterns, "printer"));
        assert!(!matches_any(&patterns, "printer2"));
        assert!(!matches_any(&patterns, "la"));
        assert!(matches_any(&["*".to_owned()], "anything"));
        assert!(!matches_any(&[], "anything"));
    }

    #[test]
    fn targets_by_id_and_by_capability() {
        let list = ["lab-*".to_owned(), "capability:gpu".to_owned()];
        let targets = Targets::parse(&list).expect("valid");
        assert!(targets.allows_id("lab-1"));
        assert!(!targets.allows_id("gpu-box"));
        assert!(targets.by_capability());
        assert!(targets.allows_capabilities(&["gpu".to_owned(), "x".to_owned()]));
        assert!(!targets.allows_capabilities(&["x".to_owned()]));
        assert!(targets.covers_required(&["gpu".to_owned()]));
        assert!(!targets.covers_required(&["x".to_owned()]));
        for bad in [vec![], vec!["capability:".to_owned()], vec![" ".to_owned()]] {
            assert!(Targets::parse(&bad).is_err(), "{bad:?}");
        }
    }
}
