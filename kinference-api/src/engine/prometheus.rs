//! Prometheus text exposition (format 0.0.4, also what OpenMetrics text
//! looks like line by line), as far as reading gauges and counters goes.
//!
//! A sample line is `name{label="value",...} value [timestamp]`. Label
//! values may hold escaped quotes, backslashes and braces; the optional
//! trailing timestamp (milliseconds) is not the value. Comments (`# HELP`,
//! `# TYPE`), blank lines and lines that do not parse are skipped.

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, suffixes included (`vllm:prefix_cache_hits_total`).
    pub name: &'a str,
    /// Labels in the order written; values as written (escapes kept).
    pub labels: Vec<(&'a str, &'a str)>,
    /// The value (`NaN`, `+Inf` and `-Inf` included).
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    /// Whether this is a sample of metric `name` (suffixes included) whose
    /// labels include each of `labels` (other labels may be present too).
    pub fn is(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.name == name && labels.iter().all(|(k, v)| self.label(k) == Some(v))
    }
}

/// The samples of `text`, in order.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(sample)
}

/// Parses one line; `None` for comments, blanks and malformed lines.
pub fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut s = inner;
        loop {
            s = s.trim_start_matches([',', ' ']);
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after_key) = s.split_once("=\"")?;
            let bytes = after_key.as_bytes();
            let mut i = 0;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            let value = after_key.get(..i)?;
            labels.push((key.trim(), value));
            s = after_key.get(i + 1..)?;
        }
    }
    // The first field after the name and labels is the value; a second one
    // would be the timestamp.
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_labels_and_timestamps() {
        let s = sample(
            r#"vllm:num_requests_running{engine="0",model_name="a \"b\" {c}"} 3.0 1767225600000"#,
        )
        .unwrap();
        assert_eq!(s.name, "vllm:num_requests_running");
        assert!(
            (s.value - 3.0).abs() < 1e-12,
            "the timestamp is not the value"
        );
        assert_eq!(s.label("engine"), Some("0"));
        assert_eq!(s.label("model_name"), Some(r#"a \"b\" {c}"#));
        let bare = sample("up 1").unwrap();
        assert_eq!((bare.name, bare.value), ("up", 1.0));
        assert!(bare.labels.is_empty());
        assert!(sample("x{} +Inf").unwrap().value.is_infinite());
        assert!(sample("x NaN").unwrap().value.is_nan());
        for bad in [
            "",
            "# HELP x y",
            "garbage",
            "x{a=\"1\" 2",
            "x{a=1} 2",
            "{a=\"b\"} 1",
        ] {
            assert!(sample(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn a_sample_is_a_metric_by_name_and_some_labels() {
        let s = sample(r#"requests_total{api="chat",code="200"} 4"#).unwrap();
        assert!(s.is("requests_total", &[]));
        assert!(s.is("requests_total", &[("code", "200")]));
        assert!(s.is("requests_total", &[("code", "200"), ("api", "chat")]));
        assert!(!s.is("requests_total", &[("code", "404")]));
        assert!(!s.is("requests_total", &[("model", "chat")]));
        assert!(!s.is("requests", &[]), "the whole name, not a prefix");
        assert!(!s.is("requests_total_count", &[]));
    }
}
