//! Where an engine publishes its KV events: vLLM's `GET /kv_event_sources`
//! (vLLM ≥ 0.31), an object keyed by DP rank, each value the rank's
//! `--kv-events-config` with its `endpoint` resolved. Read by the router (to
//! subscribe) and the controller (to probe).

/// One DP rank's KV-event publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSource {
    /// The DP rank (vLLM's `engine` label in `/metrics`).
    pub rank: u32,
    /// The PUB port. Hosts are not kept: they are often wildcards
    /// (`tcp://*:5557`); the caller uses the engine's own address.
    pub port: u16,
    /// The replay ROUTER port, if the rank has one.
    pub replay_port: Option<u16>,
}

fn port_of(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}

/// Parses a `/kv_event_sources` body: the ranks that publish over ZeroMQ
/// with events enabled, by rank. An empty list means no KV events. Entries
/// whose key is not a rank or whose endpoint has no port are skipped.
///
/// # Errors
/// When the body is not a JSON object.
pub fn parse_kv_event_sources(body: &[u8]) -> Result<Vec<KvSource>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("/kv_event_sources: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("/kv_event_sources: not a JSON object keyed by DP rank")?;
    let mut out: Vec<KvSource> = obj
        .iter()
        .filter_map(|(rank, cfg)| {
            let rank = rank.parse().ok()?;
            let enabled = cfg
                .get("enable_kv_cache_events")
                .and_then(serde_json::Value::as_bool);
            let publisher = cfg.get("publisher").and_then(serde_json::Value::as_str);
            if enabled == Some(false) || publisher.is_some_and(|p| p != "zmq") {
                return None;
            }
            Some(KvSource {
                rank,
                port: port_of(cfg.get("endpoint")?.as_str()?)?,
                replay_port: cfg
                    .get("replay_endpoint")
                    .and_then(serde_json::Value::as_str)
                    .and_then(port_of),
            })
        })
        .collect();
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_event_sources_as_vllm_serves_them() {
        let body = br#"{"1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": null},
                        "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://*:6000", "topic": ""},
                        "2": {"enable_kv_cache_events": false, "endpoint": "tcp://*:5559"},
                        "3": {"enable_kv_cache_events": true, "publisher": "null", "endpoint": "tcp://*:5560"},
                        "4": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5561"},
                        "x": {"endpoint": "tcp://*:1"}}"#;
        assert_eq!(
            parse_kv_event_sources(body).unwrap(),
            [
                KvSource {
                    rank: 0,
                    port: 5557,
                    replay_port: Some(6000)
                },
                KvSource {
                    rank: 1,
                    port: 5558,
                    replay_port: None
                },
                KvSource {
                    rank: 4,
                    port: 5561,
                    replay_port: None
                },
            ]
        );
        assert_eq!(parse_kv_event_sources(b"{}").unwrap(), []);
        for bad in [&b"[]"[..], b"<html>", b""] {
            assert!(
                parse_kv_event_sources(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
