//! Where an engine publishes its KV events: vLLM's `GET /kv_event_sources`
//! (vLLM ≥ 0.31, an object keyed by DP rank whose values are each rank's
//! resolved `--kv-events-config`) and SGLang's `GET /server_info` (a
//! `kv_events` object with port bases per DP rank in recent releases; the
//! server arguments `kv_events_config`, `page_size` and `dp_size` in older
//! ones).
//!
//! Hosts are never kept: they are often wildcards (`tcp://*:5557`), and a
//! router must only dial the engine's own address (never a host an engine
//! names).

use serde_json::Value;

use super::WireError;

/// One DP rank's KV-event publisher.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvSource {
    /// The DP rank (vLLM's `engine` label in `/metrics`).
    pub rank: u32,
    /// The PUB port.
    pub port: u16,
    /// The replay ROUTER port, if the rank has one.
    pub replay_port: Option<u16>,
    /// The topic (frame 0) it publishes under.
    pub topic: String,
}

fn port_of(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}

/// Parses a `/kv_event_sources` body: the ranks that publish over ZeroMQ
/// with events enabled, by rank. An empty list means no KV events. Entries
/// whose key is not a rank or whose endpoint has no port are skipped.
///
/// # Errors
/// [`WireError::Json`] when the body is not a JSON object.
pub fn parse_kv_event_sources(body: &[u8]) -> Result<Vec<KvSource>, WireError> {
    const WHAT: &str = "/kv_event_sources";
    let v: Value = serde_json::from_slice(body).map_err(|e| WireError::json(WHAT, &e))?;
    let obj = v
        .as_object()
        .ok_or_else(|| WireError::shape(WHAT, "not a JSON object keyed by DP rank"))?;
    let mut out: Vec<KvSource> = obj
        .iter()
        .filter_map(|(rank, cfg)| {
            let rank = rank.parse().ok()?;
            let enabled = cfg.get("enable_kv_cache_events").and_then(Value::as_bool);
            let publisher = cfg.get("publisher").and_then(Value::as_str);
            if enabled == Some(false) || publisher.is_some_and(|p| p != "zmq") {
                return None;
            }
            Some(KvSource {
                rank,
                port: port_of(cfg.get("endpoint")?.as_str()?)?,
                replay_port: cfg
                    .get("replay_endpoint")
                    .and_then(Value::as_str)
                    .and_then(port_of),
                topic: cfg
                    .get("topic")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            })
        })
        .collect();
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

/// What SGLang's `/server_info` says about its KV events.
#[derive(Clone, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct ServerInfo {
    /// The width of the blocks its events carry (`kv_events.block_size`,
    /// else the `page_size` server argument).
    pub block_size: Option<u32>,
    /// Data-parallel ranks (`dp_size`, default 1).
    pub dp_size: u32,
    /// One publisher per DP rank (rank r on the base port + r); empty when
    /// KV events are off (`publisher` `"null"`, SGLang's default).
    pub sources: Vec<KvSource>,
    /// Tokens the KV cache holds, over all DP ranks:
    /// `max_total_num_tokens` (top level, or in the first
    /// `internal_states` entry) × `dp_size`.
    pub kv_capacity_tokens: Option<u64>,
}

fn as_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

fn as_u16(v: Option<&Value>) -> Option<u16> {
    v.and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
}

/// Parses SGLang's `/server_info` (also served as `/get_server_info`).
///
/// # Errors
/// [`WireError::Json`] when the body is not a JSON object.
pub fn parse_server_info(body: &[u8]) -> Result<ServerInfo, WireError> {
    const WHAT: &str = "/server_info";
    let v: Value = serde_json::from_slice(body).map_err(|e| WireError::json(WHAT, &e))?;
    let obj = v
        .as_object()
        .ok_or_else(|| WireError::shape(WHAT, "not a JSON object"))?;
    let dp_size = as_u32(obj.get("dp_size")).unwrap_or(1).max(1);
    let page_size = as_u32(obj.get("page_size"));
    let kv_capacity_tokens = obj
        .get("max_total_num_tokens")
        .or_else(|| {
            obj.get("internal_states")?
                .as_array()?
                .first()?
                .get("max_total_num_tokens")
        })
        .and_then(Value::as_u64)
        .filter(|t| *t > 0)
        .map(|t| t.saturating_mul(u64::from(dp_size)));
    // Recent releases: a `kv_events` object with port bases.
    if let Some(kv) = obj.get("kv_events").and_then(Value::as_object) {
        let dp = as_u32(kv.get("dp_size")).unwrap_or(dp_size).max(1);
        let publishes = kv.get("publisher").and_then(Value::as_str) == Some("zmq");
        let base = as_u16(kv.get("endpoint_port_base"));
        let replay = as_u16(kv.get("replay_endpoint_port_base"));
        let topic = kv.get("topic").and_then(Value::as_str).unwrap_or_default();
        let sources = match (publishes, base) {
            (true, Some(base)) => (0..dp)
                .filter_map(|r| {
                    Some(KvSource {
                        rank: r,
                        port: base.checked_add(u16::try_from(r).ok()?)?,
                        replay_port: replay.and_then(|p| p.checked_add(u16::try_from(r).ok()?)),
                        topic: topic.to_owned(),
                    })
                })
                .collect(),
            _ => Vec::new(),
        };
        return Ok(ServerInfo {
            block_size: as_u32(kv.get("block_size")).or(page_size),
            dp_size: dp,
            sources,
            kv_capacity_tokens,
        });
    }
    // Older releases: the server arguments, `kv_events_config` as a JSON string.
    let cfg: Option<Value> = obj
        .get("kv_events_config")
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str(s).ok());
    let sources = cfg
        .as_ref()
        .filter(|c| c.get("publisher").and_then(Value::as_str) == Some("zmq"))
        .and_then(|c| {
            let port = port_of(c.get("endpoint")?.as_str()?)?;
            let replay = c
                .get("replay_endpoint")
                .and_then(Value::as_str)
                .and_then(port_of);
            let topic = c.get("topic").and_then(Value::as_str).unwrap_or_default();
            Some(
                (0..dp_size)
                    .filter_map(|r| {
                        let off = u16::try_from(r).ok()?;
                        Some(KvSource {
                            rank: r,
                            port: port.checked_add(off)?,
                            replay_port: replay.and_then(|p| p.checked_add(off)),
                            topic: topic.to_owned(),
                        })
                    })
                    .collect(),
            )
        })
        .unwrap_or_default();
    Ok(ServerInfo {
        block_size: page_size,
        dp_size,
        sources,
        kv_capacity_tokens,
    })
}

/// Where an engine's KV events come from, by one rule for the router and
/// the controller: what the engine says (vLLM's `/kv_event_sources`, else
/// SGLang's `/server_info`), else rank 0 on the worker set's KV port with
/// the replay port the worker set names (`kvEvents.replayPort`), if any.
/// An engine that answers with an empty list publishes nothing.
pub fn publishers(
    kv_event_sources: Option<Vec<KvSource>>,
    server_info: Option<&ServerInfo>,
    kv_port: u16,
    replay_port: Option<u16>,
) -> Vec<KvSource> {
    if let Some(listed) = kv_event_sources {
        return listed;
    }
    if let Some(info) = server_info {
        return info.sources.clone();
    }
    vec![KvSource {
        rank: 0,
        port: kv_port,
        replay_port,
        topic: String::new(),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(rank: u32, port: u16, replay_port: Option<u16>) -> KvSource {
        KvSource {
            rank,
            port,
            replay_port,
            topic: String::new(),
        }
    }

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
                src(0, 5557, Some(6000)),
                src(1, 5558, None),
                src(4, 5561, None)
            ]
        );
        assert!(parse_kv_event_sources(b"{}").unwrap().is_empty());
        assert!(parse_kv_event_sources(b"[]").is_err());
        assert!(parse_kv_event_sources(b"<html>").is_err());
    }

    #[test]
    fn the_engine_says_first_then_the_worker_set() {
        let listed = vec![src(0, 7000, None), src(1, 7001, None)];
        assert_eq!(
            publishers(Some(listed.clone()), None, 5557, Some(5558)),
            listed,
            "the engine knows its replay is off"
        );
        let info = ServerInfo {
            block_size: Some(16),
            dp_size: 1,
            sources: vec![src(0, 5557, Some(5600))],
            kv_capacity_tokens: None,
        };
        assert_eq!(publishers(None, Some(&info), 1, None), info.sources);
        assert_eq!(
            publishers(None, None, 5557, Some(5558)),
            [src(0, 5557, Some(5558))]
        );
        assert_eq!(
            publishers(None, None, 5557, None),
            [src(0, 5557, None)],
            "no replay unless named"
        );
        assert!(publishers(Some(vec![]), None, 5557, None).is_empty());
    }

    #[test]
    fn sglang_server_info_both_generations() {
        let recent = br#"{"model_path":"Qwen/Qwen3-8B","page_size":1,"dp_size":2,
            "kv_events":{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,"replay_endpoint_port_base":5600,"topic":"kv","block_size":16,"dp_size":2}}"#;
        let i = parse_server_info(recent).unwrap();
        assert_eq!(i.block_size, Some(16));
        assert_eq!(i.dp_size, 2);
        assert_eq!(i.sources.len(), 2);
        assert_eq!(
            (i.sources[1].port, i.sources[1].replay_port),
            (5558, Some(5601))
        );
        assert_eq!(i.sources[0].topic, "kv");

        let older = br#"{"page_size":32,"dp_size":1,"kv_events_config":"{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}"}"#;
        let i = parse_server_info(older).unwrap();
        assert_eq!(i.block_size, Some(32));
        assert_eq!(i.sources, [src(0, 5557, None)]);

        let off = br#"{"page_size":1,"kv_events":{"publisher":"null","endpoint_port_base":5557}}"#;
        assert!(parse_server_info(off).unwrap().sources.is_empty());
        let none = br#"{"page_size":1}"#;
        assert!(parse_server_info(none).unwrap().sources.is_empty());
        assert!(parse_server_info(b"[1]").is_err());
    }

    #[test]
    fn sglang_kv_capacity_is_max_total_num_tokens_per_rank() {
        let top = br#"{"page_size":1,"dp_size":2,"max_total_num_tokens":6000}"#;
        assert_eq!(
            parse_server_info(top).unwrap().kv_capacity_tokens,
            Some(12_000)
        );
        let nested = br#"{"page_size":1,"internal_states":[{"max_total_num_tokens":4096}]}"#;
        assert_eq!(
            parse_server_info(nested).unwrap().kv_capacity_tokens,
            Some(4096)
        );
        let none = br#"{"page_size":1,"max_total_num_tokens":"many"}"#;
        assert_eq!(parse_server_info(none).unwrap().kv_capacity_tokens, None);
    }
}
