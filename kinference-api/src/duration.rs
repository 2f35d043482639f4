//! Durations as both binaries' flags and the chart write them.

use std::time::Duration;

/// Parses `250ms`, `30s`, `10m`, `1h`, `1h 30m` (humantime's forms), or a
/// bare number of seconds.
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration ({e}): use e.g. 250ms, 30s, 10m or 1h"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_bare_seconds() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration(" 7 "), Ok(Duration::from_secs(7)));
        assert!(parse_duration("soon").unwrap_err().contains("30s"));
        assert!(parse_duration("3 fortnights").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
