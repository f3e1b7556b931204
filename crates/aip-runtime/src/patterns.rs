//! Id patterns in credentials and principals: an exact id, or a prefix ending in `*`.

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

#[cfg(test)]
mod tests {
    use super::matches_any;

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
}
